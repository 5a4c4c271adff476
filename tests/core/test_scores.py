"""Scores maths: factored fast path vs. explicit definitions, invariants, degenerate input.

References are written here independently, in numpy float64: the explicit matrix is built by
a loop over heads (query head h reads KV head h // (H / H_kv), as transformers' repeat_kv)
and the scores follow PAPER.md's definitions line by line.
"""

from __future__ import annotations

import doctest
import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from attn_probe import definitions as scores
from attn_probe.core import factored_scores, gram_is_cheaper, products, score_factors
from attn_probe.core import stacks as metrics
from attn_probe.definitions import (
    directionality_from_norms,
    directionality_score,
    pair_kv_heads,
    symmetry_from_inner_products,
    symmetry_score,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- references
def ref_matrix(q: np.ndarray, k: np.ndarray, head: int | None = None) -> np.ndarray:
    """M = sum_h Q_h^T K_{h // (H/Hkv)} (or one head), by an explicit loop over heads."""
    num_heads, num_kv = q.shape[0], k.shape[0]
    group = num_heads // num_kv
    d = q.shape[2]
    m = np.zeros((d, d))
    for h in range(num_heads) if head is None else [head]:
        kv = h // group
        for i in range(q.shape[1]):  # rank-1 terms: row = query feature, column = key feature
            m += np.outer(q[h, i], k[kv, i])
    return m


def ref_symmetry(m: np.ndarray) -> float:
    return float(np.sum(m * m.T) / np.sum(m * m))


def ref_excess(m: np.ndarray, num_std: float = 2.0) -> tuple[float, float]:
    r = np.sqrt(np.sum(m * m, axis=1))
    c = np.sqrt(np.sum(m * m, axis=0))
    tau_r = r.mean() + num_std * r.std(ddof=1)
    tau_c = c.mean() + num_std * c.std(ddof=1)
    return float(np.sum(np.maximum(r - tau_r, 0))), float(np.sum(np.maximum(c - tau_c, 0)))


def ref_directionality(m: np.ndarray, num_std: float = 2.0) -> float:
    big_r, big_c = ref_excess(m, num_std)
    return 0.0 if big_r + big_c == 0 else (big_r - big_c) / (big_r + big_c)


def well_conditioned(m: np.ndarray, num_std: float = 2.0) -> bool:
    """Directionality is ill-conditioned when R + C is at rounding level: skip those draws."""
    big_r, big_c = ref_excess(m, num_std)
    scale = max(np.linalg.norm(m, axis=1).mean(), np.linalg.norm(m, axis=0).mean())
    return big_r + big_c > 1e-6 * scale and np.sum(m * m) > 1e-12 * np.sum(np.abs(m)) ** 2 / m.size


# --------------------------------------------------------------------------- strategies
@st.composite
def factor_shapes(draw):
    num_kv = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.integers(1, 6))
    d = draw(st.integers(2, 24))
    return num_kv * group, num_kv, head_dim, d


@st.composite
def factors(draw):
    """Random (q, k) in float64, sometimes with zeroed rows/columns or a dominant feature."""
    num_heads, num_kv, head_dim, d = draw(factor_shapes())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((num_heads, head_dim, d))
    k = rng.standard_normal((num_kv, head_dim, d))
    structure = draw(st.sampled_from(["plain", "sparse", "dominant-key", "dominant-query"]))
    if structure == "sparse":
        q[..., rng.random(d) < 0.3] = 0.0
        k[..., rng.random(d) < 0.3] = 0.0
    elif structure == "dominant-key":
        k[..., rng.integers(d)] *= 20.0
    elif structure == "dominant-query":
        q[..., rng.integers(d)] *= 20.0
    return q, k


def torch64(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))


# --------------------------------------------------------------------------- fast path == definitions
@pytest.mark.parametrize("branch", ["gram", "explicit"])
@SETTINGS
@given(qk=factors())
def test_factored_equals_explicit_definitions(branch, qk):
    q, k = qk
    with mock.patch.object(products, "gram_is_cheaper", lambda r, d: branch == "gram"):
        got = factored_scores(torch64(q), torch64(k), per_head=True, dtype=torch.float64)
    m = ref_matrix(q, k)
    if np.sum(m * m) > 1e-20:
        assert got.symmetry == pytest.approx(ref_symmetry(m), abs=1e-6)
    if well_conditioned(m):
        assert got.directionality == pytest.approx(ref_directionality(m), abs=1e-6)
    for h in range(q.shape[0]):
        mh = ref_matrix(q, k, head=h)
        if np.sum(mh * mh) > 1e-20:
            assert got.head_symmetry[h] == pytest.approx(ref_symmetry(mh), abs=1e-6), h
        if well_conditioned(mh):
            assert got.head_directionality[h] == pytest.approx(ref_directionality(mh), abs=1e-6), h


