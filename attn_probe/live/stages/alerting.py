"""A stage after the assembly: the alert rules (:mod:`attn_probe.live.alerts`) and the stop decision.

Where each rule is evaluated, so that every rank takes the same stop decision at the same step:

- rules on ``max_logit``, ``entropy`` and the QK-clip dry run (``max_logit_signed``,
  ``qk_clip_scale``, ``heads_over_tau``, :mod:`attn_probe.live.stages.qk_clip`) (:data:`EVERY_RANK`):
  on every rank, from the values combined over ranks (identical everywhere), on the training
  thread when they are taken (:meth:`Alerting.check_attention`), even in the asynchronous mode;
  only the columns where something was counted give a value, so a NaN there (a NaN logit) fires;
- rules on the weight metrics and ``logit_bound_ratio``: on the main process, which alone scores
  the weights, when its snapshot is published (:meth:`Alerting.check`). With ``stop_on_alert`` on
  several ranks their stop is shared: :meth:`Alerting.agree`, one MIN all-reduce of three
  integers on the probe's gloo group at every snapshot on every rank (bounded by
  ``agreement_timeout``); a stop found between snapshots (an asynchronous delivery) is shared at
  the next one.

On the main process a fired alert is one line on stderr (printed, like the status line: no file
path, no source line, shown whatever the warnings filter), a call of the user's
``alert_callback``, and ``run.alert`` of the active W&B run, sent from a daemon thread: the
training thread never waits on a tracker.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from ...distributed import Agreement, AgreementError
from ...isolation import Failures, print_line
from ...sinks import Snapshot
from ..alerts import Alert, AlertMonitor, AlertRule, check_rules, impossible_rule
from ..config import ProbeConfig
from .qk_clip import CLIP_METRICS, OVER_METRIC, SCALE_METRIC, SIGNED_METRIC, clip_tables

__all__ = ["EVERY_RANK", "Alerting", "agree_stop", "attention_rows", "build_alerting", "print_line"]

#: the rows of a layer's combined attention table
ATTENTION = ("max_logit", "entropy")
#: metrics whose values are combined over ranks before they are logged: identical on every rank
EVERY_RANK = (*ATTENTION, *CLIP_METRICS)
#: metrics computed from others: NaN when an input is missing (a layer not measured, a zero bound);
#: NaN logits fire the rules on ``max_logit`` and the QK-clip dry run
DERIVED = ("logit_bound_ratio",)


class Alerting:
    """The rules of a probe: ``check_attention`` (every rank), ``check`` (main process), ``agree``.

    ``stop_requested`` is set, identically on every rank, once a rule fired with
    ``stop_on_alert`` (``stop_alert``: the alert that stopped it, on the main process).
    ``ranks``: the probe's agreement group on a run of several processes (``None``: one
    process, where a stop is decided at once). ``fired``: the alerts fired on this rank.
    """

    def __init__(self, rules: Sequence[AlertRule], *, stop_on_alert: bool, callback: Callable[[Alert], Any] | None,
                 is_main_process: bool, failures: Failures, ranks: Agreement | None = None) -> None:
        every = [r for r in rules if r.metric in EVERY_RANK]
        main = [r for r in rules if r.metric not in EVERY_RANK]
        self.every_rank = AlertMonitor(every) if every else None
        self.main = AlertMonitor(main) if main else None
        self.stop_on_alert = stop_on_alert
        self.callback = callback
        self.is_main_process = is_main_process
        self.failures = failures
        self.ranks = ranks
        self.fired: list[Alert] = []
        self.stop_requested = False
        self.stop_alert: Alert | None = None
        self._pending: Alert | None = None  # main process: a stop to share at the next agreement
        self._watch: ResumeWatch | None = None  # the resume cut's walk, replayed (:meth:`resume_watch`)

    @property
    def shares_stop(self) -> bool:
        """Whether the ranks agree on the stop at each snapshot: ``stop_on_alert`` with a rule that
        only the main process evaluates, on several ranks."""
        return self.stop_on_alert and self.main is not None and self.ranks is not None

    def check_attention(self, step: int, rows: Iterable[dict[str, Any]]) -> list[Alert]:
        """The rules on :data:`EVERY_RANK` on ``step``'s combined values (every rank)."""
        if self.every_rank is None:
            return []
        fired = self.every_rank.evaluate(step, rows)
        if fired and self.stop_on_alert:
            self._stop(fired[0])
        self._report(fired)
        return fired

    def check(self, snapshot: Snapshot) -> list[Alert]:
        """The other rules on a published snapshot (main process; a stop is shared with :meth:`agree`)."""
        if self.main is None:
            return []
        rows: dict[tuple, dict[str, Any]] = {}
        for r in snapshot.records:
            if r.metric in DERIVED and r.value != r.value:
                continue  # a NaN ratio only says an input is missing; NaN logits or weights fire their own rules
            key = (r.group, r.layer, r.head)
            rows.setdefault(key, {"group": r.group, "layer": r.layer, "head": r.head})[r.metric] = r.value
        fired = self.main.evaluate(snapshot.step, rows.values())
        if fired and self.stop_on_alert and not self.stop_requested:
            if self.ranks is None:
                self._stop(fired[0])
            elif self._pending is None:
                self._pending = fired[0]
        self._report(fired)
        return fired

    def agree(self, step: int) -> None:
        """Every rank, at each snapshot (taken or skipped) when :attr:`shares_stop`: one MIN
        all-reduce of ``[no stop here, step, -step]``. A stop on any rank stops every rank; ranks
        at different steps raise ``RuntimeError`` (every rank alike). Raises
        :class:`~attn_probe.distributed.AgreementError` when the group failed (the caller
        disables the probe on this rank)."""
        assert self.ranks is not None
        no_stop, low, minus_high = self.ranks.min([0 if self._pending is not None else 1, int(step), -int(step)])
        if low != -minus_high:
            raise RuntimeError(f"the ranks disagree on the step of the stop decision ({low} to {-minus_high})")
        if not no_stop and not self.stop_requested:
            self._stop(self._pending)
        self._pending = None

    @property
    def metrics(self) -> set[str]:
        """The metrics its rules watch."""
        return {rule.metric for monitor in (self.every_rank, self.main) if monitor is not None
                for rule in monitor.rules}

    def _replay_monitors(self, every_rank: bool) -> dict[str, AlertMonitor | None]:
        return {"every": self.every_rank if every_rank else None, "main": self.main}

    def resume_watch(self, resume_step: int, *, every_rank: bool = True) -> ResumeWatch | None:
        """A reader of the resume cut's walk (the trajectory sink hands it to
        :func:`~attn_probe.formats.cutting.cut_run` ``watch=``) that replays the rules over the rows
        the cut keeps, so that :meth:`restore` needs no walk of its own (``None``: no rule)."""
        monitors = self._replay_monitors(every_rank)
        if not _metrics_of(monitors):
            return None
        self._watch = ResumeWatch(monitors, int(resume_step), every_rank)
        return self._watch

    def restore(self, path: str, run_id: str, *, every_rank: bool = True) -> int:
        """Rebuild the rules' state (growth windows, rules already fired, NaNs already reported) from
        the rows of the run ``run_id`` that the trajectory ``path`` holds, as if this probe had seen
        them: a resumed run then fires what an uninterrupted one fires. Nothing is reported and no
        stop is requested for what fired before the resume. ``every_rank=False`` leaves the rules on
        ``max_logit``/``entropy`` fresh (another rank, which cannot read the file, must take the same
        stop decision). Returns the steps replayed; may raise ``OSError``.

        The file was cut back to the resumed step already: the rows are those before it. They are
        replayed as the rules saw them live: the attention statistics of a column that was not
        measured (``null`` in the file) give no row, a NaN derived metric neither (:meth:`check`).
        When the cut's walk was watched (:meth:`resume_watch`) and settled which run this is, its
        replay is taken; otherwise the file is read again.
        """
        from ...formats.run_rows import RunRows

        monitors = self._replay_monitors(every_rank)
        metrics = _metrics_of(monitors)
        if not metrics:
            return 0
        watch, self._watch = self._watch, None
        found = watch.outcome(path, run_id) if watch is not None and watch.every_rank == every_rank else None
        if found is not None:
            replayed, steps = found
        else:
            replay = _Replay(monitors)
            reader = RunRows(path, run_id, metrics)
            for key, step, rows in reader:
                replay.snapshot(key, step, rows)
            replayed, steps = replay.fresh.get(reader.latest), replay.steps.get(reader.latest, 0)
        if replayed is None:
            return 0
        if "every" in replayed:
            self.every_rank = replayed["every"]
        if "main" in replayed:
            self.main = replayed["main"]
        return steps

    def _stop(self, alert: Alert | None) -> None:
        self.stop_requested = True
        self.stop_alert = alert

    def _report(self, fired: list[Alert]) -> None:
        self.fired.extend(fired)
        if not self.is_main_process:
            return
        for alert in fired:
            print_line(alert.message())
            if self.callback is not None:
                try:
                    self.callback(alert)
                except Exception as exc:  # noqa: BLE001 - user code must not stop training
                    self.failures.report("the alert callback", exc)
            _tracker_alert(alert, self.failures)


