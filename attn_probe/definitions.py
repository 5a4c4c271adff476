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

This module is the independent reference the tests compare the scoring core with
(:mod:`attn_probe.core`, which computes the same scores from factors without forming ``d x d``
products): it imports nothing from the core and shares no code with it. Its functions are
written to be obviously correct, not fast: the explicit matrix, its row and column norms, and
the directionality excesses summed in plain Python.
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
]

Tensor = torch.Tensor


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



def _finite_num_std(num_std: float) -> float:
    """``num_std`` as a float; ``ValueError`` unless it is finite."""
    value = float(num_std)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"num_std must be finite, got {value}")
    return value


# --------------------------------------------------------------------------- reductions
def symmetry_from_inner_products(trace_m_m: float, frob_sq: float) -> float:
    """``<M, M^T>_F / ||M||_F^2`` clipped to ``[-1, 1]``; ``nan`` when the norm is zero or anything is non-finite."""
    if not (math.isfinite(trace_m_m) and math.isfinite(frob_sq)) or frob_sq <= 0.0:
        return float("nan")
    return max(-1.0, min(1.0, trace_m_m / frob_sq))



def _excess_over_threshold(norms: list[float], num_std: float) -> float:
    """``sum over norms above tau of (norm - tau)``, ``tau = mean + num_std * std`` (unbiased std)."""
    n = len(norms)
    mean = math.fsum(norms) / n
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in norms) / (n - 1))
    tau = mean + num_std * std
    return math.fsum(x - tau for x in norms if x > tau)


def _rounding_tolerance(*tensors: Tensor) -> float:
    """``sqrt(eps)`` of the widest-eps floating dtype among ``tensors`` (float64's for integers)."""
    eps = [torch.finfo(t.dtype).eps for t in tensors if t.is_floating_point()]
    return math.sqrt(max(eps) if eps else torch.finfo(torch.float64).eps)


def directionality_from_norms(
    row_norms: Tensor, col_norms: Tensor, num_std: float = 2.0, *, rtol: float | None = None
) -> float:
    """Directionality ``(R - C) / (R + C)`` from the row and column L2 norms of ``M``.

    ``nan`` if a norm is non-finite or all are zero; ``0`` if ``R + C <= rtol * max(mean r,
    mean c)`` (no row or column stands out beyond rounding; ``rtol`` defaults to
    ``sqrt(eps)`` of the norms' dtype) or if there are fewer than two rows.
    """
    num_std = _finite_num_std(num_std)
    r = torch.as_tensor(row_norms).detach()
    c = torch.as_tensor(col_norms).detach()
    tol = _rounding_tolerance(r, c) if rtol is None else float(rtol)
    rows = r.to("cpu", torch.float64).flatten().tolist()
    cols = c.to("cpu", torch.float64).flatten().tolist()
    if not rows or not cols:
        raise ValueError("norms must be non-empty")
    if not all(math.isfinite(x) for x in rows + cols) or all(x == 0 for x in rows + cols):
        return float("nan")
    if len(rows) < 2 or len(cols) < 2:  # unbiased std undefined: no row or column stands out
        return 0.0
    excess_r = _excess_over_threshold(rows, num_std)
    excess_c = _excess_over_threshold(cols, num_std)
    total = excess_r + excess_c
    if not total > tol * max(math.fsum(rows) / len(rows), math.fsum(cols) / len(cols)):
        return 0.0
    return (excess_r - excess_c) / total


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
    num_std = _finite_num_std(num_std)
    m = _normalised(_as_matrix(M), dtype)
    if m is None:
        return float("nan")
    # column norms as row norms of the transpose: identical arithmetic for rows and columns,
    # so an exactly symmetric M gives exactly R == C
    rows = torch.linalg.vector_norm(m, dim=1)
    cols = torch.linalg.vector_norm(m.T.contiguous(), dim=1)
    return directionality_from_norms(rows, cols, num_std)



# --------------------------------------------------------------------------- head pairing
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
