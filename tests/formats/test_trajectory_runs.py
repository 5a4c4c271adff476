"""Runs in the trajectory file identified by id, never by step or directory name (issue 29).

* two runs in one ``log_dir`` (real ``attn_probe.watch`` runs of a tiny BERT), the second
  resumed: the first run's lines stay byte-identical (sha256), and the resumed run stays one run;
* :func:`cut_run` against an independent reference that assigns every line to its run with
  ``json`` and drops only the resumed run's rows at or past the resume step;
* two real Trainer jobs whose default run directories get the same name (the same second: the
  name is forced), then a branch from B's checkpoint into A's ``output_dir``: each run's files
  change only when that run writes, and ``load_trajectory`` (and the CSV/Parquet exports) show
  the branch's parent as B's run id read from B's own header;
* bounded readers: a 10^6-run file loaded in a subprocess (time, its own peak RSS ``VmHWM``,
  warning size), a 1,000-deep directory given to ``attn-probe export`` as a user runs it, and
  a symbolic-link loop.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

pd = pytest.importorskip("pandas")
from helpers import RandomTokens, make_args, tiny_bert  # noqa: E402
from transformers import Trainer  # noqa: E402

import attn_probe  # noqa: E402
from attn_probe import load_trajectory  # noqa: E402
from attn_probe.analysis.trajectory import TrajectoryWarning, export_trajectory, read_table  # noqa: E402
from attn_probe.formats.trajectory import HEADER_KEY, cut_run, encode_header  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EVERY = 5


def segments(path: Path) -> list[tuple[str | None, list[bytes]]]:
    """``(run id, lines)`` in file order, a run's lines following its header (``None``: no header)."""
    out: list[tuple[str | None, list[bytes]]] = [(None, [])]
    for raw in path.read_bytes().splitlines(keepends=True):
        rec = json.loads(raw)
        if HEADER_KEY in rec:
            out.append((rec[HEADER_KEY]["run_id"], [raw]))
        else:
            out[-1][1].append(raw)
    return [s for s in out if s[1]]


def sha(lines: list[bytes]) -> str:
    return hashlib.sha256(b"".join(lines)).hexdigest()


