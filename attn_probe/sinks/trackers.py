"""What the experiment-tracker sinks (W&B, MLflow, trackio) share: key names and a base class.

Keys are the TensorBoard tags of :func:`attn_probe.tags.scalar_tag`:

``attn_probe/{group}/{metric}/layer_{LL}``            one layer
``attn_probe/{group}/{metric}/layer_{LL}/head_{HH}``  one head (only with ``per_head=True``)
``attn_probe/{group}/{metric}/{median|q25|q75}``      across layers

They use only ``[A-Za-z0-9_./-]``, which every tracker accepts (MLflow rejects some other
characters, W&B treats others specially); a group or metric name with any other character is
rewritten with ``_`` for it. Each key of a metric's median contains the metric's name and
``median``.

The tracker sinks are *network sinks*: W&B, MLflow (over HTTP) and trackio may wait on a
server, and MLflow's HTTP client retries a dead server for minutes
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``MLFLOW_HTTP_REQUEST_TIMEOUT``). Their ``log`` may
therefore block or raise; they are meant to be driven off the training thread, and the probe
isolates a failing sink. Each sink imports its library only in ``start()``.
"""

from __future__ import annotations

import importlib
import math
import re
import time
from typing import Any

from ..tags import PREFIX, scalar_tag
from . import RunInfo, Snapshot

__all__ = ["KEY_PATTERN", "STEP_KEY", "TrackerSink", "tracker_key", "tracker_metrics", "import_tracker"]

#: characters every supported tracker accepts in a metric key
KEY_PATTERN = re.compile(r"^[A-Za-z0-9_./-]+$")
_INVALID = re.compile(r"[^A-Za-z0-9_.-]")
#: the probe's own step axis where a tracker has separate step metrics (W&B)
STEP_KEY = f"{PREFIX}/step"


def _clean(part: str) -> str:
    """``part`` with every character outside ``[A-Za-z0-9_.-]`` (``/`` included) replaced by ``_``."""
    return _INVALID.sub("_", str(part)) or "_"


def tracker_key(group: str, metric: str, layer: int | None = None, head: int | None = None,
                stat: str | None = None) -> str:
    """Tracker key of one series: :func:`attn_probe.tags.scalar_tag`, valid for every tracker.

    Example:
        >>> tracker_key("self", "symmetry", layer=3)
        'attn_probe/self/symmetry/layer_03'
        >>> tracker_key("self", "directionality", stat="median")
        'attn_probe/self/directionality/median'
    """
    tag = scalar_tag(group, metric, layer=layer, head=head, stat=stat)
    if KEY_PATTERN.match(tag) and tag.count("/") == (4 if head is not None else 3):
        return tag
    return scalar_tag(_clean(group), _clean(metric), layer=layer, head=head, stat=stat)


def tracker_metrics(snapshot: Snapshot, *, per_head: bool = False, layers: bool = True,
                    stats: bool = True) -> dict[str, float]:
    """``{key: value}`` of one snapshot: per-layer values, heads if ``per_head``, and the stats.

    Values are floats; NaN (an undefined score) is kept.
    """
    out: dict[str, float] = {}
    if stats:
        for (group, metric, stat), value in snapshot.stats.items():
            out[tracker_key(group, metric, stat=stat)] = float(value)
    if layers or per_head:
        for r in snapshot.records:
            if r.head is None and not layers or r.head is not None and not per_head:
                continue
            out[tracker_key(r.group, r.metric, layer=r.layer, head=r.head)] = float(r.value)
    return out


def import_tracker(module: str, extra: str, who: str) -> Any:
    """``import module``; an ``ImportError`` naming the pip extra if it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{who} needs the '{module}' package: pip install 'attn-probe[{extra}]' (or pip install {module})"
        ) from exc


class TrackerSink:
    """Base of the tracker sinks: lifecycle, key naming, and whether the run is ours to finish.

    Subclasses implement ``_open(run_info)`` (set ``self.run`` and ``self.owns_run``),
    ``_send(snapshot, values)`` and ``_close()``. ``finish()`` finishes only a run the sink
    created; a run handed in by the user stays open.
    """

    #: module imported in ``start()`` and the pip extra that installs it
    module = ""
    extra = ""

    def __init__(self, *, per_head: bool = False) -> None:
        self.per_head = bool(per_head)
        self.run: Any = None
        self.owns_run = False
        self.run_info: RunInfo | None = None
        self._open_now = False

    def _import(self) -> Any:
        return import_tracker(self.module, self.extra, type(self).__name__)

    # ------------------------------------------------------------------ Sink protocol
    def start(self, run: RunInfo) -> None:
        if self._open_now:
            raise RuntimeError(f"{type(self).__name__} is already started")
        self.run_info = run
        self._open(run)
        self._open_now = True

    def log(self, snapshot: Snapshot) -> None:
        if not self._open_now:
            raise RuntimeError(f"{type(self).__name__}.log() before start() or after finish()")
        values = self.metrics(snapshot)
        if values:
            self._send(snapshot, values)

    def finish(self) -> None:
        if not self._open_now:
            return
        self._open_now = False
        self._close()

    # ------------------------------------------------------------------ helpers
    def metrics(self, snapshot: Snapshot) -> dict[str, float]:
        """The ``{key: value}`` this sink sends for ``snapshot``."""
        return tracker_metrics(snapshot, per_head=self.per_head)

    @staticmethod
    def timestamp_ms(snapshot: Snapshot) -> int:
        wall = snapshot.wall_time
        if not isinstance(wall, (int, float)) or not math.isfinite(wall):
            wall = time.time()
        return int(wall * 1000)

    def _open(self, run_info: RunInfo) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _send(self, snapshot: Snapshot, values: dict[str, float]) -> None:  # pragma: no cover
        raise NotImplementedError

    def _close(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError
