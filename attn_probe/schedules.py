"""When to take a snapshot: a schedule is any callable ``step -> bool``.

``step`` counts optimizer updates (or training forward passes for the module hook), starting
at 0 for the weights before training. Schedules are plain functions, trivially combined:

>>> from attn_probe.schedules import every, log_spaced
>>> s = every(100)
>>> [t for t in range(301) if s(t)]
[0, 100, 200, 300]
>>> dense_then_sparse = log_spaced(per_decade=4, max_interval=1000)
>>> [t for t in range(60) if dense_then_sparse(t)]
[0, 1, 2, 3, 6, 10, 18, 32, 56]
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["Schedule", "every", "log_spaced", "as_schedule", "any_of", "is_deterministic"]

Schedule = Callable[[int], bool]
ScheduleLike = int | Schedule


def every(n: int, offset: int = 0) -> Schedule:
    """Fire at ``offset, offset + n, offset + 2n, ...``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"every= must be a positive integer, got {n!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a non-negative integer, got {offset!r}")

    def schedule(step: int) -> bool:
        return step >= offset and (step - offset) % n == 0

    schedule.__qualname__ = f"every({n}, offset={offset})"
    return _deterministic(schedule)


def log_spaced(per_decade: int = 10, start: int = 1, max_interval: int | None = None) -> Schedule:
    """Dense early, sparse later: step 0 and ``round(start * 10**(k / per_decade))``, k = 0, 1, ...

    Each decade of steps gets about ``per_decade`` snapshots. With ``max_interval`` the gaps
    stop growing: once they would exceed it, the schedule also fires every ``max_interval``
    steps, so long runs keep a bounded resolution.
    """
    if per_decade < 1 or start < 1:
        raise ValueError("per_decade and start must be positive integers")
    if max_interval is not None and max_interval < 1:
        raise ValueError("max_interval must be a positive integer or None")

    def point(k: int) -> int:
        return int(round(start * 10.0 ** (k / per_decade)))

    def schedule(step: int) -> bool:
        if step == 0:
            return True
        if step < start:
            return False
        if max_interval is not None and step % max_interval == 0:
            return True
        k = per_decade * math.log10(step / start)
        return any(point(j) == step for j in (math.floor(k) - 1, math.floor(k), math.ceil(k), math.ceil(k) + 1) if j >= 0)

    schedule.__qualname__ = f"log_spaced(per_decade={per_decade}, start={start}, max_interval={max_interval})"
    return _deterministic(schedule)


def any_of(*schedules: Schedule) -> Schedule:
    """Fire when any of ``schedules`` fires (deterministic when all of them are)."""

    def schedule(step: int) -> bool:
        return any(s(step) for s in schedules)

    schedule.__qualname__ = f"any_of({', '.join(getattr(s, '__qualname__', repr(s)) for s in schedules)})"
    return _deterministic(schedule) if all(is_deterministic(s) for s in schedules) else schedule


def _deterministic(schedule: Schedule) -> Schedule:
    schedule.deterministic = True  # type: ignore[attr-defined]
    return schedule


def is_deterministic(schedule: Schedule | None) -> bool:
    """Whether ``schedule``'s answer depends on the step alone (the built-in ``every``/``log_spaced``).

    Then every rank computes the same answer and a sharded probe agrees with the other ranks
    only on due steps; any other callable (it may read a clock, a file, rank-local state) is
    agreed on at every step. ``None`` (never fires) counts as deterministic.
    """
    return schedule is None or getattr(schedule, "deterministic", False) is True


def as_schedule(value: ScheduleLike | None) -> Schedule | None:
    """``int`` -> :func:`every`; callables pass through; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return every(value)
    if callable(value):
        return value
    raise TypeError(f"a schedule is a positive int or a callable step -> bool, got {value!r}")
