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
from matplotlib.collections import PolyCollection  # noqa: E402

from attn_probe import plot_dynamics, plot_heatmap  # noqa: E402
from attn_probe.analysis.trajectory import MissingExtraError, TrajectoryError  # noqa: E402
from attn_probe.trajectory_format import TRAJECTORY_FILENAME  # noqa: E402

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
        assert ax.get_ylim() == (-1.0, 1.0)
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
    assert ax.get_ylim() == (-1.0, 1.0)
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
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37, max_position_embeddings=16)
    model = transformers.BertForMaskedLM(cfg)
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
    transformers = pytest.importorskip("transformers")
    import json

    from safetensors.torch import save_file

    torch.manual_seed(1)
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=20, max_position_embeddings=8)
    model = transformers.BertModel(cfg)
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
