"""What the trackers (W&B, MLflow, trackio, the integrations' trackers) share, in one place.

* Keys: :func:`tracker_key`, the TensorBoard tags of :func:`attn_probe.formats.tags.scalar_tag`
  (``attn_probe/{group}/{metric}/layer_{LL}[/head_{HH}]``, ``.../{median|q25|q75}``) with
  every character outside ``[A-Za-z0-9_./-]`` (which every tracker accepts) rewritten as ``_``.
  With per-head values and not ``per_head``, the key budget of :mod:`attn_probe.sinks.head_budget`
  (``.../layer_{LL}/heads_{min|median|max}``, ``.../layer_{LL}/top_{R}[_head]``).
* :class:`TrackerSink`, the base of the plain-loop sinks, and :class:`TrackerFanOut`, which
  sends to the targets (:class:`TrackerTarget`) that the Trainer, Lightning and Accelerate integrations
  hand it (W&B apart: the integrations give it a :class:`~attn_probe.sinks.wandb.WandbSink`).
* Resume, no step twice: each tracker run's :class:`~attn_probe.sinks.tracker_record.ResendGuard`.
"""

from __future__ import annotations

import importlib
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..formats.tags import scalar_tag
from . import RunInfo, Sink, Snapshot
from .head_budget import DEFAULT_TOP_K, head_budget, top_k_of
from .tracker_record import STEP_KEY, ResendGuard, TrackerRun, make_guard

__all__ = ["KEY_PATTERN", "STEP_KEY", "TrackerSink", "tracker_key", "tracker_metrics", "import_tracker",
           "current_trackio_run", "TrackerTarget", "TrackerFanOut"]

#: characters every supported tracker accepts in a metric key
KEY_PATTERN = re.compile(r"^[A-Za-z0-9_./-]+$")
_INVALID = re.compile(r"[^A-Za-z0-9_.-]")


def _clean(part: str) -> str:
    """``part`` with every character outside ``[A-Za-z0-9_.-]`` (``/`` included) replaced by ``_``."""
    return _INVALID.sub("_", str(part)) or "_"


def tracker_key(group: str, metric: str, layer: int | None = None, head: int | None = None,
                stat: str | None = None, summary: str | None = None) -> str:
    """Tracker key of one series: :func:`attn_probe.formats.tags.scalar_tag`, valid for every tracker.

    Example:
        >>> tracker_key("self", "symmetry", layer=3)
        'attn_probe/self/symmetry/layer_03'
        >>> tracker_key("self", "directionality", stat="median")
        'attn_probe/self/directionality/median'
    """
    tag = scalar_tag(group, metric, layer=layer, head=head, stat=stat, summary=summary)
    if KEY_PATTERN.match(tag) and tag.count("/") == (4 if head is not None or summary is not None else 3):
        return tag
    return scalar_tag(_clean(group), _clean(metric), layer=layer, head=head, stat=stat, summary=summary)


def tracker_metrics(snapshot: Snapshot, *, per_head: bool = False, layers: bool = True,
                    stats: bool = True, top_k: int | None = DEFAULT_TOP_K) -> dict[str, float]:
    """``{key: value}`` of one snapshot: per-layer values, every head if ``per_head``, and the stats.

    Without ``per_head``, a snapshot's per-head values are summed up per layer and metric
    (:mod:`attn_probe.sinks.head_budget`: min/median/max over heads, the ``top_k`` top heads and
    their indices; ``top_k=None``: none of it). Values are floats; NaN (an undefined score) is kept.
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
    if layers and not per_head and top_k is not None:
        for (group, metric, layer, name), value in head_budget(snapshot.records, top_k).items():
            out[tracker_key(group, metric, layer=layer, summary=name)] = value
    return out


def current_trackio_run(trackio: Any) -> Any:
    """trackio's current run in this context (``trackio.context_vars.current_run``), or ``None``."""
    current = getattr(getattr(trackio, "context_vars", None), "current_run", None)
    return current.get() if current is not None else None


