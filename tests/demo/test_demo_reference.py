"""The demo's reading of the result, as a user sees it: a tiny ``attn-probe demo`` in a child process.

One TensorBoard command; one final loss (the Trainer's last logged loss, that of TensorBoard's
``train/loss``) in every place it is printed; progress lines with the time left; the verdict's
paper numbers are those of the shipped table; no DeepSpeed accelerator warning. The paper's
matching runs are written as TensorBoard runs whose scalars are the table's values.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import attn_probe.baselines  # noqa: E402
from attn_probe.formats.tags import scalar_tag  # noqa: E402

TINY = ["--size", "tiny", "--steps", "6", "--batch-size", "4", "--seq-len", "16", "--every", "2",
        "--max-chars", "20000", "--no-figure", "--threads", "1", "--sequential"]


def paper_rows(layers: int, model: str, dataset: str) -> dict[int, dict[str, float]]:
    """step -> the row of one of the paper's runs, from the shipped CSV read with csv alone."""
    path = Path(attn_probe.baselines.__file__).with_name("paper_trajectories.csv")
    with path.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return {int(r["step"]): {k: float(v) for k, v in r.items() if "_" in k and k.split("_")[-1] in
                             ("median", "q25", "q75")}
            for r in rows if int(r["layers"]) == layers and r["model"] == model and r["dataset"] == dataset}


def tb_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[Path, str]:
    """A tiny demo as a user runs it: a child process, stdout and stderr together (not a terminal)."""
    out = tmp_path_factory.mktemp("demo reference")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("DS_ACCELERATOR", None)
    done = subprocess.run([sys.executable, "-m", "attn_probe.cli", "demo", *TINY, "--out-dir", str(out),
                           "--name", "d"], capture_output=True, text=True, env=env, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    return out / "d", text


def test_one_tensorboard_command_for_both_models_and_the_paper(demo_run):
    root, text = demo_run
    commands = set(re.findall(r"tensorboard --logdir (?:'[^']*'|\S+) --samples_per_plugin scalars=\d+", text))
    assert commands == {f"tensorboard --logdir {shlex.quote(str(root))} --samples_per_plugin scalars=1000000"}
    assert "attn_probe: watching" not in text  # the probe's own line (and command) per run


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_no_deepspeed_accelerator_warning(demo_run):
    _, text = demo_run
    assert "real_accelerator" not in text and "Setting accelerator" not in text


def test_deepspeed_setting_is_scoped_and_a_users_value_kept(monkeypatch):
    import torch

    from attn_probe.demo.run import _deepspeed_on_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    with _deepspeed_on_cpu():
        assert os.environ["DS_ACCELERATOR"] == "cpu"
    assert "DS_ACCELERATOR" not in os.environ
    monkeypatch.setenv("DS_ACCELERATOR", "mine")
    with _deepspeed_on_cpu():
        assert os.environ["DS_ACCELERATOR"] == "mine"
    assert os.environ["DS_ACCELERATOR"] == "mine"


def test_one_final_loss_everywhere(demo_run):
    root, text = demo_run
    assert text.count("final loss: the training loss averaged over the last 2 steps") == 1
    for kind in ("encoder", "decoder"):
        steps, loss = tb_scalars(root / kind, "train/loss")[-1]
        assert steps == 6
        final = f"{loss:.3f}"
        assert f"  {kind}: " in text and re.search(rf"^  {kind}: \d+ s, final loss {final}, ", text, re.M)
        assert re.search(rf"^{kind} .* {final}$", text, re.M)  # the table
        assert f"{kind}: still on the unigram plateau (final loss {final};" in text  # the verdict
        assert re.search(rf"^{kind}: step 6/6, loss {final}, ", text, re.M)  # the last progress line
        # every loss printed for this model is one of its logged losses, to 3 decimals
        logged = {f"{v:.3f}" for _, v in tb_scalars(root / kind, "train/loss")}
        printed = set(re.findall(rf"^{kind}: step \d+/6, loss (\d+\.\d+)", text, re.M))
        assert printed and printed <= logged


def test_progress_lines_say_the_time_left(demo_run):
    _, text = demo_run
    lines = re.findall(r"^(encoder|decoder): step (\d+)/6, loss \d+\.\d{3}, \d+ s(, about \d+ s left)?$", text, re.M)
    assert {(k, s) for k, s, _ in lines} >= {(k, str(s)) for k in ("encoder", "decoder") for s in (2, 4, 6)}
    assert all(bool(left) == (s != "6") for _, s, left in lines)  # the last line has nothing left


def test_verdict_quotes_the_papers_matching_runs_from_the_table(demo_run):
    root, text = demo_run
    for kind in ("encoder", "decoder"):
        table = paper_rows(4, kind, "wikipedia")  # tiny: 2 layers -> the 4-layer runs; characters -> Wikipedia
        line = next(ln for ln in text.splitlines() if re.match(rf"  {kind} [+-]\d\.\d{{3}} at step 6; ", ln))
        assert f"the paper's 4-layer {kind}, Wikipedia, character-level" in line
        assert (f"{table[1000]['symmetry_median']:+.3f} at step 1,000 (its nearest checkpoint), "
                f"{table[200_000]['symmetry_median']:+.3f} at step 200,000 (its last)") in line
        # its TensorBoard run: the table's values at the checkpoints up to the first one past step 6
        run = root / f"paper-4-layer-{kind}-wikipedia"
        for metric in ("symmetry", "directionality"):
            for stat in ("median", "q25", "q75"):
                got = tb_scalars(run, scalar_tag("self", metric, stat=stat))
                assert got == [(1000, pytest.approx(table[1000][f"{metric}_{stat}"], abs=1e-6))]


@pytest.mark.parametrize(("last_step", "shown"), [(1, [1000]), (1500, [1000, 2000]), (2000, [1000, 2000]),
                                                  (2001, [1000, 2000, 3000]), (10**6, None)])
def test_reference_runs_are_clipped_to_the_demos_steps(tmp_path, last_step, shown):
    from attn_probe.demo.reference import matching_runs, write_paper_runs

    runs = matching_runs(["encoder"], 4, "wordpiece")
    (written,) = write_paper_runs(tmp_path, runs, ["self", "cross"], last_step)
    assert written == tmp_path / "paper-4-layer-encoder-jigsaw"
    table = paper_rows(4, "encoder", "jigsaw")
    shown = shown or sorted(table)  # past the paper's end: all of it
    for group in ("self", "cross"):
        got = tb_scalars(written, scalar_tag(group, "symmetry", stat="q75"))
        assert [s for s, _ in got] == shown
        assert [v for _, v in got] == pytest.approx([table[s]["symmetry_q75"] for s in shown], abs=1e-6)
    write_paper_runs(tmp_path, runs, ["self"], last_step)  # a rerun replaces the run, not appends to it
    assert len(list(written.glob("events.out.tfevents.*"))) == 1


def test_reading_the_demo_root_back_skips_the_paper_runs(demo_run):
    """`attn-probe plot/summary runs/demo` read the two models only: the paper's TensorBoard runs
    beside them are not probe runs, and no warning names them."""
    import warnings

    from attn_probe.analysis.trajectory import load_trajectory

    root, _ = demo_run
    assert sorted(p.name for p in root.glob("paper-*")), "the demo wrote no paper run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = load_trajectory(root)
    assert sorted(df["run"].unique()) == ["decoder", "encoder"]
    assert not [w for w in caught if "paper-" in str(w.message)], [str(w.message) for w in caught]