def watch_run(log_dir: Path, last: int, start: int = 0, state: dict | None = None, seed: int = 0) -> dict:
    """A plain training loop watched every EVERY steps from ``start`` to ``last``; returns the
    model and optimizer state at step 10 (for a resume) when ``state`` is None."""
    model = tiny_bert(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    saved: dict = {}
    probe = attn_probe.watch(model, optimizer=opt, log_dir=str(log_dir), every=EVERY, start_step=start)
    g = torch.Generator().manual_seed(seed + start)
    for step in range(start + 1, last + 1):
        ids = torch.randint(0, 50, (4, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 10 and state is None:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "opt": copy.deepcopy(opt.state_dict())}
    probe.close()
    return saved


def test_resuming_the_second_run_of_a_file_leaves_the_first_run_byte_for_byte(tmp_path):
    log_dir = tmp_path / "run"
    watch_run(log_dir, 40, seed=1)
    (first_id, first_lines), = segments(log_dir / "attn_probe.jsonl")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        state = watch_run(log_dir, 20, seed=2)  # a fresh run appended (warned)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch_run(log_dir, 20, start=10, state=state, seed=2)  # resumed at step 10
    segs = segments(log_dir / "attn_probe.jsonl")
    assert segs[0] == (first_id, first_lines)  # untouched: same bytes
    assert sha(segs[0][1]) == sha(first_lines)
    second = {rid for rid, _ in segs[1:]}
    assert len(second) == 1 and first_id not in second  # the resume continued the second run's id
    (cut,) = [str(w.message) for w in caught if "dropped" in str(w.message)]
    assert f"of run {second.pop()}" in cut and "1 other run" in cut and "\n" not in cut
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = load_trajectory(log_dir)
    steps = df[(df.metric == "symmetry") & (df.layer == 0) & df["head"].isna()].groupby("run")["step"].apply(list)
    assert steps.to_dict() == {"run": list(range(0, 41, 5)), "run#2": [0, 5, 10, 15, 20]}
    assert df.groupby("run")["run_id"].nunique().to_dict() == {"run": 1, "run#2": 1}
    assert df[df.run == "run"]["run_id"].iloc[0] == first_id
    (msg,) = [str(w.message) for w in caught if issubclass(w.category, TrajectoryWarning)]
    assert "holds 2 runs (told apart by their run headers)" in msg


def row(step: int, layer: int = 0) -> bytes:
    return (json.dumps({"step": step, "wall_time": 1.5, "group": "self", "layer": layer, "head": None,
                        "metric": "symmetry", "value": 0.25}) + "\n").encode()


def header(run_id: str, step: int, resumed: bool = False) -> bytes:
    return encode_header(run_id, step, wall_time=1.0, resumed=resumed, config={"every": 5})


def reference_cut(data: bytes, target: str | None, resume: int) -> bytes:
    """Each line parsed with json: a line belongs to the run of the header before it; the target
    run's rows (and headers) at steps >= resume go, everything else stays."""
    kept, run = [], None
    for raw in data.splitlines(keepends=True):
        rec = json.loads(raw)
        if HEADER_KEY in rec:
            run = rec[HEADER_KEY]["run_id"]
        if run != target or rec["step"] < resume:
            kept.append(raw)
    return b"".join(kept)


LAYOUTS = {
    # the resumed run last: cut in place
    "last_run": (b"".join(row(s) for s in range(0, 50, 5)), ["a", "b"], "b"),
    # the resumed run first, another run after it: rewritten around the other run
    "first_run": (b"", ["b", "a"], "b"),
    # a run resumed before (two headers of b; its first part was cut back to step 15 then, as a
    # resume does), another run between its parts
    "interleaved": (b"", ["b-", "a", "b+"], "b"),
    # rows written before run headers, then a run with a header: the legacy rows are kept
    "legacy_then_run": (b"".join(row(s) for s in range(0, 50, 5)), ["b"], "b"),
}


@pytest.mark.parametrize("chunk", [64, 1 << 22], ids=["tiny_chunks", "default_chunks"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cut_run_drops_only_the_resumed_runs_rows(tmp_path, chunk, layout):
    legacy, runs, target = LAYOUTS[layout]
    data = legacy
    for name in runs:
        rid = name.rstrip("+-")
        start = 15 if name.endswith("+") else 0
        data += header(rid, start, resumed=name.endswith("+")) + b"".join(
            row(s, la) for s in range(start, 15 if name.endswith("-") else 45, 5) for la in range(2))
    path = tmp_path / "attn_probe.jsonl"
    path.write_bytes(data)
    cut = cut_run(path, 20, target, otherwise="none", chunk_size=chunk)
    want = reference_cut(data, target, 20)
    assert path.read_bytes() == want
    assert cut.run_id == target and cut.found
    assert cut.dropped == data.count(b"\n") - want.count(b"\n") > 0
    assert [p.name for p in tmp_path.iterdir()] == ["attn_probe.jsonl"]


def test_cut_run_of_a_run_not_in_the_file_cuts_nothing(tmp_path):
    path = tmp_path / "attn_probe.jsonl"
    data = header("a", 0) + b"".join(row(s) for s in range(0, 50, 5))
    path.write_bytes(data)
    assert cut_run(path, 10, "new", otherwise="none").dropped == 0
    assert path.read_bytes() == data


# --------------------------------------------------------------------------- Trainer jobs


def files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def trainer_run(out: Path, steps: int, resume: Path | None = None) -> list[str]:
    args = make_args(out, steps, report_to=["tensorboard"], save_strategy="steps", save_steps=2)
    trainer = Trainer(model=tiny_bert(), args=args, train_dataset=RandomTokens())
    attn_probe.attach(trainer, every=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return [str(w.message) for w in caught if "attn_probe" in str(w.message)]


def header_of(run_dir: Path) -> dict:
    with open(run_dir / "attn_probe.jsonl", "rb") as fh:
        return json.loads(fh.readline())[HEADER_KEY]


def test_trainer_runs_with_colliding_names_stay_two_runs(tmp_path, monkeypatch):
    """Both jobs' default run directories are named ``runs/Nov27_10-00-00_host`` (as two jobs of a
    sweep started in the same second are); B's checkpoint resumed under A's output_dir branches."""
    from attn_probe.integrations import transformers as integration

    name = os.path.join("runs", "Nov27_10-00-00_host")
    monkeypatch.setattr(integration, "default_log_dir", lambda root="runs": name)
    a, b = tmp_path / "A", tmp_path / "B"
    trainer_run(a, 4)
    trainer_run(b, 4)
    a_run, b_run = a / name, b / name
    a_files, b_files = files(a_run), files(b_run)
    b_id = header_of(b_run)["run_id"]
    assert header_of(a_run)["run_id"] != b_id

    messages = trainer_run(a, 4, resume=b / "checkpoint-2")  # B's checkpoint, A's output_dir

    assert files(a_run) == a_files and files(b_run) == b_files  # neither A's nor B's files touched
    branch = a / (name + "_1")
    assert sorted(p.name for p in (a / "runs").iterdir()) == ["Nov27_10-00-00_host", "Nov27_10-00-00_host_1"]
    assert any("branched" in m and str(branch) in m for m in messages)
    df = load_trajectory(branch)
    assert set(df["parent_run"]) == {b_id} and set(df["parent_step"]) == {2}
    assert df["run_id"].nunique() == 1 and df["run_id"].iloc[0] not in (b_id, header_of(a_run)["run_id"])
    assert sorted(df["step"].unique()) == [2, 3, 4]
    for suffix in (".csv", ".parquet"):  # the exports carry the lineage
        out = export_trajectory(df, tmp_path / f"t{suffix}")
        back = read_table(out)
        pd.testing.assert_frame_equal(back[["run_id", "parent_run", "parent_step"]],
                                      df[["run_id", "parent_run", "parent_step"]], check_dtype=False)

    # A's own checkpoint (checkpoint-2; the branch saved checkpoint-4 here) continues A's run:
    # its files change now, and only its files
    branch_files = files(branch)
    trainer_run(a, 4, resume=a / "checkpoint-2")
    assert files(b_run) == b_files and files(branch) == branch_files
    assert files(a_run) != a_files
    ids = {rec[HEADER_KEY]["run_id"] for rec in map(json.loads, (a_run / "attn_probe.jsonl").read_bytes().splitlines())
           if HEADER_KEY in rec}
    assert ids == {header_of(a_run)["run_id"]}  # one run, resumed


# --------------------------------------------------------------------------- bounded readers

CHILD = textwrap.dedent("""
    import json, sys, time, warnings
    from attn_probe.analysis.trajectory import load_trajectory
    def vm_hwm():  # this process's own peak; ru_maxrss would carry the pytest parent's over exec
        with open("/proc/self/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith("VmHWM:"))) * 1024
    import pandas  # noqa: F401  (imported before the clock starts, as a user's session has it)
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            df = load_trajectory(sys.argv[1])
            rows, runs, error = len(df), int(df["run"].nunique()), None
        except Exception as exc:  # a refusal must be one line
            rows, runs, error = 0, 0, f"{type(exc).__name__}: {exc}"
    print(json.dumps({"seconds": time.monotonic() - t0, "maxrss": vm_hwm(),
                      "rows": rows, "runs": runs, "error": error, "warnings": [str(w.message) for w in caught]}))
""")


def test_a_file_of_a_million_one_row_runs_loads_in_bounded_time_and_memory(tmp_path):
    """The issue's hostile file: 10^6 one-row runs (each row at step 0 again: a new run), 107 MB.
    Before: MemoryError after 214 s under a 6 GiB cap (one DataFrame per run, a warning naming
    every run)."""
    path = tmp_path / "attn_probe.jsonl"
    line = (json.dumps({"step": 0, "wall_time": 1732280000.125, "group": "self", "layer": 0, "head": None,
                        "metric": "symmetry", "value": 0.4123456789}) + "\n").encode()
    with open(path, "wb") as fh:
        for _ in range(10):
            fh.write(line * 100_000)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["error"] is None, result["error"]
    assert result["rows"] == 10**6 and result["runs"] == 10**6
    assert result["seconds"] <= 60, result["seconds"]
    assert result["maxrss"] <= 1 << 30, result["maxrss"]
    text = "\n".join(result["warnings"])
    assert len(text.encode()) < 2048 and "holds 1000000 runs" in text and "... and 999995 more" in text


def test_a_1000_deep_directory_gets_a_one_line_error_from_export(tmp_path):
    deep = tmp_path / "deep"
    made = []
    d = deep
    try:
        for _ in range(1001):  # os.makedirs (and shutil.rmtree) recurse once per level
            d.mkdir()
            made.append(d)
            d = d / "d"
        proc = subprocess.run([sys.executable, "-m", "attn_probe", "export", str(deep), "-o", str(tmp_path / "o.csv")],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        for d in reversed(made):
            d.rmdir()
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "nested more than" in err


def test_a_symbolic_link_loop_is_walked_once(tmp_path):
    run = tmp_path / "root" / "run"
    run.mkdir(parents=True)
    (run / "attn_probe.jsonl").write_bytes(header("x", 0) + row(0) + row(5))
    os.symlink(tmp_path / "root", run / "loop")  # root/run/loop -> root
    df = load_trajectory(tmp_path / "root")
    assert df["run"].unique().tolist() == ["run"] and df["step"].tolist() == [0, 5]