def build_alerting(config: ProbeConfig, known: Collection[str], *, logged: Collection[str], layers: Iterable[int],
                   is_main_process: bool, failures: Failures, ranks: Agreement | None = None) -> Alerting | None:
    """The stage for ``config.alerts`` (``None`` without rules). Raises ``ValueError``, one line,
    for a rule that can never fire: a metric that is not one of ``known`` (the names a rule may
    take) or not ``logged`` in this run, a head rule without ``per_head``, a layer index not
    among the measured ``layers``."""
    if not config.alerts:
        return None
    rules = check_rules(config.alerts, known)  # "alert on unknown metric ..."
    layers = set(layers)
    for rule in rules:
        why = impossible_rule(rule, logged=logged, per_head=config.per_head, layers=layers)
        if why is None and rule.heads and rule.metric == OVER_METRIC:
            why = f"{OVER_METRIC} is a per-layer count (no per-head values): leave heads=True out"
        if why is not None:
            raise ValueError(f"alert rule {rule.metric} {rule.describe()} can never fire: {why}")
    return Alerting(rules, stop_on_alert=config.stop_on_alert, callback=config.alert_callback,
                    is_main_process=is_main_process, failures=failures, ranks=ranks)


def _tracker_alert(alert: Alert, failures: Failures) -> None:
    """``run.alert`` of the active W&B run, if W&B is in use here, on a daemon thread (never waited for)."""
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None or not hasattr(run, "alert"):
        return

    def send() -> None:
        try:
            run.alert(title=f"attn_probe: {alert.metric} in layer {alert.layer}", text=alert.message())
        except Exception as exc:  # noqa: BLE001
            failures.report("the W&B alert", exc)

    threading.Thread(target=send, name="attn_probe-alert", daemon=True).start()


