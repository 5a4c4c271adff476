"""``attn-probe export | summary | plot | heatmap``: exit codes, outputs and one-line errors.

In-process through ``attn_probe.cli.main([...])``, plus one subprocess smoke test.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

import pandas as pd  # noqa: E402

from attn_probe.analysis.trajectory import read_table  # noqa: E402
from attn_probe.cli import main  # noqa: E402
from attn_probe.formats.tags import scalar_tag  # noqa: E402
from attn_probe.formats.trajectory import TRAJECTORY_FILENAME  # noqa: E402

STEPS = [0, 10, 20]
LAYERS = 5


def values(seed):
    rng = np.random.default_rng(seed)
    return {(m, s, la): float(np.float32(rng.uniform(-1, 1)))
            for m in ("symmetry", "directionality") for s in STEPS for la in range(LAYERS)}


@pytest.fixture
def runs(tmp_path):
    """encoder/ as a trajectory file, decoder/ as TensorBoard event files only."""
    from torch.utils.tensorboard import SummaryWriter

    vals = {"encoder": values(0), "decoder": values(1)}
    enc = tmp_path / "runs" / "encoder"
    enc.mkdir(parents=True)
    with open(enc / TRAJECTORY_FILENAME, "w") as fh:
        for (m, s, la), v in vals["encoder"].items():
            fh.write(json.dumps({"step": s, "wall_time": 0.0, "group": "self", "layer": la, "head": None,
                                 "metric": m, "value": v}) + "\n")
    with SummaryWriter(str(tmp_path / "runs" / "decoder")) as w:
        for (m, s, la), v in vals["decoder"].items():
            w.add_scalar(scalar_tag("self", m, layer=la), v, s)
    return tmp_path / "runs", vals


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("suffix", ["csv", "parquet", "jsonl"])
def test_export(runs, tmp_path, capsys, suffix):
    root, vals = runs
    out = tmp_path / f"all.{suffix}"
    code, _, err = run_cli(capsys, "export", root, "-o", out)
    assert code == 0, err
    assert f"wrote {2 * len(vals['encoder'])} rows from 2 runs" in err
    df = read_table(out)
    assert sorted(df["run"].unique()) == ["decoder", "encoder"]
    for name, v in vals.items():
        part = df[df["run"] == name]
        got = {(m, s, la): val for m, s, la, val in zip(part["metric"], part["step"], part["layer"],
                                                         part["value"], strict=True)}
        assert got == v


def test_export_format_flag_and_bad_suffix(runs, tmp_path, capsys):
    root, _ = runs
    code, _, _ = run_cli(capsys, "export", root, "-o", tmp_path / "t.dat", "--format", "parquet")
    assert code == 0 and len(read_table(tmp_path / "t.dat", format="parquet")) > 0
    code, out, err = run_cli(capsys, "export", root, "-o", tmp_path / "t.xlsx")
    assert code == 2 and not (tmp_path / "t.xlsx").exists()
    assert err.startswith("attn-probe export: error: cannot tell the format") and err.count("\n") == 1


def test_summary_text_and_csv(runs, capsys):
    root, vals = runs
    code, out, err = run_cli(capsys, "summary", root, "--format", "csv")
    assert code == 0, err
    table = pd.read_csv(io.StringIO(out))
    assert len(table) == 4  # 2 runs x 2 scores
    for row in table.itertuples():
        v = vals[row.run]
        first = [v[(row.metric, 0, la)] for la in range(LAYERS)]
        last = [v[(row.metric, 20, la)] for la in range(LAYERS)]
        assert (row.first_step, row.last_step, row.layers) == (0, 20, LAYERS)
        assert row.first_median == pytest.approx(np.median(first))
        assert row.first_q25 == pytest.approx(np.percentile(first, 25))
        assert row.last_q75 == pytest.approx(np.percentile(last, 75))
    code, out, _ = run_cli(capsys, "summary", root / "encoder")
    assert code == 0
    med = np.median([vals["encoder"][("symmetry", 20, la)] for la in range(LAYERS)])
    assert out.splitlines()[0] == "run encoder"
    sym_line = next(line for line in out.splitlines() if " symmetry " in line)
    assert f"{med:+.2f} [" in sym_line


def test_plot_and_per_layer(runs, tmp_path, capsys):
    root, _ = runs
    for extra, name in (([], "fig.png"), (["--per-layer", "--group", "self", "--metric", "symmetry"], "fig.svg")):
        code, _, err = run_cli(capsys, "plot", root, "-o", tmp_path / name, *extra)
        assert code == 0, err
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heatmap(tmp_path, capsys):
    pytest.importorskip("transformers")
    from helpers import tiny_model  # after the skip: helpers imports transformers

    tiny_model("bert", None, cls="BertModel", vocab_size=40, hidden_size=16, num_hidden_layers=2,
               num_attention_heads=2, intermediate_size=20, max_position_embeddings=8).save_pretrained(tmp_path / "ckpt")
    code, _, err = run_cli(capsys, "heatmap", tmp_path / "ckpt", "--layer", "1", "--head", "0",
                           "-o", tmp_path / "hm.png")
    assert code == 0, err
    assert (tmp_path / "hm.png").read_bytes()[:4] == b"\x89PNG"
    code, _, err = run_cli(capsys, "heatmap", tmp_path / "ckpt", "--layer", "3", "-o", tmp_path / "x.png")
    assert code == 2 and "no layer 3" in err and "Traceback" not in err
    code, _, err = run_cli(capsys, "heatmap", tmp_path, "--layer", "0", "-o", tmp_path / "x.png")
    assert code == 2 and "no config.json" in err and "ckpt" in err


def _bad_inputs(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "noprobe").mkdir()
    (tmp_path / "noprobe" / "notes.txt").write_text("hello")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / TRAJECTORY_FILENAME).write_text('{"step": 1, "gr\nnonsense\n')
    return {
        "missing": (tmp_path / "nope", "no such directory"),
        "empty": (tmp_path / "empty", "no probe data"),
        "no_probe_data": (tmp_path / "noprobe", "no probe data"),
        "corrupt": (tmp_path / "corrupt", "no probe data"),
    }


@pytest.mark.parametrize("command", ["export", "summary", "plot"])
@pytest.mark.parametrize("case", ["missing", "empty", "no_probe_data", "corrupt"])
def test_unusable_input_is_one_line_and_exit_2(tmp_path, capsys, command, case):
    path, message = _bad_inputs(tmp_path)[case]
    extra = {"export": ["-o", tmp_path / "o.csv"], "plot": ["-o", tmp_path / "o.png"], "summary": []}[command]
    code, out, err = run_cli(capsys, command, path, *extra)
    assert code == 2
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and message in errors[0] and errors[0].startswith(f"attn-probe {command}: error:")
    if case == "corrupt":
        assert "warning: " in err and "skipped 2 corrupt or truncated lines" in err
    assert not (tmp_path / "o.csv").exists() and not (tmp_path / "o.png").exists()


def test_mixed_runs_keep_the_usable_ones_with_a_warning(runs, tmp_path, capsys):
    root, _ = runs
    bad = _bad_inputs(tmp_path)["corrupt"][0]
    code, out, err = run_cli(capsys, "summary", root / "encoder", bad)
    assert code == 0
    assert "run encoder" in out and "corrupt" not in out
    assert "warning:" in err and "no probe data, skipped" in err


def test_missing_pandas_is_a_one_line_error(runs, capsys, monkeypatch):
    root, _ = runs
    monkeypatch.setitem(sys.modules, "pandas", None)
    code, _, err = run_cli(capsys, "summary", root)
    assert code == 2 and "pip install 'attn-probe[pandas]'" in err and "Traceback" not in err


def test_subprocess_smoke(runs):
    root, _ = runs
    proc = subprocess.run([sys.executable, "-m", "attn_probe", "summary", str(root)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "run decoder" in proc.stdout and "run encoder" in proc.stdout


def _probe_run(run_dir, steps, nan_metrics=()):
    """A run as the probe writes it (its own trajectory sink), NaN (null) for ``nan_metrics``."""
    from attn_probe.sinks import Record, RunInfo, Snapshot
    from attn_probe.sinks.trajectory import TrajectorySink

    sink = TrajectorySink(str(run_dir))
    sink.start(RunInfo({}, {}, ["self"], ["symmetry", "directionality"], True))
    for step in steps:
        sink.log(Snapshot(step, 0.0, [
            Record("self", layer, head, metric, float("nan") if metric in nan_metrics else 0.1 * (layer + 1))
            for layer in range(2) for head in (None, 0) for metric in ("symmetry", "directionality")]))
    sink.finish()
    return run_dir


@pytest.mark.parametrize("extra", [[], ["--per-layer"], ["--logx"]], ids=["median", "per_layer", "logx"])
def test_plot_with_nothing_finite_is_exit_2(tmp_path, capsys, extra):
    run = _probe_run(tmp_path / "allnan", [0, 6], nan_metrics=("symmetry", "directionality"))
    code, _, err = run_cli(capsys, "plot", run, "-o", tmp_path / "allnan.png", *extra)
    assert code == 2, err
    assert "Traceback" not in err and "No artists" not in err
    (line,) = [ln for ln in err.splitlines() if ln]
    assert line.startswith("attn-probe plot: error: nothing finite to plot")
    assert not (tmp_path / "allnan.png").exists()
    code, _, err = run_cli(capsys, "summary", run)
    assert code == 2 and "error: no layer-level values to summarise: all" in err and "are NaN" in err


@pytest.mark.parametrize("extra", [[], ["--per-layer"]], ids=["median", "per_layer"])
def test_plot_and_summary_name_an_all_nan_metric(tmp_path, capsys, extra):
    run = _probe_run(tmp_path / "nanrun", [0, 6], nan_metrics=("directionality",))
    code, _, err = run_cli(capsys, "plot", run, "-o", tmp_path / "nanrun.png", *extra)
    assert code == 0, err
    assert (tmp_path / "nanrun.png").stat().st_size > 0
    assert ("attn-probe plot: warning: run nanrun, group self: no finite layer-level value of directionality "
            "(all NaN); metric not drawn") in err
    assert "No artists" not in err
    code, out, err = run_cli(capsys, "summary", run)
    assert code == 0
    assert ("attn-probe summary: warning: run nanrun, group self: no finite layer-level value of directionality "
            "(all NaN); metric left out of the summary") in err
    assert " symmetry " in out and "directionality" not in out

