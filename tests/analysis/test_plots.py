"""Figures: structure of the dynamics figure (axes, series, labels, limits) and heatmap contents.

The checks read the matplotlib objects, not pixels, and compare the drawn data with numpy
references computed here from the values written / from the model's own q/k weights.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")
pytest.importorskip("pandas")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from helpers import tiny_model  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402

from attn_probe import plot_dynamics, plot_heatmap  # noqa: E402
from attn_probe.analysis.trajectory import MissingExtraError, TrajectoryError  # noqa: E402
from attn_probe.formats.trajectory import TRAJECTORY_FILENAME  # noqa: E402

STEPS = [0, 100, 200, 400]
LAYERS = 4


def write_run(run_dir, values, groups=("self",)):
    """values[(group, metric, step, layer)] -> float, written as one trajectory file."""
    run_dir.mkdir(parents=True)
    with open(run_dir / TRAJECTORY_FILENAME, "w") as fh:
        for (group, metric, step, layer), v in values.items():
            fh.write(json.dumps({"step": step, "wall_time": 0.0, "group": group, "layer": layer,
                                 "head": None, "metric": metric, "value": v}) + "\n")
            if layer == 0:  # a per-head row that must not enter the layer statistics
                fh.write(json.dumps({"step": step, "wall_time": 0.0, "group": group, "layer": 0,
                                     "head": 1, "metric": metric, "value": 0.99}) + "\n")


def assert_score_ylim(ax):
    """A score panel's y range holds every drawn value (lines, bands) and 0, inside [-1.05, 1.05]."""
    ys = [np.asarray(ln.get_ydata(), dtype=float) for ln in ax.get_lines()]
    ys += [p.vertices[:, 1] for c in ax.collections if isinstance(c, PolyCollection) for p in c.get_paths()]
    ys = np.concatenate(ys)
    lo, hi = ax.get_ylim()
    assert -1.05 <= lo <= min(ys.min(), 0.0) and max(ys.max(), 0.0) <= hi <= 1.05


def make_values(seed, groups=("self",)):
    rng = np.random.default_rng(seed)
    return {(g, m, s, la): float(rng.uniform(-0.9, 0.9))
            for g in groups for m in ("symmetry", "directionality") for s in STEPS for la in range(LAYERS)}


@pytest.fixture
def runs(tmp_path):
    vals = {"encoder": make_values(0), "decoder": make_values(1)}
    for name, v in vals.items():
        write_run(tmp_path / "runs" / name, v)
    return tmp_path / "runs", vals


