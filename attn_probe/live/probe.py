"""The live probe: a façade that runs the stages of :mod:`attn_probe.live.stages` in order.

At each counted step or hand-made snapshot, :class:`Probe` asks

1. the step decision (:class:`~attn_probe.live.stages.decision.StepDecision`): is it due, is it
   newer than the last snapshot, and on a sharded run do all ranks agree;
2. the measurement (:class:`~attn_probe.live.stages.measurement.Measurement`): surgery check,
   the walk (gathering what the pairs declare), the scoring core, one host transfer; in the
   asynchronous mode on a worker thread;
3. the assembly (:class:`~attn_probe.sinks.assembly.Assembler`): records and statistics;
4. the outputs (:class:`~attn_probe.live.stages.outputs.Outputs`): the sinks, main process only.

On a fresh run every rank also computes, at attach and before the probe's first collective, the
random-matrix range of its layer shapes (:func:`random_range_records`: seeded draws whose count
follows from the shapes alone, so every rank spends the same work and none waits for another in
an agreement); the main process hands it to the sinks once with the first published snapshot
(``Snapshot.baselines``: the trajectory file writes it).

It owns only the step counter, the hook handles and the lifecycle; every public method is
isolated (:func:`attn_probe.isolation.never_raise`): once attached, the probe never stops
training. What counts steps lives in :mod:`attn_probe.live.counting`; :func:`attn_probe.watch`
(in :mod:`attn_probe.watching`) attaches a probe to a loop. This module imports neither
transformers nor accelerate.
"""

from __future__ import annotations

import functools
import math
import sys
import time
import weakref
from typing import Any

import torch
from torch import nn

from ..baselines import random_range
from ..distributed import Agreement, AgreementError, is_main_process, world_info
from ..extraction import AttentionLayer, entry_point
from ..formats.logdir import LogDirError, LogDirInUseError
from ..isolation import Failures, never_raise, safe_warn
from ..scoring.pairs import QKPair, ScorePair
from ..sinks import Record, Snapshot
from ..sinks.assembly import Assembler, layer_statistics
from .config import ProbeConfig, config_from_options
from .counting import ForwardPasses, OptimizerUpdates
from .images import render_heatmap
from .quantities import Quantity, build_quantities
from .stages.alerting import agree_stop, build_alerting
from .stages.attention import AttentionStage, build_stage, metric_names
from .stages.decision import StepDecision, make_agreement
from .stages.measurement import Measured, Measurement, find_layers
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


#: the trajectory rows of the layout check (a layer's reading against its forward: issue 44)
LAYOUT_METRIC = "layout_check"
#: their values: verified 1, refused 0 (tiled, mismatch), unverified null
LAYOUT_VALUES = {"ok": 1.0, "tiled": 0.0, "mismatch": 0.0}


def _deliver_at_exit(seconds: float) -> None:
    """Exit hook (before the sinks are flushed): write each unclosed probe's snapshot in flight.

    Waits for it within ``seconds``; the worker thread then no longer runs while the interpreter
    shuts down (a thread still inside torch then can abort the process).
    """
    deadline = time.monotonic() + seconds
    for probe in list(_SCORING):
        if not probe._closed:
            probe.measurement.deliver(probe._publish, wait=True, timeout=max(0.0, deadline - time.monotonic()),
                                      closing=True, moment="interpreter exit (the probe was never closed)")


at_interpreter_exit(_deliver_at_exit)