def agree_stop(alerting: Alerting | None, step: int, disable: Callable[[str], None]) -> None:
    """:meth:`Alerting.agree` where the stop is shared; a failed group calls ``disable`` (this rank
    then issues no further collective); never raises."""
    if alerting is None or not alerting.shares_stop:
        return
    try:
        alerting.agree(step)
    except AgreementError as exc:
        disable(str(exc))
    except Exception as exc:  # noqa: BLE001 - a step mismatch: the same on every rank
        alerting.failures.report("the stop decision between ranks", exc)


def attention_rows(layers: Sequence[Any], tables: Sequence[Any], *, per_head: bool,
                   counted: Sequence[Any] | None = None, signed: Sequence[Any] | None = None,
                   tau: float | None = None) -> list[dict[str, Any]]:
    """Rows ``{group, layer, head, max_logit, entropy}`` of the combined attention ``tables`` (per
    layer a ``(2, 1 + H)`` table, rows :data:`ATTENTION`, column 0 the layer), heads with ``per_head``;
    with ``signed`` (per layer the :func:`~attn_probe.live.stages.qk_clip.signed_columns` entry) and
    ``tau``, also the QK-clip dry run (``heads_over_tau`` on the layer row only).
    ``counted`` (per layer, per column): columns where nothing was measured (no forward reached the
    layer, or its measurement failed) give no row, so their NaN never fires a rule; a NaN in a
    counted column (a NaN logit) does."""
    rows = []
    for i, (layer, table) in enumerate(zip(layers, tables, strict=True)):
        clip = None
        if signed is not None and tau is not None:
            (_, scale_table), (_, over) = clip_tables(signed[i], tau, per_head=True)
            clip = (scale_table, float(over[0, 0]))
        for col in range(table.shape[1] if per_head else 1):
            if counted is not None and not counted[i][col]:
                continue
            row = {"group": layer.group, "layer": layer.layer, "head": None if col == 0 else col - 1,
                   **{name: float(table[k, col]) for k, name in enumerate(ATTENTION)}}
            if clip is not None and col < clip[0].shape[1]:
                row[SIGNED_METRIC] = float(clip[0][0, col])
                row[SCALE_METRIC] = float(clip[0][1, col])
                if col == 0:
                    row[OVER_METRIC] = clip[1]
            rows.append(row)
    return rows


