"""Deliver snapshots to sinks off the training step, one isolated lane per sink.

The interface the probe uses and the lanes' rules are in docs/sinks.md (the dispatcher), what
the user sees in docs/live-probe.md (writing off the training step). In short: a background sink
gets a bounded queue drained by a daemon thread, the others are called on the caller's thread
(their ``flush()``/``finish()`` on a short-lived helper thread); a failing sink is retried
(``recover()``, then ``log``) at every later snapshot and silences no other; a full lane drops
its oldest snapshot (a ``lossless`` one first waits up to :data:`BACKPRESSURE_TIMEOUT`);
``flush``/``close`` are bounded, and a lane still busy at ``close()`` is given up with the steps
it did not deliver named. Deliveries run in a copy of the caller's :mod:`contextvars` context.
Warnings go through :func:`attn_probe.isolation.safe_warn`.
"""

from __future__ import annotations

import atexit
import contextvars
import os
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..isolation import safe_warn
from . import RunInfo, Snapshot, sink_members

__all__ = ["SinkDispatcher", "SinkStats", "sink_name", "describe_steps", "before_exit_flush",
           "DEFAULT_QUEUE_SIZE", "DEFAULT_TIMEOUT", "EXIT_TIMEOUT", "BACKPRESSURE_TIMEOUT"]

#: snapshots a lane holds before it drops its oldest
DEFAULT_QUEUE_SIZE = 64
#: seconds ``close()`` (and ``flush()`` without a timeout) waits for all lanes together
DEFAULT_TIMEOUT = 60.0
#: seconds the interpreter-exit hook waits for dispatchers that were never closed
EXIT_TIMEOUT = 10.0
#: seconds the caller waits for room in a full lane of a ``lossless`` sink before dropping
BACKPRESSURE_TIMEOUT = 10.0


def sink_name(sink: Any) -> str:
    """A sink as named in warnings: its class, and its file or directory when it has one."""
    name = type(sink).__name__
    where = getattr(sink, "path", None) or getattr(sink, "log_dir", None)
    return f"{name}({where})" if isinstance(where, str) and where else name


def describe_steps(steps: Sequence[int]) -> str:
    """``"step 5"``, ``"steps 5, 10"`` or ``"steps 5 to 245 (48 snapshots)"``."""
    if not steps:
        return "no step"
    if len(steps) == 1:
        return f"step {steps[0]}"
    if len(steps) <= 4:
        return "steps " + ", ".join(str(s) for s in steps)
    return f"steps {steps[0]} to {steps[-1]} ({len(steps)} snapshots)"


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class SinkStats:
    """What happened to one sink's snapshots (``SinkDispatcher.stats()``)."""

    sink: str
    background: bool
    delivered: int = 0
    #: snapshots whose ``log`` (or ``recover``) raised
    lost: int = 0
    #: snapshots dropped because the lane's queue was full
    dropped: int = 0
    #: snapshots still waiting (or in flight) when ``close()`` gave up on the lane
    undelivered: int = 0
    #: the sink is failing now (its last delivery raised)
    failing: bool = False
    #: the most recent failure, as ``Type: message``
    last_error: str | None = None
    lost_steps: list[int] = field(default_factory=list)
    #: the steps of ``undelivered``: the one the sink was still sending, then those waiting
    unconfirmed_steps: list[int] = field(default_factory=list)


class _Item:
    """One entry of a lane's queue: a snapshot, or a flush/finish request."""

    __slots__ = ("kind", "snapshot", "context", "done", "inline")

    def __init__(self, kind: str, snapshot: Snapshot | None = None) -> None:
        self.kind = kind
        self.snapshot = snapshot
        self.context = contextvars.copy_context()
        self.done = threading.Event()
        #: an inline lane's flush/finish run on a helper thread: the context values it started with
        self.inline: dict[Any, Any] | None = None

    def adopt_context(self) -> None:
        """On the caller's thread, once an inline flush/finish ran in time: set the context
        variables it changed (trackio's ``finish()`` clears its current run), as if it ran here."""
        if self.inline is None or not self.done.is_set():
            return
        for var, value in self.context.items():
            if self.inline.get(var, _Item) is not value:
                var.set(value)


