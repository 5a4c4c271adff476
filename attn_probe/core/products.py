"""Factors in, shared quantities out: validation of factors and options, power-of-two rescaling, and
:class:`Products` (Frobenius norms, inner products, row/column norms, largest singular values of
``M = A^T B`` from the factors, without forming ``d x d`` when they are thin)."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch

from . import spectra as solvers
from .algorithm import gpu_algorithm, gram_is_cheaper, lanczos_threshold
from .spectra import Spectra

Tensor = torch.Tensor
Row = dict[str, Any]

# ------------------------------------------------------------------------------ validation
def check_num_std(num_std: float) -> float:
    num_std = float(num_std)
    if not math.isfinite(num_std):
        raise ValueError(f"num_std must be finite, got {num_std}")
    return num_std



def check_factors(query: Tensor, key: Tensor) -> tuple[int, int, int, int]:
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



def _block_gram(x: Tensor, block: int = 256) -> Tensor:
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

# ------------------------------------------------------------------------------- products
class Products:
    """Shared quantities of a batch of matrices ``M_{n,j} = A_{n,j}^T B_n``, computed on demand.

    ``a``: ``(n, G, r, d)``, ``b``: ``(n, r, d)`` (the ``G`` query-side factors of a group
    share one key-side factor). Both are divided by a power of two near their largest entry
    (exact, also in bf16), which keeps squares and Gram products inside the dtype's range;
    the scores are scale-invariant, and the norms multiply the scale back in float64
    (:attr:`scale`). :func:`score_factor_stack` passes factors it scaled itself
    (``scale_a``, ``scale_b``: one power of two per layer) and a :class:`Spectra` shared by
    the layer and head products. With ``r`` small against ``d``
    (:func:`attn_probe.core.algorithm.gram_is_cheaper`) everything comes from the ``r x r`` Gram
    matrices ``G_A = A A^T``, ``G_B = B B^T``:

    * ``||M||_F^2 = tr(G_A G_B)``, ``<M, M^T>_F = tr((B A^T)^2)``;
    * row norms ``r_i^2 = diag(A^T G_B A)``, column norms ``c_j^2 = diag(B^T G_A B)``;
    * ``sigma_max(M)^2 = lambda_max(G_B G_A)`` (``r x r``; on the CPU algorithm
      ``lambda_max(F^T G_B F)`` with ``G_A = F F^T``);

    otherwise ``M`` is formed explicitly. ``low`` (bf16/fp16 copies of ``a``, ``b`` or
    ``None``s) enter the Gram and cross products with float32 output on CUDA.
    ``parts`` (a callable) gives the products of the unsummed heads whose sum this layer matrix
    is, for metrics defined per head (``qk_bound``).
    """

    def __init__(self, a: Tensor, b: Tensor, num_std: float, dtype: torch.dtype,
                 parts: Callable[[], Products] | None = None, *, scale_a: Tensor | None = None,
                 scale_b: Tensor | None = None, spectra: Spectra | None = None,
                 low: tuple[Tensor | None, Tensor | None] = (None, None)) -> None:
        if scale_a is None or scale_b is None:
            a, scale_a = rescaled(a, 2)
            b, scale_b = rescaled(b, 2)
            scale_b = scale_b[:, None]
        self.a, self.b = a, b
        #: the power-of-two scale of each factor, float64: ``M = scale_a * scale_b * (a^T b)``
        self.scale_a = scale_a  # (n, G)
        self.scale_b = scale_b  # (n, 1)
        self.low_a, self.low_b = low
        self.num_std = num_std
        self.eps = torch.finfo(dtype).eps
        n, G, r, d = a.shape
        self.shape = (n, G)
        self.explicit = not gram_is_cheaper(r, d)
        self.squaring = gpu_algorithm(a.device)
        self.spectra = spectra if spectra is not None else Spectra(self.squaring)
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
        return self._gram(self.a, self.low_a)  # (n, G, r, r)

    @cached_property
    def gram_b(self) -> Tensor:
        return self._gram(self.b, self.low_b)  # (n, r, r)

    def _gram(self, x: Tensor, low: Tensor | None) -> Tensor:
        if low is not None:
            return _matmul_out(low, low.mT, x.dtype)
        return x @ x.mT if self.squaring else _block_gram(x)

    @cached_property
    def matrix(self) -> Tensor:
        """``M`` formed explicitly, ``(n, G, d, d)`` (only on the explicit path)."""
        return self.a.mT @ self.b[:, None]

    # -- shared quantities, each (n, G) or (n, G, d) -------------------------------------------
    @cached_property
    def frob_sq(self) -> Tensor:
        """``||M||_F^2`` (non-finite input propagates)."""
        if self.explicit:  # a reduction without a d x d temporary
            return torch.linalg.vector_norm(self.matrix, dim=(-2, -1)).square()
        return (self.gram_a * self.gram_b[:, None]).sum((-1, -2))

    @cached_property
    def trace_mm(self) -> Tensor:
        """``<M, M^T>_F = tr(M M)``."""
        if self.explicit:
            m = self.matrix
            return (m * m.mT).sum((-1, -2))
        n, G, r, d = self.a.shape
        if self.low_a is not None and self.low_b is not None:
            cross = _matmul_out(self.low_b, self.low_a.reshape(n, G * r, d).mT, self.a.dtype)
        else:
            cross = self.b @ self.a.reshape(n, G * r, d).mT
        cross = cross.reshape(n, r, G, r).transpose(1, 2)  # B A_j^T
        return (cross * cross.mT).sum((-1, -2))

    @cached_property
    def factor_sq(self) -> tuple[Tensor, Tensor]:
        """``||A||_F^2`` ``(n, G)`` and ``||B||_F^2`` ``(n, 1)``."""
        if self.explicit:
            norm = torch.linalg.vector_norm
            return norm(self.a, dim=(-2, -1)).square(), norm(self.b, dim=(-2, -1)).square()[:, None]
        return solvers.trace(self.gram_a), solvers.trace(self.gram_b)[:, None]

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

    # -- largest eigenvalues, through the shared Spectra -----------------------------------------
    def request(self, *kinds: str) -> None:
        """Register this batch's eigenvalue problems (``"m"``: ``sigma_max(M)``, ``"factors"``:
        ``sigma_max`` of ``A`` and ``B``) with :attr:`spectra`, to be solved with the others."""
        for kind in kinds:
            if kind == "m":
                self.spectra.add((id(self), "m"), self._m_problem, self._m_host)
            else:
                self.spectra.add((id(self), "a"), lambda: _small_gram(self.a, lambda: self.gram_a),
                                 lambda: solvers.lambda_max(_small_gram(self.a, lambda: self.gram_a)))
                self.spectra.add((id(self), "b"), lambda: _small_gram(self.b, lambda: self.gram_b),
                                 lambda: solvers.lambda_max(_small_gram(self.b, lambda: self.gram_b)))

    @cached_property
    def sigma_max_sq(self) -> Tensor:
        """``sigma_max(M)^2`` of the rescaled ``M``, ``(n, G)``; NaN if not finite.

        The largest eigenvalue of a matrix with the same non-zero spectrum as ``M M^T``:
        ``G_B G_A`` (``r x r``) on the Gram path, ``M^T M`` (``d x d``) on the explicit one.
        GPU algorithm: :func:`lambda_max_by_squaring`, batched with the stack's other problems
        (:class:`Spectra`). CPU algorithm: problems of size ``m = min(r, d)`` up to
        :func:`lanczos_threshold` exactly (``eigvalsh`` of ``F^T G_B F``, ``G_A = F F^T``
        from ``eigh(G_A)``, or of ``M^T M``); larger ones by :func:`lanczos_lambda_max` on
        the operator ``v -> A^T G_B A v`` or ``v -> M^T M v``: a fixed number of steps from a
        fixed start vector, nothing carried between calls.
        """
        self.request("m")
        return self.spectra.get((id(self), "m"))

    def _m_problem(self) -> Tensor:
        if self.explicit:
            m = self.matrix
            return m.mT @ m
        return self.gram_b[:, None] @ self.gram_a

    def _m_host(self) -> Tensor:
        r, d = self.a.shape[-2:]
        if min(r, d) > lanczos_threshold(self.a.device):
            if self.explicit:
                m = self.matrix
                return solvers.lanczos_lambda_max(lambda v: solvers.mtv(m, solvers.mv(m, v)), (*self.shape, d), m)
            a, gb = self.a, self.gram_b[:, None]
            return solvers.lanczos_lambda_max(lambda v: solvers.mtv(a, solvers.mv(gb, solvers.mv(a, v))), (*self.shape, d), a,
                                      steps=solvers.lanczos_steps(r))  # rank <= r: the Krylov space too
        if r < d:
            s, u = solvers.eigh(self.gram_a)
            f = u * s.clamp_min(0).sqrt()[..., None, :]  # G_A = F F^T
            c = f.mT @ self.gram_b[:, None] @ f
        else:
            m = self.matrix
            c = m.mT @ m
        return solvers.lambda_max(c)

    @cached_property
    def factor_sigma_max(self) -> tuple[Tensor, Tensor]:
        """``sigma_max(A)`` ``(n, G)`` and ``sigma_max(B)`` ``(n, 1)``, true scale, float64."""
        self.request("factors")
        la, lb = self.spectra.get((id(self), "a")), self.spectra.get((id(self), "b"))
        return (la.double().clamp_min(0).sqrt() * self.scale_a,
                lb.double().clamp_min(0).sqrt()[:, None] * self.scale_b)


def _matmul_out(x: Tensor, y: Tensor, dtype: torch.dtype) -> Tensor:
    """``x @ y`` of low-precision stacks with ``dtype`` output (``torch.bmm(..., out_dtype=)``)."""
    lead = torch.broadcast_shapes(x.shape[:-2], y.shape[:-2])
    x3 = x.expand(*lead, *x.shape[-2:]).reshape(-1, *x.shape[-2:])
    y3 = y.expand(*lead, *y.shape[-2:]).reshape(-1, *y.shape[-2:])
    return torch.bmm(x3, y3, out_dtype=dtype).reshape(*lead, x.shape[-2], y.shape[-1])


def pow2_scale(t: Tensor, dims: int) -> Tensor:
    """A power of two near the largest ``|entry|`` of each trailing ``dims``-dimensional block of ``t``.

    ``2^floor(log2 max|t|)`` (the largest entry scaled into ``[1, 2)``; dividing by it is exact
    in every binary float type); ``tiny`` for a zero block, 1 for a non-finite one (its
    non-finite entries then give NaN downstream, its finite ones stay in range). Float32 for
    half-precision input, else ``t``'s dtype.
    """
    block = tuple(range(-dims, 0))
    amax = torch.maximum(t.amax(block), -t.amin(block))  # no |t| copy (NaN propagates; aminmax is slower)
    if amax.dtype in (torch.float16, torch.bfloat16):
        amax = amax.float()
    return torch.exp2(torch.floor(torch.log2(amax.clamp_min(torch.finfo(amax.dtype).tiny)))).nan_to_num(1.0, 1.0, 1.0)


def rescaled(t: Tensor, dims: int = 2) -> tuple[Tensor, Tensor]:
    """Each trailing ``dims``-dimensional block of ``t`` divided by :func:`pow2_scale`, and that scale (float64)."""
    scale = pow2_scale(t, dims)
    shaped = scale.reshape(*scale.shape, *([1] * dims))
    return t / shaped.to(t.dtype), scale.to(torch.float64)


def _small_gram(x: Tensor, gram: Callable[[], Tensor]) -> Tensor:
    """The smaller of ``x x^T`` (``gram()``, computed lazily) and ``x^T x``: same non-zero spectrum."""
    r, d = x.shape[-2:]
    return x.mT @ x if d < r else gram()
