"""The update rate of W_qk (attn_probe.core.update) against explicit float64 d x d matrices: the exact
Gram identity (grouped-query heads, per head, the Gram and the explicit path, bf16 weights, tiny
changes), and the seeded sketch within its stated error over many seeds (a statistical bound)."""

from __future__ import annotations

import math

import pytest
import torch

from attn_probe.core.update import (
    exact_update_sq,
    frobenius_sq,
    sketch,
    sketch_matrix,
    sketch_relative_sd,
    sketch_update_sq,
    update_rate,
)


def stack(layers, heads, kv, hd, d, seed, scale=0.02, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(layers, heads, hd, d, generator=gen, dtype=torch.float64) * scale
    k = torch.randn(layers, kv, hd, d, generator=gen, dtype=torch.float64) * scale
    return q.to(dtype), k.to(dtype)


def explicit(q, k):
    """Per layer: [M, M_0, ..., M_{H-1}] as float64 d x d, each formed head by head (no shared code)."""
    q, k = q.double(), k.double()
    heads, kv = q.shape[1], k.shape[1]
    out = []
    for layer in range(q.shape[0]):
        mats = [q[layer, h].T @ k[layer, h // (heads // kv)] for h in range(heads)]
        out.append([sum(mats), *mats])
    return out


def explicit_rates(q, k, q0, k0):
    now, before = explicit(q, k), explicit(q0, k0)
    return torch.tensor([[float(torch.linalg.norm(m - m0) / torch.linalg.norm(m0)) for m, m0 in zip(a, b, strict=True)]
                         for a, b in zip(now, before, strict=True)], dtype=torch.float64)


@pytest.mark.parametrize("shape", [(3, 8, 2, 16, 96), (2, 4, 4, 16, 48), (2, 4, 4, 32, 24)],
                         ids=["gqa-gram", "mha-gram", "mha-explicit"])
@pytest.mark.parametrize("size", [1e-1, 1e-4])
def test_exact_rate_equals_the_explicit_float64_matrices(shape, size):
    layers, heads, kv, hd, d = shape
    q0, k0 = stack(layers, heads, kv, hd, d, seed=1)
    dq, dk = stack(layers, heads, kv, hd, d, seed=2, scale=0.02 * size)
    q, k = q0 + dq, k0 + dk
    num, den = exact_update_sq(q, k, q0, k0, per_head=True)
    got = update_rate(num, den)
    want = explicit_rates(q, k, q0, k0)
    assert got.shape == (layers, 1 + heads) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=2e-4, atol=0)
    # the layer column alone without per_head; the denominator is ||M'||^2
    num_l, den_l = exact_update_sq(q, k, q0, k0)
    torch.testing.assert_close(update_rate(num_l, den_l), want[:, :1], rtol=2e-4, atol=0)
    want_den = torch.tensor([[float(torch.linalg.norm(m) ** 2) for m in mats] for mats in explicit(q0, k0)], dtype=torch.float64)
    torch.testing.assert_close(den, want_den, rtol=1e-5, atol=0)


def test_a_tiny_change_is_resolved_in_float32():
    """||dM|| never cancels against ||M||: a relative change of 1e-6 in float32 is right to 1e-3."""
    q0, k0 = stack(1, 4, 2, 16, 64, seed=3)
    q = q0.clone()
    q[0, 1, 3, 7] += 1e-6 * float(q0.abs().max())  # one weight moved
    got = update_rate(*exact_update_sq(q, k0, q0, k0, per_head=True))
    want = explicit_rates(q.double(), k0.double(), q0.double(), k0.double())
    assert 0 < float(want[0, 0]) < 1e-5
    torch.testing.assert_close(got[:, :2], want[:, :2], rtol=1e-3, atol=0)
    assert torch.all(got[:, 3:] == 0)  # heads 2 and 3 did not move (head 1 shares key head 0 with head 0)


def test_bf16_weights_are_exact_against_their_float64_values():
    q0, k0 = stack(2, 4, 2, 16, 64, seed=4, dtype=torch.bfloat16)
    dq, dk = stack(2, 4, 2, 16, 64, seed=5, scale=0.002, dtype=torch.bfloat16)
    q, k = q0 + dq, k0 + dk
    got = update_rate(*exact_update_sq(q, k, q0, k0, per_head=True))
    torch.testing.assert_close(got, explicit_rates(q, k, q0, k0), rtol=1e-4, atol=0)


def test_zero_previous_matrix_gives_nan_and_no_change_gives_zero():
    q, k = stack(1, 2, 2, 8, 16, seed=6)
    assert torch.all(update_rate(*exact_update_sq(q, k, q, k, per_head=True)) == 0)
    got = update_rate(*exact_update_sq(q, k, torch.zeros_like(q), k))
    assert torch.isnan(got).all()


def test_frobenius_sq_against_explicit():
    q, k = stack(2, 8, 2, 16, 40, seed=7)
    want = torch.tensor([[float(torch.linalg.norm(m) ** 2) for m in mats] for mats in explicit(q, k)], dtype=torch.float64)
    torch.testing.assert_close(frobenius_sq(q, k, per_head=True), want, rtol=1e-5, atol=0)


def test_sketch_is_m_omega_and_omega_is_seeded():
    q, k = stack(2, 4, 2, 8, 32, seed=8)
    omega = sketch_matrix(32, 5)
    assert torch.equal(omega, sketch_matrix(32, 5)) and not torch.equal(omega, sketch_matrix(32, 5, seed=1))
    s = sketch(q, k, omega, per_head=True)
    want = torch.stack([torch.stack([m @ omega.double() for m in mats]) for mats in explicit(q, k)])
    torch.testing.assert_close(s.double(), want, rtol=1e-4, atol=1e-9)
    with pytest.raises(ValueError, match="sketch columns"):
        sketch_matrix(8, 0)


@pytest.mark.parametrize("kind", ["rank-one", "full-rank"])
def test_sketch_estimator_is_unbiased_within_its_stated_error(kind):
    """Over 400 seeds of Omega: the mean of ||S - S'||^2 / r is ||dM||^2 (within 4 standard errors),
    the relative sd is at most sqrt(2 / r) (equal for a rank-one change), and the rate's relative
    error stays within 4 times its stated sd sqrt(1 / (2 r)) for every seed."""
    r, d, seeds = 16, 48, 400
    q0, k0 = stack(1, 4, 4, 8, d, seed=9)
    q, k = q0.clone(), k0.clone()
    if kind == "rank-one":  # dM = u v^T: one query row of one head moved
        q[0, 2, 5] += 0.01 * torch.randn(d, generator=torch.Generator().manual_seed(10))
    else:
        dq, dk = stack(1, 4, 4, 8, d, seed=11, scale=0.002)
        q, k = q + dq, k + dk
    exact_sq = float(torch.linalg.norm(explicit(q, k)[0][0] - explicit(q0, k0)[0][0]) ** 2)
    est = []
    for seed in range(seeds):
        omega = sketch_matrix(d, r, seed=seed)
        est.append(float(sketch_update_sq(sketch(q, k, omega), sketch(q0, k0, omega))[0, 0]))
    est_t = torch.tensor(est, dtype=torch.float64) / exact_sq
    sd_bound = sketch_relative_sd(r)
    mean, sd = float(est_t.mean()), float(est_t.std())
    assert abs(mean - 1) < 4 * sd_bound / math.sqrt(seeds), (mean, sd)
    assert sd < sd_bound * 1.15, (sd, sd_bound)  # sample sd of 400 draws: within 15 % of the true one
    if kind == "rank-one":
        assert sd > sd_bound * 0.85, (sd, sd_bound)  # the worst case attains the bound
    else:
        assert sd < sd_bound * 0.8, (sd, sd_bound)  # a spread change does better
    rate_err = (est_t.sqrt() - 1).abs()
    assert float(rate_err.max()) < 4 * math.sqrt(1 / (2 * r)) + 0.1, float(rate_err.max())
