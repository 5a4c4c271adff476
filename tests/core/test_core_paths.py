"""The core's computation paths give the reference numbers: layers scored as stacks, Lanczos for
large problems, and the eigensolver-free path used off CPU (forced here on CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import reference, tiny_model  # reference: every metric of an explicit float64 matrix

import attn_probe
from attn_probe import core
from attn_probe.core import (
    DEFAULT_METRICS,
    is_magnitude,
    products,
    score_factor_stack,
    score_factors,
    spectra,
)
from attn_probe.scoring import pairs as pairs_module
from attn_probe.scoring.pairs import QKPair


def check_table(table, q, k, rel=1e-4, abs_=1e-4):
    """``table`` (metrics x (1 + H)) against the explicit float64 references of layer and heads."""
    q, k = q.double(), k.double()
    h, hkv = q.shape[0], k.shape[0]
    group = h // hkv
    heads = [q[i].T @ k[i // group] for i in range(h)]
    cases = [(sum(heads), list(q), [k[i // group] for i in range(h)])]
    cases += [(heads[i], [q[i]], [k[i // group]]) for i in range(h)] if table.shape[1] > 1 else []
    for col, (m, qs, ks) in enumerate(cases):
        want = reference(m, qs, ks)
        for j, metric in enumerate(DEFAULT_METRICS):
            got = float(table[j, col])
            if is_magnitude(metric):
                assert got == pytest.approx(want[metric], rel=rel), (col, metric)
            else:
                assert got == pytest.approx(want[metric], abs=abs_), (col, metric)


def factors(shape, seed, lead=5.0, dtype=torch.float32):
    h, hkv, dh, d = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(h, dh, d, generator=gen, dtype=torch.float64) * 0.02
    k = torch.randn(hkv, dh, d, generator=gen, dtype=torch.float64) * 0.02
    k[:, 0] *= lead  # a leading direction, as training makes
    return q.to(dtype), k.to(dtype)


# ---------------------------------------------------------------------------------- stacks
@pytest.mark.parametrize("shape", [(4, 4, 8, 32), (6, 3, 4, 16), (4, 4, 8, 8), (3, 3, 64, 40)],
                         ids=["gram", "gqa", "r-equals-d", "explicit"])
def test_a_stack_of_layers_scores_each_like_score_factors(shape):
    stack = [factors(shape, seed) for seed in range(5)]
    queries = torch.stack([q for q, _ in stack])
    keys = torch.stack([k for _, k in stack])
    table = score_factor_stack(queries, keys, per_head=True)
    assert table.shape == (5, len(DEFAULT_METRICS), 1 + shape[0])
    for i, (q, k) in enumerate(stack):
        one = score_factors(q, k, per_head=True)
        torch.testing.assert_close(table[i], one, rtol=1e-6, atol=1e-6)
        check_table(table[i], q, k)


def test_stack_input_errors():
    q = torch.randn(2, 4, 8, 32)
    with pytest.raises(ValueError, match="layers"):
        score_factor_stack(q, torch.randn(3, 4, 8, 32))
    with pytest.raises(ValueError, match="layers, heads"):
        score_factor_stack(q[0], q[0])


def llama(layers=6, d=32):
    return tiny_model("llama", 0, vocab_size=40, hidden_size=d, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=48, max_position_embeddings=16)


def live_values(model, tmp_path, name, pairs=None):
    probe = attn_probe.watch(model, log_dir=str(tmp_path / name), per_head=True, every=1000,
                             **({"pairs": pairs} if pairs else {}))
    snap = probe.snapshot(1)
    probe.close(final_snapshot=False)
    return {(r.group, r.layer, r.head, r.metric): r.value for r in snap.records}


def test_live_snapshot_in_chunks_equals_score_model(tmp_path, monkeypatch):
    """Stacked in the probe (in chunks of two layers here) or one layer at a time: same values."""
    model = llama()
    rows = attn_probe.score_model(model, per_head=True)
    monkeypatch.setattr(pairs_module, "CPU_STACK_BYTES", 1)  # one layer a chunk: the per-layer path
    single = live_values(model, tmp_path, "single")
    q, k = attn_probe.find_attention(model)[0].factors()
    per_layer = (3 * (q.numel() + k.numel()) + q.shape[-1] ** 2) * 4
    monkeypatch.setattr(pairs_module, "CPU_STACK_BYTES", 2 * per_layer)
    chunked = live_values(model, tmp_path, "chunked")
    monkeypatch.setattr(pairs_module, "CPU_STACK_BYTES", pairs_module.STACK_BYTES)  # all six in one stack
    stacked = live_values(model, tmp_path, "stacked")
    monkeypatch.undo()
    assert set(single) == set(chunked) == set(stacked)
    assert len(single) == 6 * 5 * len(DEFAULT_METRICS)
    for key, value in single.items():
        for other in (chunked[key], stacked[key]):
            assert abs(other - value) <= 1e-6 * max(1.0, abs(value)), key
    for row in rows:
        for metric in DEFAULT_METRICS:
            want = row[metric]
            got = stacked[(row["group"], row["layer"], row["head"], metric)]
            assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (row["layer"], row["head"], metric)


def test_a_pair_that_overrides_score_is_called_layer_by_layer(tmp_path):
    calls = []

    class Doubled(QKPair):
        prefix = "twice_"

        def score(self, layer, query, key, *, per_head, num_std):
            calls.append(layer.layer)
            return 2 * super().score(layer, query, key, per_head=per_head, num_std=num_std)

    model = llama(layers=3)
    values = live_values(model, tmp_path, "run", pairs=[QKPair(("symmetry",)), Doubled(("frobenius_norm",))])
    assert calls and calls == [0, 1, 2] * (len(calls) // 3)  # each snapshot: one call a layer, in order
    for row in attn_probe.score_model(model, metrics=("frobenius_norm",)):
        got = values[(row["group"], row["layer"], None, "twice_frobenius_norm")]
        assert got == pytest.approx(2 * row["frobenius_norm"], rel=1e-6)


def test_bf16_weights_are_stacked_in_the_compute_dtype(tmp_path):
    model = llama(layers=3).to(torch.bfloat16)
    live = live_values(model, tmp_path, "bf16")
    for row in attn_probe.score_model(model, per_head=True):  # per layer, float32 core
        for metric in DEFAULT_METRICS:
            want = row[metric]
            assert abs(live[(row["group"], row["layer"], row["head"], metric)] - want) <= 1e-6 * max(1, abs(want))


# ---------------------------------------------------------------------------------- Lanczos
@pytest.mark.parametrize("shape", [(8, 8, 64, 512), (14, 7, 64, 1600), (2, 2, 256, 400)],
                         ids=["explicit-512", "gqa-gram-448x1600", "rows-beyond-d"])
def test_lanczos_path_matches_svdvals(shape):
    assert min(shape[1] * shape[2], shape[3]) > core.lanczos_threshold(torch.device("cpu"))
    explicit = not attn_probe.core.gram_is_cheaper(shape[1] * shape[2], shape[3])
    assert explicit == (shape[3] != 1600)
    q, k = factors(shape, seed=3, lead=1.0)  # random-like spectrum: the hard case for Lanczos
    check_table(score_factors(q, k), q, k)
    q, k = factors(shape, seed=4, lead=8.0)
    check_table(score_factors(q, k), q, k)


def spectrum_matrix(top, rest, m, seed):
    """``m x m`` float64 with singular values ``top`` then ``rest`` (random singular vectors)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))[0]
    s = torch.cat([torch.tensor(top, dtype=torch.float64), rest])
    return (u * s) @ v.T


