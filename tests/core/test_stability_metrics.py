"""The stability metrics (spectral_norm, frobenius_norm, stable_rank, qk_bound) against explicit
float64 references, their degenerate values, their tags and stats, and old two-metric runs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import assert_matches, reference
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BloomConfig,
    BloomModel,
    FalconConfig,
    FalconModel,
    GPT2Config,
    GPT2Model,
    GPTNeoXConfig,
    GPTNeoXModel,
    LlamaConfig,
    LlamaModel,
)

import attn_probe
from attn_probe.cli import main
from attn_probe.core import DEFAULT_METRICS, MAGNITUDES, Products, is_magnitude, score_factors
from attn_probe.formats.tags import BAND_STATS, STATS, layer_stats, parse_tag, scalar_tag, stats_for

NORMS = ("spectral_norm", "frobenius_norm", "stable_rank", "qk_bound")
SMALL = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)

MODELS = {
    "bert-separate": lambda: BertForMaskedLM(BertConfig(**SMALL)),
    "gpt2-conv1d": lambda: GPT2Model(GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=4)),
    "neox-interleaved": lambda: GPTNeoXModel(GPTNeoXConfig(**SMALL)),
    "bloom": lambda: BloomModel(BloomConfig(vocab_size=40, hidden_size=32, n_layer=2, n_head=4)),
    "falcon-interleaved": lambda: FalconModel(FalconConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2,
                                                           num_attention_heads=4, multi_query=False,
                                                           new_decoder_architecture=False)),
    "falcon-grouped": lambda: FalconModel(FalconConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2,
                                                       num_attention_heads=4, new_decoder_architecture=True,
                                                       num_kv_heads=2)),
    "llama-gqa": lambda: LlamaModel(LlamaConfig(**SMALL, num_key_value_heads=2)),
}


@pytest.mark.parametrize("name", list(MODELS), ids=list(MODELS))
def test_every_metric_equals_the_explicit_float64_reference(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    with torch.no_grad():  # away from the init, with a few larger directions
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rows = attn_probe.score_model(model, per_head=True)
    assert all(set(DEFAULT_METRICS) <= set(r) for r in rows)
    for layer in attn_probe.find_attention(model):
        q, k = (t.detach().double() for t in layer.factors())
        group = layer.num_heads // layer.num_kv_heads
        for head in [None, *range(layer.num_heads)]:
            heads = range(layer.num_heads) if head is None else [head]
            want = reference(layer.qk_matrix(head=head), [q[h] for h in heads], [k[h // group] for h in heads])
            got = next(r for r in rows if (r["group"], r["layer"], r["head"]) == (layer.group, layer.layer, head))
            assert_matches(got, want, (layer.name, head))


@pytest.mark.parametrize("shape", [(4, 4, 8, 32), (6, 3, 4, 16), (4, 4, 8, 8), (2, 1, 16, 8), (3, 3, 64, 40)],
                         ids=["gram-path", "gqa", "r-equals-d", "heads-wider-than-d", "explicit-layer"])
def test_core_matches_references_on_both_paths(shape):
    h, hkv, dh, d = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(h, dh, d, generator=gen, dtype=torch.float64)
    k = torch.randn(hkv, dh, d, generator=gen, dtype=torch.float64)
    k[:, 0] *= 5  # a leading direction
    table = score_factors(q, k, per_head=True).tolist()  # float32 core
    group = h // hkv
    heads = [q[i].T @ k[i // group] for i in range(h)]
    for col, (m, qs, ks) in enumerate([(sum(heads), list(q), [k[i // group] for i in range(h)]),
                                       *((heads[i], [q[i]], [k[i // group]]) for i in range(h))]):
        got = {metric: table[j][col] for j, metric in enumerate(DEFAULT_METRICS)}
        assert_matches(got, reference(m, qs, ks), col)


def test_norm_inequalities_hold():
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(8, 4, 24, generator=gen), torch.randn(2, 4, 24, generator=gen)
    t = dict(zip(DEFAULT_METRICS, score_factors(q, k, per_head=True).tolist(), strict=True))
    for col in range(9):
        assert t["spectral_norm"][col] <= t["frobenius_norm"][col] * (1 + 1e-6)
        assert 1.0 <= t["stable_rank"][col] <= min(4 * (2 if col == 0 else 1), 24) * (1 + 1e-6)
    for col in range(1, 9):
        assert t["spectral_norm"][col] <= t["qk_bound"][col] * (1 + 1e-6)  # sigma(Q^T K) <= sigma(Q) sigma(K)
    assert t["qk_bound"][0] == max(t["qk_bound"][1:])  # the layer row is the largest head


@pytest.mark.parametrize("scale", [1e20, 1e-20, 3.0])
def test_norms_scale_back_without_overflow_and_scores_do_not_move(scale):
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(4, 8, 16, generator=gen), torch.randn(4, 8, 16, generator=gen)
    base = score_factors(q, k, per_head=True)
    scaled = score_factors(q * scale, k * scale, per_head=True)  # float32: scale**2 overflows/underflows it
    assert scaled.dtype == torch.float64 and bool(torch.isfinite(scaled).all())
    for i, metric in enumerate(DEFAULT_METRICS):
        factor = scale**2 if metric in ("spectral_norm", "frobenius_norm", "qk_bound") else 1.0
        torch.testing.assert_close(scaled[i], base[i] * factor, rtol=1e-5, atol=1e-6)


def test_degenerate_inputs_have_documented_values():
    nan = math.nan

    def table(q, k):
        return {m: v for m, v in zip(DEFAULT_METRICS, score_factors(q, k, per_head=True).tolist(), strict=True)}

    # zero: norms 0, stable rank and the scores undefined
    t = table(torch.zeros(2, 3, 5), torch.zeros(2, 3, 5))
    assert t["spectral_norm"] == t["frobenius_norm"] == t["qk_bound"] == [0.0, 0.0, 0.0]
    assert all(math.isnan(v) for m in ("stable_rank", "symmetry", "directionality") for v in t[m])
    # one NaN (or inf) entry in head 0: that head and the layer are NaN in every metric, head 1 is not
    for bad in (nan, math.inf):
        q = torch.randn(2, 3, 5)
        q[0, 1, 2] = bad
        t = table(q, torch.randn(2, 3, 5))
        assert all(math.isnan(t[m][0]) and math.isnan(t[m][1]) for m in DEFAULT_METRICS), bad
        assert all(math.isfinite(t[m][2]) for m in DEFAULT_METRICS), bad
    # rank 1: stable rank 1, spectral = Frobenius = |u| |v|
    u, v = torch.randn(1, 1, 6, dtype=torch.float64), torch.randn(1, 1, 6, dtype=torch.float64)
    t = table(u, v)
    assert t["stable_rank"] == pytest.approx([1.0, 1.0], rel=1e-6)
    expected = float(u.norm() * v.norm())
    assert t["spectral_norm"] == pytest.approx([expected] * 2, rel=1e-6)
    assert t["frobenius_norm"] == pytest.approx([expected] * 2, rel=1e-6)
    assert t["qk_bound"] == pytest.approx([expected] * 2, rel=1e-6)
    # 1 x 1 (d = 1): |m|, stable rank 1; head_dim 3 -> sigma(Q_h) = ||Q_h||
    q, k = torch.tensor([[[2.0], [0.0], [0.0]]]), torch.tensor([[[-3.0], [4.0], [0.0]]])
    t = table(q, k)
    assert t["spectral_norm"] == t["frobenius_norm"] == [6.0, 6.0]
    assert t["stable_rank"] == [1.0, 1.0] and t["symmetry"] == [1.0, 1.0] and t["directionality"] == [0.0, 0.0]
    assert t["qk_bound"] == pytest.approx([10.0, 10.0])  # 2 * 5


def test_gram_path_spectral_norm_does_not_form_the_matrix():
    gen = torch.Generator().manual_seed(0)
    p = Products(torch.randn(3, 2, 8, 256, generator=gen), torch.randn(3, 8, 256, generator=gen), 2.0, torch.float32)
    assert not p.explicit
    p.sigma_max_sq  # noqa: B018 - computed for its side effect on the cache
    assert "matrix" not in p.__dict__  # no d x d product was made


def test_tags_and_stats_of_the_magnitudes():
    assert MAGNITUDES == set(NORMS)
    assert stats_for("symmetry") == BAND_STATS == ("median", "q25", "q75")
    for metric in (*NORMS, *("ov_" + m for m in NORMS)):
        assert stats_for(metric) == (*BAND_STATS, "max")
        tag = scalar_tag("self", metric, stat="max")
        assert parse_tag(tag).stat == "max" and parse_tag(tag).metric == metric
    assert set(STATS) == {"median", "q25", "q75", "max"}
    assert layer_stats([1.0, 5.0, math.nan, 2.0], "spectral_norm")["max"] == 5.0
    assert list(layer_stats([1.0, 2.0], "symmetry")) == list(BAND_STATS)


def test_the_probe_writes_max_for_the_norms_only_and_reads_it_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(**SMALL))
    probe = attn_probe.watch(model, log_dir=str(tmp_path), every=None)
    snap = probe.snapshot(3)
    probe.close(final_snapshot=False)
    layer_values = {m: [r.value for r in snap.records if r.metric == m and r.head is None] for m in DEFAULT_METRICS}
    for metric in DEFAULT_METRICS:
        stats = {s for g, m, s in snap.stats if m == metric}
        assert stats == set(stats_for(metric))
        if is_magnitude(metric):
            assert snap.stats[("self", metric, "max")] == max(layer_values[metric])
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "attn_probe/self/spectral_norm/max" in tags and "attn_probe/self/symmetry/max" not in tags
    parsed = [parse_tag(t) for t in tags if t.startswith("attn_probe/")]
    assert all(p is not None for p in parsed)
    assert {p.metric for p in parsed} == set(DEFAULT_METRICS)
    from attn_probe.sinks.tensorboard import custom_scalars_layout

    layout = custom_scalars_layout(["self"], list(DEFAULT_METRICS))
    assert set(layout) == {"attn_probe/self: symmetry, the paper's figure", "attn_probe/self", "attn_probe/self/norms"}
    assert all(c.split(":")[0] in ("symmetry", "directionality") for c in layout["attn_probe/self"])
    assert all(c.split(":")[0] in NORMS for c in layout["attn_probe/self/norms"])


def test_two_metric_runs_still_load_plot_and_summarise(tmp_path, capsys):
    pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    from attn_probe.analysis.plots import plot_dynamics
    from attn_probe.analysis.summary import summarize

    torch.manual_seed(0)
    for name, metrics in (("old", ["symmetry", "directionality"]), ("new", None)):
        model = BertForMaskedLM(BertConfig(**SMALL))
        # runs as written before the random-matrix range was logged
        opts = {"random_range": False} if metrics is None else {"metrics": metrics, "random_range": False}
        probe = attn_probe.watch(model, log_dir=str(tmp_path / name), every=None, **opts)
        for step in (1, 2):
            probe.snapshot(step)
        probe.close(final_snapshot=False)
    with open(tmp_path / "old" / "attn_probe.jsonl") as f:
        assert {json.loads(line).get("metric") for line in f if '"run_header"' not in line} - {None} == {"symmetry", "directionality"}
    df = attn_probe.load_trajectory([tmp_path / "old", tmp_path / "new"])
    table = summarize(df)
    assert set(table[table["run"] == "old"]["metric"]) == {"symmetry", "directionality"}
    assert set(table[table["run"] == "new"]["metric"]) == set(DEFAULT_METRICS)
    fig = plot_dynamics(df, metrics=["symmetry", "spectral_norm", "stable_rank"])
    scales = [ax.get_yscale() for ax in fig.axes[:3]]
    lo, hi = fig.axes[0].get_ylim()  # the score's range, fitted to the values (analysis.plots.score_ylim)
    assert scales == ["linear", "log", "log"] and -1.05 <= lo <= 0.0 <= hi <= 1.05
    plot_dynamics(tmp_path / "old", path=tmp_path / "old.png")  # the default figure of an old run
    assert main(["plot", str(tmp_path / "new"), "--metric", "qk_bound", "--metric", "directionality",
                 "-o", str(tmp_path / "norms.png")]) == 0
    assert (tmp_path / "norms.png").stat().st_size > 0
    assert main(["summary", str(tmp_path / "old")]) == 0
    assert "symmetry" in capsys.readouterr().out


def test_cli_metric_option_narrows_the_rows(tmp_path, capsys):
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(**SMALL)).save_pretrained(tmp_path / "ckpt")
    capsys.readouterr()
    assert main(["score", str(tmp_path / "ckpt"), "--json", "--metric", "spectral_norm", "--metric", "qk_bound"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(set(r) == {"group", "layer", "name", "head", "spectral_norm", "qk_bound"} for r in rows)
    assert main(["score", str(tmp_path / "ckpt"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(set(DEFAULT_METRICS) <= set(r) for r in rows)