class _Lane:
    """One sink: its contract, queue, thread, failure state and counters."""

    def __init__(self, sink: Any, *, background: bool, queue_size: int) -> None:
        self.sink = sink
        self.members = sink_members(sink)
        self.name = sink_name(sink)
        self.background = background and self.members.background
        self.capacity = max(1, int(queue_size))
        self.stats = SinkStats(self.name, self.background)
        self._items: deque[_Item] = deque()
        self._waiting = 0  # snapshots in _items
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._abandoned = False
        self._finished = False
        self._outage: list[int] = []  # steps lost in the current outage
        self._stopped_at: int | None = None
        self._stop_error: str | None = None
        self._warned_drop = False
        self._warned_flush = False
        #: inline lanes: the short-lived thread running the sink's flush()/finish(), if any
        self._helper: threading.Thread | None = None
        #: what the lane's thread is handling now (a batch of snapshots, or one request)
        self._current: list[_Item] = []
        self._progress = 0  # items the lane's thread finished
        self._stalled = False  # a lossless lane made no progress during a whole wait

    def _helper_busy(self) -> bool:
        return self._helper is not None and self._helper.is_alive()

    def _drop_warning(self, step: int, why: str) -> None:
        if not self._warned_drop:
            self._warned_drop = True
            safe_warn(f"attn_probe: sink {self.name} {why}; dropped its {'oldest waiting ' if self.background else ''}"
                      f"snapshot (step {step}). Later drops are counted and reported at close(); training "
                      "continues.")

    # -- submitting (caller's thread) ----------------------------------------------------------

    def submit(self, item: _Item, *, helper: bool = True) -> None:
        """Queue ``item`` (background lane) or deliver it (inline lane; ``helper=False`` runs an
        inline flush/finish here too, for finalisers, which must not start threads)."""
        if not self.background:
            self._submit_inline(item, helper=helper)
            return
        with self._cond:
            if self._finished or self._abandoned:
                item.done.set()
                return
            dropped: int | None = None
            if item.kind == "snapshot":
                if self._waiting >= self.capacity and self.members.lossless and not self._stalled:
                    self._wait_for_room()
                if self._waiting >= self.capacity:
                    old = next(i for i in self._items if i.kind == "snapshot")
                    self._items.remove(old)
                    self._waiting -= 1
                    dropped = old.snapshot.step  # type: ignore[union-attr]
                    self.stats.dropped += 1
                self._waiting += 1
            self._items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"attn_probe sink {self.name}", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if dropped is not None:
            self._drop_warning(dropped, f"is {self.capacity} snapshots behind (slow or blocked)")

    def _wait_for_room(self) -> None:
        """Back-pressure (``self._cond`` held): wait until the lane has room, bounded."""
        deadline, progress = time.monotonic() + BACKPRESSURE_TIMEOUT, self._progress
        while self._waiting >= self.capacity and not (self._finished or self._abandoned):
            left = deadline - time.monotonic()
            if left <= 0:
                self._stalled = self._progress == progress
                return
            self._cond.wait(left)

    def _submit_inline(self, item: _Item, *, helper: bool = True) -> None:
        """Inline lane: a snapshot is delivered now, on the caller's thread; ``flush()``/``finish()``
        run on a short-lived daemon thread (after any earlier one), so that the caller waits for
        them only up to its deadline (a tracker's flush may wait on a dead server for minutes)."""
        if item.kind == "snapshot":
            if self._finished or self._abandoned:
                pass
            elif self._helper_busy():  # still in a flush()/finish() past its deadline: not from two threads
                self.stats.dropped += 1
                self._drop_warning(item.snapshot.step, "is still busy flushing (slow or blocked)")  # type: ignore[union-attr]
            else:
                self._handle([item])
            item.done.set()
            return
        previous = self._helper
        item.inline = dict(item.context.items())

        def run() -> None:
            try:
                if previous is not None:
                    previous.join()
                item.context.run(self._handle, [item])  # also once abandoned: finish() the sink
            except BaseException:  # noqa: BLE001 - never raise from the helper
                pass
            finally:
                item.done.set()

        if not helper or sys.is_finalizing():
            run()  # a thread started now might never run (and Thread.start() would wait for it forever)
            return
        thread = threading.Thread(target=run, name=f"attn_probe sink {self.name} {item.kind}", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no new thread at interpreter shutdown (the exit hook): run it here
            run()
            return
        self._helper = thread

    # -- the lane's thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                batch = [self._items.popleft()]
                if batch[0].kind == "snapshot" and self.members.log_batch is not None:
                    while self._items and self._items[0].kind == "snapshot":
                        batch.append(self._items.popleft())
                if batch[0].kind == "snapshot":
                    self._waiting -= len(batch)
                self._current = batch
                self._cond.notify_all()  # room for a caller waiting on a full lane
            item = batch[0]
            try:
                item.context.run(self._handle, batch)
            except BaseException:  # noqa: BLE001 - the lane never dies (SystemExit included)
                pass
            finally:
                with self._cond:
                    self._current = []
                    self._progress += len(batch)
                    self._stalled = False
                    self._cond.notify_all()
                for done in batch:
                    done.done.set()
            if item.kind == "finish":
                return

    # -- delivery (the lane's thread, or the caller's when inline) ----------------------------

    def _handle(self, batch: list[_Item]) -> None:
        """Deliver a batch of snapshots, or run one flush/finish request."""
        kind = batch[0].kind
        try:
            if kind == "snapshot":
                if not self._abandoned:
                    self._deliver([i.snapshot for i in batch])  # type: ignore[misc]
            elif kind == "flush":
                self._flush_sink()
            elif kind == "finish":
                self._finish_sink()
        except Exception:  # noqa: BLE001 - nothing escapes a lane
            pass

    def _deliver(self, snapshots: list[Snapshot]) -> None:
        """``log`` one snapshot, or ``log_batch`` several; a failure loses all of them."""
        if self._finished:
            return
        try:
            if self.stats.failing and self.members.recover is not None:
                self.members.recover()
            if len(snapshots) > 1 and self.members.log_batch is not None:
                self.members.log_batch(snapshots)
            else:
                self.members.log(snapshots[0])
        except Exception as exc:  # noqa: BLE001 - one sink must not stop training or the others
            for snapshot in snapshots:
                self._failed(snapshot.step, exc)
            return
        self.stats.delivered += len(snapshots)
        if self.stats.failing:
            self._resumed(snapshots[0].step)

    def _failed(self, step: int, exc: BaseException) -> None:
        s = self.stats
        s.lost += 1
        s.lost_steps.append(step)
        s.last_error = _error_text(exc)
        self._outage.append(step)
        if s.failing:
            return
        s.failing = True
        self._stopped_at, self._stop_error = step, s.last_error
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        safe_warn(f"attn_probe: logging to {self.name} stopped at step {step} ({s.last_error}). Its snapshots "
                  "are lost until it recovers; it is retried at every later snapshot, and the other sinks "
                  f"and training continue.\n{tb}")

    def _resumed(self, step: int) -> None:
        lost, self._outage = self._outage, []
        self.stats.failing = False
        safe_warn(f"attn_probe: logging to {self.name} resumed at step {step}; lost {describe_steps(lost)} "
                  f"while it failed (from step {self._stopped_at}: {self._stop_error}).")

    def _flush_sink(self) -> None:
        flush = self.members.flush
        if self._finished or self.stats.failing or flush is None:
            return
        try:
            flush()
        except Exception as exc:  # noqa: BLE001
            if not self._warned_flush:
                self._warned_flush = True
                safe_warn(f"attn_probe: flushing {self.name} failed ({_error_text(exc)}); snapshots it "
                          "accepted may be lost. Training continues.")

    def _finish_sink(self) -> None:
        if self._finished:
            return
        self._finished = True
        try:
            self.members.finish()
        except Exception as exc:  # noqa: BLE001
            safe_warn(f"attn_probe: closing {self.name} failed ({_error_text(exc)}); what it had written "
                      "before stays.")

    # -- closing (caller's thread) -------------------------------------------------------------

    def abandon(self) -> list[int]:
        """Give up on a lane still busy at the deadline: drop what waits; returns the steps not
        delivered (the snapshot in flight first, then those waiting)."""
        with self._cond:
            self._abandoned = True
            busy = [i.snapshot.step for i in self._current if i.snapshot is not None]
            steps = busy + [i.snapshot.step for i in self._items if i.kind == "snapshot"]  # type: ignore[union-attr]
            self._items = deque(i for i in self._items if i.kind != "snapshot")
            self._waiting = 0
            self.stats.undelivered += len(steps)
            self.stats.unconfirmed_steps = sorted(steps)
        return steps

    def report_close(self) -> None:
        s = self.stats
        if s.failing and self._outage:
            safe_warn(f"attn_probe: logging to {self.name} stopped at step {self._stopped_at} and did not "
                      f"resume before close(); lost {describe_steps(self._outage)} ({self._stop_error}).")
        if s.dropped:
            safe_warn(f"attn_probe: sink {self.name} fell behind and dropped {s.dropped} snapshot"
                      f"{'s' if s.dropped != 1 else ''} (queue of {self.capacity}).")


#: dispatchers not closed yet, flushed by the interpreter-exit hook
_OPEN: weakref.WeakSet[SinkDispatcher] = weakref.WeakSet()
_OPEN_GUARD = threading.Lock()
#: called by the exit hook before it flushes, with the seconds left (see :func:`before_exit_flush`)
_BEFORE_FLUSH: list[Callable[[float], None]] = []


def before_exit_flush(hook: Callable[[float], None]) -> None:
    """Have the interpreter-exit hook call ``hook(seconds_left)`` before it flushes the
    dispatchers (once per ``hook``): a probe hands its snapshot still being scored to its
    sinks there. ``hook`` must not raise and should return within the seconds given."""
    if hook not in _BEFORE_FLUSH:
        _BEFORE_FLUSH.append(hook)


def _flush_at_exit() -> None:
    deadline = time.monotonic() + EXIT_TIMEOUT
    for hook in list(_BEFORE_FLUSH):
        try:
            hook(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - never raise at exit
            pass
    with _OPEN_GUARD:
        open_now = list(_OPEN)
    for dispatcher in open_now:
        try:
            dispatcher.flush(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - never raise at exit
            pass
        # finish it here, while the modules still exist: a finaliser run during the interpreter's
        # teardown finds this module's globals already cleared and would finish nothing
        dispatcher._finish_left_open()


atexit.register(_flush_at_exit)


class SinkDispatcher:
    """Fan snapshots out to ``sinks``, each in its own lane (the interface: docs/sinks.md)."""

    def __init__(self, sinks: Iterable[Any], *, background: bool = True, queue_size: int = DEFAULT_QUEUE_SIZE,
                 timeout: float = DEFAULT_TIMEOUT, run_dir: str | None = None) -> None:
        if int(queue_size) < 1:
            raise ValueError(f"queue_size must be at least 1, got {queue_size!r}")
        self.sinks = list(sinks)
        self.background = bool(background)
        self.timeout = float(timeout)
        self._lanes = [_Lane(s, background=self.background, queue_size=queue_size) for s in self.sinks]
        found = [lane.members.directory for lane in self._lanes if lane.members.directory is not None]
        self.run_dir = run_dir if run_dir is not None else (found[0] if found else None)
        self._pid = os.getpid()
        self._closed = False
        self._started = False
        #: the sink whose ``start`` raised in :meth:`start`, if one did
        self.failed_sink: Any = None

    def start(self, run: RunInfo) -> None:
        """Bind ``run_dir`` into each sink, then ``start(run)`` each on this thread; on an exception
        the sinks already started are finished and the exception propagates."""
        for lane in self._lanes:
            if lane.members.bind_run_dir is not None:
                try:
                    lane.members.bind_run_dir(self.run_dir)
                except Exception:  # noqa: BLE001 - the sink then works without a run directory
                    pass
        started: list[_Lane] = []
        try:
            for lane in self._lanes:
                self.failed_sink = lane.sink
                lane.members.start(run)
                started.append(lane)
            self.failed_sink = None
        except BaseException:
            for lane in started:
                lane._finish_sink()
            for lane in self._lanes:
                lane._finished = True
            self._closed = True
            raise
        self._started = True
        with _OPEN_GUARD:
            _OPEN.add(self)

    def _usable(self) -> bool:
        return self._started and not self._closed and os.getpid() == self._pid

    def log(self, snapshot: Snapshot) -> None:
        """Hand ``snapshot`` to every sink's lane (inline lanes deliver now). Never raises."""
        if not self._usable():
            return
        for lane in self._lanes:
            try:
                lane.submit(_Item("snapshot", snapshot))
            except Exception:  # noqa: BLE001
                pass

    def _request(self, kind: str, timeout: float | None) -> list[_Item]:
        """Submit a flush/finish to every lane; wait for them all until the deadline."""
        items = []
        for lane in self._lanes:
            item = _Item(kind)
            lane.submit(item)
            items.append(item)
        deadline = time.monotonic() + (self.timeout if timeout is None else max(0.0, float(timeout)))
        for item in items:
            item.done.wait(max(0.0, deadline - time.monotonic()))
            item.adopt_context()
        return items

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot logged so far reached its sink (and the sink's ``flush()`` ran);
        ``timeout`` defaults to the dispatcher's. Returns whether all lanes got there."""
        if not self._usable():
            return True
        try:
            return all(item.done.is_set() for item in self._request("flush", timeout))
        except Exception:  # noqa: BLE001
            return False

    def close(self, timeout: float | None = None) -> bool:
        """Deliver what waits, finish every sink, stop the threads; bounded by ``timeout``.

        Lanes still busy at the deadline are abandoned and what they did not deliver is warned
        about by step. Returns whether every lane finished in time. Never raises.
        """
        if self._closed or os.getpid() != self._pid:
            return True
        self._closed = True
        with _OPEN_GUARD:
            _OPEN.discard(self)
        if not self._started:
            return True
        ok = True
        try:
            items = self._request("finish", timeout)
            for lane, item in zip(self._lanes, items, strict=True):
                if not item.done.is_set():
                    ok = False
                    steps = lane.abandon()
                    sent = (f" ({describe_steps(steps)}; the first was sent to it and not confirmed stored, it may "
                            "be lost)" if steps else "")
                    safe_warn(f"attn_probe: sink {lane.name} did not finish within "
                              f"{self.timeout if timeout is None else timeout:g} s at close() and was given up; "
                              f"{len(steps)} snapshot{'s' if len(steps) != 1 else ''} not delivered to it{sent}. "
                              "Its thread is left to finish in the background.")
                lane.report_close()
        except Exception:  # noqa: BLE001
            ok = False
        return ok

    def __del__(self) -> None:
        # Collected without close() (a probe dropped in a notebook): let every lane write what it
        # holds and then finish its sink, without waiting here (this may run on any thread).
        self._finish_left_open()

    def _finish_left_open(self) -> None:
        """Finish every lane of a dispatcher left open (never raises, never waits); once."""
        try:
            if self._started and not self._closed and os.getpid() == self._pid:
                self._closed = True
                for lane in self._lanes:
                    lane.submit(_Item("finish"), helper=False)
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def stats(self) -> list[SinkStats]:
        """A copy of every lane's counters."""
        return [SinkStats(**{**vars(lane.stats), "lost_steps": list(lane.stats.lost_steps),
                             "unconfirmed_steps": list(lane.stats.unconfirmed_steps)})
                for lane in self._lanes]

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        mode = "background" if self.background else "inline"
        return f"SinkDispatcher({', '.join(lane.name for lane in self._lanes)}; {mode})"
