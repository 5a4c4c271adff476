"""Which tracker run the probe logs into, what it already holds, and what was sent to it.

A resumed run (``RunInfo.resume_step`` = G) recomputes the snapshots at steps >= G, and the
tracker run may hold some of them already. Before its first snapshot each tracker run's
:class:`ResendGuard` learns the last probe step L it holds and skips the snapshots at steps
<= L, with one warning. L comes from the tracker where it can be read back (:class:`TrackerRun`
``read_back``: MLflow's metric history, W&B online's ``run.summary["attn_probe/step"]``; bounded
by :data:`READ_BACK_TIMEOUT`), else from the probe's record ``<run dir>/attn_probe_trackers.json``
(:class:`SentRecord`: per tracker run id, the last step sent, rewritten atomically after every
send). Failures never raise: an unreadable record counts as absent (a step may then be sent
twice, never lost). Used by :mod:`attn_probe.sinks.trackers` and the integrations.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..formats.tags import PREFIX
from ..isolation import safe_warn

__all__ = ["STEP_KEY", "SENT_FILENAME", "READ_BACK_TIMEOUT", "NotReadable", "TrackerRun", "SentRecord",
           "ResendGuard", "make_guard", "mlflow_run", "mlflow_held_step", "wandb_run", "wandb_held_step",
           "trackio_run"]

#: the probe's own step axis where a tracker has separate step metrics (W&B)
STEP_KEY = f"{PREFIX}/step"
#: the probe's record of what each tracker run got, in the probe's run directory
SENT_FILENAME = "attn_probe_trackers.json"
_SENT_FORMAT = "attn_probe.trackers/1"
#: seconds a tracker's read-back may take at start before the record is used instead
READ_BACK_TIMEOUT = 20.0


class NotReadable(Exception):
    """The tracker cannot say which probe steps it holds (offline, no such API, an error)."""


@dataclass(frozen=True)
class TrackerRun:
    """One run of one tracker, as the probe sends to it.

    ``tracker``: ``"wandb"``, ``"mlflow"``, ``"trackio"`` or an integration's name;
    ``run_id``: the tracker's id of the run (``None`` where none can be had: the record is then
    kept under the tracker's name alone); ``label``: how messages name it; ``read_back``: returns
    the last probe step the run holds (``None``: it holds none) or raises (:class:`NotReadable`)
    when the tracker cannot tell.
    """

    tracker: str
    run_id: str | None
    label: str
    read_back: Callable[[], int | None] | None = None

    @property
    def key(self) -> str:
        """The record's key: ``tracker:run_id``, or ``tracker`` without an id."""
        return f"{self.tracker}:{self.run_id}" if self.run_id else self.tracker


_RECORD_LOCKS: dict[str, threading.Lock] = {}
_RECORD_WARNED: set[str] = set()
_RECORD_GUARD = threading.Lock()


def _record_lock(path: str) -> threading.Lock:
    with _RECORD_GUARD:
        return _RECORD_LOCKS.setdefault(os.path.realpath(path), threading.Lock())


def _write_atomically(path: str, text: str) -> None:
    """``text`` into ``path`` through a temporary file and ``os.replace``: never a torn file.

    Not fsync'd: it survives the process being killed (the common way a long run ends early);
    after an OS crash it may be older or unreadable, and an older or missing record only makes
    the tracker get some steps twice, never lose one.
    """
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def _as_step(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value)


class SentRecord:
    """``<run_dir>/attn_probe_trackers.json``: per tracker run, the last probe step sent to it.

    ``{"format": "attn_probe.trackers/1", "runs": {"<tracker>:<run id>": {"tracker": ...,
    "run_id": ..., "label": ..., "last_step": 1000, "time": <unix time>}}}``. Several sinks of one
    probe share the file (a lock per path in this process; one probe per run directory). Never
    raises: an unreadable file reads as empty; a failed write is warned about once per file.
    """

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, SENT_FILENAME)

    def _runs(self) -> dict[str, Any]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError, RecursionError):
            return {}
        runs = data.get("runs") if isinstance(data, dict) else None
        return runs if isinstance(runs, dict) else {}

    def last(self, key: str) -> int | None:
        """The last step recorded for ``key``, or ``None``."""
        try:
            with _record_lock(self.path):
                entry = self._runs().get(key)
            return _as_step(entry.get("last_step")) if isinstance(entry, dict) else None
        except Exception:  # noqa: BLE001 - a record that cannot be read is no record
            return None

    def record(self, run: TrackerRun, step: int) -> bool:
        """Record that ``run`` got ``step``; returns whether the file was written. Never raises."""
        try:
            with _record_lock(self.path):
                runs = self._runs()
                runs[run.key] = {"tracker": run.tracker, "run_id": run.run_id, "label": run.label,
                                 "last_step": int(step), "time": round(time.time(), 3)}
                _write_atomically(self.path, json.dumps({"format": _SENT_FORMAT, "runs": runs}, indent=1) + "\n")
            return True
        except Exception as exc:  # noqa: BLE001 - the record must never stop the tracker logging
            with _RECORD_GUARD:
                first = self.path not in _RECORD_WARNED
                _RECORD_WARNED.add(self.path)
            if first:
                safe_warn(f"attn_probe: could not record the steps sent to the trackers in {self.path} "
                          f"({type(exc).__name__}: {exc}); logging to the trackers continues, but if this run "
                          "is resumed they may get some of its steps twice.", stacklevel=2)
            return False


