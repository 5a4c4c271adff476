"""The one scoring core: a layer's factors -> a ``(metrics, 1 + H)`` tensor on the weights' device.

Every path that scores weights goes through :func:`score_factors`: the live probe (through
its pairs, :mod:`attn_probe.pairs`), :func:`attn_probe.score_model`, checkpoint scoring and
the distributed path. So on the same weights, device and dtype they give the same numbers.

For factors ``A_h, B_g`` (per-head ``(head_dim, d)`` slices; query head ``h`` reads key head
``g(h) = h // (H / H_kv)``) the scored matrices are ``M_h = A_h^T B_{g(h)}`` and the layer
matrix ``M = sum_h M_h``. Column 0 of the result is ``M``, column ``1 + h`` is ``M_h``.

**Adding a metric** touches this module only: write a function ``(products) -> (n, G)``
tensor and add it to :data:`METRICS`. It can use the shared quantities of :class:`Products`
(computed lazily, once per batch, from the factors without forming ``d x d`` when they are
thin) or add a new cached property there. The metric name is the JSONL ``metric`` field,
the TensorBoard tag segment and the row key, unchanged everywhere.

No host synchronisation happens here: results stay on the factors' device until a caller
moves many layers' tables to the host in one transfer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property
from typing import Any

import torch

from .scores import _check_factors, _check_num_std, _directionality_batch, _gram, gram_is_cheaper

__all__ = [
    "METRICS",
    "DEFAULT_METRICS",
    "Products",
    "check_metrics",
    "score_factors",
    "table_entries",
    "table_rows",
]

Tensor = torch.Tensor
Row = dict[str, Any]


class Products:
    """Shared quantities of a batch of matrices ``M_{n,j} = A_{n,j}^T B_n``, computed on demand.

    ``a``: ``(n, G, r, d)``, ``b``: ``(n, r, d)`` (the ``G`` query-side factors of a group
    share one key-side factor). Both are rescaled by their largest entry first: every metric
    here is scale-invariant, and this keeps squares and Gram products inside the dtype's range.
    With ``r`` small against ``d`` (:func:`attn_probe.scores.gram_is_cheaper`) everything
    comes from the ``r x r`` Gram matrices ``G_A = A A^T``, ``G_B = B B^T``:

    * ``||M||_F^2 = tr(G_A G_B)``, ``<M, M^T>_F = tr((B A^T)^2)``;
    * row norms ``r_i^2 = diag(A^T G_B A)``, column norms ``c_j^2 = diag(B^T G_A B)``;

    otherwise ``M`` is formed explicitly.
    """

    def __init__(self, a: Tensor, b: Tensor, num_std: float, dtype: torch.dtype) -> None:
        self.a = _rescaled(a)
        self.b = _rescaled(b)
        self.num_std = num_std
        self.eps = torch.finfo(dtype).eps
        n, G, r, d = a.shape
        self.shape = (n, G)
        self.explicit = not gram_is_cheaper(r, d)

    # -- building blocks ---------------------------------------------------------------------
    @cached_property
    def gram_a(self) -> Tensor:
        return _gram(self.a)  # (n, G, r, r)

    @cached_property
    def gram_b(self) -> Tensor:
        return _gram(self.b)  # (n, r, r)

    @cached_property
    def matrix(self) -> Tensor:
        """``M`` formed explicitly, ``(n, G, d, d)`` (only on the explicit path)."""
        return self.a.mT @ self.b[:, None]

    # -- shared quantities, each (n, G) or (n, G, d) -------------------------------------------
    @cached_property
    def frob_sq(self) -> Tensor:
        """``||M||_F^2`` (non-finite input propagates)."""
        if self.explicit:
            return self.matrix.square().sum((-1, -2))
        return (self.gram_a * self.gram_b[:, None]).sum((-1, -2))

    @cached_property
    def trace_mm(self) -> Tensor:
        """``<M, M^T>_F = tr(M M)``."""
        if self.explicit:
            m = self.matrix
            return (m * m.mT).sum((-1, -2))
        n, G, r, d = self.a.shape
        cross = (self.b @ self.a.reshape(n, G * r, d).mT).reshape(n, r, G, r).transpose(1, 2)  # B A_j^T
        return (cross * cross.mT).sum((-1, -2))

    @cached_property
    def factor_sq(self) -> tuple[Tensor, Tensor]:
        """``||A||_F^2`` ``(n, G)`` and ``||B||_F^2`` ``(n, 1)``."""
        return self.a.square().sum((-1, -2)), self.b.square().sum((-1, -2))[:, None]

    @cached_property
    def row_norms(self) -> Tensor:
        """L2 norm of each row of ``M`` (query side), ``(n, G, d)``."""
        if self.explicit:
            return torch.linalg.vector_norm(self.matrix, dim=-1)
        return ((self.gram_b[:, None] @ self.a) * self.a).sum(-2).clamp_min(0).sqrt()

    @cached_property
    def col_norms(self) -> Tensor:
        """L2 norm of each column of ``M`` (key side), ``(n, G, d)``."""
        if self.explicit:
            return torch.linalg.vector_norm(self.matrix, dim=-2)
        n, G, r, d = self.a.shape
        col_sq = ((self.gram_a.reshape(n, G * r, r) @ self.b).reshape(n, G, r, d) * self.b[:, None]).sum(-2)
        return col_sq.clamp_min(0).sqrt()

    @cached_property
    def valid(self) -> Tensor:
        """``M`` is finite and not zero up to rounding: ``||M||^2 > 16 eps ||A||^2 ||B||^2``."""
        a_sq, b_sq = self.factor_sq
        frob = self.frob_sq
        return torch.isfinite(frob) & (frob > 16 * self.eps * a_sq * b_sq)


def _rescaled(t: Tensor) -> Tensor:
    """Each matrix ``t[..., :, :]`` divided by its largest entry (all metrics are scale-invariant).

    A non-finite entry makes its whole matrix non-finite, so it is reported as undefined.
    """
    amax = t.abs().amax((-1, -2), keepdim=True)
    return t * torch.where(amax > 0, amax.reciprocal(), torch.ones_like(amax))


def _undefined_as_nan(p: Products, value: Tensor) -> Tensor:
    return torch.where(p.valid, value.to(torch.float64), float("nan"))


# ------------------------------------------------------------------------------------ metrics
def symmetry(p: Products) -> Tensor:
    """``<M, M^T>_F / ||M||_F^2`` in ``[-1, 1]``: +1 symmetric, -1 skew, ~0 random."""
    ratio = (p.trace_mm / torch.where(p.valid, p.frob_sq, 1.0)).clamp(-1.0, 1.0)
    return _undefined_as_nan(p, ratio)


def directionality(p: Products) -> Tensor:
    """``(R - C) / (R + C)`` from the row/column norm excesses over ``mean + num_std * std``."""
    rows = p.row_norms.to(torch.float64)
    cols = p.col_norms.to(torch.float64)
    return _undefined_as_nan(p, _directionality_batch(rows, cols, p.num_std, math.sqrt(p.eps)))


#: name -> function of :class:`Products` returning ``(n, G)``; order = display order
METRICS: dict[str, Callable[[Products], Tensor]] = {
    "symmetry": symmetry,
    "directionality": directionality,
}

#: what every path computes unless told otherwise
DEFAULT_METRICS: tuple[str, ...] = ("symmetry", "directionality")


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


def _metric_table(p: Products, metrics: tuple[str, ...]) -> Tensor:
    return torch.stack([METRICS[m](p).reshape(-1).to(torch.float64) for m in metrics])


def score_factors(
    query: Tensor,
    key: Tensor,
    metrics: Sequence[str] | None = None,
    *,
    per_head: bool = False,
    num_std: float = 2.0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Metrics of ``M = sum_h Q_h^T K_{g(h)}`` (and of every ``M_h``), as a device tensor.

    ``query``: ``(num_heads, head_dim, d)``, ``key``: ``(num_kv_heads, head_dim, d)``.
    Returns float64 ``(len(metrics), 1 + num_heads * per_head)`` on the factors' device:
    column 0 the layer matrix, then one column per head. Grouped query heads are summed
    before the layer product (``M = sum_g (sum_{h in g} Q_h)^T K_g``), so a grouped-query
    layer costs ``num_kv_heads`` heads. Computed in ``dtype`` under ``no_grad``; no host sync.

    Example:
        >>> q = torch.randn(4, 8, 32)
        >>> score_factors(q, q, ("symmetry",), per_head=True)  # W_q = W_k: all symmetric
        tensor([[1., 1., 1., 1., 1.]], dtype=torch.float64)
    """
    num_heads, num_kv, head_dim, d = _check_factors(query, key)
    num_std = _check_num_std(num_std)
    names = check_metrics(metrics)
    group = num_heads // num_kv
    with torch.no_grad():
        q = query.detach().to(dtype)
        k = key.detach().to(dtype)
        q_grouped = q.reshape(num_kv, group, head_dim, d).sum(1) if group > 1 else q
        layer = Products(q_grouped.reshape(1, 1, num_kv * head_dim, d), k.reshape(1, num_kv * head_dim, d),
                         num_std, dtype)
        columns = [_metric_table(layer, names)]
        if per_head:
            heads = Products(q.reshape(num_kv, group, head_dim, d), k, num_std, dtype)
            columns.append(_metric_table(heads, names))
        return torch.cat(columns, 1)


# ------------------------------------------------------------------------------------ tables
def table_entries(metrics: Sequence[str], table: Any) -> Iterator[tuple[int | None, str, float]]:
    """``(head, metric, value)`` of a host table ``(len(metrics), 1 + H)``; ``head`` ``None`` = layer."""
    for i, metric in enumerate(metrics):
        for col in range(len(table[i])):
            yield (None if col == 0 else col - 1), metric, float(table[i][col])


def table_rows(layer: Any, metrics: Sequence[str], table: Any) -> list[Row]:
    """Rows ``{group, layer, name, head, <metric>: value, ...}``: the layer row, then one per head."""
    base = {"group": layer.group, "layer": layer.layer, "name": layer.name}
    rows: dict[int | None, Row] = {}
    for head, metric, value in table_entries(metrics, table):
        rows.setdefault(head, {**base, "head": head})[metric] = value
    return list(rows.values())
