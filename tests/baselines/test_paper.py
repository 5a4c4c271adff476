"""The paper's trajectories (attn_probe.baselines.paper) against the shipped table read here with
``csv`` on its own, and against the numbers the paper and our notes state."""

from __future__ import annotations

import configparser
import csv
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attn_probe.baselines import paper
from attn_probe.baselines.paper import (
    PaperPoint,
    PaperRun,
    matching_paper_run,
    paper_final,
    paper_point,
    paper_run,
    paper_runs,
    paper_trajectory,
)

ROOT = Path(__file__).resolve().parents[2]
CSV = ROOT / "attn_probe" / "baselines" / "paper_trajectories.csv"


def read_table() -> dict[tuple[str, str], dict[int, tuple[float, float, float]]]:
    """(run name, metric) -> step -> (median, q25, q75), straight from the file."""
    out: dict[tuple[str, str], dict[int, tuple[float, float, float]]] = {}
    with open(CSV, newline="") as fh:
        rows = csv.DictReader(line for line in fh if not line.startswith("#"))
        for row in rows:
            name = f"{row['size']}-{row['model']}-{row['dataset']}"
            for metric in ("symmetry", "directionality"):
                out.setdefault((name, metric), {})[int(row["step"])] = tuple(
                    float(row[f"{metric}_{q}"]) for q in ("median", "q25", "q75"))
    return out


TABLE = read_table()
NAMES = sorted({name for name, _ in TABLE})


def nearest(steps, step):
    """The nearest of ``steps`` to ``step``, the lower on a tie: by brute force."""
    return min(steps, key=lambda s: (abs(s - step), s))


def test_the_table_is_attributed_and_complete():
    head = CSV.read_text().split("\n", 12)
    comment = " ".join(line for line in head if line.startswith("#"))
    assert "arXiv 2502.10927" in comment and "github.com/matteosaponati/attention-geometry" in comment
    assert len(NAMES) == 12
    for steps in TABLE.values():
        assert sorted(steps) == list(range(1000, 200_001, 1000))


def test_runs_are_the_tables_runs():
    runs = paper_runs()
    assert sorted(r.name for r in runs) == NAMES
    with open(CSV, newline="") as fh:
        rows = {f"{r['size']}-{r['model']}-{r['dataset']}": r
                for r in csv.DictReader(line for line in fh if not line.startswith("#"))}
    for run in runs:
        row = rows[run.name]
        assert run == PaperRun(run.name, int(row["layers"]), row["model"], row["dataset"],
                               "chars" if row["tokens"].startswith("characters") else "wordpiece")
        assert paper_run(run.name) == run and paper_run(run) == run
        assert run.name == f"{run.layers}-layer-{run.model}-{run.dataset}"
    assert {r.tokens for r in runs if r.dataset in ("wikipedia", "red_pajama")} == {"chars"}
    assert {r.tokens for r in runs if r.dataset == "jigsaw"} == {"wordpiece"}
    assert paper_run("4-layer-encoder-wikipedia").describe() == "the paper's 4-layer encoder, Wikipedia, character-level"
    assert paper_run("12-layer-decoder-jigsaw").describe() == "the paper's 12-layer decoder, Jigsaw, word-level (WordPiece)"
    assert paper_run("4-layer-decoder-red_pajama").describe() == "the paper's 4-layer decoder, RedPajama, character-level"


@pytest.mark.parametrize("name", ["4-layer-encoder-wikipedia", "4-layer-decoder-jigsaw", "12-layer-decoder-red_pajama"])
@pytest.mark.parametrize("metric", ["symmetry", "directionality"])
@pytest.mark.parametrize("step, checkpoint", [
    (12_000, 12_000), (12_499, 12_000), (12_500, 12_000), (12_501, 13_000),  # ties go to the lower
    (1_500, 1_000), (0, 1_000), (999, 1_000), (199_500, 199_000), (199_501, 200_000), (10**9, 200_000),
])
def test_point_is_the_nearest_checkpoint_of_the_table(name, metric, step, checkpoint):
    assert paper_point(name, metric, step) == PaperPoint(checkpoint, *TABLE[(name, metric)][checkpoint])


@given(step=st.integers(0, 250_000), index=st.integers(0, 11), metric=st.sampled_from(["symmetry", "directionality"]))
def test_point_matches_a_brute_force_nearest(step, index, metric):
    name = NAMES[index]
    values = TABLE[(name, metric)]
    at = nearest(values, step)
    assert paper_point(name, metric, step) == (at, *values[at])


@pytest.mark.parametrize("name", NAMES)
def test_final_is_step_200k(name):
    for metric in ("symmetry", "directionality"):
        assert paper_final(name, metric) == PaperPoint(200_000, *TABLE[(name, metric)][200_000])


