"""Accelerate integration: ``probe = attn_probe.watch(model, accelerator=accelerator, every=100)``.

Call it after ``accelerator.prepare(...)`` (and after ``accelerator.init_trackers(...)`` to share
the TensorBoard run). The counter advances on *real* optimizer updates only:

* plain / DDP / FSDP: a step post-hook on each prepared optimizer's *inner* torch optimizer.
  ``AcceleratedOptimizer.step`` calls it only when ``accelerator.sync_gradients`` is true
  (not on accumulation micro-steps), and the fp16 GradScaler does not call it when it skips
  an overflowing step;
* DeepSpeed: after ``engine.step()`` when the engine reports ``was_step_applied()`` at a new
  global step.

Writes go through the accelerator's TensorBoard tracker's writer when one is initialised
(flushed, never closed by the probe), otherwise into an own writer in ``log_dir``. Every other
tracker given to ``Accelerator(log_with=...)`` and initialised by ``init_trackers`` (W&B,
MLflow, trackio, Comet, ...) gets the per-layer values and the across-layer median/q25/q75
through its public ``GeneralTracker.log`` (:func:`accelerator_targets`), called on the
training thread (MLflow's fluent API keeps its active run per thread). W&B is a
:class:`~attn_probe.sinks.wandb.WandbSink` beside the accelerator's W&B run: a run of the
probe's own in its group (``wandb_separate_run=False``: joining its rows, losses counted).
``trackers=False`` turns this off, a list of tracker names narrows it,
``trackers_per_head=True`` adds per-head values.

Optimizer: ``watch(model, accelerator=acc, optimizer=opt)`` hooks ``opt`` (the inner torch
optimizer of an ``AcceleratedOptimizer``, its public ``optimizer`` attribute). Without
``optimizer=``, the prepared optimizers are found in ``accelerator._optimizers``: Accelerate
has no public accessor for them, so this private attribute is read only as that fallback.

Resume: ``watch(model, accelerator=acc, start_step=G)``. The trajectory drops its rows at steps
``>= G``, and :class:`~attn_probe.sinks.tensorboard.TensorBoardSink` writes TensorBoard's
restart marker (``SessionLog.START`` at G) into the tracker's writer, the newest event file of
the run, so TensorBoard drops the interrupted run's events at steps ``>= G`` (the user's
logged losses too) and each step shows once. The same logic serves every resume path.

Run directory: Accelerate saves no record of the probe's run with its checkpoints
(``accelerator.save_state`` knows nothing of it), so there is nothing for
:func:`attn_probe.live.resume_policy.settle_run` to decide: the directory is ``log_dir=``, else the
TensorBoard tracker's (its writer), else the probe's own default; on ``start_step=G`` the trajectory
continues the last run it holds (the probe's resume cut).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..isolation import safe_warn
from ..live.config import ProbeConfig
from ..live.counting import EngineSteps
from ..live.probe import Probe

#: options of ``watch(accelerator=...)`` only: what its non-TensorBoard trackers get
ACCELERATE_OPTIONS = ("trackers", "trackers_per_head", "wandb_separate_run")

__all__ = ["ACCELERATE_OPTIONS", "accelerator_targets", "watch_accelerated", "tensorboard_tracker_writer"]


def tensorboard_tracker_writer(accelerator: Any) -> Any:
    """The ``SummaryWriter`` of the accelerator's initialised TensorBoard tracker, or ``None``."""
    for tracker in getattr(accelerator, "trackers", None) or []:
        if getattr(tracker, "name", None) == "tensorboard":
            writer = getattr(tracker, "writer", None)
            if writer is not None:
                return writer
    return None


def _tracker_name(tracker: Any) -> str:
    return str(getattr(tracker, "name", type(tracker).__name__)).lower()


def other_trackers(accelerator: Any, which: bool | Sequence[str] = True) -> list[Any]:
    """The accelerator's initialised trackers other than TensorBoard (the probe writes that itself)."""
    if which is False:
        return []
    names = None if which is True else {str(n).lower() for n in which}
    return [t for t in getattr(accelerator, "trackers", None) or []
            if _tracker_name(t) != "tensorboard" and (names is None or _tracker_name(t) in names)]


def accelerator_targets(trackers: Sequence[Any]) -> list[Any]:
    """The accelerator's trackers as targets (:class:`~attn_probe.sinks.trackers.TrackerTarget`) of the
    probe's tracker fan-out (W&B apart: :func:`watch_accelerated` gives it a ``WandbSink``): each
    gets the values through its public ``GeneralTracker.log`` with ``step=``, and its run is
    identified through ``GeneralTracker.tracker`` (:func:`~attn_probe.integrations.tracker_run.tracker_run`) for the resume guard.
    """
    from ..sinks.trackers import TrackerTarget
    from .tracker_run import tracker_run

    def target(tracker: Any) -> TrackerTarget:
        return TrackerTarget(_tracker_name(tracker), lambda: tracker_run(tracker, "accelerate"),
                             lambda values, step: tracker.log(values, step=step))

    return [target(t) for t in trackers]


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer.optimizer (public)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"cannot hook optimizer of type {type(inner).__name__}")
    return inner