@SETTINGS
@given(qk=factors())
def test_explicit_functions_equal_definitions(qk):
    q, k = qk
    m = ref_matrix(q, k)
    assume(np.sum(m * m) > 1e-20)
    assert symmetry_score(m) == pytest.approx(ref_symmetry(m), abs=1e-9)
    assert symmetry_score(torch64(m)) == pytest.approx(ref_symmetry(m), abs=1e-9)
    if well_conditioned(m):
        assert directionality_score(m) == pytest.approx(ref_directionality(m), abs=1e-9)
        assert directionality_score(m, num_std=1.0) == pytest.approx(ref_directionality(m, 1.0), abs=1e-9)


def test_float32_factored_path_is_accurate():
    """Default float32 path vs float64 definitions on a GQA layer with a dominant key feature."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((8, 16, 96)) * 0.02
    k = rng.standard_normal((2, 16, 96)) * 0.02
    k[..., 5] *= 10
    got = factored_scores(torch.from_numpy(q).float(), torch.from_numpy(k).float(), per_head=True)
    m = ref_matrix(q, k)
    assert got.symmetry == pytest.approx(ref_symmetry(m), abs=1e-5)
    assert got.directionality == pytest.approx(ref_directionality(m), abs=1e-4)
    assert got.directionality < -0.5
    for h in range(8):
        mh = ref_matrix(q, k, head=h)
        assert got.head_symmetry[h] == pytest.approx(ref_symmetry(mh), abs=1e-5)
        assert got.head_directionality[h] == pytest.approx(ref_directionality(mh), abs=1e-4)


def test_branch_choice_by_cost():
    assert gram_is_cheaper(1024, 4096)  # Llama-3-8B layer after grouping: 8 KV heads x 128
    assert gram_is_cheaper(128, 4096)  # one Llama head
    assert gram_is_cheaper(64, 768)  # one BERT-base head
    assert not gram_is_cheaper(768, 768)  # BERT-base layer: forming M is cheaper


def test_pairing_matches_transformers_repeat_kv():
    from transformers.models.llama.modeling_llama import repeat_kv

    num_heads, num_kv = 8, 2
    k = torch.arange(num_kv, dtype=torch.float32).reshape(1, num_kv, 1, 1)  # (batch, kv, seq, dim)
    repeated = repeat_kv(k, num_heads // num_kv).flatten().long()
    assert repeated.tolist() == pair_kv_heads(num_heads, num_kv).tolist()
    with pytest.raises(ValueError):
        pair_kv_heads(6, 4)


# --------------------------------------------------------------------------- invariants
@SETTINGS
@given(qk=factors(), log_c=st.floats(-30, 30), negative=st.booleans())
def test_scale_invariance(qk, log_c, negative):
    q, k = qk
    c = (-1.0 if negative else 1.0) * 10.0**log_c
    m = ref_matrix(q, k)
    assume(np.sum(m * m) > 1e-20)
    assert symmetry_score(c * m) == pytest.approx(symmetry_score(m), abs=1e-9)
    assert directionality_score(c * m) == pytest.approx(directionality_score(m), abs=1e-9)
    base = factored_scores(torch64(q), torch64(k), per_head=True, dtype=torch.float64)
    scaled = factored_scores(torch64(c * q), torch64(k), per_head=True, dtype=torch.float64)
    assert scaled.symmetry == pytest.approx(base.symmetry, abs=1e-9)
    assert scaled.directionality == pytest.approx(base.directionality, abs=1e-9, nan_ok=True)
    np.testing.assert_allclose(scaled.head_symmetry, base.head_symmetry, atol=1e-9)


def test_scale_invariance_near_float_limits():
    rng = np.random.default_rng(1)
    m = rng.standard_normal((16, 16))
    for c in (1e-300, 1e300):
        assert symmetry_score(c * m) == pytest.approx(symmetry_score(m), abs=1e-12)
        assert directionality_score(c * m) == pytest.approx(directionality_score(m), abs=1e-12)
    q = torch.from_numpy(rng.standard_normal((4, 8, 64))).float()
    for c in (1e-25, 1e25):  # squares would under/overflow float32 without rescaling
        assert factored_scores(c * q, q).symmetry == pytest.approx(1.0, abs=1e-6)


@SETTINGS
@given(qk=factors())
def test_transpose_flips_directionality(qk):
    q, k = qk
    m = ref_matrix(q, k)
    assume(np.sum(m * m) > 1e-20)
    assert symmetry_score(m.T) == pytest.approx(symmetry_score(m), abs=1e-12)
    assert directionality_score(m.T) == pytest.approx(-directionality_score(m), abs=1e-12)
    # swapping the factors transposes M (same head count on both sides)
    q1 = q[: k.shape[0]]
    fwd = factored_scores(torch64(q1), torch64(k), per_head=True, dtype=torch.float64)
    back = factored_scores(torch64(k), torch64(q1), per_head=True, dtype=torch.float64)
    assert back.symmetry == pytest.approx(fwd.symmetry, abs=1e-9)
    if well_conditioned(ref_matrix(q1, k)):
        assert back.directionality == pytest.approx(-fwd.directionality, abs=1e-9)


@SETTINGS
@given(qk=factors())
def test_shared_query_key_weights_give_symmetry_one(qk):
    q, _ = qk
    t = torch64(q)
    got = factored_scores(t, t, per_head=True, dtype=torch.float64)
    assume(np.abs(q).max() > 0)
    assert got.symmetry == pytest.approx(1.0, abs=1e-9)
    # M = A^T A is symmetric: R == C up to rounding (exactly, on the Gram path)
    assert got.directionality == pytest.approx(0.0, abs=1e-9)
    for h in range(q.shape[0]):
        if np.abs(q[h]).max() > 0:
            assert got.head_symmetry[h] == pytest.approx(1.0, abs=1e-9)
            assert got.head_directionality[h] == pytest.approx(0.0, abs=1e-9)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), d=st.integers(2, 24))
def test_skew_symmetric_gives_minus_one(seed, d):
    x = np.random.default_rng(seed).standard_normal((d, d))
    assert symmetry_score(x - x.T) == pytest.approx(-1.0, abs=1e-12)
    # from factors: A = [X; I], B = [I; -X]  ->  M = A^T B = X^T - X
    a = np.stack([x, np.eye(d)])
    b = np.stack([np.eye(d), -x])
    got = factored_scores(torch64(a), torch64(b), dtype=torch.float64)
    assert got.symmetry == pytest.approx(-1.0, abs=1e-9)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), d=st.integers(2, 40))
def test_exactly_symmetric_matrix_has_zero_directionality(seed, d):
    x = np.random.default_rng(seed).standard_normal((d, d))
    assert directionality_score(x + x.T) == 0.0
    assert symmetry_score(x + x.T) == pytest.approx(1.0, abs=1e-12)


@SETTINGS
@given(qk=factors(), seed=st.integers(0, 1000))
def test_permuting_heads_permutes_head_scores(qk, seed):
    q, k = qk
    num_heads, num_kv = q.shape[0], k.shape[0]
    group = num_heads // num_kv
    rng = np.random.default_rng(seed)
    kv_perm = rng.permutation(num_kv)
    # keep each query head with its KV head: permute whole groups, and heads within a group
    perm = np.concatenate([g * group + rng.permutation(group) for g in kv_perm])
    base = factored_scores(torch64(q), torch64(k), per_head=True, dtype=torch.float64)
    moved = factored_scores(torch64(q[perm]), torch64(k[kv_perm]), per_head=True, dtype=torch.float64)
    np.testing.assert_allclose(moved.head_symmetry, np.array(base.head_symmetry)[perm], atol=1e-12)
    np.testing.assert_allclose(moved.head_directionality, np.array(base.head_directionality)[perm], atol=1e-12)
    assert moved.symmetry == pytest.approx(base.symmetry, abs=1e-9, nan_ok=True)


def test_paper_checks_dominant_column_and_row():
    rng = np.random.default_rng(2)
    m = rng.standard_normal((128, 128)) * 0.01
    m[:, 7] += 5.0  # key 7 dominates: column dominance, the decoder signature
    assert directionality_score(m) < -0.9
    assert directionality_score(m.T) > 0.9
    # the same from factors: head 0 adds the rank-1 term 1 (5 e_7)^T, a constant dominant column
    q = rng.standard_normal((4, 8, 128)) * 0.01
    k = rng.standard_normal((2, 8, 128)) * 0.01
    q[0, 0, :] = 1.0
    k[0, 0, :] = 0.0
    k[0, 0, 7] = 5.0
    got = factored_scores(torch.from_numpy(q), torch.from_numpy(k), per_head=True)
    assert got.directionality < -0.9 and got.head_directionality[0] < -0.9
    assert factored_scores(torch.from_numpy(k), torch.from_numpy(q[:2])).directionality > 0.9


def test_random_matrices_score_near_zero():
    rng = np.random.default_rng(3)
    syms = [symmetry_score(rng.standard_normal((256, 256))) for _ in range(5)]
    assert max(abs(s) for s in syms) < 0.1


# --------------------------------------------------------------------------- degenerate input
@pytest.mark.parametrize(
    "bad",
    [np.zeros((3, 4)), np.zeros(5), np.zeros((2, 2, 2)), np.zeros((0, 0)), np.array([["a", "b"], ["c", "d"]]),
     np.eye(3) * (1 + 1j), [[1.0, 2.0], [3.0]]],
    ids=["non-square", "1-d", "3-d", "empty", "strings", "complex", "ragged"],
)
def test_invalid_matrices_raise(bad):
    with pytest.raises(ValueError):
        symmetry_score(bad)
    with pytest.raises(ValueError):
        directionality_score(bad)


@pytest.mark.parametrize("value", [0.0, float("nan"), float("inf"), -float("inf")], ids=["zero", "nan", "inf", "-inf"])
def test_undefined_matrices_give_nan(value):
    m = np.zeros((4, 4)) if value == 0.0 else np.eye(4)
    m[1, 2] = value
    assert math.isnan(symmetry_score(m))
    assert math.isnan(directionality_score(m))
    t = torch.from_numpy(m).reshape(1, 4, 4)
    got = factored_scores(t, torch.eye(4, dtype=torch.float64).reshape(1, 4, 4), per_head=True)
    assert math.isnan(got.symmetry) and math.isnan(got.directionality)
    assert math.isnan(got.head_symmetry[0]) and math.isnan(got.head_directionality[0])


def test_one_bad_head_leaves_other_heads_alone():
    rng = np.random.default_rng(4)
    q = torch.from_numpy(rng.standard_normal((4, 3, 16)))
    k = torch.from_numpy(rng.standard_normal((2, 3, 16)))
    clean = factored_scores(q, k, per_head=True, dtype=torch.float64)
    q[1, 0, 0] = float("nan")
    q[2] = 0.0
    got = factored_scores(q, k, per_head=True, dtype=torch.float64)
    assert math.isnan(got.symmetry)  # the layer matrix contains the nan
    assert math.isnan(got.head_symmetry[1]) and math.isnan(got.head_symmetry[2])
    for h in (0, 3):
        assert got.head_symmetry[h] == pytest.approx(clean.head_symmetry[h], abs=1e-12)
        assert got.head_directionality[h] == pytest.approx(clean.head_directionality[h], abs=1e-12)


def test_product_zero_up_to_rounding_gives_nan():
    # A rows [a, a], B rows [b, -b]: non-zero factors, M = a b^T - a b^T = 0
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal(32), rng.standard_normal(32)
    q = torch.from_numpy(np.stack([a, a])).reshape(1, 2, 32)
    k = torch.from_numpy(np.stack([b, -b])).reshape(1, 2, 32)
    for dtype in (torch.float32, torch.float64):
        got = factored_scores(q, k, dtype=dtype)
        assert math.isnan(got.symmetry) and math.isnan(got.directionality)


def test_equal_norms_give_zero_directionality_not_rounding_noise():
    # an orthogonal matrix: every row and column norm is 1 up to rounding, so R + C is noise
    for seed in range(5):
        q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((64, 64)))
        assert directionality_score(q) == 0.0
        assert factored_scores(torch.from_numpy(q.T.copy()).reshape(1, 64, 64),
                               torch.eye(64, dtype=torch.float64).reshape(1, 64, 64)).directionality == 0.0


def test_small_matrices():
    assert symmetry_score([[3.0]]) == 1.0
    assert directionality_score([[3.0]]) == 0.0
    assert symmetry_score(np.array([[0, 1], [-1, 0]])) == -1.0  # integer input


def test_numpy_inputs_of_any_layout_and_dtype():
    rng = np.random.default_rng(6)
    m = rng.standard_normal((20, 20))
    ref = symmetry_score(torch.from_numpy(m))
    assert symmetry_score(m[::-1, ::-1]) == pytest.approx(ref, abs=1e-12)  # negative strides
    assert symmetry_score(np.asfortranarray(m)) == pytest.approx(ref, abs=1e-12)
    assert symmetry_score(m.astype(np.float32)) == pytest.approx(ref, abs=1e-6)
    assert symmetry_score(m.tolist()) == pytest.approx(ref, abs=1e-12)
    assert directionality_score(m.astype(np.float16)) == pytest.approx(directionality_score(m), abs=1e-2)


def test_invalid_factors_and_options_raise():
    q = torch.randn(4, 2, 8)
    with pytest.raises(ValueError):
        factored_scores(q, torch.randn(3, 2, 8))  # 4 heads cannot share 3 KV heads
    with pytest.raises(ValueError):
        factored_scores(q, torch.randn(2, 3, 8))  # head_dim mismatch
    with pytest.raises(ValueError):
        factored_scores(q, torch.randn(2, 2, 9))  # d mismatch
    with pytest.raises(ValueError):
        factored_scores(q.reshape(8, 8), q.reshape(8, 8))
    with pytest.raises(ValueError):
        factored_scores(torch.randn(0, 2, 8), torch.randn(0, 2, 8))
    with pytest.raises(ValueError):
        factored_scores(q, q, num_std=float("nan"))
    with pytest.raises(ValueError):
        directionality_score(torch.randn(4, 4), num_std=float("inf"))


def test_reductions_from_norms_and_inner_products():
    rng = np.random.default_rng(7)
    m = rng.standard_normal((50, 50))
    m[3] *= 6
    r, c = np.linalg.norm(m, axis=1), np.linalg.norm(m, axis=0)
    assert directionality_from_norms(torch.from_numpy(r), torch.from_numpy(c)) == pytest.approx(
        ref_directionality(m), abs=1e-12
    )
    assert directionality_from_norms(torch.from_numpy(r), torch.from_numpy(c)) > 0.5
    assert math.isnan(directionality_from_norms(torch.zeros(5), torch.zeros(5)))
    assert math.isnan(directionality_from_norms(torch.tensor([1.0, float("nan")]), torch.ones(2)))
    assert symmetry_from_inner_products(0.5, 2.0) == 0.25
    assert math.isnan(symmetry_from_inner_products(1.0, 0.0))
    assert math.isnan(symmetry_from_inner_products(float("inf"), 1.0))


def test_docstring_examples_run():
    result = doctest.testmod(scores, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5
    assert result.failed == 0
    result = doctest.testmod(metrics, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3
    assert result.failed == 0


def test_scores_module_does_not_import_the_core():
    """No metrics <-> scores circle: scores.py is the definitions, the core imports it."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(scores))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and "metrics" in m for m in imported), imported


