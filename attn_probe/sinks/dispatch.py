"""Deliver snapshots to sinks off the training step, one isolated lane per sink.

:class:`SinkDispatcher` is what the probe writes through. Each sink gets a *lane*: a bounded
queue and a daemon thread that drains it, so that

* a slow or blocked sink (MLflow over HTTP retries a dead server for minutes) delays neither
  the training step nor any other sink;
* a failing sink never silences another: an exception from ``sink.log`` is caught in its
  lane, the snapshot is counted as lost for that sink only, and the user is warned once when
  the sink stops and once when it resumes (naming the sink, the steps lost and the step it
  resumed at);
* a failed sink is retried at every later snapshot: ``sink.recover()`` (when the sink has
  one: reopen a file or a writer) and then ``sink.log`` again.

**Queue full.** A lane holds at most ``queue_size`` snapshots. When a new snapshot arrives at a
full lane, the lane drops its *oldest* waiting snapshot (the newest state is the one worth
showing once the sink catches up; the final snapshot at ``close()`` is never the one
dropped), counts it, warns at the first drop and reports the total at ``close()``.

**flush / close.** ``flush(timeout)`` returns once every snapshot submitted before it has been
handed to its sink (and the sink's own ``flush()``, if any, has run), or when ``timeout``
seconds have passed (returns ``False`` then). ``close(timeout)`` does the same, then calls
each sink's ``finish()`` in its lane; a lane still busy at the deadline is abandoned: its
waiting snapshots are dropped and counted in a warning, and its thread (a daemon) finishes
the sink if the blocked call ever returns. An inline lane's ``flush()``/``finish()`` run on a
short-lived daemon thread (one after the other), so they are bounded by the same deadline;
while one outlives it, that lane's new snapshots are dropped and counted (a sink is never
called from two threads at once). Nothing waits without a bound, and the daemon
threads never hold up interpreter exit; an ``atexit`` hook flushes dispatchers that were
never closed, bounded by :data:`EXIT_TIMEOUT` (first handing them, through
:func:`before_exit_flush`, the snapshots unclosed probes are still scoring).

**Which thread.** A sink gets a background lane when its class says it is safe to call from
another thread: ``background = True`` (the TensorBoard and trajectory sinks do; a network
sink should). Any other sink is delivered inline, on the caller's thread, with the same
isolation, retries and warnings: calling a sink from a thread it was not written for can
break it silently (MLflow's fluent API keeps the active run per thread: from another thread
it would log into a new run; :class:`~attn_probe.sinks.mlflow.MlflowSink` reads it only in
``start`` and then uses its own client and run id, so it is a background sink).
``SinkDispatcher(background=False)`` delivers every sink
inline (for debugging, and for tests that want files written when ``log`` returns).
Background deliveries run in a copy of the caller's :mod:`contextvars` context taken at
submission, so libraries that keep their current run in a ``ContextVar`` (trackio) see it.

**Deferred sinks.** A sink whose ``log`` only queues the snapshot (MLflow's asynchronous
batches) says so with ``deferred = True`` and reports later, through ``settled()``, which
steps were stored or lost: a list of ``(step, error)`` in step order, ``error`` ``None`` once
stored. The lane asks after every ``log``, ``flush`` and ``finish``; a stored step counts as
delivered (and ends an outage), a lost one goes through the ordinary failure path (counted in
``lost_steps``, the stop/resume/close warnings name it). ``unsettled()`` (optional) names the
steps still pending; a lane given up at ``close()`` reports them (``unconfirmed_steps``).

**The run directory.** Before starting the sinks, ``start`` calls ``sink.bind_run_dir(path)``
on every sink that has that method (the tracker sinks keep their record of the steps each
tracker run got there, :mod:`attn_probe.sinks.trackers`): ``path`` is the ``run_dir`` given
to the dispatcher, else the directory of the probe's trajectory sink (``attn_probe.jsonl``),
else ``None``.

**Never raises.** ``log``, ``flush`` and ``close`` catch everything; warnings go through
:func:`safe_warn`, which falls back to stderr when the warnings filter turns them into
exceptions (``python -W error``). ``start`` is the exception: it runs at attach time on the
caller's thread and raises, after finishing the sinks already started.
"""

from __future__ import annotations

import atexit
import contextvars
import os
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import RunInfo, Snapshot

__all__ = ["SinkDispatcher", "SinkStats", "safe_warn", "sink_name", "describe_steps",
           "DEFAULT_QUEUE_SIZE", "DEFAULT_TIMEOUT", "EXIT_TIMEOUT"]