def _warn_if_trackers_not_started(accelerator: Any, log_dir: str | None, trackers: bool | Sequence[str]) -> None:
    """Warn when ``log_with`` names trackers that ``init_trackers`` has not started yet.

    The probe chooses its TensorBoard writer and tracker sinks at attach: trackers started
    later would get nothing from it, silently.
    """
    wanted = [str(getattr(t, "value", None) or getattr(t, "name", None) or t)
              for t in (getattr(accelerator, "log_with", None) or [])]
    if not wanted or getattr(accelerator, "trackers", None) or (log_dir is not None and trackers is False):
        return
    safe_warn(f"attn_probe: the accelerator logs with {', '.join(wanted)}, but accelerator.init_trackers() has "
              "not run yet, so the probe sends nothing to those trackers and writes TensorBoard files "
              f"{'to ' + log_dir if log_dir else 'to its own default directory'}. Call attn_probe.watch(...) after "
              "accelerator.init_trackers(...).", stacklevel=3)


def watch_accelerated(
    model: nn.Module,
    accelerator: Any,
    config: ProbeConfig,
    *,
    optimizer: Any = None,
    trackers: bool | Sequence[str] = True,
    trackers_per_head: bool = False,
    wandb_separate_run: bool = True,
) -> Probe:
    """Build a :class:`Probe` counting the accelerator's real optimizer updates; snapshot step 0.

    ``optimizer`` is the optimizer to count (prepared or not); without it, the accelerator's
    prepared optimizers (read from the private ``accelerator._optimizers``, for want of a
    public accessor). ``trackers``/``trackers_per_head`` choose what the accelerator's
    non-TensorBoard trackers get; ``wandb_separate_run`` how W&B gets it
    (:class:`~attn_probe.sinks.wandb.WandbSink`'s ``separate_run``). ``config`` is passed whole; this adds the accelerator's
    TensorBoard writer (without ``log_dir``), its main-process flag (unless given) and the
    tracker fan-out to it.
    """
    if not isinstance(trackers, bool):
        trackers = tuple(trackers)
        if not all(isinstance(t, str) for t in trackers):
            raise TypeError(f"trackers must be True, False or tracker names, got {trackers!r}")
    log_dir = config.log_dir
    main = bool(accelerator.is_main_process) if config.is_main_process is None else config.is_main_process
    changes: dict[str, Any] = {"is_main_process": main}
    if log_dir is None and config.writer is None:
        changes["writer"] = tensorboard_tracker_writer(accelerator)
    engine_wrapper = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if optimizer is not None:
        optimizers = [_inner_optimizer(optimizer)]
    else:
        optimizers = list(getattr(accelerator, "_optimizers", None) or [])  # no public accessor
    if engine_wrapper is None and not optimizers:
        raise ValueError(
            "attn_probe.watch(accelerator=...) found no prepared optimizer: call it after "
            "accelerator.prepare(model, optimizer, ...)"
        )
    if main:
        _warn_if_trackers_not_started(accelerator, log_dir, trackers)
        others = other_trackers(accelerator, trackers)
        on_wandb = [t for t in others if _tracker_name(t) == "wandb" and getattr(t, "tracker", None) is not None]
        others = [t for t in others if t not in on_wandb]
        added: list[Any] = []
        if others:
            from ..sinks.trackers import TrackerFanOut

            added.append(TrackerFanOut(accelerator_targets(others), per_head=trackers_per_head))
        if on_wandb:
            from ..sinks.wandb import WandbSink

            added.extend(WandbSink(t.tracker, separate_run=bool(wandb_separate_run), per_head=trackers_per_head,
                                   log_config=bool(wandb_separate_run)) for t in on_wandb)
        if added:
            changes["sinks"] = [*(config.sinks or []), *added]
    probe = Probe(model, config.replace(**changes))
    try:
        if engine_wrapper is not None:
            probe.add_hook_handle(EngineSteps(engine_wrapper.engine, probe))
        else:
            # one counter: several optimizers step together once per update
            probe.attach_optimizer(_inner_optimizer(optimizers[0]))
    except Exception:
        probe.close(final_snapshot=False)
        raise
    probe.announce(every=probe.config.every, unit="optimizer steps")
    probe.snapshot(probe.step)
    return probe
