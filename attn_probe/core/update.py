"""The update rate of ``W_qk`` between two snapshots, from the factors: pure maths, torch only.

``qk_update = ||M(t) - M(t')||_F / ||M(t')||_F`` for the layer matrix ``M = sum_h Q_h^T K_{g(h)}``
and, per head, ``M_h = Q_h^T K_{g(h)}`` (``docs/scores.md``, "The update rate"). Two ways:

* **Exact** (:func:`exact_update_sq`), from the previous factors ``A', B'``. With
  ``dA = A - A'``, ``dB = B - B'``,

      M - M' = dA^T B + A'^T dB = X^T Y,   X = [dA; A'],  Y = [B; dB]   (2r x d each),

  so ``||M - M'||_F^2 = sum(X X^T * Y Y^T)`` (two ``2r x 2r`` Gram products, no ``d x d``
  matrix when the factors are thin) and ``||M'||_F^2 = sum(A'A'^T * B'B'^T)``, with both Gram
  blocks read off ``X X^T`` and ``Y Y^T`` (``B'B'^T = BB^T - B dB^T - dB B^T + dB dB^T``).
  Every term is of the size of the change itself: nothing cancels against ``||M||^2``, so a
  relative change of ``1e-6`` is resolved in float32. Where forming ``M`` is cheaper
  (:func:`~attn_probe.core.algorithm.gram_is_cheaper`), ``X^T Y`` and ``A'^T B'`` are formed.
* **Sketch** (:func:`sketch`), from ``S = M Omega = A^T (B Omega)`` with a seeded Gaussian
  ``Omega`` (``d x r``, :func:`sketch_matrix`, the same at every snapshot):
  ``||S(t) - S(t')||_F^2 / r`` is unbiased for ``||M(t) - M(t')||_F^2``; with ``sigma_i`` the
  singular values of the change its relative standard deviation is
  ``sqrt(2 sum sigma^4 / (r (sum sigma^2)^2)) <= sqrt(2 / r)``, equality for a rank-one change
  (25 % at ``r = 32``); that of the norm ``||dM||_F``, the metric, about half of it (13 % at
  ``r = 32``, 25 % at ``r = 8``). The denominator stays exact (:func:`frobenius_sq`, kept from
  the previous snapshot).

Stacks are shaped like the core's: ``q`` ``(L, H, head_dim, d)``, ``k`` ``(L, H_kv, head_dim, d)``;
results ``(L, 1 + H * per_head)``, column 0 the layer matrix, float64.
"""

from __future__ import annotations

import math

import torch

from .algorithm import gram_is_cheaper

Tensor = torch.Tensor

#: the metric's name (JSONL ``metric`` field, TensorBoard tag segment)
UPDATE_METRIC = "qk_update"
#: metrics whose NaN means "no value" (no previous snapshot): the assembly writes no row for them
ABSENT_WHEN_UNDEFINED = frozenset({UPDATE_METRIC})
#: columns of the sketch ``Omega``: relative sd of ``||dM||^2`` at most ``sqrt(2 / 32)`` = 25 %, of ``||dM||`` about 13 %
SKETCH_COLUMNS = 32
#: seed of ``Omega`` (a local generator: every rank, run and resume draws the same matrix)
SKETCH_SEED = 20250211


def _batches(q: Tensor, k: Tensor, per_head: bool) -> list[tuple[Tensor, Tensor]]:
    """``(A, B)`` of the layer matrices (``(L, 1, r, d)``, ``(L, r, d)``; grouped query heads summed)
    and, with ``per_head``, of the heads (``(L * H_kv, G, hd, d)``, ``(L * H_kv, hd, d)``)."""
    n, heads, hd, d = q.shape
    kv = k.shape[1]
    group = heads // kv
    grouped = q.reshape(n, kv, group, hd, d).sum(2) if group > 1 else q
    out = [(grouped.reshape(n, 1, kv * hd, d), k.reshape(n, kv * hd, d))]
    if per_head:
        out.append((q.reshape(n * kv, group, hd, d), k.reshape(n * kv, hd, d)))
    return out


def _columns(parts: list[Tensor], n: int) -> Tensor:
    """Per-batch ``(n', G)`` values -> ``(L, 1 + H)``: the layer column, then the heads."""
    return parts[0].reshape(n, -1) if len(parts) == 1 else torch.cat([p.reshape(n, -1) for p in parts], 1)


def _gram_sum(x: Tensor, y: Tensor) -> Tensor:
    """``||x^T y||_F^2`` for ``x`` ``(n, G, r, d)``, ``y`` ``(n, r, d)``: ``(n, G)``."""
    r, d = x.shape[-2:]
    if gram_is_cheaper(r, d):
        return ((x @ x.mT) * (y @ y.mT)[:, None]).sum((-1, -2))
    return torch.linalg.vector_norm(x.mT @ y[:, None], dim=(-2, -1)).square()