def _metrics_of(monitors: dict[str, AlertMonitor | None]) -> set[str]:
    return {rule.metric for m in monitors.values() if m is not None for rule in m.rules}


class _Replay:
    """Fresh copies of the rules evaluated over each run's snapshots, as they were evaluated live."""

    def __init__(self, monitors: dict[str, AlertMonitor | None]) -> None:
        self.monitors = {name: m for name, m in monitors.items() if m is not None}
        self.fresh: dict[Any, dict[str, AlertMonitor]] = {}  # run key -> monitors replayed over that run
        self.steps: dict[Any, int] = {}

    def snapshot(self, key: Any, step: int, rows: Iterable[tuple]) -> None:
        replay = self.fresh.setdefault(key, {name: AlertMonitor(m.rules) for name, m in self.monitors.items()})
        by_row: dict[str, dict[tuple, dict[str, Any]]] = {"every": {}, "main": {}}
        for _step, group, layer, head, metric, value in rows:
            every = metric in EVERY_RANK
            if value != value and (every or metric in DERIVED):
                continue  # not measured there, or an input missing: no row live either
            table = by_row["every" if every else "main"]
            table.setdefault((group, layer, head), {"group": group, "layer": layer, "head": head})[metric] = value
        for name, monitor in replay.items():
            if by_row[name]:
                monitor.evaluate(step, by_row[name].values())
        self.steps[key] = self.steps.get(key, 0) + 1

    def forget(self, key: Any) -> None:
        self.fresh.pop(key, None)
        self.steps.pop(key, None)


class ResumeWatch:
    """The alert replay of a resume read on the resume cut's walk (one walk of the file for both).

    Called with each piece of the walk (:func:`~attn_probe.formats.cutting.cut_run` ``watch=``), it
    replays the rules over the rows each run would keep were it the one cut back to
    ``resume_step``; :meth:`finish` is told what the cut did. The replay of at most
    :attr:`LIMIT` runs is held at once (the runs whose rows came last); :meth:`outcome` is ``None``
    whenever the walk cannot stand for a read of the cut file (a rewritten file, a run without an
    id, a run no longer held): the rules are then replayed from the file as before."""

    LIMIT = 8

    def __init__(self, monitors: dict[str, AlertMonitor | None], resume_step: int, every_rank: bool) -> None:
        from ...formats.run_rows import RunRows

        self.every_rank = every_rank
        self._replay = _Replay(monitors)
        self._rows = RunRows(None, None, _metrics_of(monitors), below=resume_step)
        self._held: dict[Any, None] = {}  # run keys followed, least recent first
        self._dropped: set = set()  # run keys no longer followed
        self._ids: set[str] = set()  # ids of the runs seen
        self._result: tuple[str, str, Any] | None = None

    def __call__(self, piece: tuple) -> None:
        key = piece[2]
        if key is None or key[0] != "run":
            return
        self._ids.add(key[1])
        if key in self._dropped:
            return
        if key in self._held:
            del self._held[key]
        elif len(self._held) >= self.LIMIT:
            old = next(iter(self._held))
            del self._held[old]
            self._dropped.add(old)
            self._rows.forget(old)
            self._replay.forget(old)
        self._held[key] = None
        for done in self._rows.feed(piece):
            self._replay.snapshot(*done)

    def finish(self, path: str, cut: Any, run_id: str) -> None:
        """What the cut of ``path`` did (a :class:`~attn_probe.formats.cutting.Cut`) and the id the
        resumed run writes under."""
        for done in self._rows.drain():
            self._replay.snapshot(*done)
        target = cut.target
        if cut.rewritten:
            return
        if target is None:
            if run_id not in self._ids:  # a run new to the file: nothing of it to replay
                self._result = (path, run_id, None)
        elif target[0] == "run" and target[1] == run_id and target not in self._dropped:
            self._result = (path, run_id, target)

    def outcome(self, path: str, run_id: str) -> tuple[dict[str, AlertMonitor] | None, int] | None:
        """``(monitors replayed, steps)`` of the run ``run_id`` of ``path`` as a read of the cut file
        would give them (``None``: the walk cannot tell, read the file)."""
        if self._result is None or self._result[:2] != (path, run_id):
            return None
        key = self._result[2]
        return self._replay.fresh.get(key), self._replay.steps.get(key, 0)
