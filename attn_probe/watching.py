"""``attn_probe.watch``: attach a probe to a training loop (above the probe and the integrations)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .extraction import entry_point
from .integrations.accelerate import ACCELERATE_OPTIONS, watch_accelerated
from .live.config import config_from_options
from .live.probe import Probe
from .live.schedules import ScheduleLike

__all__ = ["watch"]


@entry_point("watch")  # an unsupported model's message shows the fix as a watch(...) call
def watch(
    model: nn.Module,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    accelerator: Any = None,
    log_dir: str | None = None,
    every: ScheduleLike | None = 100,
    **options: Any,
) -> Probe:
    """Attach a probe to a training loop and take the step-0 snapshot now.

    * ``watch(model, optimizer=opt, log_dir="runs/x", every=100)``: counts ``opt.step()``;
    * ``watch(model, accelerator=accelerator, every=100)``: counts real optimizer updates of
      the prepared optimizers (``optimizer=opt`` names the one to count), writes into the
      accelerator's TensorBoard run if any, and sends the values to its other trackers
      (``trackers=``/``trackers_per_head=``/``wandb_separate_run=``, :mod:`attn_probe.integrations.accelerate`);
    * ``watch(model, every=100)``: counts training-mode forward passes of ``model``.

    ``every`` is an int or a callable ``step -> bool`` (:mod:`attn_probe.live.schedules`). The
    other options are the fields of :class:`~attn_probe.live.config.ProbeConfig` (``metrics``,
    ``per_head``, ``groups``, ``layers``, ``num_std``, ``images_every``, ``image_size``,
    ``image_mode``, ``pairs``, ``start_step``, ``find_kwargs``, and where and how it is written:
    ``sinks``, ``writer``, ``background``, ``async_scoring``, ...); a misspelled or invalid one
    raises ``TypeError``/``ValueError`` here.
    """
    accelerate_only = {k: options.pop(k) for k in ACCELERATE_OPTIONS if k in options}
    if accelerate_only and accelerator is None:
        raise TypeError(f"{', '.join(sorted(accelerate_only))}: only with accelerator=")
    config = config_from_options(every=every, log_dir=log_dir, allowed_extra=("optimizer", "accelerator"),
                                 **options)
    if accelerator is not None:
        return watch_accelerated(model, accelerator, config, optimizer=optimizer, **accelerate_only)
    probe = Probe(model, config)
    if optimizer is not None:
        probe.attach_optimizer(optimizer)
    else:
        probe.attach_forward_counter(model)
    probe.announce(every=config.every, unit="optimizer steps" if optimizer is not None else "training forward passes")
    probe.snapshot(probe.step)
    return probe
