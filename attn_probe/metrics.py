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
many layers' tables to the host in one transfer. :func:`score_factor_stack` scores many layers
of one shape at once (the live probe's path). ``sigma_max`` is exact for problems up to
:func:`lanczos_threshold` (a dense eigensolver on CPU, repeated squaring elsewhere) and comes
from a fixed-step Lanczos iteration above it.
Off CPU nothing calls ``eigh``/``eigvalsh`` (they read their error flag on the host, which
waits for the device): largest eigenvalues come from repeated squaring
(:func:`_lambda_max_by_squaring`), matrix products only. The one exception is the first use
of a Lanczos size, which copies its fixed start vector to the device (cached afterwards).
"""

from __future__ import annotations

import itertools
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
    "score_factor_stack",
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

        The largest eigenvalue of a symmetric PSD matrix with the same non-zero spectrum as
        ``M M^T``. Problems of size ``m = min(r, d)`` up to :func:`lanczos_threshold` are
        solved exactly: on CPU ``F^T G_B F`` (``r x r``, ``G_A = F F^T`` from ``eigh(G_A)``)
        when ``r < d``, else ``M^T M`` (``d x d``); elsewhere ``G_B G_A`` or ``M^T M`` by
        repeated squaring. Larger ones use :func:`lanczos_lambda_max`
        on the operator ``v -> A^T G_B A v`` (Gram path) or ``v -> M^T M v`` (``M`` formed):
        a fixed number of steps from a fixed start vector, nothing carried between calls.
        """
        r, d = self.a.shape[-2:]
        if min(r, d) > lanczos_threshold(self.a.device):
            if self.explicit:
                m = self.matrix
                return lanczos_lambda_max(lambda v: _mtv(m, _mv(m, v)), (*self.shape, d), m)
            a, gb = self.a, self.gram_b[:, None]
            return lanczos_lambda_max(lambda v: _mtv(a, _mv(gb, _mv(a, v))), (*self.shape, d), a,
                                      steps=lanczos_steps(r))  # rank <= r: the Krylov space too
        if r < d and not host_eigensolver(self.a.device):  # no eigh: it would wait for the device
            gb_ga = self.gram_b[:, None] @ self.gram_a  # same spectrum as F^T G_B F
            c0, finite = _finite_or_zero(gb_ga)
            return torch.where(finite, _lambda_max_by_squaring(c0).to(c0.dtype).clamp_min(0), float("nan"))
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
    """Largest eigenvalue (clamped at 0) of each symmetric PSD ``c[..., :, :]``; NaN if not finite.

    ``eigvalsh`` on CPU; elsewhere :func:`_lambda_max_by_squaring`, which needs no host
    synchronisation (a dense eigensolver checks its error flag on the host).
    """
    c0, finite = _finite_or_zero(c)
    c0 = (c0 + c0.mT) * 0.5
    if host_eigensolver(c.device):
        lam = torch.linalg.eigvalsh(c0)[..., -1]
    else:
        lam = _lambda_max_by_squaring(c0).to(c.dtype)
    return torch.where(finite, lam.clamp_min(0), float("nan"))


#: squarings in :func:`_lambda_max_by_squaring`: relative error at most about ``ln(n) / 2^s``
SQUARINGS = 32


def _lambda_max_by_squaring(c: Tensor, squarings: int = SQUARINGS) -> Tensor:
    """Largest eigenvalue of PSD ``c`` from ``P = c^(2^s)``: ``tr(c P) / tr(P)``, float64.

    ``c`` may also be a product of two PSD matrices (``G_B G_A``: real, non-negative
    eigenvalues, diagonalisable), whose traces behave alike.

    With eigenvalues ``l_i`` the ratio is ``sum l_i w_i / sum w_i``, ``w_i = (l_i / l_1)^(2^s)``,
    so it lies within about ``l_1 ln(n) / 2^s`` below ``l_1`` (``n`` the size) whatever the gap. Each square is divided
    by its trace (no overflow); only matrix products, so nothing waits for the device.
    """
    p = c.to(torch.float64)
    p = p / _trace(p).clamp_min(torch.finfo(torch.float64).tiny)[..., None, None]
    for _ in range(squarings):
        p = p @ p
        p = p / _trace(p).clamp_min(torch.finfo(torch.float64).tiny)[..., None, None]
    top = _trace(c.to(torch.float64) @ p)
    return torch.where(_trace(p) > 0, top / _trace(p).clamp_min(torch.finfo(torch.float64).tiny), 0.0)


def _trace(x: Tensor) -> Tensor:
    return x.diagonal(dim1=-2, dim2=-1).sum(-1)


#: Lanczos steps for problems up to 2048 (more, as ``m^(1/3)``, beyond: the relative gap at
#: the top of a random-like spectrum shrinks as ``m^(-2/3)``); see docs/scores.md
LANCZOS_STEPS = 48


def host_eigensolver(device: torch.device) -> bool:
    """Whether dense eigensolvers (``eigh``/``eigvalsh``) are used on ``device``: on CPU only.

    Elsewhere they check their error flag on the host, a synchronisation the core avoids
    (:func:`_lambda_max_by_squaring` instead).
    """
    return device.type == "cpu"


def lanczos_threshold(device: torch.device) -> int:
    """Largest problem size solved exactly on ``device``; larger ones use Lanczos.

    Exactly: ``eigvalsh`` on CPU, repeated squaring elsewhere. On CPU LAPACK's ``eigvalsh`` is cheaper up to a few hundred (measured, docs/performance.md);
    on other devices a dense eigensolver is slow for small matrices and waits for the device.
    """
    return 384 if host_eigensolver(device) else 64


def lanczos_steps(m: int) -> int:
    """Lanczos steps for an ``m x m`` problem: :data:`LANCZOS_STEPS`, growing as ``m^(1/3)`` past 2048."""
    return min(m, max(LANCZOS_STEPS, math.ceil(LANCZOS_STEPS * (m / 2048) ** (1 / 3))))


_START: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}