@pytest.mark.parametrize("gap", [1e-2, 1e-3, 1e-4, 1e-6, 0.0])
def test_lanczos_with_clustered_top_singular_values(gap):
    m = 600
    rest = torch.linspace(0.05, 0.9, m - 5, dtype=torch.float64)
    mat = spectrum_matrix([1 - gap * i for i in range(5)], rest, m, seed=int(gap * 1e6))
    c = (mat.T @ mat).float()[None]
    lam = core.lanczos_lambda_max(lambda v: spectra.mv(c, v), (1, m), c)
    assert float(lam[0]) == pytest.approx(1.0, rel=2e-4)  # sigma^2: 1e-4 on sigma


def test_lanczos_degenerate_operators():
    m = 500
    u = torch.randn(1, m, 1)
    rank1 = u @ u.mT
    lam = core.lanczos_lambda_max(lambda v: spectra.mv(rank1, v), (1, m), rank1)
    assert float(lam[0]) == pytest.approx(float(u.square().sum()), rel=1e-5)  # the Krylov space closes at once
    zero = torch.zeros(1, m, m)
    assert float(core.lanczos_lambda_max(lambda v: spectra.mv(zero, v), (1, m), zero)[0]) == 0.0
    nan = torch.full((1, m, m), float("nan"))
    assert math.isnan(float(core.lanczos_lambda_max(lambda v: spectra.mv(nan, v), (1, m), nan)[0]))


