"""The random-matrix range (attn_probe.baselines.random_range) against explicit random matrices.

The references here form every ``d x d`` matrix explicitly from ``torch.randn`` factors and score
it with :mod:`attn_probe.definitions` (which shares no code with the core the module uses).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attn_probe import definitions as reference
from attn_probe.baselines import random_range as rr
from attn_probe.baselines.random_range import LayerShape, random_range, random_range_rows


def explicit(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The layer matrix and every head's ``d x d`` matrix, query head h reading key head h // (H / H_kv)."""
    q, k = q.double(), k.double()
    group = q.shape[0] // k.shape[0]
    heads = [q[h].T @ k[h // group] for h in range(q.shape[0])]
    return sum(heads), heads


def scores(m: torch.Tensor) -> tuple[float, float]:
    return reference.symmetry_score(m), reference.directionality_score(m)


def sample(shape: LayerShape, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """An independent sampler: ``n`` explicit random layers, scores of the layer and of each head."""
    g = torch.Generator().manual_seed(seed)
    layer, heads = [], []
    for _ in range(n):
        q = torch.randn(shape.num_heads, shape.head_dim, shape.d_model, generator=g, dtype=torch.float64)
        k = torch.randn(shape.num_kv_heads, shape.head_dim, shape.d_model, generator=g, dtype=torch.float64)
        m, ms = explicit(q, k)
        layer.append(scores(m))
        heads.extend(scores(mh) for mh in ms)
    return np.array(layer), np.array(heads)


SHAPES = {
    "d24-h6-gqa2": LayerShape(24, 4, 6, 2),
    "d32-h4": LayerShape(32, 8, 4, 4),
    "d40-h8-mqa": LayerShape(40, 5, 8, 1),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_draw_equals_the_explicit_matrices_of_the_same_factors(name):
    shape = SHAPES[name]
    got = random_range(shape, draws=3, seed=7, dtype=torch.float64, budget=None, cache=False)
    assert got.draws == 3 and got.note is None
    g = torch.Generator().manual_seed(7)  # the documented draw protocol: Q then K, N(0, 1) float32
    for i in range(3):
        q = torch.randn(shape.num_heads, shape.head_dim, shape.d_model, generator=g)
        k = torch.randn(shape.num_kv_heads, shape.head_dim, shape.d_model, generator=g)
        m, heads = explicit(q, k)
        np.testing.assert_allclose(got.layer_samples[i], scores(m), atol=1e-9)
        np.testing.assert_allclose(got.head_samples[i], [scores(mh) for mh in heads], atol=1e-9)
    # the summary is of those samples: symmetry over the draws, directionality with the transposes
    assert got.symmetry == pytest.approx(got.layer_samples[:, 0].mean())
    assert got.symmetry_sd == pytest.approx(got.layer_samples[:, 0].std(ddof=1))
    both = np.concatenate([got.head_samples[:, :, 1].ravel(), -got.head_samples[:, :, 1].ravel()])
    assert got.head_directionality_sd == pytest.approx(both.std(ddof=1))
    assert got.directionality == 0.0 and got.head_directionality == 0.0


def test_grouped_query_heads_pair_as_repeat_kv_does():
    # the pairing changes every draw's values: h // (H / H_kv) (transformers' repeat_kv), not h mod H_kv
    shape = LayerShape(24, 4, 6, 2)
    got = random_range(shape, draws=2, seed=3, dtype=torch.float64, cache=False)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 4, 24, generator=g).double()
    k = torch.randn(2, 4, 24, generator=g).double()
    tiled = [scores(q[h].T @ k[h % 2]) for h in range(6)]  # the paper's released code's tiling
    repeat = [scores(q[h].T @ k[h // 3]) for h in range(6)]
    np.testing.assert_allclose(got.head_samples[0], repeat, atol=1e-9)
    assert not np.allclose(got.head_samples[0], tiled, atol=1e-3)


@pytest.mark.parametrize("name", ["d32-h4", "d24-h6-gqa2"])
def test_the_range_agrees_with_an_independent_sampler(name):
    shape = SHAPES[name]
    n = 160
    got = random_range(shape, draws=n, seed=1, budget=None, cache=False)
    layer, heads = sample(shape, n, seed=99)
    for (mean, sd, n_got), ref in [
        ((got.symmetry, got.symmetry_sd, n), layer[:, 0]),
        ((got.directionality, got.directionality_sd, 2 * n), layer[:, 1]),
        ((got.head_symmetry, got.head_symmetry_sd, got.head_samples[:, :, 0].size), heads[:, 0]),
        ((got.head_directionality, got.head_directionality_sd, 2 * got.head_samples[:, :, 0].size), heads[:, 1]),
    ]:
        se = math.sqrt(sd**2 / n_got + ref.std(ddof=1) ** 2 / ref.size)
        assert abs(mean - ref.mean()) < 4 * se, (mean, ref.mean(), se)
        assert sd == pytest.approx(ref.std(ddof=1), rel=0.2)
    # the sampler's own directionality is centred on 0 (the transposition argument)
    assert abs(layer[:, 1].mean()) < 4 * layer[:, 1].std(ddof=1) / math.sqrt(n)


def test_the_scores_do_not_depend_on_the_initialisation_scale():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, 8, 32, generator=g, dtype=torch.float64)
    k = torch.randn(2, 8, 32, generator=g, dtype=torch.float64)
    m, heads = explicit(q, k)
    for a, b in [(0.02, 0.02), (1e-3, 7.0), (300.0, 0.05)]:
        ms, hs = explicit(a * q, b * k)
        assert scores(ms) == pytest.approx(scores(m), abs=1e-12)
        for h, h0 in zip(hs, heads, strict=True):
            assert scores(h) == pytest.approx(scores(h0), abs=1e-12)
    # so drawing N(0, 0.02^2) gives the range drawn at N(0, 1), draw for draw
    base = random_range(LayerShape(32, 8, 4, 2), draws=4, seed=2, dtype=torch.float64, cache=False)
    g = torch.Generator().manual_seed(2)
    for i in range(4):
        q = 0.02 * torch.randn(4, 8, 32, generator=g)
        k = 0.02 * torch.randn(2, 8, 32, generator=g)
        np.testing.assert_allclose(base.layer_samples[i], scores(explicit(q, k)[0]), atol=1e-6)  # 0.02 rounds


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_symmetry_of_a_random_product_is_about_one_over_d(d):
    # E tr(MM) = k d s^4 and E ||M||_F^2 = k d^2 s^4 for M = A^T B, A, B iid (k, d): E[s] ~= 1/d,
    # the same for the layer (k = H d_head) and for one head (k = d_head); sd about sqrt(2)/d
    shape = LayerShape(d, d // 4, 4, 4)
    got = random_range(shape, draws=48, seed=11, budget=None, cache=False)
    heads = got.head_samples[:, :, 0].ravel()
    assert abs(got.head_symmetry - 1 / d) < 4 * got.head_symmetry_sd / math.sqrt(heads.size)
    assert abs(got.symmetry - 1 / d) < 4 * got.symmetry_sd / math.sqrt(got.draws)
    assert got.head_symmetry_sd == pytest.approx(math.sqrt(2) / d, rel=0.2)
    assert got.symmetry_sd == pytest.approx(math.sqrt(2) / d, rel=0.35)


def test_heads_are_pooled_from_the_first_draws_and_the_layer_from_all():
    shape = LayerShape(32, 8, 8, 2)
    got = random_range(shape, draws=40, seed=4, budget=None, cache=False)  # HEAD_SAMPLES 256: 32 per head
    assert got.layer_samples.shape == (40, 2) and got.head_samples.shape == (32, 8, 2)
    g = torch.Generator().manual_seed(4)
    for i in range(40):  # the layer values of the later, layer-only draws are still those draws'
        q = torch.randn(8, 8, 32, generator=g)
        k = torch.randn(2, 8, 32, generator=g)
        if i in (31, 32, 39):
            np.testing.assert_allclose(got.layer_samples[i], scores(explicit(q, k)[0]), atol=1e-5)


def test_a_time_budget_gives_fewer_draws_and_says_so():
    shape = LayerShape(1024, 64, 16, 16)  # 2M numbers a draw: two draws per scored chunk
    got = random_range(shape, draws=32, budget=1e-3, per_head=False, cache=False)
    assert 1 <= got.draws < 32
    assert got.note is not None and f"{got.draws} of 32 random draws" in got.note
    assert got.layer_samples.shape == (got.draws, 2)
    assert math.isfinite(got.symmetry)


def test_drawn_numbers_bound_the_draws_by_the_shapes_alone():
    """``max_entries``: a draw count from the shapes alone (the same on every rank and machine), the
    same draws as asking for that many; shared over the shapes in the order of the layers."""
    big, small = LayerShape(64, 16, 4, 4), LayerShape(32, 8, 4, 4)  # 8192 and 2048 numbers a draw
    got = random_range(big, draws=32, budget=None, max_entries=3 * 8192 + 100, cache=False)
    assert got.draws == 3 and got.note == "3 of 32 random draws of d=64, 4 heads of 16 within 24,676 drawn numbers"
    want = random_range(big, draws=3, budget=None, cache=False)
    np.testing.assert_array_equal(got.layer_samples, want.layer_samples)
    assert random_range(big, draws=2, budget=None, max_entries=10**9, cache=False).note is None
    assert random_range(big, draws=32, budget=None, max_entries=1, cache=False).draws == 1  # at least one

    def layer(i, shape):
        return type("Layer", (), dict(group="self", layer=i, hidden_size=shape.d_model, head_dim=shape.head_dim,
                                      num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads))

    rows, notes = random_range_rows([layer(0, big), layer(1, small)], metrics=["symmetry"], per_head=False,
                                    budget=None, max_entries=3 * 8192 + 2047)
    assert {r[1] for r in rows} == {0}  # 2047 numbers left: not one draw of the small shape
    assert notes == ["3 of 32 random draws of d=64, 4 heads of 16 within 26,623 drawn numbers",
                     "skipped: fewer than one draw of d=32, 4 heads of 8 left in the 26,623 drawn numbers"]
    rows, notes = random_range_rows([layer(0, big), layer(1, small)], metrics=["symmetry"], per_head=False,
                                    budget=None, max_entries=3 * 8192 + 2048)
    assert {r[1] for r in rows} == {0, 1} and notes[1] == ("1 of 32 random draws of d=32, 4 heads of 8 within "
                                                           "2,048 drawn numbers")
    with pytest.raises(ValueError, match="max_entries"):
        random_range(big, max_entries=0)


def test_a_shape_too_large_is_skipped_without_drawing(monkeypatch):
    monkeypatch.setattr(rr, "MAX_DRAW_ENTRIES", 1000)
    got = random_range(LayerShape(64, 16, 4, 4), cache=False)
    assert got.draws == 0 and got.note.startswith("skipped") and math.isnan(got.symmetry)
    rows, notes = random_range_rows([Layer("self", 0, 64, 16, 4, 4)], metrics=("symmetry",), per_head=False)
    assert rows == [] and len(notes) == 1 and "skipped" in notes[0]


class Layer:
    def __init__(self, group, layer, hidden_size, head_dim, num_heads, num_kv_heads):
        self.group, self.layer, self.hidden_size = group, layer, hidden_size
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads


def test_rows_name_each_layer_and_head_and_compute_each_shape_once(monkeypatch):
    calls = []
    real = rr.random_range
    monkeypatch.setattr(rr, "random_range", lambda shape, **kw: calls.append(shape) or real(shape, **kw))
    layers = [Layer("encoder", 0, 32, 8, 4, 4), Layer("encoder", 1, 32, 8, 4, 4), Layer("decoder", 0, 32, 8, 4, 2)]
    rows, notes = random_range_rows(layers, metrics=("directionality", "symmetry", "spectral_norm"), per_head=True)
    assert notes == [] and calls == [LayerShape(32, 8, 4, 4), LayerShape(32, 8, 4, 2)]
    names = ["random_symmetry", "random_symmetry_sd", "random_directionality", "random_directionality_sd"]
    assert len(rows) == 3 * (1 + 4) * 4
    keys = {(g, lay, h, m) for g, lay, h, m, _ in rows}
    assert keys == {(g, lay, h, m) for g, lay in [("encoder", 0), ("encoder", 1), ("decoder", 0)]
                    for h in [None, 0, 1, 2, 3] for m in names}
    by = {(g, lay, h, m): v for g, lay, h, m, v in rows}
    gqa = random_range(LayerShape(32, 8, 4, 2), per_head=True)
    assert by[("decoder", 0, None, "random_symmetry")] == gqa.symmetry
    assert by[("decoder", 0, 2, "random_directionality_sd")] == gqa.head_directionality_sd
    only, _ = random_range_rows(layers[:1], metrics=("symmetry",), per_head=False)
    assert [r[3] for r in only] == ["random_symmetry", "random_symmetry_sd"]
    assert random_range_rows(layers, metrics=("spectral_norm",), per_head=True) == ([], [])


def test_the_global_generator_is_left_alone():
    before = torch.get_rng_state()
    random_range(LayerShape(32, 8, 4, 4), draws=3, cache=False)
    assert torch.equal(before, torch.get_rng_state())


def test_bad_input_is_one_clear_error():
    with pytest.raises(ValueError, match="cannot share"):
        LayerShape(32, 8, 6, 4)
    with pytest.raises(ValueError, match="d_model"):
        LayerShape(0, 8, 4, 4)
    with pytest.raises(ValueError, match="draws"):
        random_range(LayerShape(32, 8, 4, 4), draws=0)


# ------------------------------------------------------------- a fresh model's own initialisation
def _fresh(arch: str):
    from helpers import tiny_model

    if arch == "bert":
        return tiny_model("bert", 0, cls="BertModel", hidden_size=256, num_attention_heads=4,
                          num_hidden_layers=6, intermediate_size=64, vocab_size=64)
    return tiny_model("llama", 0, cls="LlamaModel", hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=32, num_hidden_layers=6, intermediate_size=64, vocab_size=64)


@pytest.mark.parametrize("arch", ["bert", "llama-gqa"])
def test_a_freshly_built_model_scores_inside_its_random_range(arch):
    import attn_probe

    model = _fresh(arch)
    rows = attn_probe.score_model(model, per_head=True, metrics=["symmetry", "directionality"])
    layer = next(r for r in rows if r["head"] is None)
    lay = attn_probe.find_attention(model)[0]
    got = random_range(LayerShape(lay.hidden_size, lay.head_dim, lay.num_heads, lay.num_kv_heads), per_head=True,
                       budget=None, cache=False)  # the probe's draws, without its time limit
    assert got.draws == rr.DEFAULT_DRAWS
    for metric in ("symmetry", "directionality"):
        for head in (False, True):
            mean, sd = getattr(got, f"{'head_' if head else ''}{metric}"), getattr(got, f"{'head_' if head else ''}{metric}_sd")
            values = [r[metric] for r in rows if (r["head"] is not None) == head]
            inside = [abs(v - mean) <= 3 * sd for v in values]
            assert sum(inside) >= 0.8 * len(values), (metric, head, mean, sd, values)
    # and the range is tight enough to tell: a matrix with W_q = W_k is far outside it
    assert got.sigmas(1.0) > 50 and layer["symmetry"] < got.symmetry + 3 * got.symmetry_sd


def test_rows_of_some_layers_are_the_whole_lists_numbers_at_the_cost_of_their_shapes():
    """Issue 44, finding 12: a reader needing the range of 2 layers of a header naming thousands of
    shapes drew every shape. ``only=`` draws only the shapes asked for; the shapes before them are
    accounted for (the drawn-number bound they would use), so the values equal the whole list's:
    here the third shape gets 1 draw after the first two take 32 and 4 of the 83,420 numbers."""
    from types import SimpleNamespace

    from attn_probe.baselines import random_range as rr

    def layer(i, d, head_dim):
        return SimpleNamespace(group="self", layer=i, hidden_size=d, head_dim=head_dim, num_heads=2, num_kv_heads=2)

    layers = [layer(0, 64, 8), layer(1, 128, 8), layer(2, 64, 4), layer(3, 64, 8)]
    rr.clear_cache()
    full, notes = rr.random_range_rows(layers, metrics=["symmetry", "directionality"], per_head=False,
                                       budget=None, max_entries=83_420)
    assert any("1 of 32 random draws" in n for n in notes)  # the bound shapes the third one's draws
    rr.clear_cache()
    some, _ = rr.random_range_rows(layers, metrics=["symmetry", "directionality"], per_head=False,
                                   budget=None, max_entries=83_420, only=[("self", 2)])
    assert some == [r for r in full if r[1] == 2] and some
    assert len(rr._CACHE) == 1  # one shape drawn (the cache holds each range computed)
    rr.clear_cache()
    some, _ = rr.random_range_rows(layers, metrics=["symmetry"], per_head=False, budget=None,
                                   max_entries=83_420, only=[("self", 3)])  # layer 0's shape, met first there
    assert some == [r for r in full if r[1] == 3 and "directionality" not in r[3]]
    assert len(rr._CACHE) == 1
