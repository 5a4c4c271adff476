"""What the trackers (W&B, MLflow, trackio, the integrations' trackers) share, in one place.

* Keys: :func:`tracker_key`, the TensorBoard tags of :func:`attn_probe.tags.scalar_tag`
  (``attn_probe/{group}/{metric}/layer_{LL}[/head_{HH}]``, ``.../{median|q25|q75}``) with
  every character outside ``[A-Za-z0-9_./-]`` (which every tracker accepts) rewritten as ``_``.
* The probe's W&B step axis: :func:`define_probe_axis`; how its values share a W&B run with
  someone else's logging: :class:`WandbRows`.
* :class:`TrackerSink`, the base of the plain-loop sinks, and :class:`TrackerFanOut`, which
  sends to the targets (:class:`TrackerTarget`) that the Trainer and Accelerate integrations hand it.
* Resume, no step twice: each tracker run's :class:`~attn_probe.tracker_record.ResendGuard`.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..isolation import safe_warn
from ..tags import PREFIX, scalar_tag
from ..tracker_record import STEP_KEY, ResendGuard, TrackerRun, make_guard
from . import RunInfo, Sink, Snapshot

__all__ = ["KEY_PATTERN", "STEP_KEY", "TrackerSink", "tracker_key", "tracker_metrics", "import_tracker",
           "define_probe_axis", "WandbRows", "current_trackio_run", "TrackerTarget", "TrackerFanOut"]

#: characters every supported tracker accepts in a metric key
KEY_PATTERN = re.compile(r"^[A-Za-z0-9_./-]+$")
_INVALID = re.compile(r"[^A-Za-z0-9_.-]")


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


def define_probe_axis(run: Any) -> None:
    """Give a W&B run the probe's own step axis: ``attn_probe/*`` plotted against ``attn_probe/step``."""
    run.define_metric(STEP_KEY)
    run.define_metric(f"{PREFIX}/*", step_metric=STEP_KEY)


#: what the warnings name as the lossless alternative
WANDB_FIX = ("log the probe into a W&B run of its own, in the same group: "
             "sinks=[WandbSink(run, separate_run=True)]")