def test_lanczos_is_deterministic_and_keeps_no_state():
    q, k = factors((4, 4, 128, 512), seed=9, lead=1.0)
    first = score_factors(q, k, ("spectral_norm",))
    score_factors(*factors((4, 4, 128, 512), seed=10), ("spectral_norm",))  # another problem in between
    assert torch.equal(score_factors(q, k, ("spectral_norm",)), first)


def test_lanczos_steps_grow_with_the_problem():
    assert core.lanczos_steps(20) == 20
    assert core.lanczos_steps(512) == core.LANCZOS_STEPS
    assert core.lanczos_steps(8192) > core.lanczos_steps(2048) == core.LANCZOS_STEPS


# ------------------------------------------------------------------ the CPU algorithm's helpers
def test_host_lambda_max_flags_non_finite_matrices_and_matches_eigvalsh():
    """_lambda_max (CPU algorithm): one finiteness reduction instead of an element-wise mask, no
    symmetrising pass; finite matrices against float64 eigvalsh of the symmetrised matrix, NaN,
    +inf, -inf and +inf with -inf (entry sum NaN) each give NaN without touching the others."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(6, 20, 50, generator=gen, dtype=torch.float64)
    c = (a @ a.mT).float()  # bmm output: symmetric up to rounding only
    want = torch.linalg.eigvalsh(((c + c.mT) / 2).double())[..., -1]
    bad = c.clone()
    bad[1, 3, 4], bad[2, 0, 0], bad[3, 5, 2] = float("nan"), float("inf"), -float("inf")
    bad[4, 1, 1], bad[4, 2, 2] = float("inf"), -float("inf")
    got, got_bad = spectra.lambda_max(c), spectra.lambda_max(bad)
    assert torch.allclose(got.double(), want, rtol=1e-5), (got, want)
    assert torch.isnan(got_bad[1:5]).all() and torch.equal(got_bad[[0, 5]], got[[0, 5]])
    s, u = spectra.eigh(bad)
    assert torch.isnan(s[1:5]).all() and torch.isfinite(s[[0, 5]]).all() and torch.isfinite(u).all()
    big = torch.tensor([[[1e300, 0.0], [0.0, 3.0]]], dtype=torch.float64)  # finite, far from overflow
    assert float(spectra.lambda_max(big)[0]) == pytest.approx(1e300, rel=1e-12)


def test_power_of_two_scale_reads_the_largest_magnitude_of_either_sign():
    t = torch.tensor([[[0.3, -5.0], [2.0, 1.0]], [[7.5, -0.1], [0.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]],
                      [[1.0, float("nan")], [0.0, 1.0]]])
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        scale = products.pow2_scale(t.to(dtype), 2)
        assert scale[:2].tolist() == [4.0, 4.0] and scale[3] == 1.0, (dtype, scale)
        assert scale[2] == torch.finfo(scale.dtype).tiny, (dtype, scale)


# ------------------------------------------------------------------ the eigensolver-free path
def test_lambda_max_by_squaring_matches_eigvalsh():
    gen = torch.Generator().manual_seed(1)
    bound = lambda m: math.log(max(m, 2)) / 2**core.SQUARINGS  # noqa: E731 - the documented bound
    for m in (1, 7, 48, 200):
        a = torch.randn(3, m, 2 * m, generator=gen, dtype=torch.float64)
        c = a @ a.mT
        want = torch.linalg.eigvalsh(c)[..., -1]
        got = core.lambda_max_by_squaring(c)
        assert bool((got <= want * (1 + 1e-12)).all()) and bool((got >= want * (1 - bound(m) - 1e-12)).all())
        b = torch.randn(3, m, 3 * m, generator=gen, dtype=torch.float64)
        gb = b @ b.mT
        chol = torch.linalg.cholesky(c)
        want = torch.linalg.eigvalsh(chol.mT @ gb @ chol)[..., -1]  # same spectrum as gb @ c
        got = core.lambda_max_by_squaring(gb @ c)
        assert bool((got <= want * (1 + 1e-10)).all()) and bool((got >= want * (1 - bound(m) - 1e-10)).all())
    for gap in (1e-3, 1e-8, 0.0):  # within about l_1 ln(m) / 2^s whatever the gap
        mat = spectrum_matrix([1.0, 1 - gap], torch.linspace(0, 0.9, 38, dtype=torch.float64), 40, seed=2)
        assert float(core.lambda_max_by_squaring(mat @ mat.T)) == pytest.approx(1.0, rel=bound(40))
    assert float(core.lambda_max_by_squaring(torch.zeros(5, 5))) == 0.0


@pytest.mark.parametrize("shape", [(4, 4, 8, 32), (6, 3, 4, 16), (4, 4, 8, 8), (3, 3, 64, 40), (8, 4, 32, 256),
                                   (4, 4, 32, 128), (14, 7, 64, 1600)],
                         ids=["gram", "gqa", "r-equals-d", "explicit", "gqa-gram-256", "explicit-128",
                              "gqa-gram-448x1600"])
def test_eigensolver_free_path_matches_references(shape, monkeypatch):
    """The GPU algorithm (no ``eigh``/``eigvalsh``, no Lanczos at any size), run on CPU by its switch."""
    calls = []
    for name in ("eigh", "eigvalsh"):
        real = getattr(torch.linalg, name)
        monkeypatch.setattr(torch.linalg, name, lambda *a, _real=real, _n=name, **kw: calls.append(_n) or _real(*a, **kw))
    monkeypatch.setattr(spectra, "lanczos_lambda_max", lambda *a, **kw: calls.append("lanczos"))
    q, k = factors(shape, seed=sum(shape))
    with core.gpu_algorithm_on_cpu():
        assert core.gpu_algorithm(torch.device("cpu")) and not core.host_eigensolver(torch.device("cpu"))
        check_table(score_factors(q, k, per_head=shape[3] <= 256), q, k)  # large d: the references are slow
        zero = score_factors(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), ("spectral_norm", "stable_rank"))
        nan_q = q.clone()
        nan_q[0, 0, 0] = float("nan")
        nan_table = score_factors(nan_q, k, ("spectral_norm", "qk_bound"), per_head=True)
    assert calls == []
    assert not core.gpu_algorithm(torch.device("cpu"))
    assert zero[0].tolist() == [0.0] and math.isnan(zero[1, 0])
    assert torch.isnan(nan_table[:, :2]).all()  # the layer and head 0
    assert torch.isfinite(nan_table[:, 2:]).all()  # the other heads are left alone


@pytest.mark.parametrize("entries", [1, 10**9], ids=["one-by-one", "multiply-sum"])
def test_batched_matrix_vector_products_broadcast_like_matmul(entries, monkeypatch):
    monkeypatch.setattr(spectra, "CPU_MV_ENTRIES", entries)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1, 5, 7, generator=gen, dtype=torch.float64)  # broadcast over the second dim
    v = torch.randn(3, 2, 7, generator=gen, dtype=torch.float64)
    u = torch.randn(3, 2, 5, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(spectra.mv(x, v), (x @ v[..., None])[..., 0])
    torch.testing.assert_close(spectra.mtv(x, u), (x.mT @ u[..., None])[..., 0])


def test_a_subclass_score_is_called_not_bypassed_by_stacks(tmp_path):
    calls = []

    class Counted(QKPair):  # the documented hook: a pair that defines its own score
        def score(self, layer, *args, **kwargs):
            calls.append(layer.layer)
            return super().score(layer, *args, **kwargs)

    live_values(llama(layers=3), tmp_path, "run", pairs=[Counted()])
    assert calls and calls == [0, 1, 2] * (len(calls) // 3)
