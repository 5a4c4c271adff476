"""The live probe: a façade that runs the stages of :mod:`attn_probe.stages` in order.

At each counted step or hand-made snapshot, :class:`Probe` asks

1. the step decision (:class:`~attn_probe.stages.decision.StepDecision`): is it due, is it
   newer than the last snapshot, and on a sharded run do all ranks agree;
2. the measurement (:class:`~attn_probe.stages.measurement.Measurement`): surgery check,
   the walk (gathering what the pairs declare), the scoring core, one host transfer; in the
   asynchronous mode on a worker thread;
3. the assembly (:class:`~attn_probe.stages.assembly.Assembler`): records and statistics;
4. the outputs (:class:`~attn_probe.stages.outputs.Outputs`): the sinks, main process only.

It owns only the step counter, the hook handles and the lifecycle; every public method is
isolated (:func:`attn_probe.isolation.never_raise`): once attached, the probe never stops
training. What counts steps lives in :mod:`attn_probe.counting`; :func:`attn_probe.watch`
(in :mod:`attn_probe.watching`) attaches a probe to a loop. This module imports neither
transformers nor accelerate.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch import nn

from .config import ProbeConfig, config_from_options
from .counting import ForwardPasses, OptimizerUpdates
from .distributed import AgreementError, is_main_process
from .extraction import AttentionLayer, UnsupportedModelError, find_attention
from .images import render_heatmap
from .isolation import Failures, never_raise, safe_warn
from .logdir import LogDirError, LogDirInUseError
from .pairs import QKPair, ScorePair, check_pairs, pair_metric_names
from .sinks import Snapshot
from .stages.alerting import Alerting
from .stages.assembly import Assembler
from .stages.attention import (
    RATIO_METRIC,
    AttentionStage,
    AttentionTables,
    attention_metrics,
    build_stage,
    extra_tables,
)
from .stages.decision import StepDecision, make_agreement
from .stages.measurement import Measured, Measurement
from .stages.outputs import Outputs, SinkStats, announce_line, at_interpreter_exit, run_info

__all__ = [
    "Probe",
    "ProbeConfig",
    "LogDirError",
    "LogDirInUseError",
    "ScorePair",
    "QKPair",
    "render_heatmap",
]

#: open probes in the asynchronous mode (their snapshot in flight is written at interpreter exit)
_SCORING: weakref.WeakSet[Probe] = weakref.WeakSet()


def _deliver_at_exit(seconds: float) -> None:
    """Exit hook (before the sinks are flushed): write each unclosed probe's snapshot in flight.

    Waits for it within ``seconds``; the worker thread then no longer runs while the interpreter
    shuts down (a thread still inside torch then can abort the process).
    """
    deadline = time.monotonic() + seconds
    for probe in list(_SCORING):
        if not probe._closed:
            probe._deliver(wait=True, timeout=max(0.0, deadline - time.monotonic()), closing=True,
                           moment="interpreter exit (the probe was never closed)")


at_interpreter_exit(_deliver_at_exit)


class Probe:
    """Snapshots of the attention metrics of one model, written to sinks on the main process.

    Build it with :func:`watch` (or the Trainer callback). ``snapshot(step)`` takes one by
    hand; ``close()`` (or leaving the ``with`` block) takes a final snapshot when the counter
    moved past the last one and closes the sinks. Collective-safe: call ``snapshot`` and
    ``close`` on every rank.

    ``config`` (a :class:`~attn_probe.config.ProbeConfig`) and/or its fields as keyword
    options say what is measured and when, where it goes (``log_dir``, ``writer``, ``sinks``,
    ``is_main_process``, ``extra_config``, ``purge_stale``, ``restart``) and how it is written;
    an unknown option raises ``TypeError`` naming the valid ones.

    Attach-time problems raise (:class:`~attn_probe.UnsupportedModelError`,
    :class:`LogDirError`); after that, every failure is caught, warned about once, and the
    affected snapshot is skipped.

    The stages are public attributes (``decision``, ``measurement``, ``assembler``,
    ``outputs``: ``None`` off the main process); tests use their documented seams.
    """

    def __init__(self, model: nn.Module, config: ProbeConfig | None = None, **options: Any) -> None:
        self.config = cfg = config_from_options(config, **options)
        self.model = model
        self.pairs: list[ScorePair] = cfg.score_pairs()
        self.metrics = pair_metric_names(self.pairs)
        layers: list[AttentionLayer] = find_attention(model, groups=cfg.groups, layers=cfg.layers,
                                                      **cfg.find_kwargs)
        if not layers:
            raise UnsupportedModelError(
                f"attn_probe: no attention layer matches groups={cfg.groups!r}, layers={cfg.layers!r}")
        check_pairs(self.pairs, layers)  # e.g. the OV pair on an architecture it cannot read
        self.is_main_process = is_main_process() if cfg.is_main_process is None else cfg.is_main_process
        self.step = cfg.start_step
        self.failure_log = Failures()
        agreement = make_agreement(model, cfg.agreement_timeout)  # collective on a sharded run
        self.decision = StepDecision(cfg.schedule, cfg.image_schedule, agreement)
        self.measurement = Measurement(model, cfg, self.pairs, layers, agreement=agreement,
                                       is_main_process=self.is_main_process)
        self.assembler = Assembler([pair.metrics for pair in self.pairs])
        self.attention: AttentionStage | None = None
        #: plain loops arm the attention capture right after the update before a due step; the
        #: Trainer callback turns this off and arms at ``on_step_begin`` (evaluation runs between)
        self.arm_after_update = True
        attention_reason = None
        if cfg.attention_stats:  # the stage itself (registering wrappers) last: nothing after it raises
            from .attention_stats import unavailable_reason

            attention_reason = unavailable_reason(layers)
            if attention_reason is None:
                self.metrics = [*self.metrics, *attention_metrics(self.pairs)]
        self.alerting = None if not cfg.alerts else Alerting(  # ValueError naming the known metrics
            cfg.alerts, [*self.metrics, *(("max_logit", "entropy", RATIO_METRIC) if cfg.attention_stats else ())],
            stop_on_alert=cfg.stop_on_alert, callback=cfg.alert_callback, is_main_process=self.is_main_process,
            failures=self.failure_log)
        if self.measurement.scorer is not None:
            _SCORING.add(self)  # never closed: the exit hook writes the snapshot in flight
        self._handles: list[Any] = []
        self._forward_counter: ForwardPasses | None = None
        self._closed = False
        self._final = False  # close()'s final snapshot: never asynchronous
        self._warned_closed = False
        run = run_info(cfg, model, layers, self.metrics,
                       resume_step=self.step if self.step > 0 or cfg.restart else None)
        self.outputs: Outputs | None = Outputs(cfg, run) if self.is_main_process else None
        if cfg.attention_stats:
            try:
                self.attention = build_stage(model, layers, agreement.group if agreement is not None else None,
                                             cfg.agreement_timeout)
            except Exception as exc:  # noqa: BLE001 - the weight metrics go on
                safe_warn(f"attn_probe: attention statistics are unavailable ({type(exc).__name__}: {exc}); "
                          "the weight metrics go on.")
        self._arm_next()  # the first update after attach

    # -- state read through the stages ---------------------------------------------------------
    @property
    def layers(self) -> list[AttentionLayer]:
        """The attention layers measured (found again after model surgery)."""
        return self.measurement.layers

    @property
    def last_snapshot_step(self) -> int | None:
        return self.decision.last_step

    @property
    def disabled(self) -> bool:
        """A sharded run's probe stops for good after a failed agreement (docs/distributed.md)."""
        return self.decision.disabled

    @property
    def failures(self) -> int:
        """Failures caught since attach (the first one was warned about)."""
        return self.failure_log.count

    @property
    def log_dir(self) -> str | None:
        return self.outputs.log_dir if self.outputs is not None else None

    @property
    def skipped_snapshots(self) -> int:
        """Snapshots skipped because the previous asynchronous one was still being scored."""
        return self.measurement.skipped

    def due(self, step: int) -> bool:
        """Whether the schedule (or the image schedule) fires at ``step``."""
        return self.decision.due(step).any()

    def announce(self, *, every: Any, unit: str) -> None:
        """One line on stderr, main process only: what is watched, how often, where it goes.

        Printed rather than logged so that it shows with default logging settings
        (:func:`attn_probe.stages.outputs.announce_line`).
        """
        import sys

        if not self.is_main_process:
            return
        try:
            print(announce_line(self.model, len(self.layers), self.log_dir, every=every, unit=unit),
                  file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - a status line must never stop training
            pass

    # -- running the stages --------------------------------------------------------------------
    def _assemble(self, measured: Measured, attention: AttentionTables | None = None) -> Snapshot:
        extra = () if attention is None else extra_tables(self.attention, measured.tables, attention, self.pairs,
                                                          self.config.per_head)
        return self.assembler.assemble(measured.step, measured.tables, measured.images, extra)

    def _take(self, step: int, images: bool | None, asynchronous: bool) -> Snapshot | None:
        """Stages 2 to 4 at ``step`` (already decided): measure, assemble, write."""
        attention = self.attention.take(step) if self.attention is not None else None  # every rank
        snap = self.measurement.measure(step, images, asynchronous=asynchronous,
                                        finish=lambda measured: self._assemble(measured, attention))
        if snap is not None:
            self._check_alerts(snap)
            self._write(snap)
        return snap

    @property
    def stop_requested(self) -> bool:
        """An alert fired with ``stop_on_alert`` (the same on every rank; the Trainer stops on it)."""
        return self.alerting is not None and self.alerting.stop_requested

    def _check_alerts(self, snapshot: Snapshot) -> None:
        if self.alerting is not None:
            self.alerting.check(snapshot)

    def _agreed(self, step: int, want: bool, images: bool | None, error: BaseException | None) -> Snapshot | None:
        """Sharded: the ranks agree (:meth:`StepDecision.agree`), then every rank takes part in the walk."""
        if not self.decision.agree(step, want, error):
            return None
        self.decision.taken(step)
        try:
            return self._take(step, images, asynchronous=False)
        except AgreementError as exc:
            self.decision.disable(str(exc))
            return None

    def _write(self, snapshot: Snapshot) -> None:
        """Hand the snapshot to the outputs (main process; never raises)."""
        if self.outputs is not None:
            self.outputs.write(snapshot)

    def _deliver(self, wait: bool = False, timeout: float | None = None, closing: bool = False,
                 moment: str = "close()") -> bool:
        """Hand a finished asynchronous snapshot to the outputs (training thread); never raises.

        ``wait`` first waits for a running one, up to ``timeout`` (default ``sink_timeout``).
        Returns ``False`` if one is still being scored then (:meth:`Measurement.collect`).
        """
        try:
            limit = self.config.sink_timeout if timeout is None else timeout
            settled, snap, error = self.measurement.collect(wait=wait, timeout=limit, closing=closing, moment=moment)
            if error is not None:
                self.failure_log.report("an asynchronous snapshot", error)
            elif snap is not None:
                self._check_alerts(snap)
                self._write(snap)
            return settled
        except Exception as exc:  # noqa: BLE001 - never raises
            self.failure_log.report("delivering an asynchronous snapshot", exc)
            return True

    # -- public ----------------------------------------------------------------------------------
    @never_raise
    def snapshot(self, step: int | None = None) -> Snapshot | None:
        """Measure now and write (main process); ``step`` defaults to the probe's counter.

        Steps must increase: a step ``<=`` the last snapshot's is skipped. Returns the
        :class:`~attn_probe.sinks.Snapshot` on the main process, ``None`` elsewhere, when
        skipped, and with ``async_scoring`` (the snapshot then reaches the sinks at the next
        probe call, :meth:`flush` or :meth:`close`). On a sharded run every rank must call it
        (the ranks agree first, see ``docs/distributed.md``). After :meth:`close` it measures
        nothing and warns (once).
        """
        if self._closed:
            if not self._warned_closed:
                self._warned_closed = True
                safe_warn("attn_probe: probe.snapshot() was called after probe.close(); nothing is measured. "
                          "Take snapshots before closing the probe. This warning is shown once.", stacklevel=3)
            return None
        if self.decision.disabled:
            return None
        if self.decision.agreement is not None:
            error: BaseException | None = None
            try:
                step = self.step if step is None else int(step)
            except Exception as exc:  # noqa: BLE001 - still take part in the agreement
                step, error = self.step, exc
            return self._agreed(step, True, None, error)
        self._deliver()
        step = self.step if step is None else int(step)
        if not self.decision.fresh(step):
            return None
        asynchronous = self.measurement.scorer is not None and not self._final
        if asynchronous and self.measurement.pending():  # the previous one is still being scored
            self.measurement.skip(step)
            return None
        self.decision.taken(step)
        return self._take(step, None, asynchronous)

    @never_raise
    def on_update(self, step: int | None = None) -> None:
        """Advance the counter by one update (or set it to ``step``); snapshot if due.

        On a sharded run the ranks agree on every call when the schedule is a user callable,
        and only on due steps with the built-in ``every``/``log_spaced`` (whose answer is the
        same on every rank); a schedule that raises counts as "no" and every rank skips.
        """
        error: BaseException | None = None
        try:
            self.step = self.step + 1 if step is None else int(step)
        except Exception as exc:  # noqa: BLE001
            error = exc
        stopped = self._closed or self.decision.disabled
        if error is not None and (stopped or self.decision.agreement is None):
            raise error
        if stopped:
            return
        if self.decision.agreement is None:
            self._deliver()
            if self.due(self.step):
                self.snapshot(self.step)
            self._arm_next()
            return
        due = None
        if error is None:
            try:
                due = self.decision.due(self.step)
            except Exception as exc:  # noqa: BLE001 - counts as "no", agreed with the other ranks
                error = exc
        if self.decision.needs_vote(due, error):
            self._agreed(self.step, due is not None and due.any(), due.images if due is not None else False, error)
        self._arm_next()

    def _arm_next(self) -> None:
        """Plain loops: arm the attention capture when the next update's step will be due."""
        if self.attention is not None and self.arm_after_update and self._forward_counter is None and not self._closed:
            self.arm_attention(self.step + 1)

    @never_raise
    def arm_attention(self, step: int) -> None:
        """Measure the attention of the forward passes from now on if ``step`` is due (the
        Trainer calls it at ``on_step_begin`` with the step it is about to take)."""
        if self.attention is not None and not self.decision.disabled and self.decision.due(step).scores:
            self.attention.arm(step)

    @never_raise
    def stop_attention(self) -> None:
        """No more forwards belong to the armed step (the Trainer's ``on_pre_optimizer_step``)."""
        if self.attention is not None:
            self.attention.stop()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer.step()`` calls (:class:`attn_probe.counting.OptimizerUpdates`)."""
        self.add_hook_handle(OptimizerUpdates(optimizer, self))

    def attach_forward_counter(self, module: nn.Module) -> None:
        """Count training-mode forward passes of ``module`` (:class:`attn_probe.counting.ForwardPasses`)."""
        self._forward_counter = ForwardPasses(module, self)
        if self.attention is not None:
            self.attention.cancel()  # forward-counted loops are not measured (see docs/scores.md)
        self.add_hook_handle(self._forward_counter)

    def add_hook_handle(self, handle: Any) -> None:
        """Keep a removable handle (``.remove()``) to drop at :meth:`close`."""
        self._handles.append(handle)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot taken so far is written by every sink (main process).

        With the default background writing, ``snapshot()`` returns before its values are
        on disk; call this before reading the files while the probe is open. With
        ``async_scoring`` it first waits for the snapshot being scored. ``timeout`` in seconds
        for each wait (default: the probe's ``sink_timeout``). Returns ``False`` if a snapshot
        was still being scored or a sink still busy then; ``True`` at once on other ranks and
        after :meth:`close`. Never raises.
        """
        scored = self._deliver(wait=True, timeout=timeout)
        return self.outputs.flush(timeout) and scored if self.outputs is not None else scored

    def sink_stats(self) -> list[SinkStats]:
        """Per sink: snapshots delivered, lost to failures, dropped (queue full), and whether it fails now."""
        return self.outputs.stats() if self.outputs is not None else []

    def close(self, final_snapshot: bool = True) -> None:
        """Detach hooks, take a last snapshot if the counter moved past the last one, close sinks.

        Never raises (whatever the warnings filter). On a sharded run every rank must call it:
        the final snapshot is agreed like any other.
        """
        if self._closed:
            return
        try:
            for handle in self._handles:
                try:
                    handle.remove()
                except Exception:  # noqa: BLE001
                    pass
            self._handles.clear()
            counter = self._forward_counter
            if counter is not None and counter.final_step is not None:
                self.step = max(self.step, counter.final_step)
            self._deliver(wait=True, closing=True)  # asynchronous mode: the snapshot in flight first
            moved = self.decision.fresh(self.step)
            if final_snapshot and not self.decision.disabled and (moved or self.decision.agreement is not None):
                self._final = True  # scored on this thread, even in the asynchronous mode
                self.snapshot(self.step)  # sharded: always, the agreement skips a stale step everywhere
        except Exception as exc:  # noqa: BLE001 - close() must not stop the user's script
            self.failure_log.report("close", exc)
        finally:
            self._closed = True
            _SCORING.discard(self)
            if self.attention is not None:
                try:
                    self.attention.close()  # the registry's previous entries are restored
                except Exception as exc:  # noqa: BLE001
                    self.failure_log.report("closing the attention capture", exc)
            self.decision.close()  # local: the agreement group's sockets and threads
            try:
                if self.outputs is not None:
                    self.outputs.close()
            except Exception as exc:  # noqa: BLE001
                self.failure_log.report("closing the sinks", exc)

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Probe({len(self.layers)} layers, step={self.step}, "
                f"last_snapshot={self.last_snapshot_step}, log_dir={self.log_dir!r})")