def import_tracker(module: str, extra: str, who: str) -> Any:
    """``import module``; an ``ImportError`` naming the pip extra if it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{who} needs the '{module}' package: pip install 'attn-probe[{extra}]' (or pip install {module})"
        ) from exc


def _send_guarded(guard: ResendGuard | None, step: int, send: Callable[..., None], *args: Any) -> None:
    """``send(*args)`` unless the tracker run holds ``step`` from before the resume; then record it."""
    if guard is not None and not guard.wants(step):
        return
    send(*args)
    if guard is not None:
        guard.sent(step)  # reached the tracker: recorded for a resume


class TrackerSink(Sink):
    """Base of the tracker sinks: lifecycle, key naming, resume, and whether the run is ours to finish.

    Subclasses implement ``_open(run_info)`` (set ``self.run`` and ``self.owns_run``),
    ``_send(snapshot, values)``, ``_close()`` and ``_tracker_run()`` (the :class:`TrackerRun`
    logged into, once open). ``finish()`` finishes only a run the sink created; a run handed in
    by the user stays open.

    Resume: the dispatcher binds the probe's run directory before ``start()``, which builds the
    sink's :class:`ResendGuard` (a sink with ``guard_at_first_log`` builds it at its first
    ``log``, on its lane, once its run exists); ``log`` skips the snapshots the tracker run
    already holds and records each step once ``_send`` returned.
    """

    #: module imported in ``start()`` and the pip extra that installs it
    module = ""
    extra = ""
    #: build the resume guard at the first ``log`` (the tracker run is created there) instead of at ``start()``
    guard_at_first_log = False

    def __init__(self, *, per_head: bool = False) -> None:
        self.per_head = bool(per_head)
        self.run: Any = None
        self.owns_run = False
        self.run_info: RunInfo | None = None
        #: which snapshots the tracker run gets (set at ``start()``; ``None``: all)
        self.guard: ResendGuard | None = None
        self._guard_made = False
        self._open_now = False

    def _import(self) -> Any:
        return import_tracker(self.module, self.extra, type(self).__name__)

    def start(self, run: RunInfo) -> None:
        if self._open_now:
            raise RuntimeError(f"{type(self).__name__} is already started")
        self.run_info = run
        try:
            self._open(run)
            self._guard_made = False
            if not self.guard_at_first_log:
                self._make_guard()
        except BaseException:
            # what the open took is given back (a W&B key prefix, a run it created), then the failure
            # goes to the caller as before
            try:
                self._close()
            except Exception:  # noqa: BLE001 - the open's own error is the one to report
                pass
            raise
        self._open_now = True

    def _make_guard(self) -> None:
        resume = self.run_info.resume_step if self.run_info is not None else None
        self.guard = make_guard(self._tracker_run, self.run_dir, resume)
        self._guard_made = True

    def log(self, snapshot: Snapshot) -> None:
        if not self._open_now:
            raise RuntimeError(f"{type(self).__name__}.log() before start() or after finish()")
        if not self._guard_made:
            self._make_guard()
        values = tracker_metrics(snapshot, per_head=self.per_head,
                                 top_k=top_k_of(self.run_info.config if self.run_info is not None else None))
        if values:
            _send_guarded(self.guard, int(snapshot.step), self._send, snapshot, values)

    def finish(self) -> None:
        if not self._open_now:
            return
        self._open_now = False
        self._close()

    @staticmethod
    def timestamp_ms(snapshot: Snapshot) -> int:
        wall = snapshot.wall_time
        if not isinstance(wall, (int, float)) or not math.isfinite(wall):
            wall = time.time()
        return int(wall * 1000)

    def _tracker_run(self) -> TrackerRun:
        """The tracker run this sink logs into (after ``_open``); by default, by class name alone."""
        return TrackerRun(type(self).__name__, None, type(self).__name__)

    def _open(self, run_info: RunInfo) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _send(self, snapshot: Snapshot, values: dict[str, float]) -> None:  # pragma: no cover
        raise NotImplementedError

    def _close(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass
class TrackerTarget:
    """One tracker that an integration (Trainer, Lightning, Accelerate) hands to :class:`TrackerFanOut`.

    ``name`` names it in errors; ``run()`` says which tracker run it logs into, called once,
    before its first snapshot (it may set the tracker up first); ``send(values, step)`` sends one
    snapshot's ``{key: value}``.
    """

    name: str
    run: Callable[[], TrackerRun]
    send: Callable[[dict[str, float], int], None]


class TrackerFanOut(Sink):
    """Send each snapshot to an integration's trackers: keys and resume in one place.

    Runs on the training thread (the integrations' tracker runs live there). Each target's
    :class:`ResendGuard` is made before its first snapshot, so on a resumed run it skips the
    steps its tracker run already holds. A failing target does not stop the others; the errors
    are raised together afterwards (the dispatcher counts that snapshot as lost for this sink).
    """

    def __init__(self, targets: list[TrackerTarget], *, per_head: bool = False) -> None:
        self.targets = list(targets)
        self.per_head = bool(per_head)
        self.resume_step: int | None = None
        #: top heads per layer in the key budget (the run's ``tracker_top_k``, set at ``start``)
        self.top_k: int | None = DEFAULT_TOP_K
        #: per target (by position), its guard once made (``None``: send everything)
        self.guards: dict[int, ResendGuard | None] = {}

    def start(self, run: RunInfo) -> None:
        self.resume_step = run.resume_step
        self.top_k = top_k_of(run.config)

    def _guard(self, i: int, target: TrackerTarget) -> ResendGuard | None:
        if i not in self.guards:
            self.guards[i] = make_guard(target.run, self.run_dir, self.resume_step)
        return self.guards[i]

    def log(self, snapshot: Snapshot) -> None:
        step = int(snapshot.step)
        values = tracker_metrics(snapshot, per_head=self.per_head, top_k=self.top_k)
        errors = []
        for i, target in enumerate(self.targets):
            try:
                _send_guarded(self._guard(i, target), step, target.send, dict(values), step)
            except Exception as exc:  # noqa: BLE001 - one tracker must not silence another
                errors.append(f"{target.name}: {type(exc).__name__}: {exc}")
        if errors:
            raise RuntimeError("tracker failed: " + "; ".join(errors))

    def finish(self) -> None:
        self.targets = []  # what the integrations' callables hold (the Trainer's model): no longer
