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
of one shape at once (the live probe's path). The algorithm is chosen per device in one place,
:func:`gpu_algorithm`:

* **GPU algorithm** (every device but CPU; on CPU tensors under :func:`gpu_algorithm_on_cpu`
  or ``ATTN_PROBE_GPU_ALGORITHM=1``): every largest-eigenvalue problem of a stack
  (``sigma_max`` of ``M``, of the query and of the key factors, per head too) is registered
  with one :class:`Spectra` and solved by batched repeated squaring
  (:func:`lambda_max_by_squaring`, at most about ``ln(m) / 2^20`` relative below
  ``lambda_max``), one chain per problem size: a fixed number of operations per stack,
  whatever the numbers of layers and heads; matrix products only, so nothing waits for the
  device and no dense eigensolver runs.
* **CPU algorithm**: LAPACK ``eigh``/``eigvalsh`` for problems up to
  :func:`lanczos_threshold`, a fixed-step Lanczos iteration above it (faster on CPU).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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
    "factored_scores",
    "FactoredScores",
    "gpu_algorithm",
    "gpu_algorithm_on_cpu",
    "lambda_max_by_squaring",
    "Spectra",
    "table_entries",
    "table_rows",
]

Tensor = torch.Tensor
Row = dict[str, Any]


# ------------------------------------------------------------------ the algorithm per device
#: environment variable that runs the GPU algorithm on CPU tensors too (``1``), see :func:`gpu_algorithm`
GPU_ALGORITHM_ENV = "ATTN_PROBE_GPU_ALGORITHM"
_forced_gpu_algorithm = 0


def gpu_algorithm(device: torch.device) -> bool:
    """Whether the core runs the GPU algorithm on ``device``: the one place the algorithm is chosen.

    The GPU algorithm (every device but CPU): all largest-eigenvalue problems of a stack by one
    batched repeated-squaring chain per problem size (:func:`lambda_max_by_squaring`), no dense
    eigensolver and no Lanczos, stacks sized from the device's free memory
    (:func:`attn_probe.pairs.stack_budget`), bf16/fp16 factors entering Gram products as they
    are with float32 output where torch supports it (:func:`gram_out_dtype_supported`).
    The CPU algorithm: LAPACK ``eigh``/``eigvalsh`` up to :func:`lanczos_threshold`, Lanczos
    above it, one stack per shape up to :data:`attn_probe.pairs.CPU_STACK_BYTES` (docs/performance.md).

    On CPU tensors the GPU algorithm runs inside :func:`gpu_algorithm_on_cpu` or with the
    environment variable ``ATTN_PROBE_GPU_ALGORITHM=1``: the same operations (a fixed stack
    budget, :data:`attn_probe.pairs.STACK_BYTES_CAP`, and float32 copies where CUDA multiplies
    bf16 with float32 output, which has no CPU kernel), so that its operation count
    (:mod:`attn_probe.op_count`) and its numbers can be checked without a GPU.
    """
    if device.type != "cpu":
        return True
    return _forced_gpu_algorithm > 0 or os.environ.get(GPU_ALGORITHM_ENV, "") not in ("", "0")


@contextmanager
def gpu_algorithm_on_cpu() -> Iterator[None]:
    """Run the GPU algorithm on CPU tensors inside the block (process-wide; see :func:`gpu_algorithm`)."""
    global _forced_gpu_algorithm
    _forced_gpu_algorithm += 1
    try:
        yield
    finally:
        _forced_gpu_algorithm -= 1


def host_eigensolver(device: torch.device) -> bool:
    """Whether dense eigensolvers (``eigh``/``eigvalsh``) are used on ``device``: the CPU algorithm only.

    Elsewhere they check their error flag on the host, a synchronisation the core avoids, and
    are slow for small matrices (docs/performance.md): :func:`lambda_max_by_squaring` instead.
    """
    return not gpu_algorithm(device)


def lanczos_threshold(device: torch.device) -> int | float:
    """Largest problem size solved exactly on ``device``; larger ones use Lanczos (CPU algorithm only).

    On CPU LAPACK's ``eigvalsh`` is cheaper up to a few hundred (measured, docs/performance.md);
    the GPU algorithm solves every size by repeated squaring (``inf``: never Lanczos).
    """
    return 384 if host_eigensolver(device) else math.inf


_OUT_DTYPE_OK: dict[torch.device, bool] = {}


