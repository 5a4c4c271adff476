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

Degenerate input (see ``docs/scores.md``):

* not a 2-D square matrix, an empty matrix, complex or non-numeric entries, factors of
  mismatching shapes, a non-finite ``num_std``: ``ValueError``;
* any non-finite entry (``nan``/``inf``) or the zero matrix: both scores are ``nan``;
  from factors, a product that is zero up to rounding (``||M||_F^2 <= 16 eps ||A||^2 ||B||^2``)
  also gives ``nan``;
* ``R + C`` within rounding of zero (``<= sqrt(eps) * max(mean r, mean c)``, ``eps`` of
  the norms' dtype), e.g. an orthogonal ``M`` whose norms are all equal: directionality ``0``;
* a ``1 x 1`` non-zero matrix: symmetry ``1``, directionality ``0``.

Explicit matrices, and factors, are divided by their largest absolute entry before squaring,
so both scores are scale-invariant even for entries near the floating-point range limits.

The factored functions never form ``d x d`` products when the factors are thin:
with factors ``A, B`` of shape ``(r, d)`` and ``M = A^T B``,

* ``||M||_F^2 = tr((A A^T)(B B^T))``
* ``<M, M^T>_F = tr((B A^T)^2)``
* row norms ``r_i^2 = diag(A^T (B B^T) A)``, column norms ``c_j^2 = diag(B^T (A A^T) B)``

which costs at most ``5 r^2 d`` multiply-adds instead of ``r d^2`` plus a few passes over
the ``d x d`` matrix (:func:`gram_is_cheaper` picks the cheaper one); large symmetric Gram
matrices are computed block-wise. The factored computation itself lives in the scoring core,
:mod:`attn_probe.metrics` (with :func:`~attn_probe.metrics.factored_scores`, its host-side
view); this module keeps the definitions and their explicit-matrix forms and imports nothing
from the core (the core imports it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "symmetry_score",
    "directionality_score",
    "directionality_from_norms",
    "symmetry_from_inner_products",
    "pair_kv_heads",
    "gram_is_cheaper",
]

Tensor = torch.Tensor

#: Cost, in multiply-adds per entry of ``M``, charged to the explicit path for the passes
#: over the ``d x d`` matrix (memory bound). With it a Llama-3-8B layer (r = 1024, d = 4096)
#: takes the Gram path, which ran about 2x faster than forming M on the 2-core dev CPU.
EXPLICIT_PASS_COST = 512


# --------------------------------------------------------------------------- validation
def _as_matrix(M: Any) -> Tensor:
    """A detached real 2-D square tensor (floating point); ``ValueError`` otherwise."""
    if isinstance(M, Tensor):
        t = M.detach()
    else:
        import numpy as np

        try:
            arr = np.asarray(M)
        except Exception as exc:  # ragged lists and the like
            raise ValueError(f"expected a 2-D tensor or array, got {type(M).__name__}") from exc
        if arr.dtype.kind not in "biuf":
            raise ValueError(f"expected a real numeric matrix, got numpy dtype {arr.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(arr))
    if t.ndim != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {tuple(t.shape)}")
    if t.shape[0] != t.shape[1]:
        raise ValueError(f"expected a square matrix, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError("expected a non-empty matrix, got shape (0, 0)")
    if t.is_complex():
        raise ValueError("complex matrices are not supported")
    if not t.is_floating_point():
        t = t.to(torch.float64)
    return t


def _normalised(t: Tensor, dtype: torch.dtype) -> Tensor | None:
    """``t / max|t|`` in ``dtype``; ``None`` when ``t`` is zero or has non-finite entries."""
    if not bool(torch.isfinite(t).all()):
        return None
    amax = t.abs().amax()
    if float(amax) == 0.0:
        return None
    return (t / amax).to(dtype)


def _check_num_std(num_std: float) -> float:
    num_std = float(num_std)
    if not math.isfinite(num_std):
        raise ValueError(f"num_std must be finite, got {num_std}")
    return num_std


# --------------------------------------------------------------------------- reductions
def symmetry_from_inner_products(trace_m_m: float, frob_sq: float) -> float:
    """``<M, M^T>_F / ||M||_F^2`` clipped to ``[-1, 1]``; ``nan`` when the norm is zero or anything is non-finite."""
    if not (math.isfinite(trace_m_m) and math.isfinite(frob_sq)) or frob_sq <= 0.0:
        return float("nan")
    return max(-1.0, min(1.0, trace_m_m / frob_sq))


def _directionality_batch(rows: Tensor, cols: Tensor, num_std: float, rtol: float) -> Tensor:
    """Directionality of a batch: ``rows``/``cols`` ``(..., n)`` float64 -> ``(...)`` float64."""
    n = rows.shape[-1]
    finite = torch.isfinite(rows).all(-1) & torch.isfinite(cols).all(-1)
    zero = (rows.abs().amax(-1) == 0) & (cols.abs().amax(-1) == 0)
    if n < 2 or cols.shape[-1] < 2:  # unbiased std undefined: no row or column stands out
        out = torch.zeros(rows.shape[:-1], dtype=torch.float64, device=rows.device)
    else:
        r = torch.nan_to_num(rows)
        c = torch.nan_to_num(cols)
        tau_r = r.mean(-1, keepdim=True) + num_std * r.std(-1, correction=1, keepdim=True)
        tau_c = c.mean(-1, keepdim=True) + num_std * c.std(-1, correction=1, keepdim=True)
        excess_r = (r - tau_r).clamp_min(0).sum(-1)
        excess_c = (c - tau_c).clamp_min(0).sum(-1)
        total = excess_r + excess_c
        scale = torch.maximum(r.mean(-1), c.mean(-1))
        significant = total > rtol * scale
        out = torch.where(significant, (excess_r - excess_c) / torch.where(significant, total, 1.0), 0.0)
    return torch.where(finite & ~zero, out, float("nan"))


def _default_rtol(*tensors: Tensor) -> float:
    eps = max(torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0 for t in tensors)
    return math.sqrt(eps) if eps > 0 else math.sqrt(torch.finfo(torch.float64).eps)


def directionality_from_norms(
    row_norms: Tensor, col_norms: Tensor, num_std: float = 2.0, *, rtol: float | None = None
) -> float:
    """Directionality ``(R - C) / (R + C)`` from the row and column L2 norms of ``M``.

    ``nan`` if a norm is non-finite or all are zero; ``0`` if ``R + C <= rtol * max(mean r,
    mean c)`` (no row or column stands out beyond rounding; ``rtol`` defaults to
    ``sqrt(eps)`` of the norms' dtype) or if there are fewer than two rows.
    """
    num_std = _check_num_std(num_std)
    r = torch.as_tensor(row_norms).detach()
    c = torch.as_tensor(col_norms).detach()
    tol = _default_rtol(r, c) if rtol is None else float(rtol)
    r64 = r.to("cpu", torch.float64).flatten()
    c64 = c.to("cpu", torch.float64).flatten()
    if r64.numel() == 0 or c64.numel() == 0:
        raise ValueError("norms must be non-empty")
    return float(_directionality_batch(r64, c64, num_std, tol))


# --------------------------------------------------------------------------- explicit matrices
def symmetry_score(M: Any, dtype: torch.dtype = torch.float64) -> float:
    """Symmetry ``<M, M^T>_F / ||M||_F^2`` of a square matrix (tensor or numpy array).

    +1 for symmetric, -1 for skew-symmetric, about 0 for a random matrix; ``nan`` for the
    zero matrix or non-finite entries; ``ValueError`` if ``M`` is not a square matrix.

    Example:
        >>> import torch
        >>> W = torch.randn(8, 16)
        >>> round(symmetry_score(W.T @ W), 6)
        1.0
        >>> symmetry_score(torch.zeros(3, 3))  # undefined for the zero matrix
        nan
    """
    m = _normalised(_as_matrix(M), dtype)
    if m is None:
        return float("nan")
    return symmetry_from_inner_products(float((m * m.T).sum()), float((m * m).sum()))


def directionality_score(M: Any, num_std: float = 2.0, dtype: torch.dtype = torch.float64) -> float:
    """Directionality ``(R - C)/(R + C)`` of a square matrix; negative = column dominance.

    Example:
        >>> import torch
        >>> M = torch.randn(64, 64) * 0.01
        >>> M[:, 3] += 10.0          # one dominant column (key)
        >>> directionality_score(M) < -0.9
        True
        >>> directionality_score(M.T) > 0.9  # one dominant row (query)
        True
    """
    num_std = _check_num_std(num_std)
    m = _normalised(_as_matrix(M), dtype)
    if m is None:
        return float("nan")
    # column norms as row norms of the transpose: identical arithmetic for rows and columns,
    # so an exactly symmetric M gives exactly R == C
    rows = torch.linalg.vector_norm(m, dim=1)
    cols = torch.linalg.vector_norm(m.T.contiguous(), dim=1)
    return directionality_from_norms(rows, cols, num_std)


# --------------------------------------------------------------------------- factored
def pair_kv_heads(num_heads: int, num_kv_heads: int) -> Tensor:
    """Key/value head used by each query head, as transformers' ``repeat_kv`` pairs them.

    Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

    Example:
        >>> pair_kv_heads(8, 2).tolist()
        [0, 0, 0, 0, 1, 1, 1, 1]
    """
    if num_kv_heads <= 0 or num_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    return torch.arange(num_heads) // (num_heads // num_kv_heads)


def _check_factors(query: Tensor, key: Tensor) -> tuple[int, int, int, int]:
    if not isinstance(query, Tensor) or not isinstance(key, Tensor):
        raise ValueError("factors must be torch tensors")
    if query.ndim != 3 or key.ndim != 3:
        raise ValueError(
            "factors must be shaped (heads, head_dim, d); got "
            f"query {tuple(query.shape)} and key {tuple(key.shape)}"
        )
    num_heads, head_dim, d = query.shape
    num_kv, head_dim_k, d_k = key.shape
    if head_dim_k != head_dim or d_k != d:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} do not match")
    if query.numel() == 0 or key.numel() == 0:
        raise ValueError(f"empty factors: query {tuple(query.shape)}, key {tuple(key.shape)}")
    if num_heads % num_kv:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv} key heads")
    if query.is_complex() or key.is_complex():
        raise ValueError("complex factors are not supported")
    return num_heads, num_kv, head_dim, d


def gram_is_cheaper(r: int, d: int) -> bool:
    """Whether the Gram path (``~5 r^2 d``) beats forming ``M = A^T B`` (``r d^2`` + passes over ``d^2``)."""
    return 5 * r * r < (r + EXPLICIT_PASS_COST) * d


def _gram(x: Tensor, block: int = 256) -> Tensor:
    """``x x^T`` for ``(..., r, d)``, computing only the block rows of the upper triangle.

    With ``k = r / block`` block rows this costs ``(k + 1) / 2k`` of the full product.
    """
    r = x.shape[-2]
    if r < 2 * block:
        return x @ x.mT
    g = x.new_empty((*x.shape[:-2], r, r))
    for s in range(0, r, block):
        e = min(s + block, r)
        rows = x[..., s:e, :] @ x[..., s:, :].mT  # (..., e - s, r - s)
        g[..., s:e, s:] = rows
        g[..., s:, s:e] = rows.mT
    return g