def random_range_records(config: ProbeConfig, layers: list[AttentionLayer], metrics: list[str],
                         warn: bool = True) -> list[Record]:
    """The random-matrix range of ``layers`` as records (:func:`attn_probe.baselines.random_range.random_range_rows`).

    No time budget: at most :data:`~attn_probe.baselines.random_range.PROBE_ENTRIES` drawn numbers,
    so the draws, the values and the work are the same on every rank. Never raises: a failure is
    one warning and no records; shapes that got fewer draws, or none, are named in one warning
    (``warn=False``: no warnings, the other ranks').
    """
    try:
        rows, notes = random_range.random_range_rows(layers, metrics=metrics, per_head=config.per_head,
                                                     num_std=config.num_std, budget=None,
                                                     max_entries=random_range.PROBE_ENTRIES)
        if notes and warn:
            safe_warn(f"attn_probe: the random-matrix range: {'; '.join(notes)}. "
                      "(random_range=False turns it off.)")
        return [Record(*row) for row in rows]
    except Exception as exc:  # noqa: BLE001 - a reference range must never stop training
        if warn:
            safe_warn(f"attn_probe: the random-matrix range could not be computed ({type(exc).__name__}: {exc}); "
                      "it is not logged. Training and the scores are not affected.")
        return []


class Probe:
    """Snapshots of the attention metrics of one model, written to sinks on the main process.

    Build it with :func:`watch` (or the Trainer callback). ``snapshot(step)`` takes one by
    hand; ``close()`` (or leaving the ``with`` block) takes a final snapshot when the counter
    moved past the last one and closes the sinks. Collective-safe: call ``snapshot`` and
    ``close`` on every rank.

    ``config`` (a :class:`~attn_probe.live.config.ProbeConfig`) and/or its fields as keyword
    options say what is measured and when, where it goes (``log_dir``, ``writer``, ``sinks``,
    ``is_main_process``, ``extra_config``, ``purge_stale``, ``restart``) and how it is written;
    an unknown option raises ``TypeError`` naming the valid ones.

    Attach-time problems raise (:class:`~attn_probe.UnsupportedModelError`,
    :class:`LogDirError`); after that, every failure is caught, warned about once, and the
    affected snapshot is skipped.

    The stages are public attributes (``decision``, ``measurement``, ``assembler``,
    ``outputs``: ``None`` off the main process); tests use their documented seams.
    """

    @entry_point("Probe")  # an unsupported model's message shows the fix as a Probe(...) call
    def __init__(self, model: nn.Module, config: ProbeConfig | None = None, **options: Any) -> None:
        self.config = cfg = config_from_options(config, **options)
        self.model = model
        self.pairs: list[ScorePair] = cfg.score_pairs()
        layers = find_layers(model, cfg, self.pairs)  # raises before any collective
        self.is_main_process = is_main_process() if cfg.is_main_process is None else cfg.is_main_process
        self.step = cfg.start_step
        self.failure_log = Failures()
        self.metrics, alertable = metric_names(cfg, self.pairs, layers)
        #: the random-matrix range, written once with the first snapshot a fresh run publishes (a
        #: resumed run keeps its rows: they sit at its first step, before any resume cut). Every
        #: rank computes it, before the probe's first collective: the same seeded draws, as many on
        #: every rank, so no rank waits in an agreement while another computes it
        computes_range = cfg.random_range and self.step == 0 and (self.is_main_process or world_info().distributed)
        self._random_rows: list[Record] = (
            random_range_records(cfg, layers, self.metrics, warn=self.is_main_process) if computes_range else [])
        agreement = make_agreement(model, cfg.agreement_timeout)  # collective on a sharded run
        self.decision = StepDecision(cfg.schedule, cfg.image_schedule, agreement)
        self.measurement = Measurement(model, cfg, self.pairs, layers, agreement=agreement,
                                       is_main_process=self.is_main_process, failures=self.failure_log)
        self.assembler = Assembler()
        self.alerting = build_alerting(cfg, alertable, logged=self.metrics, layers=[lay.layer for lay in layers],
                                       is_main_process=self.is_main_process,
                                       failures=self.failure_log)  # ValueError: a rule that can never fire
        #: the probe's gloo group on several ranks: the sharded walk's, else (DDP) its own when the
        #: attention statistics are combined or a stop decision is shared (a collective: every rank attaches)
        self.ranks: Agreement | None = agreement
        if agreement is None and world_info().distributed and (cfg.attention_stats or (cfg.stop_on_alert and cfg.alerts)):
            self.ranks = Agreement(cfg.agreement_timeout)
        if self.alerting is not None:
            self.alerting.ranks = self.ranks
        if self.ranks is not None:
            self.decision.timeout = self.ranks.timeout  # named when an agreement fails
        if self.measurement.scorer is not None:
            _SCORING.add(self)  # never closed: the exit hook writes the snapshot in flight
        self._handles: list[Any] = []
        self._layout_rows: list[Record] = []  # the layout checks' rows, written with the next snapshot
        self._forward_counter: ForwardPasses | None = None
        self._closed = False
        self._final = False  # close()'s final snapshot: never asynchronous
        self._warned_closed = False
        run = run_info(cfg, model, layers, self.metrics,
                       resume_step=self.step if self.step > 0 or cfg.restart else None)
        watch = self.alerting.resume_watch(self.step, every_rank=not (cfg.stop_on_alert and world_info().distributed)) \
            if self.alerting is not None and self.step > 0 and self.is_main_process else None
        self.outputs: Outputs | None = Outputs(cfg, run, watch=watch) if self.is_main_process else None
        if self.outputs is None:
            self._random_rows = []  # computed to keep the main process's pace; only the main process writes it
        if self.alerting is not None and self.step > 0:
            self._restore_alerts()
        # the attention stage (registering wrappers) last: nothing after it raises
        self.attention: AttentionStage | None = build_stage(model, layers, cfg, self.pairs, self.ranks,
                                                            self.decision.measures_forwards, self.failure_log)
        if self.attention is not None:
            self.attention.after_update(self.step)  # the first update after attach (never raises)
        #: what a snapshot measures, in the order taken and assembled (:mod:`attn_probe.live.quantities`)
        self.quantities: list[Quantity] = build_quantities([pair.metrics for pair in self.pairs], cfg.schedule,
                                                           cfg.image_schedule, self.attention, cfg.per_head)

    def _restore_alerts(self) -> None:
        """A resumed run (``start_step > 0``): the alert rules go on from the rows of this run that the
        trajectory holds (:meth:`~attn_probe.live.stages.alerting.Alerting.restore`), so that they fire
        as in an uninterrupted run. Main process only (it alone writes the file); the rules on
        ``max_logit``/``entropy`` are evaluated on every rank and decide a stop there, so with
        ``stop_on_alert`` on several ranks they start afresh (warned). Never raises."""
        alerting = self.alerting
        assert alerting is not None
        shared_stop = self.config.stop_on_alert and world_info().distributed
        found = self.outputs.trajectory() if self.outputs is not None else None
        if found is None:
            return
        try:
            alerting.restore(*found, every_rank=not shared_stop)
        except Exception as exc:  # noqa: BLE001 - the rules then start afresh; training goes on
            self.failure_log.report("restoring the alert rules' state from the trajectory", exc)
            return
        if shared_stop and alerting.every_rank is not None:
            safe_warn(f"attn_probe: resumed at step {self.step} with stop_on_alert on several ranks: the rules on "
                      f"{', '.join(sorted(r.metric for r in alerting.every_rank.rules))} start afresh (every rank "
                      "decides their stop and only this one reads the trajectory); the other rules go on from "
                      "the run's rows.")

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
        (:func:`attn_probe.live.stages.outputs.announce_line`).
        """
        if not self.is_main_process:
            return
        try:
            print(announce_line(self.model, len(self.layers), self.log_dir, every=every, unit=unit),
                  file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - a status line must never stop training
            pass

    # -- running the stages --------------------------------------------------------------------
    def _take(self, step: int, images: bool | None, asynchronous: bool, weights: bool = True) -> Snapshot | None:
        """Stages 2 to 4 at ``step`` (already decided): take each quantity, walk, assemble, write.

        Every rank issues the same collectives whatever happens here: each quantity's
        :meth:`~attn_probe.live.quantities.Quantity.take` in the list's order (the attention
        combine), then the walk, then the stop decision
        (:func:`~attn_probe.live.stages.alerting.agree_stop`), also when the measurement fails.
        ``weights=False``: a step whose weight snapshot is skipped (the previous asynchronous one
        is still being scored) still takes the quantities and agrees on the stop on every rank.
        """
        refused = self._layout_news()  # local: the layout checks of the forwards so far
        taken = [(quantity, quantity.take(step)) for quantity in self.quantities]  # every rank
        snap = None
        try:
            if self.alerting is not None:
                for quantity, value in taken:  # the combined values: the same on every rank
                    try:  # local: must not keep this rank out of the walk's collectives below
                        rows = quantity.alert_rows(value)
                        if rows is not None:  # refused layers too: measured from the forward's own q/k,
                            self.alerting.check_attention(step, rows)  # identical on every rank (no local filter)
                    except Exception as exc:  # noqa: BLE001
                        self.failure_log.report("the alert rules", exc)
            if weights:
                layout_rows, self._layout_rows = self._layout_rows, []
                snap = self.measurement.measure(step, images, asynchronous=asynchronous,
                                                finish=functools.partial(self._assemble, taken, refused, layout_rows))
                if snap is not None:
                    self._publish(snap)
        finally:
            if not self.decision.disabled:
                agree_stop(self.alerting, step, self.decision.disable)
        return snap

    def _assemble(self, taken: list[tuple[Quantity, Any]], refused: frozenset[tuple[str, int]],
                  layout_rows: list[Record], measured: Measured) -> Snapshot:
        """Every quantity's rows of ``measured`` (main process; on the scoring worker when asynchronous),
        less the layers whose reading their forward contradicted (``refused``), with the layout checks'
        rows (``layout_rows``: the trajectory file only)."""
        snap = self.assembler.assemble(measured.step, [quantity.rows(measured, value) for quantity, value in taken])
        if refused:
            snap.records = [r for r in snap.records if (r.group, r.layer) not in refused]
            snap.stats = layer_statistics(snap.records)
            snap.images = {key: image for key, image in snap.images.items() if key not in refused}
        snap.baselines = list(layout_rows)
        return snap

    def _layout_news(self) -> frozenset[tuple[str, int]]:
        """The layout checks finished since the last snapshot, as rows for the next one written
        (``layout_check``: 1 verified, 0 refused, null unverified; the check's line beside it), and the
        ``(group, layer)`` refused now (counted per snapshot). Never raises."""
        stage = self.attention
        if stage is None:
            return frozenset()
        try:
            for layer, result in stage.layout_news(warn=self.is_main_process):
                value = LAYOUT_VALUES.get(result.verdict, math.nan)
                self._layout_rows.append(Record(layer.group, layer.layer, None, LAYOUT_METRIC, value,
                                                f"{result.verdict}: {result.line}"))
            if stage.refused:
                stage.refused_snapshots += 1
            return frozenset(stage.refused)
        except Exception as exc:  # noqa: BLE001
            self.failure_log.report("recording the layout check", exc)
            return frozenset()

    def _publish(self, snapshot: Snapshot) -> None:
        """An assembled snapshot: the alert rules (every rank), then the outputs (main process; never raises)."""
        if self.alerting is not None:
            self.alerting.check(snapshot)
        if self.outputs is not None:
            if self._random_rows:
                snapshot.baselines, self._random_rows = [*self._random_rows, *snapshot.baselines], []
            self.outputs.write(snapshot)

    @property
    def stop_requested(self) -> bool:
        """An alert fired with ``stop_on_alert``: the same on every rank at the same step (the
        Trainer stops on it; a plain loop checks it after ``optimizer.step()``)."""
        return self.alerting is not None and self.alerting.stop_requested

    def _agreed(self, step: int, images: bool | None) -> Snapshot | None:
        """Sharded, once the ranks agreed on ``step`` (:class:`StepDecision`): every rank takes part in the walk."""
        try:
            return self._take(step, images, asynchronous=False)
        except AgreementError as exc:
            self.decision.disable(str(exc))
            return None

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
            return self._agreed(step, None) if self.decision.agree(step, True, error) else None
        self.measurement.deliver(self._publish)
        step = self.step if step is None else int(step)
        if not self.decision.fresh(step):
            return None
        asynchronous = self.measurement.scorer is not None and not self._final
        if asynchronous and self.measurement.busy(step):  # the previous one is still being scored: skipped
            if self.ranks is None:
                return None
            # several ranks: only the main process scores, so only it can be busy; the step's
            # collectives (attention combine, stop decision) still run on every rank, and every
            # rank records the step as taken (the final snapshot at close() is then agreed too)
            self.decision.taken(step)
            return self._take(step, None, False, weights=False)
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
            self.measurement.deliver(self._publish)
            if self.due(self.step):
                self.snapshot(self.step)
        elif (due := self.decision.agree_counted(self.step, error)) is not None:  # a raising schedule: "no"
            self._agreed(self.step, due.images)
        if self.attention is not None:  # plain loops: armed for the next step if due (never raises)
            self.attention.after_update(self.step)

    @property
    def arm_after_update(self) -> bool:
        """Plain loops arm the attention capture right after each update (``AttentionStage.after_update``);
        the Trainer callback sets it to ``False`` and arms at ``on_step_begin`` (:meth:`arm_attention`)."""
        return self.attention is not None and self.attention.arm_after_update

    @arm_after_update.setter
    def arm_after_update(self, value: bool) -> None:
        if self.attention is not None:
            self.attention.arm_after_update = value

    @never_raise
    def arm_attention(self, step: int) -> None:
        """Measure the attention of the forward passes from now on if ``step`` is due (the
        Trainer calls it at ``on_step_begin`` with the step it is about to take)."""
        if self.attention is not None:
            self.attention.arm_if_due(step)

    @never_raise
    @property
    def measures_activations(self) -> bool:
        """Whether a quantity is measured in the training forwards (the attention statistics):
        the loop then tells the probe where a step's forwards begin and end."""
        return self.attention is not None

    def arm_for_batch(self, steps: Any) -> None:
        """Measure this batch's forwards for the first due step of ``steps`` (manual optimisation:
        a batch makes several updates). Never raises."""
        if self.attention is not None:
            self.attention.arm_for_batch(steps)

    def end_batch(self, step: int) -> None:
        """The batch whose forwards :meth:`arm_for_batch` armed ended at ``step``."""
        if self.attention is not None:
            self.attention.end_batch(step)

    def stop_attention(self) -> None:
        """No more forwards belong to the armed step (the Trainer's ``on_pre_optimizer_step``)."""
        if self.attention is not None:
            self.attention.stop()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer.step()`` calls (:class:`attn_probe.live.counting.OptimizerUpdates`)."""
        self.add_hook_handle(OptimizerUpdates(optimizer, self))

    def attach_forward_counter(self, module: nn.Module) -> None:
        """Count training-mode forward passes of ``module`` (:class:`attn_probe.live.counting.ForwardPasses`)."""
        self._forward_counter = ForwardPasses(module, self)
        if self.attention is not None:
            self.attention.count_forwards()  # forward-counted loops are not measured (see docs/scores.md)
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
        scored = self.measurement.deliver(self._publish, wait=True, timeout=timeout)
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
            self.measurement.deliver(self._publish, wait=True, closing=True)  # the snapshot in flight first
            if final_snapshot and self.decision.final_due(self.step):
                self._final = True  # scored on this thread, even in the asynchronous mode
                self.snapshot(self.step)
        except Exception as exc:  # noqa: BLE001 - close() must not stop the user's script
            self.failure_log.report("close", exc)
        finally:
            self._closed = True
            _SCORING.discard(self)
            if self.attention is not None:
                self.attention.close()  # the registry's previous entries are restored; never raises
            self.decision.close()  # local: the agreement group's sockets and threads
            if self.ranks is not None and self.ranks is not self.decision.agreement:
                self.ranks.close()  # DDP: the probe's own group, likewise
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