def test_dynamics_figure_has_one_band_and_median_per_run(runs, tmp_path):
    root, vals = runs
    fig = plot_dynamics(root, path=tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 0
    assert len(fig.axes) == 2
    for ax, metric in zip(fig.axes, ("symmetry", "directionality"), strict=True):
        assert ax.get_title() == metric
        assert_score_ylim(ax)
        assert ax.get_xlabel() == "step"
        lines = ax.get_lines()
        zero = [ln for ln in lines if ln.get_linestyle() == "--"]
        medians = [ln for ln in lines if ln.get_linestyle() == "-"]
        assert len(zero) == 1 and set(zero[0].get_ydata()) == {0.0}
        assert sorted(ln.get_label() for ln in medians) == ["decoder", "encoder"]
        bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
        assert len(bands) == 2
        for ln in medians:
            v = vals[ln.get_label()]
            expected = [np.median([v[("self", metric, s, la)] for la in range(LAYERS)]) for s in STEPS]
            np.testing.assert_allclose(ln.get_xdata(), STEPS)
            np.testing.assert_allclose(ln.get_ydata(), expected, rtol=0, atol=1e-12)
        # each band spans q25..q75 of the layers: its vertices' y range at step 0
        for band, ln in zip(bands, medians, strict=True):
            v = vals[ln.get_label()]
            at0 = [v[("self", metric, 0, la)] for la in range(LAYERS)]
            xy = band.get_paths()[0].vertices
            ys = xy[np.isclose(xy[:, 0], 0.0), 1]
            assert ys.min() == pytest.approx(np.percentile(at0, 25))
            assert ys.max() == pytest.approx(np.percentile(at0, 75))
    legend = fig.axes[0].get_legend()
    assert sorted(t.get_text() for t in legend.get_texts()) == ["decoder", "encoder"]
    plt.close(fig)


def test_per_layer_figure_colours_layers_by_depth(runs):
    root, vals = runs
    fig = plot_dynamics(root / "encoder", per_layer=True, metrics=["symmetry"])
    ax, cbar_ax = fig.axes  # one panel and the colorbar
    assert cbar_ax.get_ylabel() == "layer (depth)"
    curves = [ln for ln in ax.get_lines() if set(ln.get_ydata()) != {0.0}]
    assert len(curves) == LAYERS
    viridis = matplotlib.colormaps["viridis"]
    v = vals["encoder"]
    for ln in curves:
        ys = np.asarray(ln.get_ydata())
        layer = next(la for la in range(LAYERS)
                     if np.allclose(ys, [v[("self", "symmetry", s, la)] for s in STEPS]))
        np.testing.assert_allclose(matplotlib.colors.to_rgba(ln.get_color()), viridis(layer / (LAYERS - 1)))
    assert_score_ylim(ax)
    plt.close(fig)


def test_several_groups_get_their_own_series_and_labels(tmp_path):
    write_run(tmp_path / "t5", make_values(2, groups=("encoder", "decoder")), groups=("encoder", "decoder"))
    fig = plot_dynamics(tmp_path / "t5", metrics="directionality")
    (ax,) = fig.axes
    labels = sorted(ln.get_label() for ln in ax.get_lines() if ln.get_linestyle() == "-")
    assert labels == ["t5 (decoder)", "t5 (encoder)"]
    plt.close(fig)
    fig = plot_dynamics(tmp_path / "t5", groups=["decoder"])
    assert all(len([c for c in a.collections if isinstance(c, PolyCollection)]) == 1 for a in fig.axes)
    plt.close(fig)


def test_bad_selection_and_missing_matplotlib(runs, tmp_path, monkeypatch):
    root, _ = runs
    with pytest.raises(TrajectoryError, match="no group 'cross'"):
        plot_dynamics(root, groups="cross")
    with pytest.raises(ValueError, match="image format"):
        plot_dynamics(root, path=tmp_path / "fig.txt")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"attn-probe\[plot\]"):
        plot_dynamics(root)


# --------------------------------------------------------------------------- heatmap


def reference_directionality(m: np.ndarray) -> float:
    r, c = np.linalg.norm(m, axis=1), np.linalg.norm(m, axis=0)
    tr, tc = r.mean() + 2 * r.std(ddof=1), c.mean() + 2 * c.std(ddof=1)
    R, C = (r - tr)[r > tr].sum(), (c - tc)[c > tc].sum()
    return 0.0 if R + C == 0 else (R - C) / (R + C)


@pytest.fixture(scope="module")
def bert_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_model("bert", None, intermediate_size=37, max_position_embeddings=16)
    with torch.no_grad():  # a recognisable structure: one dominant key column in layer 1
        model.bert.encoder.layer[1].attention.self.key.weight[:, 5] += 1.0
    path = tmp_path_factory.mktemp("ckpt") / "bert"
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("head", [None, 2], ids=["layer", "head2"])
def test_heatmap_shows_wq_transpose_wk_with_a_symmetric_scale(bert_checkpoint, tmp_path, head):
    path, model = bert_checkpoint
    attn = model.bert.encoder.layer[1].attention.self
    wq, wk = attn.query.weight.detach().double().numpy(), attn.key.weight.detach().double().numpy()
    if head is not None:
        dh = 32 // 4
        wq, wk = wq[head * dh:(head + 1) * dh], wk[head * dh:(head + 1) * dh]
    ref = wq.T @ wk  # x_i^T W_q^T W_k x_j = q_i . k_j: rows = query, columns = key
    fig = plot_heatmap(path, 1, head=head, clip_percentile=100, path=tmp_path / "hm.png")
    ax = fig.axes[0]
    (im,) = ax.get_images()
    np.testing.assert_allclose(np.asarray(im.get_array()), ref, rtol=1e-6, atol=1e-6)
    lo, hi = im.get_clim()
    assert lo == -hi and hi == pytest.approx(np.abs(ref).max(), rel=1e-6)
    assert im.get_cmap().name == "RdBu_r"
    sym = np.sum(ref * ref.T) / np.sum(ref * ref)
    assert f"symmetry {sym:+.2f}" in ax.get_title()
    assert f"directionality {reference_directionality(ref):+.2f}" in ax.get_title()
    assert ("head 2" in ax.get_title()) == (head is not None)
    assert (tmp_path / "hm.png").stat().st_size > 0
    plt.close(fig)