def _start_vector(m: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The fixed, seeded unit start vector of length ``m`` (the same on every call and rank)."""
    key = (m, dtype, device)
    if key not in _START:
        gen = torch.Generator().manual_seed(20250214)
        v = torch.randn(m, generator=gen, dtype=torch.float64)
        _START[key] = (v / v.norm()).to(device=device, dtype=dtype)
    return _START[key]


#: on CPU, matrices with at least this many entries are multiplied one by one (BLAS ``mv``);
#: smaller ones by a fused multiply-sum over the whole batch (batched ``bmm`` with one column
#: is slow on CPU; measured in docs/performance.md)
CPU_MV_ENTRIES = 16384


def _mv(x: Tensor, v: Tensor) -> Tensor:
    """``x @ v`` for stacks ``x (..., p, q)``, ``v (..., q)`` (leading dims broadcast, same count)."""
    if x.device.type != "cpu":
        return (x @ v[..., None])[..., 0]
    if x.shape[-2] * x.shape[-1] < CPU_MV_ENTRIES:
        return (x * v[..., None, :]).sum(-1)
    return _each(x, v, lambda m, u: torch.mv(m, u), x.shape[-2])


def _mtv(x: Tensor, v: Tensor) -> Tensor:
    """``x^T @ v`` for stacks ``x (..., p, q)``, ``v (..., p)`` (leading dims broadcast, same count)."""
    if x.device.type != "cpu":
        return (x.mT @ v[..., None])[..., 0]
    if x.shape[-2] * x.shape[-1] < CPU_MV_ENTRIES:
        return (x * v[..., :, None]).sum(-2)
    return _each(x, v, lambda m, u: torch.mv(m.T, u), x.shape[-1])


def _each(x: Tensor, v: Tensor, op: Callable[[Tensor, Tensor], Tensor], size: int) -> Tensor:
    """``op`` on every matrix of ``x`` with its vector of ``v``, broadcasting size-1 leading dims."""
    xb, vb = x.shape[:-2], v.shape[:-1]
    batch = torch.broadcast_shapes(xb, vb)
    out = v.new_empty((*batch, size))
    for idx in itertools.product(*(range(n) for n in batch)):
        xi = x[tuple(i if n > 1 else 0 for i, n in zip(idx, xb, strict=True))]
        vi = v[tuple(i if n > 1 else 0 for i, n in zip(idx, vb, strict=True))]
        out[idx] = op(xi, vi)
    return out


def lanczos_lambda_max(op: Callable[[Tensor], Tensor], shape: tuple[int, ...], like: Tensor,
                       steps: int | None = None) -> Tensor:
    """Largest eigenvalue of each symmetric PSD operator in a batch, ``shape[:-1]``, by Lanczos.

    ``op`` maps vectors ``(*shape)`` to ``(*shape)``. A fixed number of steps
    (:func:`lanczos_steps`) from a fixed start vector, with full reorthogonalisation (twice),
    then the largest Ritz value of ``H = V^T op(V)`` (``steps x steps``). A Krylov space that
    closes early (rank-deficient operator) gives zero vectors, which add zero Ritz values.
    Non-finite operators give NaN. No host synchronisation except the final small
    ``eigvalsh`` (replaced by :func:`_lambda_max_by_squaring` off CPU).
    """
    *batch, m = shape
    k = lanczos_steps(m) if steps is None else min(steps, m)
    dtype, device = like.dtype, like.device
    basis = like.new_zeros((*batch, k, m))
    images = like.new_zeros((*batch, k, m))
    v = _start_vector(m, dtype, device).expand(*batch, m)
    first = None
    for j in range(k):
        basis[..., j, :] = v
        w = op(v)
        images[..., j, :] = w
        if first is None:
            first = w.norm(dim=-1, keepdim=True)  # |op(v0)|: the scale breakdown is judged against
        seen = basis[..., : j + 1, :]
        for _ in range(2):  # "twice is enough" (Gram-Schmidt)
            w = w - ((seen * w[..., None, :]).sum(-1)[..., None] * seen).sum(-2)
        norm = w.norm(dim=-1, keepdim=True)
        keep = norm > 1e3 * torch.finfo(dtype).eps * first
        v = torch.where(keep, w / torch.where(keep, norm, 1.0), 0.0)
    h = basis @ images.mT
    return _lambda_max(h)


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


def _metric_table(p: Products, metrics: tuple[str, ...], layers: int) -> Tensor:
    """``(layers, len(metrics), columns)`` of the metrics of ``p`` (its ``(n, G)`` split per layer)."""
    return torch.stack([METRICS[m](p).reshape(layers, -1).to(torch.float64) for m in metrics], 1)


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
    One layer of :func:`score_factor_stack`.

    Example:
        >>> q = torch.randn(4, 8, 32)
        >>> score_factors(q, q, ("symmetry",), per_head=True)  # W_q = W_k: all symmetric
        tensor([[1., 1., 1., 1., 1.]], dtype=torch.float64)
    """
    _check_factors(query, key)
    return score_factor_stack(query[None], key[None], metrics, per_head=per_head, num_std=num_std,
                              dtype=dtype)[0]


def score_factor_stack(
    queries: Tensor,
    keys: Tensor,
    metrics: Sequence[str] | None = None,
    *,
    per_head: bool = False,
    num_std: float = 2.0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """:func:`score_factors` of ``L`` layers of one shape at once: ``(L, len(metrics), 1 + H * per_head)``.

    ``queries``: ``(L, num_heads, head_dim, d)``, ``keys``: ``(L, num_kv_heads, head_dim, d)``.
    Each layer's values equal its :func:`score_factors` up to rounding (the same operations,
    batched); the batch saves the per-layer launches and Python work of small layers.
    """
    if not isinstance(queries, Tensor) or not isinstance(keys, Tensor) or queries.ndim != 4 or keys.ndim != 4:
        raise ValueError("stacked factors must be shaped (layers, heads, head_dim, d)")
    if queries.shape[0] != keys.shape[0] or queries.shape[0] == 0:
        raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)}: need the same, "
                         "non-zero number of layers")
    num_heads, num_kv, head_dim, d = _check_factors(queries[0], keys[0])
    num_std = _check_num_std(num_std)
    names = check_metrics(metrics)
    n_layers, group = queries.shape[0], num_heads // num_kv
    with torch.no_grad():
        # contiguous: a strided view (fused projections) and a stacked copy then round alike
        q = queries.detach().to(dtype).contiguous()
        k = keys.detach().to(dtype).contiguous()
        q_grouped = q.reshape(n_layers, num_kv, group, head_dim, d).sum(2) if group > 1 else q
        heads = _Lazy(lambda: Products(q.reshape(n_layers * num_kv, group, head_dim, d),
                                       k.reshape(n_layers * num_kv, head_dim, d), num_std, dtype))
        layer = Products(q_grouped.reshape(n_layers, 1, num_kv * head_dim, d),
                         k.reshape(n_layers, num_kv * head_dim, d), num_std, dtype, parts=heads.get)
        columns = [_metric_table(layer, names, n_layers)]
        if per_head:
            columns.append(_metric_table(heads.get(), names, n_layers))
        return torch.cat(columns, 2)


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
