"""Symmetry and directionality of the query-key bilinear form (pure maths, torch only).

Conventions (Saponati et al., ICML 2025, arXiv 2502.10927):

* ``M = W_qk`` is ``d x d``; rows index the query token, columns the key token, so the
  attention logit is ``x_i^T M x_j``.
* With ``nn.Linear`` weights ``Q_h, K_h`` of shape ``(d_head, d)`` for head ``h``,
  the head matrix is ``M_h = Q_h^T K_h`` and the layer matrix is ``M = sum_h M_h``.

Symmetry

.. math::  s(M) = \\frac{2\\,\\lVert (M + M^T)/2 \\rVert_F^2}{\\lVert M \\rVert_F^2} - 1
               = \\frac{\\langle M, M^T \\rangle_F}{\\lVert M \\rVert_F^2} \\in [-1, 1]

Directionality, with row norms ``r``, column norms ``c`` and thresholds
``tau = mean + num_std * std`` (unbiased std)

.. math::  R = \\sum_{r_i > \\tau_r} (r_i - \\tau_r), \\quad
           C = \\sum_{c_j > \\tau_c} (c_j - \\tau_c), \\quad
           d(M) = \\frac{R - C}{R + C}

and ``d = 0`` when ``R + C = 0``. Negative values mean a few dominant *columns* (keys),
the decoder signature.

Degenerate input: both scores are ``nan`` for a matrix with non-finite entries or for the
zero matrix (the scores are undefined there); input that is not a square 2-D matrix, or
factors of mismatching shapes, raise ``ValueError``.

The factored functions never form ``d x d`` products when the factors are thin:
with ``A = Q^T``-stacked factors ``(r, d)`` and ``M = A^T B``,

* ``||M||_F^2 = tr((A A^T)(B B^T))``
* ``<M, M^T>_F = tr((B A^T)^2)``
* row norms ``r_i^2 = diag(A^T (B B^T) A)``, column norms ``c_j^2 = diag(B^T (A A^T) B)``

which costs ``O(r^2 d)`` instead of ``O(r d^2)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "symmetry_score",
    "directionality_score",
    "directionality_from_norms",
    "symmetry_from_inner_products",
    "factored_scores",
    "FactoredScores",
    "pair_kv_heads",
]

Tensor = torch.Tensor


def _as_matrix(M: Any, dtype: torch.dtype) -> Tensor:
    if isinstance(M, Tensor):
        t = M.detach()
    else:
        try:
            import numpy as np

            t = torch.from_numpy(np.asarray(M))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"expected a 2-D tensor or array, got {type(M).__name__}") from exc
    if t.ndim != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {tuple(t.shape)}")
    if t.shape[0] != t.shape[1]:
        raise ValueError(f"expected a square matrix, got shape {tuple(t.shape)}")
    if t.is_complex():
        raise ValueError("complex matrices are not supported")
    return t.to(dtype)


def symmetry_from_inner_products(trace_m_m: float, frob_sq: float) -> float:
    """``<M, M^T>_F / ||M||_F^2``; ``nan`` when the norm is zero or anything is non-finite."""
    if not (math.isfinite(trace_m_m) and math.isfinite(frob_sq)) or frob_sq <= 0.0:
        return float("nan")
    return max(-1.0, min(1.0, trace_m_m / frob_sq))


def directionality_from_norms(row_norms: Tensor, col_norms: Tensor, num_std: float = 2.0) -> float:
    """Directionality ``(R - C) / (R + C)`` from the row and column L2 norms of ``M``."""
    r = row_norms.detach().to(torch.float64).flatten()
    c = col_norms.detach().to(torch.float64).flatten()
    if not (torch.isfinite(r).all() and torch.isfinite(c).all()):
        return float("nan")
    if r.numel() < 2 or c.numel() < 2:
        return 0.0
    if float(r.max()) == 0.0 and float(c.max()) == 0.0:
        return float("nan")
    tau_r = r.mean() + num_std * r.std(unbiased=True)
    tau_c = c.mean() + num_std * c.std(unbiased=True)
    excess_r = float((r - tau_r).clamp_min(0).sum())
    excess_c = float((c - tau_c).clamp_min(0).sum())
    total = excess_r + excess_c
    if total == 0.0:
        return 0.0
    return (excess_r - excess_c) / total


def symmetry_score(M: Any, dtype: torch.dtype = torch.float64) -> float:
    """Symmetry ``<M, M^T>_F / ||M||_F^2`` of a square matrix (tensor or numpy array).

    +1 for symmetric, -1 for skew-symmetric, about 0 for a random matrix; ``nan`` for the
    zero matrix or non-finite entries.

    Example:
        >>> import torch
        >>> W = torch.randn(8, 16)
        >>> round(symmetry_score(W.T @ W), 6)
        1.0
    """
    m = _as_matrix(M, dtype)
    return symmetry_from_inner_products(float((m * m.T).sum()), float((m * m).sum()))


def directionality_score(M: Any, num_std: float = 2.0, dtype: torch.dtype = torch.float64) -> float:
    """Directionality ``(R - C)/(R + C)`` of a square matrix; negative = column dominance.

    Example:
        >>> import torch
        >>> M = torch.randn(64, 64) * 0.01
        >>> M[:, 3] += 10.0          # one dominant column (key)
        >>> directionality_score(M) < -0.9
        True
    """
    m = _as_matrix(M, dtype)
    if not torch.isfinite(m).all():
        return float("nan")
    return directionality_from_norms(m.norm(dim=1), m.norm(dim=0), num_std)


def pair_kv_heads(num_heads: int, num_kv_heads: int) -> Tensor:
    """Key/value head used by each query head, as transformers' ``repeat_kv`` pairs them.

    Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    """
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    return torch.arange(num_heads) // (num_heads // num_kv_heads)


@dataclass
class FactoredScores:
    """Scores of one layer: the layer-level matrix and, optionally, every head."""

    symmetry: float
    directionality: float
    head_symmetry: list[float] | None = None
    head_directionality: list[float] | None = None


def _check_factors(query: Tensor, key: Tensor) -> tuple[int, int, int, int]:
    if query.ndim != 3 or key.ndim != 3:
        raise ValueError(
            "factors must be shaped (heads, head_dim, d); got "
            f"query {tuple(query.shape)} and key {tuple(key.shape)}"
        )
    num_heads, head_dim, d = query.shape
    num_kv, head_dim_k, d_k = key.shape
    if head_dim_k != head_dim or d_k != d:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} do not match")
    if num_heads % num_kv:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv} key heads")
    return num_heads, num_kv, head_dim, d


def _scores_from_grams(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Batched ``(..., r, d)`` factors -> (<M,M^T>, ||M||^2, row norms, col norms) of ``A^T B``."""
    gram_a = a @ a.transpose(-1, -2)
    gram_b = b @ b.transpose(-1, -2)
    cross = b @ a.transpose(-1, -2)
    frob_sq = (gram_a * gram_b).sum((-1, -2))  # tr(GA GB), both symmetric
    trace_mm = (cross * cross.transpose(-1, -2)).sum((-1, -2))  # tr(C C)
    row_sq = ((gram_b @ a) * a).sum(-2)
    col_sq = ((gram_a @ b) * b).sum(-2)
    return trace_mm, frob_sq, row_sq.clamp_min(0).sqrt(), col_sq.clamp_min(0).sqrt()