def test_heatmap_default_scale_clips_at_a_percentile(bert_checkpoint):
    path, model = bert_checkpoint
    fig = plot_heatmap(model, 0, vmax=None)
    (im,) = fig.axes[0].get_images()
    arr = np.abs(np.asarray(im.get_array()))
    lo, hi = im.get_clim()
    assert lo == -hi and hi == pytest.approx(np.percentile(arr, 99.5))
    plt.close(fig)
    fig = plot_heatmap(model, 0, vmax=0.5)
    assert fig.axes[0].get_images()[0].get_clim() == (-0.5, 0.5)
    plt.close(fig)


@pytest.mark.parametrize("kwargs, match", [
    ({"layer": 7}, "no layer 7"),
    ({"layer": 0, "group": "cross"}, "no group 'cross'"),
    ({"layer": 0, "head": 4}, "head 4 out of range"),
])
def test_heatmap_bad_selection(bert_checkpoint, kwargs, match):
    _, model = bert_checkpoint
    layer = kwargs.pop("layer")
    with pytest.raises(ValueError, match=match):
        plot_heatmap(model, layer, **kwargs)


def test_logx_axis_starts_at_zero(runs):
    root, _ = runs
    fig = plot_dynamics(root, logx=True)
    for ax in fig.axes:
        assert ax.get_xscale() == "symlog" and ax.get_xlim()[0] == 0
    plt.close(fig)


def test_heatmap_of_an_encoder_decoder_needs_a_group():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.T5Model(transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                                       num_decoder_layers=2, num_heads=4))
    with pytest.raises(ValueError, match="choose one with group="):
        plot_heatmap(model, 1)
    fig = plot_heatmap(model, 1, group="cross", clip_percentile=100)
    attn = model.decoder.block[1].layer[1].EncDecAttention
    ref = attn.q.weight.detach().double().numpy().T @ attn.k.weight.detach().double().numpy()
    (im,) = fig.axes[0].get_images()
    np.testing.assert_allclose(np.asarray(im.get_array()), ref, rtol=1e-6, atol=1e-8)
    assert fig.axes[0].get_title().startswith("cross layer 1:")
    plt.close(fig)


def test_heatmap_from_a_checkpoint_reads_only_that_layers_tensors(tmp_path):
    """The other tensors sit in a shard that is unreadable: only layer 1's q/k may be read."""
    pytest.importorskip("transformers")
    import json

    from safetensors.torch import save_file

    torch.manual_seed(1)
    model = tiny_model("bert", None, cls="BertModel", vocab_size=40, hidden_size=16, num_attention_heads=2,
                       intermediate_size=20, max_position_embeddings=8)
    path = tmp_path / "sharded"
    model.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    wanted = {f"encoder.layer.1.attention.self.{p}.weight" for p in ("query", "key")}
    save_file({k: state[k] for k in wanted}, str(path / "qk.safetensors"))
    (path / "model.safetensors").unlink()
    (path / "rest.safetensors").write_bytes(b"not a safetensors file")
    weight_map = {k: "qk.safetensors" if k in wanted else "rest.safetensors" for k in state}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    fig = plot_heatmap(path, 1, clip_percentile=100)
    attn = model.encoder.layer[1].attention.self
    ref = attn.query.weight.detach().double().numpy().T @ attn.key.weight.detach().double().numpy()
    (im,) = fig.axes[0].get_images()
    np.testing.assert_allclose(np.asarray(im.get_array()), ref, rtol=1e-6, atol=1e-8)
    plt.close(fig)
    with pytest.raises(ValueError, match="rest.safetensors"):  # layer 0 lives in the broken shard
        plot_heatmap(path, 0)


# --------------------------------------------------------------------------- NaN and short runs