#: snapshots a lane holds before it drops its oldest
DEFAULT_QUEUE_SIZE = 64
#: seconds ``close()`` (and ``flush()`` without a timeout) waits for all lanes together
DEFAULT_TIMEOUT = 60.0
#: seconds the interpreter-exit hook waits for dispatchers that were never closed
EXIT_TIMEOUT = 10.0


def safe_warn(message: str, category: type[Warning] = RuntimeWarning, stacklevel: int = 2) -> None:
    """``warnings.warn`` that never raises: under ``-W error`` the message goes to stderr instead."""
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Exception:  # noqa: BLE001 - a warning must never stop training
        try:
            print(f"{category.__name__}: {message}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - stderr closed: nothing left to tell
            pass


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
    #: snapshots still waiting when ``close()`` gave up on the lane
    undelivered: int = 0
    #: the sink is failing now (its last delivery raised)
    failing: bool = False
    #: the most recent failure, as ``Type: message``
    last_error: str | None = None
    lost_steps: list[int] = field(default_factory=list)
    #: steps the sink accepted but had not confirmed stored when ``close()`` gave up on it
    #: (a deferred sink, such as MLflow's asynchronous batches, still waiting on its server)
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
        variables it changed (trackio's ``finish()`` clears its current run), as if it had run
        here, as it did before those calls moved to a helper thread."""
        if self.inline is None or not self.done.is_set():
            return
        for var, value in self.context.items():
            if self.inline.get(var, _Item) is not value:
                var.set(value)


class _Lane:
    """One sink: its queue, its thread, its failure state and counters."""

    def __init__(self, sink: Any, *, background: bool, queue_size: int) -> None:
        self.sink = sink
        self.name = sink_name(sink)
        self.background = background and getattr(sink, "background", False) is True
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
        #: what the lane's thread is handling now ("snapshot", "flush", "finish" or None)
        self._current: str | None = None

    def _helper_busy(self) -> bool:
        return self._helper is not None and self._helper.is_alive()

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
                if self._waiting >= self.capacity:
                    for old in self._items:
                        if old.kind == "snapshot":
                            self._items.remove(old)
                            self._waiting -= 1
                            assert old.snapshot is not None
                            dropped = old.snapshot.step
                            self.stats.dropped += 1
                            break
                self._waiting += 1
            self._items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"attn_probe sink {self.name}", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if dropped is not None and not self._warned_drop:
            self._warned_drop = True
            safe_warn(f"attn_probe: sink {self.name} is {self.capacity} snapshots behind (slow or blocked); "
                      f"dropped its oldest waiting snapshot (step {dropped}). Later drops are counted and "
                      "reported at close(); training continues.")

    def _submit_inline(self, item: _Item, *, helper: bool = True) -> None:
        """Inline lane: a snapshot is delivered now, on the caller's thread; the sink's
        ``flush()``/``finish()`` run on a short-lived daemon thread (after any earlier one), so
        that the caller waits for them only up to its deadline (a tracker's flush may wait on a
        dead server for minutes)."""
        if item.kind == "snapshot":
            if self._finished or self._abandoned:
                pass
            elif self._helper_busy():
                # the sink is still in a flush()/finish() that outlived its deadline: calling it
                # from here now would run it on two threads at once
                assert item.snapshot is not None
                self.stats.dropped += 1
                if not self._warned_drop:
                    self._warned_drop = True
                    safe_warn(f"attn_probe: sink {self.name} is still busy flushing (slow or blocked); dropped "
                              f"its snapshot at step {item.snapshot.step}. Later drops are counted and "
                              "reported at close(); training continues.")
            else:
                self._handle(item)
            item.done.set()
            return
        previous = self._helper
        item.inline = dict(item.context.items())

        def run() -> None:
            try:
                if previous is not None:
                    previous.join()
                item.context.run(self._handle, item)  # also once abandoned: finish() the sink
            except BaseException:  # noqa: BLE001 - never raise from the helper
                pass
            finally:
                item.done.set()

        if not helper or sys.is_finalizing():
            # a thread started now might never run (and Thread.start() would wait for it forever)
            run()
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
                item = self._items.popleft()
                if item.kind == "snapshot":
                    self._waiting -= 1
                self._current = item.kind
            try:
                if not (self._abandoned and item.kind == "snapshot"):
                    item.context.run(self._handle, item)
            except BaseException:  # noqa: BLE001 - the lane never dies (SystemExit included)
                pass
            finally:
                self._current = None
                item.done.set()
            if item.kind == "finish":
                return

    # -- delivery (the lane's thread, or the caller's when inline) ----------------------------

    def _handle(self, item: _Item) -> None:
        try:
            if item.kind == "snapshot":
                assert item.snapshot is not None
                self._deliver(item.snapshot)
            elif item.kind == "flush":
                self._flush_sink()
            elif item.kind == "finish":
                self._finish_sink()
        except Exception:  # noqa: BLE001 - nothing escapes a lane
            pass

    def _deliver(self, snapshot: Snapshot) -> None:
        if self._finished:
            return
        step = snapshot.step
        try:
            if self.stats.failing:
                recover = getattr(self.sink, "recover", None)
                if callable(recover):
                    recover()
            self.sink.log(snapshot)
        except Exception as exc:  # noqa: BLE001 - one sink must not stop training or the others
            self._settle()
            self._failed(step, exc)
            return
        if getattr(self.sink, "deferred", False) is True:
            self._settle()  # counted once the sink knows whether it was stored
            return
        self.stats.delivered += 1
        if self.stats.failing:
            self._resumed(step)

    def _settle(self) -> int:
        """Account for what a deferred sink (``deferred = True``) learned since the last call:
        ``sink.settled()`` returns ``(step, error)`` in step order, ``error`` ``None`` for a
        snapshot stored, else the exception its delivery failed with. Returns how many failed."""
        settled = getattr(self.sink, "settled", None)
        if not callable(settled):
            return 0
        try:
            outcomes = list(settled() or ())
        except Exception:  # noqa: BLE001 - nothing escapes a lane
            return 0
        failed = 0
        for step, error in outcomes:
            if error is None:
                self.stats.delivered += 1
                if self.stats.failing:
                    self._resumed(int(step))
            else:
                failed += 1
                self._failed(int(step), error)
        return failed

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
        s = self.stats
        lost, self._outage = self._outage, []
        s.failing = False
        safe_warn(f"attn_probe: logging to {self.name} resumed at step {step}; lost {describe_steps(lost)} "
                  f"while it failed (from step {self._stopped_at}: {self._stop_error}).")

    def _flush_sink(self) -> None:
        flush = getattr(self.sink, "flush", None)
        if self._finished or self.stats.failing or not callable(flush):
            self._settle()
            return
        try:
            flush()
        except Exception as exc:  # noqa: BLE001
            if self._settle():
                return  # the failed snapshots were just reported, by step
            if not self._warned_flush:
                self._warned_flush = True
                safe_warn(f"attn_probe: flushing {self.name} failed ({_error_text(exc)}); snapshots it "
                          "accepted may be lost. Training continues.")
        else:
            self._settle()

    def _finish_sink(self) -> None:
        if self._finished:
            return
        self._finished = True
        try:
            self.sink.finish()
        except Exception as exc:  # noqa: BLE001
            if self._settle():
                return  # the failed snapshots were just reported, by step
            safe_warn(f"attn_probe: closing {self.name} failed ({_error_text(exc)}); what it had written "
                      "before stays.")
        else:
            self._settle()

    # -- closing (caller's thread) -------------------------------------------------------------

    def abandon(self) -> int:
        """Give up on a lane still busy at the deadline: drop what waits; returns how many snapshots."""
        with self._cond:
            self._abandoned = True
            waiting = [i for i in self._items if i.kind == "snapshot"]
            busy = 1 if self._current == "snapshot" and self._thread is not None and self._thread.is_alive() else 0
            self._items = deque(i for i in self._items if i.kind != "snapshot")
            self._waiting = 0
            n = len(waiting) + busy
            self.stats.undelivered += n
        unsettled = getattr(self.sink, "unsettled", None)
        if callable(unsettled):
            try:
                self.stats.unconfirmed_steps = sorted(int(s) for s in unsettled())
            except Exception:  # noqa: BLE001
                pass
        return n

    def report_close(self) -> None:
        s = self.stats
        if s.failing and self._outage:
            safe_warn(f"attn_probe: logging to {self.name} stopped at step {self._stopped_at} and did not "
                      f"resume before close(); lost {describe_steps(self._outage)} ({self._stop_error}).")
        if s.dropped:
            safe_warn(f"attn_probe: sink {self.name} fell behind and dropped {s.dropped} snapshot"
                      f"{'s' if s.dropped != 1 else ''} (queue of {self.capacity}).")


def _trajectory_dir(sinks: Sequence[Any]) -> str | None:
    """The directory of the probe's ``attn_probe.jsonl`` (its trajectory sink), if one is among ``sinks``."""
    from .trajectory import TrajectorySink

    for sink in sinks:
        if isinstance(sink, TrajectorySink) and isinstance(sink.path, str):
            return os.path.dirname(sink.path) or "."
    return None


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


atexit.register(_flush_at_exit)


class SinkDispatcher:
    """Fan snapshots out to ``sinks``, each in its own lane (see the module docstring).

    ``background=False`` delivers inline on the caller's thread; ``queue_size`` bounds each
    lane; ``timeout`` is the default bound of :meth:`flush` and :meth:`close`, in seconds.
    """

    def __init__(self, sinks: Iterable[Any], *, background: bool = True, queue_size: int = DEFAULT_QUEUE_SIZE,
                 timeout: float = DEFAULT_TIMEOUT, run_dir: str | None = None) -> None:
        if int(queue_size) < 1:
            raise ValueError(f"queue_size must be at least 1, got {queue_size!r}")
        self.sinks = list(sinks)
        self.background = bool(background)
        self.timeout = float(timeout)
        self.run_dir = run_dir
        self._lanes = [_Lane(s, background=self.background, queue_size=queue_size) for s in self.sinks]
        self._pid = os.getpid()
        self._closed = False
        self._started = False
        #: the sink whose ``start`` raised in :meth:`start`, if one did
        self.failed_sink: Any = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, run: RunInfo) -> None:
        """``sink.start(run)`` for each sink, on this thread; on an exception the sinks already
        started are finished and the exception propagates (attach-time errors must surface)."""
        run_dir = self.run_dir if self.run_dir is not None else _trajectory_dir(self.sinks)
        for lane in self._lanes:
            bind = getattr(lane.sink, "bind_run_dir", None)
            if callable(bind):
                try:
                    bind(run_dir)
                except Exception:  # noqa: BLE001 - the sink then works without a run directory
                    pass
        started: list[_Lane] = []
        try:
            for lane in self._lanes:
                self.failed_sink = lane.sink
                lane.sink.start(run)
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

    def _wait(self, items: list[_Item], timeout: float | None) -> bool:
        deadline = time.monotonic() + (self.timeout if timeout is None else max(0.0, float(timeout)))
        ok = True
        for item in items:
            if not item.done.wait(max(0.0, deadline - time.monotonic())):
                ok = False
        return ok

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot logged so far reached its sink (and the sink's own ``flush()``
        ran); ``timeout`` defaults to the dispatcher's. Returns whether all lanes got there."""
        if not self._usable():
            return True
        try:
            items = []
            for lane in self._lanes:
                item = _Item("flush")
                lane.submit(item)
                items.append(item)
            ok = self._wait(items, timeout)
            for item in items:
                item.adopt_context()
            return ok
        except Exception:  # noqa: BLE001
            return False

    def close(self, timeout: float | None = None) -> bool:
        """Deliver what waits, finish every sink, stop the threads; bounded by ``timeout``.

        Lanes still busy at the deadline are abandoned (their waiting snapshots are counted as
        undelivered and warned about). Returns whether every lane finished in time. Never raises.
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
            items = []
            for lane in self._lanes:
                item = _Item("finish")
                lane.submit(item)
                items.append(item)
            deadline_ok = self._wait(items, timeout)
            for item in items:
                item.adopt_context()
            for lane, item in zip(self._lanes, items, strict=True):
                if not item.done.is_set():
                    ok = False
                    n = lane.abandon()
                    unconfirmed = lane.stats.unconfirmed_steps
                    sent = (f"; {describe_steps(unconfirmed)} sent to it {'was' if len(unconfirmed) == 1 else 'were'} "
                            "not confirmed stored and may be lost" if unconfirmed else "")
                    safe_warn(f"attn_probe: sink {lane.name} did not finish within "
                              f"{self.timeout if timeout is None else timeout:g} s at close() and was given up; "
                              f"{n} snapshot{'s' if n != 1 else ''} not delivered to it{sent}. Its thread is "
                              "left to finish in the background.")
                lane.report_close()
            ok = ok and deadline_ok
        except Exception:  # noqa: BLE001
            ok = False
        return ok

    def __del__(self) -> None:
        # Collected without close() (a probe dropped in a notebook): let every lane write what it
        # holds and then finish its sink, without waiting here (this may run on any thread).
        try:
            if self._started and not self._closed and os.getpid() == self._pid:
                self._closed = True
                for lane in self._lanes:
                    lane.submit(_Item("finish"), helper=False)
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    # -- introspection ---------------------------------------------------------------------------

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
