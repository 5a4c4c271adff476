"""When to take a snapshot: a schedule is any callable ``step -> bool``.

``step`` counts optimizer updates (or training forward passes for the module hook), starting
at 0 for the weights before training. The built-in ones are small module-level classes
(:class:`Every`, :class:`LogSpaced`, :class:`AnyOf`), so a config holding one pickles and
compares by value; they are made by plain functions and trivially combined:

>>> from attn_probe.live.schedules import every, log_spaced
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

__all__ = ["Schedule", "every", "log_spaced", "as_schedule", "any_of", "is_deterministic", "Every", "LogSpaced",
           "AnyOf"]

Schedule = Callable[[int], bool]
ScheduleLike = int | Schedule


class _BuiltIn:
    """A built-in schedule: a module-level class, so it pickles (``ProbeConfig`` with it goes to a
    spawn child, Lightning's ``ddp_spawn``) and compares by value; ``repr`` is how it is named in
    the run header and the announcement (the same text as when schedules were closures)."""

    __slots__ = ()
    #: the answer depends on the step alone (:func:`is_deterministic`)
    deterministic = True

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._key() == other._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))

    def __getstate__(self) -> tuple:
        return self._key()

    def __setstate__(self, state: tuple) -> None:
        for name, value in zip(self.__slots__, state, strict=True):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _key(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)


class Every(_BuiltIn):
    """:func:`every`'s schedule."""

    __slots__ = ("n", "offset")

    def __init__(self, n: int, offset: int = 0) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"every= must be a positive integer, got {n!r}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative integer, got {offset!r}")
        self.__setstate__((n, offset))

    def __call__(self, step: int) -> bool:
        return step >= self.offset and (step - self.offset) % self.n == 0

    def __repr__(self) -> str:
        return f"every({self.n}, offset={self.offset})"


class LogSpaced(_BuiltIn):
    """:func:`log_spaced`'s schedule."""

    __slots__ = ("per_decade", "start", "max_interval")

    def __init__(self, per_decade: int = 10, start: int = 1, max_interval: int | None = None) -> None:
        if per_decade < 1 or start < 1:
            raise ValueError("per_decade and start must be positive integers")
        if max_interval is not None and max_interval < 1:
            raise ValueError("max_interval must be a positive integer or None")
        self.__setstate__((per_decade, start, max_interval))

    def _point(self, k: int) -> int:
        return int(round(self.start * 10.0 ** (k / self.per_decade)))

    def __call__(self, step: int) -> bool:
        if step == 0:
            return True
        if step < self.start:
            return False
        if self.max_interval is not None and step % self.max_interval == 0:
            return True
        k = self.per_decade * math.log10(step / self.start)
        return any(self._point(j) == step
                   for j in (math.floor(k) - 1, math.floor(k), math.ceil(k), math.ceil(k) + 1) if j >= 0)

    def __repr__(self) -> str:
        return f"log_spaced(per_decade={self.per_decade}, start={self.start}, max_interval={self.max_interval})"


class AnyOf(_BuiltIn):
    """:func:`any_of`'s schedule: deterministic when all its parts are."""

    __slots__ = ("schedules",)

    def __init__(self, *schedules: Schedule) -> None:
        self.__setstate__((tuple(schedules),))

    @property
    def deterministic(self) -> bool:  # type: ignore[override]
        return all(is_deterministic(s) for s in self.schedules)

    def __call__(self, step: int) -> bool:
        return any(s(step) for s in self.schedules)

    def __repr__(self) -> str:
        return f"any_of({', '.join(getattr(s, '__qualname__', repr(s)) for s in self.schedules)})"


def every(n: int, offset: int = 0) -> Schedule:
    """Fire at ``offset, offset + n, offset + 2n, ...``."""
    return Every(n, offset)


def log_spaced(per_decade: int = 10, start: int = 1, max_interval: int | None = None) -> Schedule:
    """Dense early, sparse later: step 0 and ``round(start * 10**(k / per_decade))``, k = 0, 1, ...

    Each decade of steps gets about ``per_decade`` snapshots. With ``max_interval`` the gaps
    stop growing: once they would exceed it, the schedule also fires every ``max_interval``
    steps, so long runs keep a bounded resolution.
    """
    return LogSpaced(per_decade, start, max_interval)


def any_of(*schedules: Schedule) -> Schedule:
    """Fire when any of ``schedules`` fires (deterministic when all of them are; picklable when
    all of them are)."""
    return AnyOf(*schedules)


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