def gram_out_dtype_supported(device: torch.device) -> bool:
    """Whether ``torch.bmm(a, b, out_dtype=torch.float32)`` runs on ``device`` for bf16 ``a, b`` (tried once)."""
    if device.type == "cpu":
        return False  # no CPU kernel (torch 2.13): the GPU algorithm on CPU upcasts instead
    if device not in _OUT_DTYPE_OK:
        try:
            x = torch.ones(1, 2, 2, dtype=torch.bfloat16, device=device)
            _OUT_DTYPE_OK[device] = torch.bmm(x, x, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE_OK[device] = False
    return _OUT_DTYPE_OK[device]


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
    finite = (total - total) == 0  # every entry finite (see _finite_or_zero): one reduction
    p = p.nan_to_num(0.0, 0.0, 0.0)
    c0 = p
    tiny = torch.finfo(dtype).tiny
    every = renormalise_every(c.shape[-1], dtype)
    p = p / _trace(p).clamp_min(tiny)[..., None, None]
    for i in range(squarings):
        p = p @ p
        if (i + 1) % every == 0 and i + 1 < squarings:
            p = p / _trace(p).clamp_min(tiny)[..., None, None]
    top = (c0 * p.mT).sum((-1, -2))  # tr(c P)
    lam = top / _trace(p).clamp_min(tiny)  # 0 / tiny = 0 for a zero matrix
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
    (:func:`attn_probe.scores.gram_is_cheaper`) everything comes from the ``r x r`` Gram
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
            a, scale_a = _rescaled(a, 2)
            b, scale_b = _rescaled(b, 2)
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
        return x @ x.mT if self.squaring else _gram(x)

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
        return _trace(self.gram_a), _trace(self.gram_b)[:, None]

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
                                 lambda: _lambda_max(_small_gram(self.a, lambda: self.gram_a)))
                self.spectra.add((id(self), "b"), lambda: _small_gram(self.b, lambda: self.gram_b),
                                 lambda: _lambda_max(_small_gram(self.b, lambda: self.gram_b)))

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
                return lanczos_lambda_max(lambda v: _mtv(m, _mv(m, v)), (*self.shape, d), m)
            a, gb = self.a, self.gram_b[:, None]
            return lanczos_lambda_max(lambda v: _mtv(a, _mv(gb, _mv(a, v))), (*self.shape, d), a,
                                      steps=lanczos_steps(r))  # rank <= r: the Krylov space too
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


def _pow2_scale(t: Tensor, dims: int) -> Tensor:
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


def _rescaled(t: Tensor, dims: int = 2) -> tuple[Tensor, Tensor]:
    """Each trailing ``dims``-dimensional block of ``t`` divided by :func:`_pow2_scale`, and that scale (float64)."""
    scale = _pow2_scale(t, dims)
    shaped = scale.reshape(*scale.shape, *([1] * dims))
    return t / shaped.to(t.dtype), scale.to(torch.float64)


def _small_gram(x: Tensor, gram: Callable[[], Tensor]) -> Tensor:
    """The smaller of ``x x^T`` (``gram()``, computed lazily) and ``x^T x``: same non-zero spectrum."""
    r, d = x.shape[-2:]
    return x.mT @ x if d < r else gram()


def _finite_or_zero(c: Tensor) -> tuple[Tensor, Tensor]:
    """``c`` with non-finite entries zeroed (LAPACK fails on them), and whether each matrix was finite.

    One pass over ``c`` (``nan_to_num``) and one reduction: a matrix is finite iff its entry sum
    is (``x - x == 0`` holds for finite ``x`` only). The sum overflows only for entries near the
    dtype's maximum over ``m^2``, far outside the power-of-two rescaled products of the core.
    """
    total = c.sum((-1, -2))
    return c.nan_to_num(0.0, 0.0, 0.0), (total - total) == 0


def _eigh(c: Tensor) -> tuple[Tensor, Tensor]:
    """``eigh`` of symmetric ``c``; a non-finite matrix gives NaN eigenvalues (LAPACK would fail)."""
    c0, finite = _finite_or_zero(c)
    s, u = torch.linalg.eigh(c0)
    return torch.where(finite[..., None], s, float("nan")), u


def _lambda_max(c: Tensor) -> Tensor:
    """Largest eigenvalue (clamped at 0) of each symmetric PSD ``c[..., :, :]``; NaN if not finite.

    ``eigvalsh`` on the CPU algorithm; else :func:`lambda_max_by_squaring`, which needs no
    host synchronisation (a dense eigensolver checks its error flag on the host).
    """
    if not host_eigensolver(c.device):
        return lambda_max_by_squaring(c).to(c.dtype).clamp_min(0)
    c0, finite = _finite_or_zero(c)
    # symmetrised: eigvalsh reads one triangle, and the two triangles of a product round differently
    # (by stack size too), so without it the live probe and score_model differ at ~1e-6 in float32
    lam = torch.linalg.eigvalsh((c0 + c0.mT) * 0.5)[..., -1]
    return torch.where(finite, lam.clamp_min(0), float("nan"))