def test_the_numbers_the_paper_and_our_notes_state():
    """The paper's 4-layer endpoints (encoder 0.35 / 0.66 / 0.48, decoder -0.50 / -0.20 / -0.54 on
    Wikipedia, Jigsaw, RedPajama) and the Jigsaw decoder at 12k steps (-0.001 [-0.04, +0.03])."""
    ends = {"wikipedia": (0.35, -0.50), "jigsaw": (0.66, -0.20), "red_pajama": (0.48, -0.54)}
    for data, (enc, dec) in ends.items():
        assert paper_final(f"4-layer-encoder-{data}", "symmetry").median == pytest.approx(enc, abs=0.006)
        assert paper_final(f"4-layer-decoder-{data}", "symmetry").median == pytest.approx(dec, abs=0.006)
    at12k = paper_point("4-layer-decoder-jigsaw", "symmetry", 12_000)
    assert (at12k.median, at12k.q25, at12k.q75) == pytest.approx((-0.001, -0.04, 0.03), abs=0.006)


@pytest.mark.parametrize("model, layers, tokens, expected", [
    ("encoder", 4, "chars", "4-layer-encoder-wikipedia"),
    ("decoder", 4, "chars", "4-layer-decoder-wikipedia"),
    ("decoder", 12, "wordpiece", "12-layer-decoder-jigsaw"),
    ("encoder", 2, "characters", "4-layer-encoder-wikipedia"),
    ("encoder", 8, "words", "4-layer-encoder-jigsaw"),  # equally near 4 and 12: the smaller
    ("decoder", 9, "BPE", "12-layer-decoder-jigsaw"),
    ("encoder", 48, "chars", "12-layer-encoder-wikipedia"),
])
def test_matching_paper_run(model, layers, tokens, expected):
    run = matching_paper_run(model, layers, tokens)
    assert run.name == expected
    assert run.model == model
    assert run.tokens == ("chars" if tokens.lower().startswith("char") else "wordpiece")


@pytest.mark.parametrize("call, match", [
    (lambda: paper_run("4-layer-encoder-wiki"), r"unknown paper run '4-layer-encoder-wiki' \(did you mean 4-layer-encoder-wikipedia\?\)"),
    (lambda: paper_point("4-layer-encoder-wikipedia", "sym", 10), "no metric 'sym'; they hold symmetry, directionality"),
    (lambda: paper_final("4-layer-encoder-wikipedia", "spectral_norm"), "no metric 'spectral_norm'"),
    (lambda: paper_point("4-layer-encoder-wikipedia", "symmetry", -1), "non-negative int"),
    (lambda: paper_point("4-layer-encoder-wikipedia", "symmetry", 1.5), "non-negative int"),
    (lambda: matching_paper_run("bert", 4, "chars"), "'encoder' or 'decoder'"),
    (lambda: matching_paper_run("encoder", 0, "chars"), "positive int"),
    (lambda: matching_paper_run("encoder", 4, "bytes"), "tokens must be 'chars'"),
])
def test_bad_input_is_a_one_line_value_error(call, match):
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_unknown_name_lists_every_name():
    with pytest.raises(ValueError) as info:
        paper_run("gpt-2")
    text = str(info.value)
    assert "\n" not in text and all(name in text for name in NAMES)


def test_trajectory_frame_is_the_table():
    pd = pytest.importorskip("pandas")
    table = pd.read_csv(CSV, comment="#")
    for name in ("4-layer-encoder-jigsaw", "12-layer-decoder-wikipedia"):
        frame = paper_trajectory(name)
        assert list(frame.columns) == ["step", "metric", "median", "q25", "q75"]
        layers, model, data = name.split("-", 3)[0], name.split("-")[2], name.split("-", 3)[3]
        rows = table[(table["size"] == f"{layers}-layer") & (table["model"] == model) & (table["dataset"] == data)]
        for metric in ("symmetry", "directionality"):
            got = frame[frame["metric"] == metric].reset_index(drop=True)
            want = rows.sort_values("step").reset_index(drop=True)
            assert got["step"].tolist() == want["step"].tolist()
            for q in ("median", "q25", "q75"):
                assert got[q].tolist() == want[f"{metric}_{q}"].tolist()


def test_import_is_light_and_the_table_is_package_data():
    code = ("import sys, attn_probe.baselines.paper as p; p.paper_point('4-layer-encoder-wikipedia', 'symmetry', 5);"
            " print(sorted(m for m in ('pandas', 'numpy', 'torch', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""}, check=True)
    assert out.stdout.strip() == "[]"
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert CSV.name in cfg["options.package_data"]["attn_probe.baselines"].split()
    assert paper.DATA_FILE == CSV.name
