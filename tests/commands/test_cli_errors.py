"""The CLI's user-facing edges (issue 20 frictions, issue 23 items 7 and 8), through the real CLI.

Each test failed before the change: a traceback, argparse's top-level usage, the generic
"found no attention layer" message, a signed norm, ``ov_qk_bound``, raw formulas and
terminal escapes in names, fsspec's ``ValueError`` for a URL log_dir, ``pyarrow>=14``.
"""

from __future__ import annotations

import configparser
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pandas")

from helpers import tiny_model  # noqa: E402

from attn_probe.analysis.trajectory import load_trajectory, read_table  # noqa: E402
from attn_probe.formats.trajectory import TRAJECTORY_FILENAME  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
HOSTILE = ["=HYPERLINK(\"evil\"&A1,\"x\")", "+1+cmd", "@SUM(1+1)", "-2+3", "\tTAB", "\rCR", "'quoted",
           "plain"]


def write_run(run_dir: Path, values: dict[str, list[float]], steps=(0, 10)) -> Path:
    """A trajectory file as the sink writes it: ``values[metric][layer]`` (+ step/100) at every step."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / TRAJECTORY_FILENAME, "w") as fh:
        for step in steps:
            for metric, per_layer in values.items():
                for layer, v in enumerate(per_layer):
                    fh.write(json.dumps({"step": step, "wall_time": 0.0, "group": "self", "layer": layer,
                                         "head": None, "metric": metric, "value": v + step / 100}) + "\n")
    return run_dir


def cli(*argv, stdout=subprocess.PIPE, timeout=180) -> subprocess.CompletedProcess:
    """``python -m attn_probe ARGV`` (the console script's ``main``) in a fresh process."""
    return subprocess.run([sys.executable, "-m", "attn_probe", *map(str, argv)], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=timeout, env=ENV)


def one_line_error(proc: subprocess.CompletedProcess, command: str) -> str:
    err = [line for line in proc.stderr.splitlines() if "[WARNING]" not in line]  # DeepSpeed's import note
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(err) == 1 and err[0].startswith(f"attn-probe {command}: error: "), proc.stderr
    return err[0]


@pytest.fixture
def run(tmp_path):
    return write_run(tmp_path / "run", {"symmetry": [0.1, -0.3, 0.5], "spectral_norm": [1.0, 2.0, 3.0]})


# --------------------------------------------------------------------------- issue 20 frictions
@pytest.mark.parametrize("suffix", ["csv", "parquet", "jsonl"])
def test_export_into_a_file_as_directory_is_one_line(run, tmp_path, suffix):
    (tmp_path / "afile").write_text("not a directory")
    proc = cli("export", run, "-o", tmp_path / "afile" / f"x.{suffix}")
    line = one_line_error(proc, "export")
    assert line.endswith(f"cannot write {tmp_path / 'afile' / f'x.{suffix}'}: {tmp_path / 'afile'} is a file, "
                         "not a directory")
    assert (tmp_path / "afile").read_text() == "not a directory"


def test_export_onto_a_directory_is_one_line(run, tmp_path):
    (tmp_path / "out.csv").mkdir()
    assert "it is a directory" in one_line_error(cli("export", run, "-o", tmp_path / "out.csv"), "export")


def test_summary_into_a_closed_pipe_exits_quietly(run):
    """``attn-probe summary RUN | head -4``: the reader is gone before the table is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = cli("summary", run, stdout=write_end)
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.returncode == 141  # as a Unix tool killed by SIGPIPE reports in the shell


def test_summary_piped_to_head_prints_its_lines(run):
    shell = f"set -o pipefail; {sys.executable} -m attn_probe summary {run} | head -2"
    proc = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=180, env=ENV)
    assert proc.stdout.splitlines()[0] == "run run" and "Traceback" not in proc.stderr


def test_a_misspelled_option_suggests_the_right_one_with_the_subcommands_usage(run, tmp_path):
    proc = cli("plot", run, "-o", tmp_path / "f.png", "--metrics", "symmetry")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("usage: attn-probe plot ")
    assert "attn-probe plot: error: unrecognized arguments: --metrics symmetry (--metrics: did you mean --metric?)" \
        in proc.stderr
    proc = cli("summary", run, "--formt", "csv")
    assert proc.stderr.startswith("usage: attn-probe summary ") and "did you mean --format?" in proc.stderr


def test_summary_prints_norms_without_a_sign_and_scores_with_one(run):
    proc = cli("summary", run)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[1]: line for line in proc.stdout.splitlines()[2:]}
    # medians and quartiles of the layers [0.1, -0.3, 0.5] and [1, 2, 3] (+0.1 at step 10)
    assert "+0.10 [-0.10, +0.30]" in rows["symmetry"] and "+0.20 [+0.00, +0.40]" in rows["symmetry"]
    assert "2.00 [1.50, 2.50]" in rows["spectral_norm"] and "2.10 [1.60, 2.60]" in rows["spectral_norm"]
    assert "+" not in rows["spectral_norm"]


def test_runs_written_with_ov_qk_bound_load_as_ov_gain_bound(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from attn_probe.formats.tags import scalar_tag

    old = write_run(tmp_path / "old", {"ov_qk_bound": [4.0, 6.0], "ov_symmetry": [0.2, 0.4]})
    with SummaryWriter(str(tmp_path / "events")) as w:  # a run read from its event files only
        w.add_scalar(scalar_tag("self", "ov_qk_bound", layer=0), 5.0, 3)
    df = load_trajectory([old, tmp_path / "events"])
    assert set(df["metric"]) == {"ov_gain_bound", "ov_symmetry"}
    bound = df[df["metric"] == "ov_gain_bound"].set_index(["run", "step", "layer"])["value"]
    assert bound.to_dict() == {("events", 3, 0): 5.0, ("old", 0, 0): 4.0, ("old", 0, 1): 6.0,
                               ("old", 10, 0): 4.1, ("old", 10, 1): 6.1}
    proc = cli("summary", old)
    line = next(r for r in proc.stdout.splitlines() if "ov_gain_bound" in r)
    assert "5.00 [4.50, 5.50]" in line  # a magnitude: no sign
    # an exported table of an old run (written before the rename) reads back renamed
    (tmp_path / "old.jsonl").write_text(json.dumps({"run": "r", "group": "self", "step": 0, "layer": 0,
                                                    "head": None, "metric": "ov_qk_bound", "value": 1.0}) + "\n")
    assert list(read_table(tmp_path / "old.jsonl")["metric"]) == ["ov_gain_bound"]


def test_the_ov_pair_writes_ov_gain_bound():
    from attn_probe.scoring.pairs import OVPair

    assert OVPair().metrics[-1] == "ov_gain_bound" and "ov_qk_bound" not in OVPair().metrics
    assert OVPair(["qk_bound"]).metrics == ("ov_gain_bound",)


# --------------------------------------------------------------------------- unsupported models
def mamba():
    from transformers import MambaConfig, MambaModel

    return MambaModel(MambaConfig(hidden_size=16, num_hidden_layers=2, vocab_size=50, state_size=4))


def squeezebert():
    from transformers import SqueezeBertConfig, SqueezeBertModel

    return SqueezeBertModel(SqueezeBertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                              intermediate_size=32, vocab_size=50, embedding_size=16))


@pytest.mark.parametrize("build, reason", [
    (mamba, "it has no softmax attention (a state-space model"),
    (squeezebert, "grouped nn.Conv1d layers (SqueezeBERT), a layout listed as not supported in "
                  "docs/supported-models.md"),
], ids=["mamba", "squeezebert"])
def test_known_unsupported_models_say_why(build, reason):
    import attn_probe

    with pytest.raises(attn_probe.UnsupportedModelError) as info:
        attn_probe.find_attention(build())
    assert reason in str(info.value) and "qk_names" not in str(info.value)
    doc = (ROOT / "docs" / "supported-models.md").read_text()
    assert "SqueezeBERT (grouped `nn.Conv1d`" in doc and "Mamba" in doc


def test_scoring_a_mamba_checkpoint_says_why(tmp_path):
    mamba().save_pretrained(tmp_path / "mamba")
    line = one_line_error(cli("score", tmp_path / "mamba"), "score")
    assert "no attention layer attn_probe can read in MambaModel" in line
    assert "it has no softmax attention" in line


# --------------------------------------------------------------------------- issue 23 item 7
def test_pyarrow_floor_excludes_cve_2023_47248_everywhere_it_is_declared():
    from packaging.requirements import Requirement

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    declared = {}
    lists = {"install_requires": cfg["options"].get("install_requires", ""), **cfg["options.extras_require"]}
    for key, value in lists.items():
        for text in value.splitlines():
            text = text.split("#")[0].strip()
            if text and Requirement(text).name == "pyarrow":
                declared[key] = Requirement(text).specifier
    assert {"pandas", "all", "test"} <= set(declared), declared
    for key, spec in declared.items():
        assert "14.0.0" not in spec and "13.0.0" not in spec, (key, spec)
        assert spec.contains("14.0.1"), (key, spec)


def test_a_parquet_table_pyarrow_refuses_is_one_line(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"run": ["a"], "group": ["self"], "step": [0], "layer": [0], "head": [None],
                      "metric": ["symmetry"], "value": [1.0]})
    # pandas metadata of the wrong shape (pandas raises TypeError), and a file that is no Parquet at all
    pq.write_table(table.replace_schema_metadata({b"pandas": b'{"columns": 5, "index_columns": 7}'}),
                   tmp_path / "meta.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1" + b"\0" * 64 + b"PAR1")
    for name in ("meta", "junk"):
        line = one_line_error(cli("summary", tmp_path / f"{name}.parquet"), "summary")
        assert f"{name}.parquet: pandas/pyarrow refused this Parquet table (" in line


# --------------------------------------------------------------------------- issue 23 item 8
@pytest.fixture
def hostile_runs(tmp_path):
    """Run directories named like formulas: the loader names each run after its directory."""
    for name in HOSTILE:
        write_run(tmp_path / "runs" / name, {"symmetry": [-0.5, -0.25, -0.75]})
    return tmp_path / "runs"


def test_exported_csv_escapes_formula_cells_and_reads_back_exactly(hostile_runs, tmp_path):
    out = tmp_path / "all.csv"
    proc = cli("export", hostile_runs, "-o", out)
    assert proc.returncode == 0, proc.stderr
    with open(out, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    first_cells = {r["run"] for r in rows}
    assert first_cells == {"'" + n if n[0] in "=+-@\t\r'" else n for n in HOSTILE}
    assert not any(c[0] in "=+-@\t\r" for c in first_cells)
    assert {r["value"] for r in rows} >= {"-0.5", "-0.25", "-0.75"}  # numbers untouched
    assert set(read_table(out)["run"]) == set(HOSTILE)  # the loader removes the escape again


def test_summary_csv_escapes_formula_cells(hostile_runs):
    proc = subprocess.run([sys.executable, "-m", "attn_probe", "summary", str(hostile_runs), "--format", "csv"],
                          capture_output=True, timeout=180, env=ENV)  # bytes: keep a name's \r as written
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(io.StringIO(proc.stdout.decode(), newline="")))
    assert {r["run"] for r in rows} == {"'" + n if n[0] in "=+-@\t\r'" else n for n in HOSTILE}
    assert {r["first_median"] for r in rows} == {"-0.5"}  # numbers untouched


def test_control_characters_in_run_names_are_escaped_in_the_text_summary(tmp_path):
    names = ["\x1b[2J\x1b[H", "\x1b]0;title\x07", "two\nlines", "rtl\u202eevil"]
    args = [f"{n}={write_run(tmp_path / f'r{i}', {'symmetry': [0.5]})}" for i, n in enumerate(names)]
    proc = cli("summary", *args)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout and "\u202e" not in proc.stdout
    heads = [line for line in proc.stdout.splitlines() if line.startswith("run ")]
    assert sorted(heads) == sorted(["run \\x1b[2J\\x1b[H", "run \\x1b]0;title\\x07", "run two\\nlines",
                                    "run rtl\\u202eevil"])
    assert len(proc.stdout.splitlines()) == 4 * 3 + 3  # 3 lines per run, blank lines between: none forged


def test_errors_and_warnings_escape_names(tmp_path):
    bad = tmp_path / "no\x1b[2Jdata"
    bad.mkdir()
    proc = cli("summary", bad)
    assert proc.returncode == 2 and "\x1b" not in proc.stderr and "no\\x1b[2Jdata" in proc.stderr


def test_a_url_log_dir_is_a_log_dir_error(tmp_path, monkeypatch):
    from transformers import BertModel

    import attn_probe
    from attn_probe.formats.logdir import LogDirError

    monkeypatch.chdir(tmp_path)
    model = tiny_model("bert", None, cls=BertModel, vocab_size=40, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=20, max_position_embeddings=8)
    with pytest.raises(LogDirError, match=r"'s3://bucket/runs/x' as its log directory: it looks like a URL"):
        attn_probe.watch(model, log_dir="s3://bucket/runs/x", every=10)
    assert list(tmp_path.iterdir()) == []


def test_the_attach_announcement_escapes_control_characters(tmp_path, capsys):
    from transformers import BertModel

    import attn_probe

    model = tiny_model("bert", None, cls=BertModel, vocab_size=40, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=20, max_position_embeddings=8)
    probe = attn_probe.watch(model, log_dir=str(tmp_path / "run\nattn_probe: forged\x1b[2J"), every=10)
    probe.close(final_snapshot=False)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("attn_probe:")]
    assert len(lines) == 1 and "\x1b" not in err and "run\\nattn_probe: forged\\x1b[2J" in lines[0]