def _call_bounded(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()`` in a daemon thread; :class:`NotReadable` if it has not returned after ``timeout`` s."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name="attn_probe tracker read-back", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise NotReadable(f"no answer within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class ResendGuard:
    """What one tracker run gets of a probe run that may be resumed (see the module docstring).

    ``wants(step)`` says whether to send a snapshot; ``sent(step)`` records a successful send.
    With ``resume_step`` (G) set, the last step the tracker run already holds (L) is looked up
    once, here: the tracker's read-back first, else the record. Snapshots at steps ``<= L`` are
    then not sent again, and a single warning says so when ``L >= G``.
    """

    def __init__(self, run: TrackerRun, record: SentRecord | None, resume_step: int | None) -> None:
        self.run = run
        self.record = record
        #: snapshots at steps up to this one are not sent (``None``: every snapshot is sent)
        self.skip_through: int | None = None
        #: steps not sent because the tracker run already held them
        self.skipped: list[int] = []
        #: where ``skip_through`` came from: ``"tracker"``, ``"record"`` or ``None``
        self.source: str | None = None
        if resume_step is None:
            return
        held, self.source = self._held()
        if held is None:
            return
        self.skip_through = held
        if held >= resume_step:
            self._warn(int(resume_step), held)

    def _held(self) -> tuple[int | None, str | None]:
        if self.run.read_back is not None:
            try:
                return _as_step(_call_bounded(self.run.read_back, READ_BACK_TIMEOUT)), "tracker"
            except Exception:  # noqa: BLE001 - NotReadable, a timeout, a server error: use the record
                pass
        if self.record is not None:
            step = self.record.last(self.run.key)
            if step is not None:
                return step, "record"
        return None, None

    def _warn(self, resume: int, held: int) -> None:
        steps = f"step {resume}" if held == resume else f"steps {resume} to {held}"
        source = ("read back from the tracker" if self.source == "tracker"
                  else f"as recorded in {self.record.path}" if self.record is not None else "")
        kept = ("TensorBoard and attn_probe.jsonl hold this run's values for them" if self.record is not None
                else "this run's values for them go only to the probe's other sinks")
        safe_warn(f"attn_probe: resuming at step {resume}, {self.run.label} already holds the probe's "
                  f"snapshots up to step {held} ({source}); its snapshots at {steps} are not sent to it again, "
                  f"so it keeps the values logged before the resume ({kept}); it gets this run's snapshots "
                  f"from the first one after step {held}.", stacklevel=3)

    def wants(self, step: int) -> bool:
        if self.skip_through is not None and step <= self.skip_through:
            self.skipped.append(int(step))
            return False
        return True

    def sent(self, step: int) -> None:
        if self.record is not None:
            self.record.record(self.run, step)


def make_guard(describe: Callable[[], TrackerRun], run_dir: str | None, resume_step: int | None) -> ResendGuard | None:
    """A :class:`ResendGuard` for the tracker run ``describe()`` names, or ``None`` (never raises).

    ``None`` when the run cannot be described: the sink then sends every step, as before.
    """
    try:
        record = SentRecord(run_dir) if run_dir else None
        return ResendGuard(describe(), record, resume_step)
    except Exception as exc:  # noqa: BLE001 - never stop the tracker (or training) over this
        safe_warn(f"attn_probe: could not tell which tracker run the probe logs into ({type(exc).__name__}: "
                  f"{exc}); every snapshot is sent to it, also those it may hold from before a resume.")
        return None


def mlflow_run(client: Any, run_id: str, label: str | None = None) -> TrackerRun:
    """An MLflow run, read back through ``client`` (the history of its probe metrics)."""
    return TrackerRun("mlflow", str(run_id), label or f"MLflow run {run_id}",
                      read_back=lambda: mlflow_held_step(client, str(run_id)))


def mlflow_held_step(client: Any, run_id: str) -> int | None:
    """The last probe step an MLflow run holds (``None``: no probe metric at all).

    The latest step of the first and of the last probe key (sorted), the smaller one: a snapshot
    goes out in batches of at most 1,000 metrics, so a snapshot cut short by a crash counts as
    not held (it is sent again; only the keys it already had get a second value).
    """
    keys = sorted(k for k in client.get_run(run_id).data.metrics if k.startswith(f"{PREFIX}/"))
    if not keys:
        return None
    steps = []
    for key in dict.fromkeys((keys[0], keys[-1])):
        history = client.get_metric_history(run_id, key)
        if history:
            steps.append(max(int(m.step) for m in history))
    return min(steps) if steps else None


def wandb_run(run: Any, step_key: str | None = STEP_KEY, label: str | None = None) -> TrackerRun:
    """A W&B run; read back from ``run.summary[step_key]`` when online (``step_key=None``: never)."""
    run_id = str(run.id)
    read_back = (lambda: wandb_held_step(run, step_key)) if step_key else None
    return TrackerRun("wandb", run_id, label or f"W&B run {run_id}", read_back=read_back)


def wandb_held_step(run: Any, step_key: str) -> int:
    """The last probe step of a resumed online W&B run: the summary keeps every key's last value.

    Offline, the summary of a resumed run starts empty, and a summary without the key proves
    nothing: both raise :class:`NotReadable` (the record is used then).
    """
    settings = getattr(run, "settings", None)
    if getattr(run, "offline", False) or getattr(settings, "mode", None) in ("offline", "dryrun", "disabled"):
        raise NotReadable("W&B is offline")
    step = _as_step(run.summary.get(step_key))
    if step is None:
        raise NotReadable(f"the run's summary has no {step_key!r}")
    return step


def trackio_run(run: Any, label: str | None = None) -> TrackerRun:
    """A trackio run: recorded under its project and id (its id stays the same on ``resume=``)."""
    project = getattr(run, "project", None)
    name = getattr(run, "name", None)
    run_id = getattr(run, "id", None) or name
    return TrackerRun("trackio", f"{project}/{run_id}", label or f"trackio run {name!r} of project {project!r}")