def _scores_explicit(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Same as :func:`_scores_from_grams` but forms ``M = A^T B``; cheaper when ``r`` is not thin."""
    m = a.transpose(-1, -2) @ b
    return (
        (m * m.transpose(-1, -2)).sum((-1, -2)),
        (m * m).sum((-1, -2)),
        m.norm(dim=-1),
        m.norm(dim=-2),
    )


def _thin_products(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # Grams cost ~5 r^2 d multiply-adds, the explicit product ~r d^2 (+ d^2 reductions).
    r, d = a.shape[-2], a.shape[-1]
    if 5 * r < d:
        return _scores_from_grams(a, b)
    return _scores_explicit(a, b)


def factored_scores(
    query: Tensor,
    key: Tensor,
    *,
    per_head: bool = False,
    layer: bool = True,
    num_std: float = 2.0,
    dtype: torch.dtype = torch.float32,
) -> FactoredScores:
    """Scores of ``M = sum_h Q_h^T K_{g(h)}`` from per-head factors, without forming it when thin.

    ``query`` is ``(num_heads, head_dim, d)`` and ``key`` is ``(num_kv_heads, head_dim, d)``
    (``nn.Linear`` weight rows split per head); query head ``h`` pairs with key head
    ``g(h) = h // (num_heads / num_kv_heads)``. Grouped heads are summed before the product,
    ``M = sum_g (sum_{h in g} Q_h)^T K_g``, so a grouped-query layer costs ``num_kv_heads``
    heads rather than ``num_heads``. Computation happens on the factors' device in ``dtype``.
    """
    num_heads, num_kv, head_dim, d = _check_factors(query, key)
    with torch.no_grad():
        q = query.detach().to(dtype)
        k = key.detach().to(dtype)
        nan = float("nan")
        finite = bool(torch.isfinite(q).all() and torch.isfinite(k).all())
        out = FactoredScores(nan, nan)
        if layer and finite:
            q_grouped = q.reshape(num_kv, num_heads // num_kv, head_dim, d).sum(1)
            trace_mm, frob_sq, rows, cols = _thin_products(
                q_grouped.reshape(num_kv * head_dim, d), k.reshape(num_kv * head_dim, d)
            )
            host = torch.stack([trace_mm, frob_sq]).to("cpu", torch.float64)
            out.symmetry = symmetry_from_inner_products(float(host[0]), float(host[1]))
            out.directionality = directionality_from_norms(rows.cpu(), cols.cpu(), num_std)
        if per_head:
            if not finite:
                out.head_symmetry = [nan] * num_heads
                out.head_directionality = [nan] * num_heads
            else:
                k_per_head = k[pair_kv_heads(num_heads, num_kv).to(k.device)]
                trace_mm, frob_sq, rows, cols = _thin_products(q, k_per_head)
                host = torch.stack([trace_mm, frob_sq]).to("cpu", torch.float64)
                rows, cols = rows.cpu(), cols.cpu()
                out.head_symmetry = [
                    symmetry_from_inner_products(float(t), float(f)) for t, f in host.T
                ]
                out.head_directionality = [
                    directionality_from_norms(rows[h], cols[h], num_std) for h in range(num_heads)
                ]
        return out