class WandbRows:
    """Put the probe's values into a W&B run that someone else also logs into, losing nothing silently.

    W&B keys history rows by one step that only increases; a commit flushes the open row and
    moves to the next step, and a ``log(..., step=s)`` with ``s`` below the current step is
    dropped. So the right way in depends on how the run's owner logs, which this class watches:
    it wraps the run's ``_partial_history_callback`` (the one method every ``run.log`` and
    ``wandb.log`` call goes through, W&B 0.19 to 0.31) to see each call's ``step``/``commit``,
    compared with W&B's own step counter ``run._local_step``; it changes nothing it is handed.

    * The owner never passes ``step=`` (W&B's default; the Trainer's W&B callback): each snapshot
      is committed as a row of its own on W&B's default Step axis (nothing of the owner's is
      dropped: their next ``log()`` simply takes the next step). While the owner has a row open
      (``log(..., commit=False)``, not committed yet) the snapshot joins that row instead.
    * The owner passes ``step=``: a commit by the probe could make their next
      ``log(..., step=s)`` be dropped, so the snapshot joins the open row (``commit=False``) and
      reaches W&B when the owner moves to a later step. Two snapshots in one open row: the earlier
      one is overwritten. Each such loss is counted, the first one warned about (with the fix,
      :data:`WANDB_FIX`), the total at :meth:`close`.
    * Before the owner's first log the probe does not know yet: the first snapshot joins the open
      row (so an owner whose first log is ``log(..., step=0)`` shares it), the next ones are rows
      of their own. An owner whose first ``log(..., step=s)`` then comes at an ``s`` below W&B's
      step has it dropped by W&B; that is warned about at once. (Should the first snapshot still
      be waiting when the owner holds a row open with ``commit=False`` and the next snapshot
      comes, that row is committed first: the owner's split row is then two rows, nothing lost.)

    A lock makes each decision and its ``run.log`` one step as seen by the owner's calls (a
    ``run.log`` only hands the record to W&B's service, it does not wait for it). Where the run
    cannot be watched (another W&B version), snapshots join the open row as before and a warning
    at the start says that some may be lost.
    """

    def __init__(self, run: Any, label: str) -> None:
        self.run = run
        self.label = label
        self.lock = threading.RLock()
        self._mine = threading.local()
        #: the probe's last snapshot is in W&B's open row, not yet flushed
        self.pending = False
        #: the open row holds something of the owner's, not yet flushed
        self.owner_open = False
        #: the owner has logged at least once since the probe started; ... with ``step=``
        self.owner_logged = False
        self.owner_step = False
        #: probe snapshots overwritten in an open row (lost to W&B); the first one's step
        self.lost = 0
        self.first_lost: int | None = None
        #: the owner's logs dropped by W&B because their step was below W&B's step
        self.owner_dropped = 0
        self._pending_step: int | None = None
        self._sent_any = False
        self._watch: Any = None
        self._install()

    # ---------------------------------------------------------------- watching the owner's calls
    def _install(self) -> None:
        original = getattr(self.run, "_partial_history_callback", None)
        if not callable(original) or not isinstance(getattr(self.run, "_local_step", None), int):
            safe_warn(f"attn_probe: cannot follow how {self.label} is logged into (this W&B version has no "
                      "_partial_history_callback/_local_step); the probe's snapshots join the open row, and "
                      f"when two land in one row the earlier is lost to W&B. To lose none, {WANDB_FIX}.")
            return

        def watch(data: Any, step: Any = None, commit: Any = None) -> Any:
            with self.lock:
                try:
                    self._saw(bool(getattr(self._mine, "on", False)), step, commit)
                except Exception:  # noqa: BLE001 - bookkeeping must never break the owner's log
                    pass
                return original(data, step, commit)

        self._watch = watch
        self.run._partial_history_callback = watch
        try:  # one status line, printed like the probe's own start line
            print(f"attn_probe: {self.label}: while it is logged without step=, each probe snapshot is a row "
                  "of its own on W&B's default Step axis (plot attn_probe/* against attn_probe/step); logged "
                  "with step=, snapshots join its rows (docs/live-probe.md, \"W&B rows\")",
                  file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - a status line must never stop training
            pass

    def _saw(self, mine: bool, step: Any, commit: Any) -> None:
        current = int(self.run._local_step)
        if step is not None and not mine:
            self.owner_step = True
        if step is not None and step < current:  # W&B drops this log: nothing changes
            if not mine:
                self.owner_dropped += 1
                if self.owner_dropped == 1:
                    safe_warn(f"attn_probe: W&B drops a log(..., step={step}) into {self.label}: its step is "
                              f"below W&B's step {current}, which the probe's own rows advanced before the "
                              f"first log that passed step=. To lose none, {WANDB_FIX}.")
            return
        if step is not None and step > current:
            self._flushed()
        if not mine:
            self.owner_logged = True
            self.owner_open = True
        if (step is None and commit is None) or commit:
            self._flushed()

    def _flushed(self) -> None:
        self.pending = False
        self.owner_open = False

    # ---------------------------------------------------------------- sending
    def send(self, values: dict[str, float], step: int) -> None:
        """Log one snapshot's ``values`` (which carry ``attn_probe/step``) as the owner's usage allows."""
        with self.lock:
            self._mine.on = True
            try:
                if self._watch is None:
                    self.run.log(values, commit=False)
                    return
                if self.pending:
                    if self.owner_step:
                        self._lose(self._pending_step)
                    else:
                        self.run.log({}, commit=True)  # the earlier snapshot: a row of its own
                if self.owner_step or self.owner_open or not (self.owner_logged or self._sent_any):
                    self.run.log(values, commit=False)
                    self.pending, self._pending_step = True, int(step)
                else:
                    self.run.log(values, commit=True)
                self._sent_any = True
            finally:
                self._mine.on = False

    def _lose(self, step: int | None) -> None:
        self.lost += 1
        if self.lost == 1:
            self.first_lost = step
            safe_warn(f"attn_probe: the probe's snapshot at step {step} did not reach {self.label} (1 lost so "
                      "far): the run is logged with step=, so the probe cannot add rows of its own without "
                      "making W&B drop your later logs, and a W&B row holds one snapshot; only the last "
                      "snapshot before each of your steps reaches it (attn_probe.jsonl and TensorBoard hold "
                      f"all). To lose none, {WANDB_FIX}.", stacklevel=3)

    def close(self) -> None:
        """Stop watching the run (the owner's later logs go straight to W&B) and say what was lost."""
        with self.lock:
            watch, self._watch = self._watch, None
            if watch is not None and getattr(self.run, "__dict__", {}).get("_partial_history_callback") is watch:
                del self.run.__dict__["_partial_history_callback"]
        if self.lost > 1:
            safe_warn(f"attn_probe: {self.lost} of the probe's snapshots did not reach {self.label} (from step "
                      f"{self.first_lost}; the run is logged with step=). To lose none, {WANDB_FIX}.")


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
    sink's :class:`ResendGuard`; ``log`` skips the snapshots the tracker run already holds and
    records each step once ``_send`` returned.
    """

    #: module imported in ``start()`` and the pip extra that installs it
    module = ""
    extra = ""

    def __init__(self, *, per_head: bool = False) -> None:
        self.per_head = bool(per_head)
        self.run: Any = None
        self.owns_run = False
        self.run_info: RunInfo | None = None
        #: which snapshots the tracker run gets (set at ``start()``; ``None``: all)
        self.guard: ResendGuard | None = None
        self._open_now = False

    def _import(self) -> Any:
        return import_tracker(self.module, self.extra, type(self).__name__)

    def start(self, run: RunInfo) -> None:
        if self._open_now:
            raise RuntimeError(f"{type(self).__name__} is already started")
        self.run_info = run
        self._open(run)
        self._open_now = True
        self.guard = make_guard(self._tracker_run, self.run_dir, run.resume_step)

    def log(self, snapshot: Snapshot) -> None:
        if not self._open_now:
            raise RuntimeError(f"{type(self).__name__}.log() before start() or after finish()")
        values = tracker_metrics(snapshot, per_head=self.per_head)
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
    """One tracker that an integration (Trainer, Accelerate) hands to :class:`TrackerFanOut`.

    ``name`` names it in errors; ``run()`` says which tracker run it logs into, called once,
    before its first snapshot (it may set the tracker up first); ``send(values, step)`` sends one
    snapshot's ``{key: value}``. ``step_axis``: a W&B run to give the probe's own step axis
    (:func:`define_probe_axis`, once); its values then carry ``attn_probe/step`` and go into
    that run through :class:`WandbRows` (``send`` is not used), as the run's owner logs allows.
    """

    name: str
    run: Callable[[], TrackerRun]
    send: Callable[[dict[str, float], int], None]
    step_axis: Any = None


class TrackerFanOut(Sink):
    """Send each snapshot to an integration's trackers: keys, step axis and resume in one place.

    Runs on the training thread (the integrations' tracker runs live there). Each target's
    :class:`ResendGuard` is made before its first snapshot, so on a resumed run it skips the
    steps its tracker run already holds. A failing target does not stop the others; the errors
    are raised together afterwards (the dispatcher counts that snapshot as lost for this sink).
    """

    def __init__(self, targets: list[TrackerTarget], *, per_head: bool = False) -> None:
        self.targets = list(targets)
        self.per_head = bool(per_head)
        self.resume_step: int | None = None
        #: per target (by position), its guard once made (``None``: send everything)
        self.guards: dict[int, ResendGuard | None] = {}
        #: per W&B target (by position), how its values go into the run
        self.rows: dict[int, WandbRows] = {}

    def start(self, run: RunInfo) -> None:
        self.resume_step = run.resume_step

    def _guard(self, i: int, target: TrackerTarget) -> ResendGuard | None:
        if i not in self.guards:
            if target.step_axis is not None:
                define_probe_axis(target.step_axis)
                self.rows[i] = WandbRows(target.step_axis, f"{target.name}'s W&B run")
            self.guards[i] = make_guard(target.run, self.run_dir, self.resume_step)
        return self.guards[i]

    def _send(self, i: int, target: TrackerTarget, values: dict[str, float], step: int) -> None:
        rows = self.rows.get(i)
        if rows is not None:
            rows.send(values, step)
        else:
            target.send(values, step)

    def log(self, snapshot: Snapshot) -> None:
        step = int(snapshot.step)
        values = tracker_metrics(snapshot, per_head=self.per_head)
        errors = []
        for i, target in enumerate(self.targets):
            try:
                payload = {**values, STEP_KEY: step} if target.step_axis is not None else dict(values)
                _send_guarded(self._guard(i, target), step, self._send, i, target, payload, step)
            except Exception as exc:  # noqa: BLE001 - one tracker must not silence another
                errors.append(f"{target.name}: {type(exc).__name__}: {exc}")
        if errors:
            raise RuntimeError("tracker failed: " + "; ".join(errors))

    def finish(self) -> None:
        rows, self.rows = self.rows, {}
        for r in rows.values():
            r.close()
        self.targets = []  # what the integrations' callables hold (the Trainer's model): no longer
