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
(flushed, never closed by the probe), otherwise into an own writer in ``log_dir``.

Resume: ``watch(model, accelerator=acc, start_step=G)``. The trajectory drops its rows at steps
``>= G``, and :class:`~attn_probe.sinks.tensorboard.TensorBoardSink` writes TensorBoard's
restart marker (``SessionLog.START`` at G) into the tracker's writer, the newest event file of
the run, so TensorBoard drops the interrupted run's events at steps ``>= G`` (the user's
logged losses too) and each step shows once. The same logic serves every resume path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import ProbeConfig
from ..counting import EngineSteps
from ..probe import Probe

__all__ = ["watch_accelerated", "tensorboard_tracker_writer"]


def tensorboard_tracker_writer(accelerator: Any) -> Any:
    """The ``SummaryWriter`` of the accelerator's initialised TensorBoard tracker, or ``None``."""
    for tracker in getattr(accelerator, "trackers", None) or []:
        if getattr(tracker, "name", None) == "tensorboard":
            writer = getattr(tracker, "writer", None)
            if writer is not None:
                return writer
    return None


def watch_accelerated(
    model: nn.Module,
    accelerator: Any,
    config: ProbeConfig | None = None,
    *,
    log_dir: str | None = None,
    **options: Any,
) -> Probe:
    """Build a :class:`Probe` counting the accelerator's real optimizer updates; snapshot step 0.

    ``options`` are :class:`~attn_probe.config.ProbeConfig` fields and the probe's wiring
    arguments (``sinks``, ``is_main_process``...).
    """
    writer = tensorboard_tracker_writer(accelerator) if log_dir is None else None
    options.setdefault("is_main_process", bool(accelerator.is_main_process))
    engine_wrapper = getattr(accelerator, "deepspeed_engine_wrapped", None)
    optimizers = list(getattr(accelerator, "_optimizers", []))
    if engine_wrapper is None and not optimizers:
        raise ValueError(
            "attn_probe.watch(accelerator=...) found no prepared optimizer: call it after "
            "accelerator.prepare(model, optimizer, ...)"
        )
    probe = Probe(model, config, log_dir=log_dir, writer=writer, **options)
    try:
        if engine_wrapper is not None:
            probe.add_hook_handle(EngineSteps(engine_wrapper.engine, probe))
        else:
            for acc_opt in optimizers:
                inner = getattr(acc_opt, "optimizer", acc_opt)
                if not isinstance(inner, torch.optim.Optimizer):
                    raise TypeError(f"cannot hook optimizer of type {type(inner).__name__}")
                probe.attach_optimizer(inner)
                break  # one counter: several optimizers step together once per update
    except Exception:
        probe.close(final_snapshot=False)
        raise
    probe.snapshot(probe.step)
    return probe
