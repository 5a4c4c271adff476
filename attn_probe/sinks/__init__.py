"""Where snapshots go. A sink has ``start(run)``, ``log(snapshot)`` and ``finish()``.

Sinks only receive plain Python data (no tensors, no model) and never import the probe;
``TensorBoardSink`` (``sinks.tensorboard``) and ``TrajectorySink`` (``sinks.trajectory``)
are imported lazily so that ``import attn_probe`` stays light.

The probe drives its sinks through :class:`~attn_probe.sinks.dispatch.SinkDispatcher`: each
sink isolated from the others, retried after a failure, and written from a background thread
of its own when it says that is safe. Optional members a sink may have:

* ``background = True`` (class attribute): may be called from the dispatcher's thread (one
  thread per sink; calls never overlap). Without it the sink is called on the training thread;
* ``recover()``: called before the next write after a failed one (reopen a file or a writer);
  raising means "still broken", and that snapshot is counted as lost for this sink;
* ``flush()``: make what was logged durable (called by ``probe.flush()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

__all__ = ["Record", "Snapshot", "RunInfo", "Sink"]


@dataclass(frozen=True)
class Record:
    """One value: ``head`` is ``None`` for the layer-level matrix; ``value`` may be NaN."""

    group: str
    layer: int
    head: int | None
    metric: str
    value: float


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


class Sink(Protocol):
    """The required members; ``background``, ``recover()`` and ``flush()`` are optional (above)."""

    def start(self, run: RunInfo) -> None: ...

    def log(self, snapshot: Snapshot) -> None: ...

    def finish(self) -> None: ...