def _trace(x: Tensor) -> Tensor:
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
    if metric == "ov_gain_bound":  # the OV pair's name for its qk_bound (pairs.OVPair)
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
        q, scale_q, low_q = _stack_factor(queries.detach(), dtype)
        k, scale_k, low_k = _stack_factor(keys.detach(), dtype)
        spectra = Spectra(gpu_algorithm(q.device))
        # one power of two per layer and factor, shared by the layer and its heads
        head_scale_q = scale_q[:, None, None].expand(n_layers, num_kv, group).reshape(n_layers * num_kv, group)
        head_scale_k = scale_k[:, None, None].expand(n_layers, num_kv, 1).reshape(n_layers * num_kv, 1)
        heads = _Lazy(lambda: Products(
            q.reshape(n_layers * num_kv, group, head_dim, d), k.reshape(n_layers * num_kv, head_dim, d),
            num_std, dtype, scale_a=head_scale_q, scale_b=head_scale_k, spectra=spectra,
            low=(None if low_q is None else low_q.reshape(n_layers * num_kv, group, head_dim, d),
                 None if low_k is None else low_k.reshape(n_layers * num_kv, head_dim, d))))
        q_grouped = q.reshape(n_layers, num_kv, group, head_dim, d).sum(2) if group > 1 else q
        layer = Products(q_grouped.reshape(n_layers, 1, num_kv * head_dim, d),
                         k.reshape(n_layers, num_kv * head_dim, d), num_std, dtype, parts=heads.get,
                         scale_a=scale_q[:, None], scale_b=scale_k[:, None], spectra=spectra,
                         low=(None if low_q is None or group > 1 else low_q.reshape(n_layers, 1, num_kv * head_dim, d),
                              None if low_k is None else low_k.reshape(n_layers, num_kv * head_dim, d)))
        # every largest-eigenvalue problem the metrics need, registered before any is solved:
        # the GPU algorithm solves them in one chain per size
        if any(m in _NEEDS_SIGMA for m in names):
            layer.request("m")
            if per_head:
                heads.get().request("m")
        if any(m in _NEEDS_FACTOR_SIGMA for m in names):
            heads.get().request("factors")
        columns = [_metric_table(layer, names, n_layers)]
        if per_head:
            columns.append(_metric_table(heads.get(), names, n_layers))
        return torch.cat(columns, 2)


#: metrics that read ``sigma_max(M)`` / the factors' ``sigma_max`` (their problems are batched)
_NEEDS_SIGMA = frozenset({"spectral_norm", "stable_rank"})
_NEEDS_FACTOR_SIGMA = frozenset({"qk_bound"})


def _stack_factor(t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    """A stack ``(L, heads, head_dim, d)`` divided by one power of two per layer, in ``dtype``.

    Returns the scaled stack in ``dtype``, the scales (float64 ``(L,)``) and, for bf16/fp16
    input on a device with float32-output matrix products (:func:`gram_out_dtype_supported`),
    the scaled stack in its own dtype (exact: a power of two) for the Gram products.
    """
    scale = _pow2_scale(t, 3)  # (L,), float32 or t's dtype
    shaped = scale[:, None, None, None]
    if torch.promote_types(t.dtype, dtype) == dtype:  # one division, promoting to dtype
        scaled = t / shaped.to(dtype)
    else:
        scaled = t.to(dtype) / shaped.to(dtype)
    low = None
    if (t.dtype in (torch.bfloat16, torch.float16) and dtype == torch.float32
            and gram_out_dtype_supported(t.device)):
        low = t / shaped.to(t.dtype)
    return scaled, scale.to(torch.float64), low


# ------------------------------------------------------------------ host view of one layer
@dataclass
class FactoredScores:
    """Scores of one layer: the layer-level matrix and, optionally, every head."""

    symmetry: float
    directionality: float
    head_symmetry: list[float] | None = None
    head_directionality: list[float] | None = None


def factored_scores(
    query: Tensor,
    key: Tensor,
    *,
    per_head: bool = False,
    layer: bool = True,
    num_std: float = 2.0,
    dtype: torch.dtype = torch.float32,
) -> FactoredScores:
    """Symmetry and directionality of ``M = sum_h Q_h^T K_{g(h)}`` from per-head factors, on the host.

    ``query`` is ``(num_heads, head_dim, d)`` and ``key`` is ``(num_kv_heads, head_dim, d)``
    (``nn.Linear`` weight rows split per head); query head ``h`` pairs with key head
    ``g(h) = h // (num_heads / num_kv_heads)``. A host-side view of :func:`score_factors`
    (one device-to-host transfer); ``layer=False`` leaves the layer scores ``nan``.

    Example:
        >>> q = torch.randn(4, 8, 32)
        >>> s = factored_scores(q, q, per_head=True)  # W_q = W_k: every M_h is symmetric
        >>> round(s.symmetry, 4), [round(x, 4) for x in s.head_symmetry]
        (1.0, [1.0, 1.0, 1.0, 1.0])
    """
    table = score_factors(query, key, ("symmetry", "directionality"), per_head=per_head,
                          num_std=num_std, dtype=dtype).cpu().tolist()
    nan = float("nan")
    out = FactoredScores(table[0][0] if layer else nan, table[1][0] if layer else nan)
    if per_head:
        out.head_symmetry, out.head_directionality = table[0][1:], table[1][1:]
    return out


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
