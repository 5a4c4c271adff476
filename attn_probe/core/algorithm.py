"""The core's algorithm choices, made in one place: the GPU or the CPU algorithm per device (with
the process-wide switch :func:`gpu_algorithm_on_cpu`), the eigensolver and Lanczos thresholds, and the
Gram or explicit path for factors of a given shape (:func:`gram_is_cheaper`)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

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
    (:func:`attn_probe.scoring.pairs.stack_budget`), bf16/fp16 factors entering Gram products as they
    are with float32 output where torch supports it (:func:`gram_out_dtype_supported`).
    The CPU algorithm: LAPACK ``eigh``/``eigvalsh`` up to :func:`lanczos_threshold`, Lanczos
    above it, one stack per shape up to :data:`attn_probe.scoring.pairs.CPU_STACK_BYTES` (docs/performance.md).

    On CPU tensors the GPU algorithm runs inside :func:`gpu_algorithm_on_cpu` or with the
    environment variable ``ATTN_PROBE_GPU_ALGORITHM=1``: the same operations (a fixed stack
    budget, :data:`attn_probe.scoring.pairs.STACK_BYTES`, and float32 copies where CUDA multiplies
    bf16 with float32 output, which has no CPU kernel), so that its operation count
    (:mod:`attn_probe.core.op_count`) and its numbers can be checked without a GPU.
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


# ------------------------------------------------------------------ Gram or explicit path
#: Cost, in multiply-adds per entry of ``M``, charged to the explicit path for the passes
#: over the ``d x d`` matrix (memory bound). With it a Llama-3-8B layer (r = 1024, d = 4096)
#: takes the Gram path, which ran about 2x faster than forming M on the 2-core dev CPU.
EXPLICIT_PASS_COST = 512


def gram_is_cheaper(r: int, d: int) -> bool:
    """Whether the Gram path (``~5 r^2 d``) beats forming ``M = A^T B`` (``r d^2`` + passes over ``d^2``)."""
    return 5 * r * r < (r + EXPLICIT_PASS_COST) * d
