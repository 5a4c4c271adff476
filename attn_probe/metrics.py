"""The one scoring core: a layer's factors -> a ``(metrics, 1 + H)`` tensor on the weights' device.

Every path that scores weights goes through :func:`score_factors`: the live probe (through
its pairs, :mod:`attn_probe.pairs`), :func:`attn_probe.score_model`, checkpoint scoring and
the distributed path. So on the same weights, device and dtype they give the same numbers.

For factors ``A_h, B_g`` (per-head ``(head_dim, d)`` slices; query head ``h`` reads key head
``g(h) = h // (H / H_kv)``) the scored matrices are ``M_h = A_h^T B_{g(h)}`` and the layer
matrix ``M = sum_h M_h``. Column 0 of the result is ``M``, column ``1 + h`` is ``M_h``.

**Adding a metric** touches this module only: write a function ``(products) -> (n, G)``
tensor and add it to :data:`METRICS` (and to :data:`MAGNITUDES` if it is an unbounded
magnitude rather than a score in ``[-1, 1]``: TensorBoard then also gets its across-layer
``max`` and plots draw it on a log axis). It can use the shared quantities of :class:`Products`
(computed lazily, once per batch, from the factors without forming ``d x d`` when they are
thin) or add a new cached property there. The metric name is the JSONL ``metric`` field,
the TensorBoard tag segment and the row key, unchanged everywhere.

No host transfer happens here: results stay on the factors' device until a caller moves
many layers' tables to the host in one transfer. The norm metrics call
``torch.linalg.eigh``/``eigvalsh``, whose status check reads the solver's error flag on the
host, so on CUDA each call is expected to wait for the device (from the PyTorch sources; not
measured on a GPU here); the two scores make no such call.
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
    "MAGNITUDES",
    "is_magnitude",
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
    share one key-side factor). Both are rescaled by their largest entry first, which keeps
    squares and Gram products inside the dtype's range; the scores are scale-invariant, and
    the norms multiply the scale back in float64 (:attr:`scale`). With ``r`` small against
    ``d`` (:func:`attn_probe.scores.gram_is_cheaper`) everything comes from the ``r x r``
    Gram matrices ``G_A = A A^T``, ``G_B = B B^T``:

    * ``||M||_F^2 = tr(G_A G_B)``, ``<M, M^T>_F = tr((B A^T)^2)``;
    * row norms ``r_i^2 = diag(A^T G_B A)``, column norms ``c_j^2 = diag(B^T G_A B)``;
    * ``sigma_max(M)^2 = lambda_max(F^T G_B F)`` with ``G_A = F F^T`` (``r x r``);

    otherwise ``M`` is formed explicitly. ``parts`` (a callable) gives the products of the
    unsummed heads whose sum this layer matrix is, for metrics defined per head (``qk_bound``).
    """

    def __init__(self, a: Tensor, b: Tensor, num_std: float, dtype: torch.dtype,
                 parts: Callable[[], Products] | None = None) -> None:
        self.a, scale_a = _rescaled(a)
        self.b, scale_b = _rescaled(b)
        #: the largest entry of each factor, float64: ``M = scale_a * scale_b * (a^T b)``
        self.scale_a = scale_a  # (n, G)
        self.scale_b = scale_b[:, None]  # (n, 1)
        self.num_std = num_std
        self.eps = torch.finfo(dtype).eps
        n, G, r, d = a.shape
        self.shape = (n, G)
        self.explicit = not gram_is_cheaper(r, d)
        self._parts = parts

    @property
    def scale(self) -> Tensor:
        """Factor that turns a norm of the rescaled ``M`` into one of the true ``M``, float64 ``(n, G)``."""
        return self.scale_a * self.scale_b

    @cached_property
    def parts(self) -> Products | None:
        """Products of the per-head matrices summed into this one (``None`` for heads)."""
        return self._parts() if self._parts is not None else None

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

    @cached_property
    def sigma_max_sq(self) -> Tensor:
        """``sigma_max(M)^2`` of the rescaled ``M``, ``(n, G)`` in the compute dtype; NaN if not finite.

        The largest eigenvalue of a symmetric matrix with the same non-zero spectrum as
        ``M M^T``: ``F^T G_B F`` (``r x r``, ``G_A = F F^T`` from ``eigh(G_A)``) when
        ``r < d``, else ``M^T M`` (``d x d``, ``M`` explicit). Exact (LAPACK/cuSOLVER), no
        iteration, nothing carried between calls.
        """
        r, d = self.a.shape[-2:]
        if r < d:
            s, u = _eigh(self.gram_a)
            f = u * s.clamp_min(0).sqrt()[..., None, :]  # G_A = F F^T
            c = f.mT @ self.gram_b[:, None] @ f
        else:
            m = self.matrix
            c = m.mT @ m
        return _lambda_max(c)

    @cached_property
    def factor_sigma_max(self) -> tuple[Tensor, Tensor]:
        """``sigma_max(A)`` ``(n, G)`` and ``sigma_max(B)`` ``(n, 1)``, true scale, float64."""
        return (_lambda_max(_small_gram(self.a, self.gram_a)).double().sqrt() * self.scale_a,
                _lambda_max(_small_gram(self.b, self.gram_b)).double().sqrt()[:, None] * self.scale_b)


