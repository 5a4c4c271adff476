"""The metric formulas on :class:`~attn_probe.core.products.Products` and their registry.

**Adding a metric** touches this module only: write a function ``(products) -> (n, G)`` tensor and add it
to :data:`METRICS` (and to :data:`MAGNITUDES` if it is an unbounded magnitude rather than a score in
``[-1, 1]``). The metric name is the JSONL ``metric`` field, the TensorBoard tag segment and the row key."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .products import Products
from .update import UPDATE_METRIC

Tensor = torch.Tensor
Row = dict[str, Any]

def _undefined_as_nan(p: Products, value: Tensor) -> Tensor:
    return torch.where(p.valid, value.to(torch.float64), float("nan"))


def _norm_directionality(rows: Tensor, cols: Tensor, num_std: float, rtol: float) -> Tensor:
    """Directionality of a batch from its norms: ``rows``/``cols`` ``(..., n)`` float64 -> ``(...)`` float64.

    Thresholds ``tau = mean + num_std * std`` (unbiased), excesses ``R``, ``C`` over them,
    ``(R - C) / (R + C)``; 0 where ``R + C <= rtol * max(mean r, mean c)`` or fewer than two
    rows/columns; NaN where a norm is non-finite or all are zero. The slow, independent
    definition is :func:`attn_probe.definitions.directionality_from_norms`.
    """
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



# ------------------------------------------------------------------------------------ metrics
def symmetry(p: Products) -> Tensor:
    """``<M, M^T>_F / ||M||_F^2`` in ``[-1, 1]``: +1 symmetric, -1 skew, ~0 random."""
    ratio = (p.trace_mm / torch.where(p.valid, p.frob_sq, 1.0)).clamp(-1.0, 1.0)
    return _undefined_as_nan(p, ratio)


def directionality(p: Products) -> Tensor:
    """``(R - C) / (R + C)`` from the row/column norm excesses over ``mean + num_std * std``."""
    rows = p.row_norms.to(torch.float64)
    cols = p.col_norms.to(torch.float64)
    return _undefined_as_nan(p, _norm_directionality(rows, cols, p.num_std, math.sqrt(p.eps)))


def spectral_norm(p: Products) -> Tensor:
    """``sigma_max(M)``, the largest singular value (true scale, float64); 0 for ``M = 0``."""
    return p.sigma_max_sq.to(torch.float64).sqrt() * p.scale


def frobenius_norm(p: Products) -> Tensor:
    """``||M||_F`` (true scale, float64); 0 for ``M = 0``."""
    return p.frob_sq.to(torch.float64).clamp_min(0).sqrt() * p.scale


def stable_rank(p: Products) -> Tensor:
    """``||M||_F^2 / sigma_max(M)^2`` in ``[1, rank M]``; NaN where ``M`` is zero or not finite."""
    ratio = p.frob_sq.to(torch.float64) / torch.where(p.valid, p.sigma_max_sq.to(torch.float64), 1.0)
    return _undefined_as_nan(p, ratio.clamp_min(1.0))


def qk_bound(p: Products) -> Tensor:
    """``sigma_max(A_h) * sigma_max(B_g(h))`` per head; for a layer, the largest over its heads.

    For W_qk this is ``sigma_max(W_q^h) sigma_max(W_k^h)``, the weight-only bound on the
    logits that survives rotary embeddings. A NaN head makes the layer value NaN.
    """
    heads = p.parts
    if heads is not None:  # a layer (G = 1): max over its unsummed heads
        n = p.shape[0]
        return qk_bound(heads).reshape(n, -1).amax(-1, keepdim=True).expand(p.shape)
    sa, sb = p.factor_sigma_max
    return sa * sb


#: name -> function of :class:`Products` returning ``(n, G)``; order = display order
METRICS: dict[str, Callable[[Products], Tensor]] = {
    "symmetry": symmetry,
    "directionality": directionality,
    "spectral_norm": spectral_norm,
    "frobenius_norm": frobenius_norm,
    "stable_rank": stable_rank,
    "qk_bound": qk_bound,
}

#: what every path computes unless told otherwise
DEFAULT_METRICS: tuple[str, ...] = tuple(METRICS)

#: metrics that are unbounded magnitudes, not scores in [-1, 1]: TensorBoard also gets their
#: across-layer ``max`` (blow-ups sit in a few layers) and plots use a log y axis
MAGNITUDES: frozenset[str] = frozenset({"spectral_norm", "frobenius_norm", "stable_rank", "qk_bound"})

#: a pair-prefixed metric name -> the name the pair writes instead (data, read by the pairs when
#: they name their metrics and by :func:`is_magnitude`): the OV pair's ``qk_bound`` is
#: ``sigma_max(W_o) sigma_max(W_v)``, a gain bound, and is written as ``ov_gain_bound``
WRITTEN_NAMES: dict[str, str] = {"ov_qk_bound": "ov_gain_bound"}


def is_magnitude(metric: str) -> bool:
    """Whether ``metric`` (possibly with a pair prefix such as ``ov_``, or written under another
    name, :data:`WRITTEN_NAMES`) is one of :data:`MAGNITUDES`."""
    metric = next((old for old, new in WRITTEN_NAMES.items() if new == metric), metric)
    if metric == UPDATE_METRIC:  # the live probe's relative change (attn_probe.core.update): >= 0, unbounded
        return True
    return any(metric == m or metric.endswith("_" + m) for m in MAGNITUDES)


def check_metrics(metrics: Sequence[str] | str | None) -> tuple[str, ...]:
    """Validated tuple of metric names (``None``: :data:`DEFAULT_METRICS`); ``ValueError`` otherwise."""
    if metrics is None:
        return DEFAULT_METRICS
    if isinstance(metrics, str):
        metrics = (metrics,)
    names = tuple(metrics)
    unknown = [m for m in names if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; known: {', '.join(METRICS)}")
    if not names:
        raise ValueError("metrics must name at least one metric")
    if len(set(names)) != len(names):
        raise ValueError(f"metrics repeat a name: {list(names)}")
    return names