def write_probe_run(run_dir, steps, layers=3, nan_metrics=(), seed=0):
    """A run written by the probe's own trajectory sink, as the live probe writes it: layer and
    per-head rows of symmetry and directionality at each step; NaN (written as null, as the
    probe does for undefined scores) for every value of ``nan_metrics``. Returns the layer values."""
    from attn_probe.sinks import Record, RunInfo, Snapshot
    from attn_probe.sinks.trajectory import TrajectorySink

    rng = np.random.default_rng(seed)
    sink = TrajectorySink(str(run_dir))
    sink.start(RunInfo({}, {}, ["self"], ["symmetry", "directionality"], True))
    vals = {}
    for step in steps:
        records = []
        for layer in range(layers):
            for metric in ("symmetry", "directionality"):
                v = float("nan") if metric in nan_metrics else float(rng.uniform(-0.9, 0.9))
                vals[(metric, step, layer)] = v
                records.append(Record("self", layer, None, metric, v))
                records += [Record("self", layer, h, metric, float("nan")) for h in range(2)]
        sink.log(Snapshot(step, 0.0, records))
    sink.finish()
    assert '"value": null' in (run_dir / TRAJECTORY_FILENAME).read_text()
    return vals


def data_lines(ax):
    """The drawn series of a panel (not the dashed zero line)."""
    return [ln for ln in ax.get_lines() if ln.get_linestyle() != "--"]


def note_texts(ax):
    return [t.get_text() for t in ax.texts]