def _rescaled(t: Tensor) -> tuple[Tensor, Tensor]:
    """Each matrix ``t[..., :, :]`` divided by its largest entry, and that entry (float64).

    A non-finite entry makes its whole matrix non-finite (and its scale inf or NaN), so it
    is reported as undefined; a zero matrix keeps scale 0.
    """
    amax = t.abs().amax((-1, -2), keepdim=True)
    scaled = t * torch.where(amax > 0, amax.reciprocal(), torch.ones_like(amax))
    return scaled, amax[..., 0, 0].to(torch.float64)


def _small_gram(x: Tensor, gram: Tensor) -> Tensor:
    """The smaller of ``x x^T`` (``gram``, computed lazily) and ``x^T x``: same non-zero spectrum."""
    r, d = x.shape[-2:]
    return x.mT @ x if d < r else gram


def _finite_or_zero(c: Tensor) -> tuple[Tensor, Tensor]:
    finite = torch.isfinite(c).all(-1).all(-1)
    return torch.where(finite[..., None, None], c, 0.0), finite


def _eigh(c: Tensor) -> tuple[Tensor, Tensor]:
    """``eigh`` of symmetric ``c``; a non-finite matrix gives NaN eigenvalues (LAPACK would fail)."""
    c0, finite = _finite_or_zero(c)
    s, u = torch.linalg.eigh(c0)
    return torch.where(finite[..., None], s, float("nan")), u


def _lambda_max(c: Tensor) -> Tensor:
    """Largest eigenvalue (clamped at 0) of each symmetric PSD ``c[..., :, :]``; NaN if not finite."""
    c0, finite = _finite_or_zero(c)
    lam = torch.linalg.eigvalsh((c0 + c0.mT) * 0.5)[..., -1].clamp_min(0)
    return torch.where(finite, lam, float("nan"))


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
    if heads is not None:  # a layer: max over the unsummed heads
        return qk_bound(heads).amax().reshape(1, 1).expand(p.shape)
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


def is_magnitude(metric: str) -> bool:
    """Whether ``metric`` (possibly with a pair prefix such as ``ov_``) is one of :data:`MAGNITUDES`."""
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
        heads = _Lazy(lambda: Products(q.reshape(num_kv, group, head_dim, d), k, num_std, dtype))
        layer = Products(q_grouped.reshape(1, 1, num_kv * head_dim, d), k.reshape(1, num_kv * head_dim, d),
                         num_std, dtype, parts=heads.get)
        columns = [_metric_table(layer, names)]
        if per_head:
            columns.append(_metric_table(heads.get(), names))
        return torch.cat(columns, 1)


class _Lazy:
    """A value built once, on first use (shared by the layer's ``parts`` and the head columns)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make, self._value = make, None

    def get(self) -> Any:
        if self._value is None:
            self._value = self._make()
        return self._value


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