@pytest.mark.parametrize("rank_deficient", [False, True], ids=["cholesky", "singular-fallback"])
def test_large_layer_path_matches_definitions(rank_deficient):
    """r >= 512 takes the blocked-Gram / Cholesky route (or its fallback for singular B B^T)."""
    rng = np.random.default_rng(8)
    num_kv, head_dim, d = 8, 64, 2048
    q = rng.standard_normal((num_kv * 2, head_dim, d)) * 0.02
    k = rng.standard_normal((num_kv, head_dim, d)) * 0.02
    k[..., 3] *= 8
    if rank_deficient:
        k[1] = k[0]  # duplicate key head: B B^T singular
    assert gram_is_cheaper(num_kv * head_dim, d)
    got = factored_scores(torch.from_numpy(q), torch.from_numpy(k), dtype=torch.float64)
    m = sum(q[h].T @ k[h // 2] for h in range(num_kv * 2))  # explicit, one head at a time
    assert got.symmetry == pytest.approx(ref_symmetry(m), abs=1e-9)
    assert got.directionality == pytest.approx(ref_directionality(m), abs=1e-9)
    assert got.directionality < -0.3
    got32 = factored_scores(torch.from_numpy(q).float(), torch.from_numpy(k).float())
    assert got32.symmetry == pytest.approx(ref_symmetry(m), abs=1e-5)
    assert got32.directionality == pytest.approx(ref_directionality(m), abs=1e-4)


@pytest.mark.parametrize("shape", [(8, 2, 8, 64), (4, 4, 16, 32), (6, 1, 4, 12)], ids=["gqa", "mha", "mqa"])
def test_device_tensor_variant_matches_explicit_definitions(shape):
    """score_factors (the core, as the live probe calls it) against explicit d x d matrices."""
    H, Hk, dh, d = shape
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(H, dh, d, generator=gen, dtype=torch.float64)
    k = torch.randn(Hk, dh, d, generator=gen, dtype=torch.float64)
    out = score_factors(q, k, ("symmetry", "directionality"), per_head=True, dtype=torch.float64)
    heads = [q[h].T @ k[h // (H // Hk)] for h in range(H)]
    mats = [sum(heads)] + heads
    expected_sym = [symmetry_score(m) for m in mats]
    expected_dir = [directionality_score(m) for m in mats]
    assert out.shape == (2, 1 + H)
    assert torch.allclose(out[0], torch.tensor(expected_sym, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(out[1], torch.tensor(expected_dir, dtype=torch.float64), atol=1e-9)