@pytest.mark.parametrize("per_layer", [False, True], ids=["median", "per_layer"])
def test_nothing_finite_to_plot_is_an_error(tmp_path, per_layer):
    write_probe_run(tmp_path / "allnan", [0, 5], nan_metrics=("symmetry", "directionality"))
    with pytest.raises(TrajectoryError, match="nothing finite to plot"):
        plot_dynamics(tmp_path / "allnan", per_layer=per_layer, path=tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(TrajectoryError, match="nothing finite to plot"):  # the one metric chosen is NaN
        write_probe_run(tmp_path / "dirnan", [0, 5], nan_metrics=("directionality",))
        plot_dynamics(tmp_path / "dirnan", metrics="directionality", per_layer=per_layer)


@pytest.mark.parametrize("per_layer", [False, True], ids=["median", "per_layer"])
@pytest.mark.parametrize("nan_metric", ["directionality", "symmetry"])
def test_an_all_nan_metric_gets_a_note_and_the_other_panel_stays(tmp_path, per_layer, nan_metric):
    from attn_probe.analysis.trajectory import TrajectoryWarning

    steps = [0, 10, 20]
    vals = write_probe_run(tmp_path / "nanrun", steps, nan_metrics=(nan_metric,))
    with pytest.warns(TrajectoryWarning, match=f"run nanrun, group self: no finite layer-level value of {nan_metric}"):
        fig = plot_dynamics(tmp_path / "nanrun", per_layer=per_layer, path=tmp_path / "fig.png")
    panels = [a for a in fig.axes if a.get_title()]
    assert [a.get_title() for a in panels] == ["symmetry", "directionality"]
    for ax in panels:
        if ax.get_title() == nan_metric:
            assert note_texts(ax) == ["no finite values"] and data_lines(ax) == []
            assert ax.get_ylim() == (-1.0, 1.0)
        else:
            assert note_texts(ax) == []
            lines = data_lines(ax)
            assert len(lines) == (3 if per_layer else 1)
            for ln in lines:
                np.testing.assert_allclose(ln.get_xdata(), steps)
                assert np.isfinite(np.asarray(ln.get_ydata(), dtype=float)).all()
            if not per_layer:
                other = ax.get_title()
                expected = [np.median([vals[(other, s, la)] for la in range(3)]) for s in steps]
                np.testing.assert_allclose(lines[0].get_ydata(), expected)
                # the legend sits in the panel with data, and names the run
                assert [t.get_text() for t in ax.get_legend().get_texts()] == ["nanrun"]
    assert all(a.get_legend() is None for a in panels if a.get_title() == nan_metric)
    plt.close(fig)


@pytest.mark.parametrize("step", [0, 4000])
def test_a_single_step_is_drawn_as_markers_around_the_step(tmp_path, step):
    vals = write_probe_run(tmp_path / "single", [step])
    fig = plot_dynamics(tmp_path / "single", path=tmp_path / "single.png")
    for ax in fig.axes:
        metric = ax.get_title()
        (ln,) = data_lines(ax)
        assert ln.get_marker() == "o" and ln.get_markersize() > 0
        layer_vals = [vals[(metric, step, la)] for la in range(3)]
        np.testing.assert_allclose(ln.get_xdata(), [step])
        np.testing.assert_allclose(ln.get_ydata(), [np.median(layer_vals)])
        lo, hi = ax.get_xlim()
        assert lo < step < hi and hi - lo >= 2 and (lo + hi) / 2 == pytest.approx(step)
        assert list(ax.get_xticks()) == [step]
        # the q25-q75 range is visible as a vertical bar at the step
        (bar,) = [c for c in ax.collections if not isinstance(c, PolyCollection)]
        (seg,) = bar.get_segments()
        np.testing.assert_allclose(seg[:, 0], [step, step])
        np.testing.assert_allclose(sorted(seg[:, 1]), np.percentile(layer_vals, [25, 75]))
    legend = fig.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["single"]
    assert legend.legend_handles[0].get_marker() == "o"
    plt.close(fig)

    for kwargs in ({"per_layer": True}, {"logx": True}):  # --per-layer; --logx (one step: a linear axis)
        fig = plot_dynamics(tmp_path / "single", **kwargs)
        for ax in [a for a in fig.axes if a.get_title()]:
            lines = data_lines(ax)
            assert len(lines) == (3 if kwargs.get("per_layer") else 1)
            for ln in lines:
                assert ln.get_marker() == "o" and list(ln.get_xdata()) == [step]
            lo, hi = ax.get_xlim()
            assert lo < step < hi and list(ax.get_xticks()) == [step]
        plt.close(fig)


def test_few_points_get_markers_many_do_not(tmp_path):
    write_probe_run(tmp_path / "short", [0, 6])
    write_probe_run(tmp_path / "long", list(range(0, 400, 10)))
    fig = plot_dynamics(tmp_path, metrics="symmetry")
    markers = {ln.get_label(): ln.get_marker() for ln in data_lines(fig.axes[0])}
    assert markers == {"short": "o", "long": "None"}
    plt.close(fig)


def test_nan_layers_and_steps_are_left_out_of_the_lines(tmp_path):
    """A layer NaN at some steps: the per-layer line joins its finite points (an isolated finite
    point between NaNs was invisible before), and the median uses the finite layers."""
    vals = write_probe_run(tmp_path / "gaps", [0, 10, 20, 30, 40])
    lines = (tmp_path / "gaps" / TRAJECTORY_FILENAME).read_text().splitlines()
    out = []
    for line in lines:
        if '"run_header"' in line:  # a run header, not a row
            continue
        row = json.loads(line)
        if row["head"] is None and row["layer"] == 1 and row["step"] != 20:
            row["value"] = None
            vals[(row["metric"], row["step"], 1)] = float("nan")
        out.append(json.dumps(row))
    (tmp_path / "gaps" / TRAJECTORY_FILENAME).write_text("\n".join(out) + "\n")
    fig = plot_dynamics(tmp_path / "gaps", per_layer=True, metrics="symmetry")
    by_x = {tuple(ln.get_xdata()): ln for ln in data_lines(fig.axes[0])}
    assert set(by_x) == {(0, 10, 20, 30, 40), (20,)}
    assert by_x[(20,)].get_marker() == "o"
    np.testing.assert_allclose(by_x[(20,)].get_ydata(), [vals[("symmetry", 20, 1)]])
    plt.close(fig)


def test_summarize_names_the_metric_it_leaves_out(tmp_path):
    from attn_probe import summarize
    from attn_probe.analysis.trajectory import TrajectoryWarning

    write_probe_run(tmp_path / "nanrun", [0, 6], nan_metrics=("directionality",))
    with pytest.warns(TrajectoryWarning, match="run nanrun, group self: no finite layer-level value of "
                                               r"directionality \(all NaN\); metric left out of the summary"):
        table = summarize(tmp_path / "nanrun")
    assert list(table["metric"]) == ["symmetry"]
    write_probe_run(tmp_path / "allnan", [0, 6], nan_metrics=("symmetry", "directionality"))
    with pytest.raises(TrajectoryError, match="no layer-level values to summarise: all 12 layer-level values "
                                              r"\(symmetry, directionality\) are NaN"):
        summarize(tmp_path / "allnan")
