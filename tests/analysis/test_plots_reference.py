"""The dynamics figure beside the paper: the reference overlay, the random-matrix band, the y range.

Runs are written by the probe's own trajectory sink; the expected values are read here from the
shipped CSV with ``csv`` (not through attn_probe.baselines) and from the values written, and
compared with the data of the matplotlib objects drawn.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("matplotlib")
pytest.importorskip("pandas")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402

from attn_probe import plot_dynamics  # noqa: E402
from attn_probe.analysis.plots import score_ylim  # noqa: E402
from attn_probe.analysis.trajectory import TrajectoryError  # noqa: E402
from attn_probe.sinks import Record, RunInfo, Snapshot  # noqa: E402
from attn_probe.sinks.trajectory import TrajectorySink  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CSV = ROOT / "attn_probe" / "baselines" / "paper_trajectories.csv"
LAYERS = 3
RANDOM_LABEL = "random W_qk (±2 sd)"
ENC = "4-layer-encoder-wikipedia"
DEC = "4-layer-decoder-jigsaw"
DESCRIBE = {ENC: "the paper's 4-layer encoder, Wikipedia, character-level",
            DEC: "the paper's 4-layer decoder, Jigsaw, word-level (WordPiece)"}


def table() -> dict[tuple[str, str], dict[int, tuple[float, float, float]]]:
    """(run name, metric) -> step -> (median, q25, q75), read from the CSV here."""
    out: dict[tuple[str, str], dict[int, tuple[float, float, float]]] = {}
    with open(CSV, newline="") as fh:
        for row in csv.DictReader(line for line in fh if not line.startswith("#")):
            for metric in ("symmetry", "directionality"):
                out.setdefault((f"{row['size']}-{row['model']}-{row['dataset']}", metric), {})[int(row["step"])] = (
                    float(row[f"{metric}_median"]), float(row[f"{metric}_q25"]), float(row[f"{metric}_q75"]))
    return out


TABLE = table()
NAMES = sorted({name for name, _ in TABLE})

#: per-layer random range written by the fixture: metric -> (means, sds) of layers 0..2
RANDOM = {"symmetry": ([0.004, 0.011, -0.002], [0.010, 0.013, 0.012]),
          "directionality": ([0.02, -0.05, 0.01], [0.19, 0.24, 0.21])}


def write_run(run_dir: Path, steps, level=(0.15, -0.3), seed=0, random=None, noise=0.01):
    """A run as the probe writes it: per step, layer-level symmetry/directionality near
    ``level * step / last`` and one per-head row; with ``random`` (metric -> (means, sds)), the
    random-range rows at the first step, layer-level plus per-head rows of other values."""
    rng = np.random.default_rng(seed)
    sink = TrajectorySink(str(run_dir))
    sink.start(RunInfo({}, {}, ["self"], ["symmetry", "directionality"], True))
    for step in steps:
        records = []
        for layer in range(LAYERS):
            for metric, top in zip(("symmetry", "directionality"), level, strict=True):
                records.append(Record("self", layer, None, metric, float(top * step / steps[-1] + rng.normal(0, noise))))
                records.append(Record("self", layer, 0, metric, 0.9))
            if random and step == steps[0]:
                for metric, (means, sds) in random.items():
                    records.append(Record("self", layer, None, f"random_{metric}", means[layer]))
                    records.append(Record("self", layer, None, f"random_{metric}_sd", sds[layer]))
                    records.append(Record("self", layer, 1, f"random_{metric}", 0.8))  # per head: not the band
                    records.append(Record("self", layer, 1, f"random_{metric}_sd", 0.5))
        sink.log(Snapshot(step, 0.0, records))
    sink.finish()
    return run_dir


def reference_lines(ax, name):
    return [ln for ln in ax.get_lines() if ln.get_label() == DESCRIBE[name]]


def hatched(ax):
    return [c for c in ax.collections if isinstance(c, PolyCollection) and c.get_hatch()]


def band_at(poly, x):
    ys = poly.get_paths()[0].vertices
    ys = ys[np.isclose(ys[:, 0], x), 1]
    return ys.min(), ys.max()


def legend_texts(fig):
    return [t.get_text() for leg in fig.legends for t in leg.get_texts() if t.get_text()]


def random_spans(ax):
    """(lo, hi) of each random band patch in ``ax``."""
    out = []
    for p in ax.patches:
        if p.get_label() == RANDOM_LABEL:
            y = p.get_path().transformed(p.get_patch_transform()).vertices[:, 1]
            out.append((y.min(), y.max()))
    return out


@pytest.mark.parametrize("last, every, shown, label", [
    (1500, 100, [1000, 2000], "to 1.5k of 200k steps"),  # 1k inside, 2k the nearest beyond
    (5000, 250, [1000, 2000, 3000, 4000, 5000, 6000], "to 5k of 200k steps"),
    (700, 50, [1000, 2000], "to 1k of 200k steps"),  # no checkpoint in range: the range reaches 1k
], ids=["1500-steps", "5000-steps", "700-steps"])
def test_reference_is_the_tables_median_and_band_clipped_to_the_runs_steps(tmp_path, last, every, shown, label):
    steps = list(range(0, last + 1, every))
    run = write_run(tmp_path / "enc", steps)
    fig = plot_dynamics(run, reference=ENC, path=tmp_path / "fig.png")
    assert [ax.get_title() for ax in fig.axes] == ["symmetry", "directionality"]
    for ax, metric in zip(fig.axes, ("symmetry", "directionality"), strict=True):
        values = TABLE[(ENC, metric)]
        (ref,) = reference_lines(ax, ENC)
        assert ref.get_linestyle() == "--"
        assert list(ref.get_xdata()) == shown
        np.testing.assert_array_equal(ref.get_ydata(), [values[s][0] for s in shown])
        (band,) = hatched(ax)
        for s in shown:
            assert band_at(band, s) == pytest.approx(values[s][1:], abs=1e-12)
        (mine,) = [ln for ln in ax.get_lines() if ln.get_label() == "enc"]
        assert list(mine.get_xdata()) == steps  # the run's own line is untouched
        lo, hi = ax.get_xlim()
        assert lo <= 0 and max(last, shown[0]) <= hi < shown[-1]  # the run's range, not 200k
    assert DESCRIBE[ENC] + f" ({label})" in legend_texts(fig)
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plt.close(fig)


def test_a_run_past_the_papers_last_step_shows_the_whole_reference(tmp_path):
    run = write_run(tmp_path / "long", [0, 100_000, 210_000])
    fig = plot_dynamics(run, reference=[DEC], metrics="symmetry")
    (ax,) = fig.axes
    (ref,) = reference_lines(ax, DEC)
    assert list(ref.get_xdata()) == list(range(1000, 200_001, 1000))
    np.testing.assert_array_equal(ref.get_ydata(), [TABLE[(DEC, "symmetry")][s][0] for s in ref.get_xdata()])
    assert DESCRIBE[DEC] in legend_texts(fig)  # not clipped: no "(to ...)"
    plt.close(fig)


def test_several_references_each_once_in_its_own_colour(tmp_path):
    run = write_run(tmp_path / "enc", list(range(0, 3001, 200)))
    fig = plot_dynamics(run, reference=[f"{ENC},{DEC}", ENC])
    for ax in fig.axes:
        (enc,), (dec,) = reference_lines(ax, ENC), reference_lines(ax, DEC)
        assert enc.get_color() != dec.get_color()
        assert len(hatched(ax)) == 2
    assert sum(text.startswith("the paper's") for text in legend_texts(fig)) == 2
    plt.close(fig)


def test_a_panel_the_paper_has_no_values_for_gets_no_reference_and_a_warning(tmp_path):
    from attn_probe.analysis.trajectory import TrajectoryWarning

    sink = TrajectorySink(str(tmp_path / "norms"))
    sink.start(RunInfo({}, {}, ["self"], ["spectral_norm"], False))
    for step in (0, 1000, 2000):
        sink.log(Snapshot(step, 0.0, [Record("self", la, None, "spectral_norm", 1.0 + la + step / 1000)
                                      for la in range(LAYERS)]))
    sink.finish()
    with pytest.warns(TrajectoryWarning, match="symmetry and directionality only: no reference drawn in the spectral_norm panel"):
        fig = plot_dynamics(tmp_path / "norms", metrics="spectral_norm", reference=ENC)
    (ax,) = fig.axes
    assert reference_lines(ax, ENC) == [] and hatched(ax) == [] and fig.legends == []
    plt.close(fig)


def test_unknown_reference_is_one_line_before_reading(tmp_path):
    with pytest.raises(ValueError) as info:
        plot_dynamics(tmp_path / "does-not-exist", reference="4-layer-encoder-wiki")
    text = str(info.value)
    assert "\n" not in text and text.startswith("unknown paper run '4-layer-encoder-wiki'")
    assert all(name in text for name in NAMES)


def test_random_band_is_median_mean_plus_minus_two_median_sd(tmp_path):
    run = write_run(tmp_path / "enc", list(range(0, 1501, 100)), random=RANDOM)
    fig = plot_dynamics(run)
    assert [ax.get_title() for ax in fig.axes] == ["symmetry", "directionality"]  # no random_* panel
    for ax, metric in zip(fig.axes, ("symmetry", "directionality"), strict=True):
        means, sds = RANDOM[metric]
        mean, sd = np.median(means), np.median(sds)
        (span,) = random_spans(ax)
        assert span == pytest.approx((mean - 2 * sd, mean + 2 * sd), abs=1e-12)
        lo, hi = ax.get_ylim()
        assert lo <= span[0] and span[1] <= hi
        for ln in ax.get_lines():  # nothing else drawn carries the random rows' values
            assert not np.isin(np.asarray(ln.get_ydata(), dtype=float), [*means, *sds]).any()
    assert RANDOM_LABEL in legend_texts(fig)
    plt.close(fig)


def test_random_band_of_equal_runs_drawn_once_and_of_different_runs_each(tmp_path):
    steps = list(range(0, 1001, 100))
    write_run(tmp_path / "same" / "enc", steps, random=RANDOM)
    write_run(tmp_path / "same" / "dec", steps, level=(0.03, -0.1), random=RANDOM, seed=1)
    fig = plot_dynamics(tmp_path / "same", metrics="symmetry")
    assert len(random_spans(fig.axes[0])) == 1
    plt.close(fig)
    wider = {m: (means, [2 * s for s in sds]) for m, (means, sds) in RANDOM.items()}
    write_run(tmp_path / "diff" / "enc", steps, random=RANDOM)
    write_run(tmp_path / "diff" / "dec", steps, random=wider, seed=1)
    fig = plot_dynamics(tmp_path / "diff", metrics="symmetry")
    assert len(random_spans(fig.axes[0])) == 2
    plt.close(fig)


def test_no_random_rows_no_band(tmp_path):
    run = write_run(tmp_path / "enc", list(range(0, 1501, 100)))
    fig = plot_dynamics(run, reference=ENC)
    assert all(random_spans(ax) == [] for ax in fig.axes)
    assert RANDOM_LABEL not in legend_texts(fig)
    plt.close(fig)


def test_random_rows_are_never_a_panel(tmp_path):
    run = write_run(tmp_path / "enc", [0, 100, 200], random=RANDOM)
    for asked in ("random_symmetry", "random_directionality_sd"):
        with pytest.raises(TrajectoryError, match="random-matrix range, not a panel"):
            plot_dynamics(run, metrics=asked)
    fig = plot_dynamics(run, per_layer=True)
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == ["symmetry", "directionality"]
    plt.close(fig)


@pytest.mark.parametrize("per_layer", [False, True], ids=["median", "per_layer"])
def test_y_range_shows_a_small_gap_between_encoder_and_decoder(tmp_path, per_layer):
    """Encoder at +0.15, decoder at +0.035 (the CPU demo's end): the gap takes a third of the axis or
    more (on [-1, 1] it would be 6%), and everything drawn stays inside it."""
    steps = list(range(0, 701, 50))
    write_run(tmp_path / "runs" / "encoder", steps, level=(0.15, -0.2), noise=0.005)
    write_run(tmp_path / "runs" / "decoder", steps, level=(0.035, -0.25), noise=0.005, seed=1)
    fig = plot_dynamics(tmp_path / "runs", per_layer=per_layer, path=tmp_path / "gap.png")
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    assert (0.15 - 0.035) / (hi - lo) >= 1 / 3
    drawn = np.concatenate([np.asarray(ln.get_ydata(), dtype=float) for ln in ax.get_lines()])
    assert lo <= min(drawn.min(), 0.0) and max(drawn.max(), 0.0) <= hi and -1.05 <= lo and hi <= 1.05
    plt.close(fig)


@given(st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=30))
def test_score_ylim_holds_the_values_and_zero_and_is_at_least_a_quarter_tall(values):
    lo, hi = score_ylim(values)
    assert -1.05 <= lo <= min(*values, 0.0) and max(*values, 0.0) <= hi <= 1.05
    assert hi - lo >= 0.25 - 1e-9
    if min(values) == -1.0:  # a line at exactly -1 is not drawn on the frame
        assert lo < -1.0


def test_score_ylim_without_values_is_the_full_range():
    assert score_ylim([]) == (-1.0, 1.0) and score_ylim([float("nan")]) == (-1.0, 1.0)


def run_cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "attn_probe", "plot", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def test_cli_reference_writes_the_figure(tmp_path):
    run = write_run(tmp_path / "enc", list(range(0, 1501, 100)), random=RANDOM)
    out = run_cli(str(run), "-o", str(tmp_path / "fig.png"), "--reference", f"{ENC},{DEC}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == f"wrote {tmp_path / 'fig.png'}"
    image = plt.imread(tmp_path / "fig.png")
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400


def test_cli_bad_reference_is_one_line(tmp_path, capsys):
    from attn_probe.cli import main

    run = write_run(tmp_path / "enc", [0, 100])
    assert main(["plot", str(run), "-o", str(tmp_path / "bad.png"), "--reference", "gpt2-small"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attn-probe plot: error: unknown paper run 'gpt2-small'")
    assert all(name in lines[0] for name in NAMES)
    assert not (tmp_path / "bad.png").exists()


def test_cli_reference_list_prints_the_names_without_runs(capsys):
    from attn_probe.cli import main

    with pytest.raises(SystemExit) as info:
        main(["plot", "--reference", "list"])
    assert info.value.code == 0
    assert sorted(line.split()[0] for line in capsys.readouterr().out.splitlines()) == NAMES


def test_cli_reference_is_repeatable_and_takes_comma_lists():
    from attn_probe.cli import build_parser

    args = build_parser().parse_args(["plot", "r", "-o", "f.png", "--reference", f"{ENC}, {DEC}", "--reference", ENC])
    assert args.reference == [ENC, DEC, ENC]
    assert build_parser().parse_args(["plot", "r", "-o", "f.png"]).reference is None
