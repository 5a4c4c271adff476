"""Largest eigenvalues: the batched repeated-squaring chain (GPU algorithm), :class:`Spectra` (every
problem of a stack solved together), LAPACK with non-finite guards and a fixed-step Lanczos (CPU algorithm)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch

from .algorithm import host_eigensolver

Tensor = torch.Tensor
Row = dict[str, Any]

# --------------------------------------------------------------------- largest eigenvalues
#: squarings of :func:`lambda_max_by_squaring`: ``lambda_max`` is underestimated by at most
#: about ``ln(m) / 2^20`` relative (< 1e-5 for ``m`` up to 36,000), ``sigma_max`` by half that
SQUARINGS = 20

#: the chain's dtype (float64: its rounding stays far below the bound above; as fast as float32
#: on an H100, docs/performance.md)
CHAIN_DTYPE = torch.float64


def renormalise_every(m: int, dtype: torch.dtype) -> int:
    """Squarings between two renormalisations of an ``m x m`` chain in ``dtype``.

    After a renormalisation (trace 1) the largest eigenvalue is at least ``1/m``; ``k``
    squarings take it to at least ``m^(-2^k)``, which must stay a normal number:
    ``2^k log10(m) <= 0.9 * |log10(tiny)|``.
    """
    digits = 0.9 * -math.log10(torch.finfo(dtype).tiny)
    k = int(math.floor(math.log2(digits / max(math.log10(max(m, 2)), 1e-3))))
    return max(1, min(k, SQUARINGS))


def lambda_max_by_squaring(c: Tensor, squarings: int = SQUARINGS, dtype: torch.dtype = CHAIN_DTYPE) -> Tensor:
    """Largest eigenvalue of each ``c[..., :, :]`` from ``P = c^(2^s)``: ``tr(c P) / tr(P)``, in ``dtype``.

    ``c`` is symmetric PSD or a product of two PSD matrices (``G_B G_A``: real non-negative
    eigenvalues, diagonalisable), ``m x m``. With eigenvalues ``l_1 >= l_i >= 0`` the ratio is
    ``sum l_i^(N+1) / sum l_i^N`` (``N = 2^s``): never above ``l_1`` and, whatever the gap,
    at most about ``l_1 ln(m) / N`` below it in exact arithmetic (so ``sigma_max = sqrt(l_1)``
    at most about ``ln(m) / 2^(s+1)`` relative). ``P`` is divided by its trace every
    :func:`renormalise_every` squarings (no overflow or underflow of the top eigenvalue), so
    a chain costs ``s`` batched matrix products and a few reductions, whatever the batch:
    no host synchronisation, no eigensolver. Zero padding adds zero eigenvalues only.
    A non-finite matrix gives NaN, a zero matrix 0.
    """
    p = c.to(dtype)
    total = p.sum((-1, -2))
    finite = (total - total) == 0  # every entry finite (see finite_or_zero): one reduction
    p = p.nan_to_num(0.0, 0.0, 0.0)
    c0 = p
    tiny = torch.finfo(dtype).tiny
    every = renormalise_every(c.shape[-1], dtype)
    p = p / trace(p).clamp_min(tiny)[..., None, None]
    for i in range(squarings):
        p = p @ p
        if (i + 1) % every == 0 and i + 1 < squarings:
            p = p / trace(p).clamp_min(tiny)[..., None, None]
    top = (c0 * p.mT).sum((-1, -2))  # tr(c P)
    lam = top / trace(p).clamp_min(tiny)  # 0 / tiny = 0 for a zero matrix
    return lam.masked_fill(~finite, math.nan)


#: the GPU algorithm pads the problems of a stack to one size (one chain) when the padded work,
#: in ``m^3`` units over the batch, stays under this many (or under twice the unpadded work):
#: then one chain of launches is cheaper than two (launch-bound sizes, docs/performance.md)
PAD_FREE_WORK = 1 << 28


class Spectra:
    """The largest-eigenvalue problems of one stack of layers, solved together on first use.

    :meth:`add` registers a problem under a key: ``matrix()`` gives a batch ``(..., m, m)`` of
    symmetric PSD matrices or products of two PSD matrices, ``host()`` its largest eigenvalues
    by the CPU algorithm. :meth:`get` solves every problem registered and not yet solved.
    With the GPU algorithm the batches are concatenated (problems of a smaller size
    zero-padded to the largest where :data:`PAD_FREE_WORK` allows) and each size solved by one
    :func:`lambda_max_by_squaring` chain: the operation count is set by the number of sizes
    (at most two: the layer's ``r`` and the head's ``head_dim``), not by layers or heads.
    """

    def __init__(self, squaring: bool) -> None:
        self.squaring = squaring
        self._pending: dict[Any, tuple[Callable[[], Tensor], Callable[[], Tensor]]] = {}
        self._done: dict[Any, Tensor] = {}

    def add(self, key: Any, matrix: Callable[[], Tensor], host: Callable[[], Tensor]) -> None:
        if key not in self._done:
            self._pending.setdefault(key, (matrix, host))

    def get(self, key: Any) -> Tensor:
        """Largest eigenvalues of problem ``key`` (shape of its batch), float64 on the GPU algorithm."""
        if key not in self._done:
            pending, self._pending = self._pending, {}
            self._done.update(self._solve_chains(pending) if self.squaring
                              else {k: host() for k, (_, host) in pending.items()})
        return self._done[key]

    @staticmethod
    def _solve_chains(pending: dict[Any, tuple[Callable[[], Tensor], Callable[[], Tensor]]]) -> dict[Any, Tensor]:
        mats = {key: matrix() for key, (matrix, _) in pending.items()}
        sizes: dict[int, int] = {}
        for c in mats.values():
            sizes[c.shape[-1]] = sizes.get(c.shape[-1], 0) + math.prod(c.shape[:-2])
        big = max(sizes)
        work = sum(n * m**3 for m, n in sizes.items())
        padded = sum(sizes.values()) * big**3
        target = {m: (big if padded <= max(2 * work, PAD_FREE_WORK) else m) for m in sizes}
        out: dict[Any, Tensor] = {}
        for size in sorted(set(target.values()), reverse=True):
            keys = [k for k, c in mats.items() if target[c.shape[-1]] == size]
            flat = [_pad_to(mats[k].reshape(-1, *mats[k].shape[-2:]), size) for k in keys]
            lam = lambda_max_by_squaring(flat[0] if len(flat) == 1 else torch.cat(flat))
            start = 0
            for k, f in zip(keys, flat, strict=True):
                out[k] = lam[start: start + f.shape[0]].reshape(mats[k].shape[:-2])
                start += f.shape[0]
        return out


def _pad_to(c: Tensor, size: int) -> Tensor:
    m = c.shape[-1]
    return c if m == size else torch.nn.functional.pad(c, (0, size - m, 0, size - m))



def finite_or_zero(c: Tensor) -> tuple[Tensor, Tensor]:
    """``c`` with non-finite entries zeroed (LAPACK fails on them), and whether each matrix was finite.

    One pass over ``c`` (``nan_to_num``) and one reduction: a matrix is finite iff its entry sum
    is (``x - x == 0`` holds for finite ``x`` only). The sum overflows only for entries near the
    dtype's maximum over ``m^2``, far outside the power-of-two rescaled products of the core.
    """
    total = c.sum((-1, -2))
    return c.nan_to_num(0.0, 0.0, 0.0), (total - total) == 0


def eigh(c: Tensor) -> tuple[Tensor, Tensor]:
    """``eigh`` of symmetric ``c``; a non-finite matrix gives NaN eigenvalues (LAPACK would fail)."""
    c0, finite = finite_or_zero(c)
    s, u = torch.linalg.eigh(c0)
    return torch.where(finite[..., None], s, float("nan")), u


def lambda_max(c: Tensor) -> Tensor:
    """Largest eigenvalue (clamped at 0) of each symmetric PSD ``c[..., :, :]``; NaN if not finite.

    ``eigvalsh`` on the CPU algorithm; else :func:`lambda_max_by_squaring`, which needs no
    host synchronisation (a dense eigensolver checks its error flag on the host).
    """
    if not host_eigensolver(c.device):
        return lambda_max_by_squaring(c).to(c.dtype).clamp_min(0)
    c0, finite = finite_or_zero(c)
    # symmetrised: eigvalsh reads one triangle, and the two triangles of a product round differently
    # (by stack size too), so without it the live probe and score_model differ at ~1e-6 in float32
    lam = torch.linalg.eigvalsh((c0 + c0.mT) * 0.5)[..., -1]
    return torch.where(finite, lam.clamp_min(0), float("nan"))


def trace(x: Tensor) -> Tensor:
    return x.diagonal(dim1=-2, dim2=-1).sum(-1)


#: Lanczos steps for problems up to 2048 (more, as ``m^(1/3)``, beyond: the relative gap at
#: the top of a random-like spectrum shrinks as ``m^(-2/3)``); see docs/scores.md
LANCZOS_STEPS = 48


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


def mv(x: Tensor, v: Tensor) -> Tensor:
    """``x @ v`` for stacks ``x (..., p, q)``, ``v (..., q)`` (leading dims broadcast, same count)."""
    if x.device.type != "cpu":
        return (x @ v[..., None])[..., 0]
    if x.shape[-2] * x.shape[-1] < CPU_MV_ENTRIES:
        return (x * v[..., None, :]).sum(-1)
    return _each(x, v, lambda m, u: torch.mv(m, u), x.shape[-2])


def mtv(x: Tensor, v: Tensor) -> Tensor:
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
    Non-finite operators give NaN. Used by the CPU algorithm only (its final small ``eigvalsh``
    waits for the device elsewhere, and the step loop is hundreds of launches).
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
    return lambda_max(h)