def exact_update_sq(q: Tensor, k: Tensor, q_prev: Tensor, k_prev: Tensor, *, per_head: bool = False,
                    dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """``(||M - M'||_F^2, ||M'||_F^2)``, each float64 ``(L, 1 + H * per_head)``, from both snapshots' factors.

    Computed in ``dtype`` (the differences ``dA``, ``dB`` after the conversion: exact for bf16
    and float32 weights in float32) by the Gram identity of the module docstring.
    """
    q, k, q_prev, k_prev = (t.detach().to(dtype) for t in (q, k, q_prev, k_prev))
    n = q.shape[0]
    nums, dens = [], []
    with torch.no_grad():
        for (a, b), (a0, b0) in zip(_batches(q, k, per_head), _batches(q_prev, k_prev, per_head), strict=True):
            r, d = b.shape[-2:]
            x = torch.cat([a - a0, a0], -2)  # (n, G, 2r, d)
            y = torch.cat([b, b - b0], -2)  # (n, 2r, d)
            if gram_is_cheaper(2 * r, d):
                gx, gy = x @ x.mT, (y @ y.mT)[:, None]
                nums.append((gx * gy).sum((-1, -2)))
                gb0 = gy[..., :r, :r] - gy[..., :r, r:] - gy[..., r:, :r] + gy[..., r:, r:]  # B' B'^T
                dens.append((gx[..., r:, r:] * gb0).sum((-1, -2)))
            else:
                nums.append(torch.linalg.vector_norm(x.mT @ y[:, None], dim=(-2, -1)).square())
                dens.append(torch.linalg.vector_norm(a0.mT @ b0[:, None], dim=(-2, -1)).square())
    return _columns(nums, n).to(torch.float64), _columns(dens, n).to(torch.float64)


def frobenius_sq(q: Tensor, k: Tensor, *, per_head: bool = False, dtype: torch.dtype = torch.float32) -> Tensor:
    """``||M||_F^2`` of the layer matrices (and heads): float64 ``(L, 1 + H * per_head)``."""
    q, k = q.detach().to(dtype), k.detach().to(dtype)
    with torch.no_grad():
        return _columns([_gram_sum(a, b) for a, b in _batches(q, k, per_head)], q.shape[0]).to(torch.float64)


def sketch_matrix(d: int, columns: int = SKETCH_COLUMNS, *, seed: int = SKETCH_SEED,
                  device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Tensor:
    """``Omega``: ``(d, columns)`` iid ``N(0, 1)`` from a local generator seeded with ``seed`` (drawn on
    the CPU in float64, so it is the same on every device and machine), then moved to ``device``."""
    if isinstance(columns, bool) or not isinstance(columns, int) or columns < 1:
        raise ValueError(f"sketch columns must be an int >= 1, got {columns!r}")
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randn(d, columns, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def sketch(q: Tensor, k: Tensor, omega: Tensor, *, per_head: bool = False,
           dtype: torch.dtype = torch.float32) -> Tensor:
    """``S = M Omega`` of the layer matrices (and heads): ``(L, 1 + H * per_head, d, r)`` in ``dtype``,
    as ``A^T (B Omega)`` (``r d`` times ``Omega``'s columns, no ``d x d`` matrix)."""
    q, k = q.detach().to(dtype), k.detach().to(dtype)
    omega = omega.to(device=q.device, dtype=dtype)
    n = q.shape[0]
    with torch.no_grad():
        parts = []
        for a, b in _batches(q, k, per_head):
            bo = b @ omega  # (n', r, cols)
            parts.append((a.mT @ bo[:, None]).reshape(n, -1, a.shape[-1], omega.shape[1]))
        return torch.cat(parts, 1)


def sketch_update_sq(s: Tensor, s_prev: Tensor) -> Tensor:
    """The sketch's estimate of ``||M - M'||_F^2``: ``||S - S'||_F^2 / r``, float64 ``(L, 1 + H)``."""
    diff = (s - s_prev.to(device=s.device, dtype=s.dtype))
    return torch.linalg.vector_norm(diff, dim=(-2, -1)).square().to(torch.float64) / s.shape[-1]


def update_rate(update_sq: Tensor, previous_sq: Tensor) -> Tensor:
    """``sqrt(||dM||^2 / ||M'||^2)``; NaN where ``M'`` is zero (or a value NaN: it propagates)."""
    return torch.where(previous_sq > 0, (update_sq / previous_sq).clamp_min(0).sqrt(), float("nan"))


def sketch_relative_sd(columns: int) -> float:
    """The sketch's worst-case (rank-one change) relative standard deviation of ``||dM||_F^2``:
    ``sqrt(2 / columns)``; that of ``||dM||_F`` (the metric) is about half of it."""
    return math.sqrt(2.0 / columns)
