"""Count the ATen operations a piece of code dispatches: a device-independent proxy for kernels.

On a GPU a snapshot is bound by the number of kernel launches, not by arithmetic
(docs/performance.md). Every non-view ATen operation launches at least one kernel there, so
the number of them dispatched on the calling thread, counted here on any device (CPU
included), tracks the launch count without a GPU. ``benchmarks/gpu_session.sh`` prints it
beside ``torch.profiler``'s CUDA kernel count to calibrate the proxy.

An operation is counted unless it is a *view*: every output aliases an input without writing
it (``view``, ``reshape`` of a contiguous tensor, ``transpose``, ``select``, ``detach``, ...:
metadata only, no kernel). In-place and ``out=`` operations write memory and are counted.

    >>> import torch
    >>> from attn_probe.core.op_count import count_ops
    >>> x = torch.ones(3, 4)
    >>> with count_ops() as ops:
    ...     y = (x.T @ x).sum()
    >>> ops.total  # the transpose is a view: mm and sum
    2
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["OpCounts", "count_ops", "is_view_op", "snapshot_op_count"]


def is_view_op(func: Any) -> bool:
    """Whether the ATen overload ``func`` only makes views: each return aliases an input, unwritten."""
    returns = func._schema.returns
    if not returns:
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class OpCounts:
    """Counts of the non-view ATen ops seen: :attr:`total` and :attr:`by_op` (overload name -> count)."""

    def __init__(self) -> None:
        self.by_op: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __repr__(self) -> str:
        return f"OpCounts(total={self.total}, top={self.by_op.most_common(5)})"


@contextmanager
def count_ops() -> Iterator[OpCounts]:
    """Count the non-view ATen ops dispatched on the calling thread inside the ``with`` block."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = OpCounts()
    thread = threading.get_ident()

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if threading.get_ident() == thread and not is_view_op(func):
                counts.by_op[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    with _Mode():
        yield counts


def snapshot_op_count(probe: Any, step: int = 1, snapshot: Callable[[int], Any] | None = None) -> OpCounts:
    """Non-view ATen ops dispatched on the calling thread by one ``probe.snapshot(step)``.

    The probe should be synchronous (``async_scoring=False``): an asynchronous one scores on
    its worker thread, which is not counted.
    """
    with count_ops() as counts:
        (snapshot or probe.snapshot)(step)
    return counts
