"""Where snapshots go: the data a sink receives and the contract it keeps with the dispatcher.

Sinks receive plain Python data (no tensors, no model) and never import the probe;
``TensorBoardSink`` (``sinks.tensorboard``) and ``TrajectorySink`` (``sinks.trajectory``) are
imported lazily so that ``import attn_probe`` stays light. The probe drives its sinks through
:class:`~attn_probe.sinks.dispatch.SinkDispatcher`, which uses the members of :class:`Sink`
and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Record", "Snapshot", "RunInfo", "Sink", "SinkMembers", "sink_members"]


@dataclass(frozen=True)
class Record:
    """One value: ``head`` is ``None`` for the layer-level matrix; ``value`` may be NaN."""

    group: str
    layer: int
    head: int | None
    metric: str
    value: float
    #: a line of text written beside the value in the trajectory file only (``layout_check`` rows)
    note: str | None = None


@dataclass
class Snapshot:
    """Everything measured at one step."""

    step: int
    wall_time: float
    records: list[Record]
    #: (group, metric, stat) -> value across layers; stat in ``tags.STATS``
    stats: dict[tuple[str, str, str], float] = field(default_factory=dict)
    #: (group, layer) -> HxWx3 uint8 heatmap of W_qk
    images: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    #: rows written once, with a fresh run's first snapshot, into the trajectory file only: the
    #: random-matrix range (``random_symmetry``, ..., :mod:`attn_probe.baselines.random_range`).
    #: Not per-step series: the TensorBoard and tracker sinks, the statistics and the alerts leave them out
    #: (the TensorBoard sink reads them as the range of its emergence events, :mod:`attn_probe.sinks.emergence`)
    baselines: list[Record] = field(default_factory=list)


@dataclass
class RunInfo:
    """Written once when a sink starts: configuration, model description, what will be logged."""

    config: dict[str, Any]
    model: dict[str, Any]
    groups: list[str]
    metrics: list[str]
    per_head: bool
    #: first step of this run; > 0 when training resumes and later data must be dropped
    resume_step: int | None = None


class Sink:
    """Every member the dispatcher uses, with its default: the table in docs/sinks.md.

    Subclass it and override ``start``, ``log`` and ``finish``. An object that is not a ``Sink``
    but has those three is accepted too: :func:`sink_members` reads the same members from it.
    """

    background: bool = False
    lossless: bool = False
    run_dir: str | None = None
    log_batch: Callable[[list[Snapshot]], None] | None = None

    def start(self, run: RunInfo) -> None:
        raise NotImplementedError

    def log(self, snapshot: Snapshot) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        return None

    def recover(self) -> None:
        return None

    def bind_run_dir(self, run_dir: str | None) -> None:
        self.run_dir = run_dir

    def directory(self) -> str | None:
        return None


class SinkMembers(NamedTuple):
    """The contract of one sink, read once when the dispatcher is built."""

    start: Callable[[RunInfo], None]
    log: Callable[[Snapshot], None]
    finish: Callable[[], None]
    background: bool
    lossless: bool
    log_batch: Callable[[list[Snapshot]], None] | None
    flush: Callable[[], None] | None
    recover: Callable[[], None] | None
    bind_run_dir: Callable[[str | None], None] | None
    directory: str | None


_NOTHING = (Sink.flush, Sink.recover)


def sink_members(sink: Any) -> SinkMembers:
    """The :class:`Sink` members of ``sink``; ``TypeError`` (one line) if a required one is missing."""
    required = []
    for name in ("start", "log", "finish"):
        member = getattr(sink, name, None)
        if not callable(member) or getattr(type(sink), name, None) is getattr(Sink, name):
            raise TypeError(f"{type(sink).__name__} is not a sink: it needs its own start(run), log(snapshot) "
                            f"and finish() (see attn_probe.sinks.Sink); {name} is missing")
        required.append(member)

    def optional(name: str) -> Any:
        member = getattr(sink, name, None)
        return member if callable(member) and getattr(type(sink), name, None) not in _NOTHING else None

    directory = optional("directory")
    return SinkMembers(*required, background=getattr(sink, "background", False) is True,
                       lossless=getattr(sink, "lossless", False) is True, log_batch=optional("log_batch"),
                       flush=optional("flush"), recover=optional("recover"),
                       bind_run_dir=optional("bind_run_dir"), directory=directory() if directory else None)
