"""``attn_probe.watch``: attach a probe to a training loop (above the probe and the integrations)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import config_from_options
from .probe import WIRING, Probe
from .schedules import ScheduleLike

__all__ = ["watch"]


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
      the prepared optimizers and writes into the accelerator's TensorBoard run if any;
    * ``watch(model, every=100)``: counts training-mode forward passes of ``model``.

    ``every`` is an int or a callable ``step -> bool`` (:mod:`attn_probe.schedules`). The
    other options are the fields of :class:`~attn_probe.config.ProbeConfig` (``metrics``,
    ``per_head``, ``groups``, ``layers``, ``num_std``, ``images_every``, ``image_size``,
    ``image_mode``, ``pairs``, ``start_step``, ``find_kwargs``) and ``sinks``/``writer``;
    a misspelled or invalid one raises ``TypeError``/``ValueError`` here.
    """
    wiring = {k: options.pop(k) for k in list(options) if k in WIRING}
    config = config_from_options(every=every, allowed_extra=WIRING + ("optimizer", "accelerator"), **options)
    if optimizer is not None and accelerator is not None:
        raise ValueError("give optimizer= or accelerator=, not both (the accelerator knows its optimizers)")
    if accelerator is not None:
        from .integrations.accelerate import watch_accelerated

        return watch_accelerated(model, accelerator, config, log_dir=log_dir, **wiring)
    probe = Probe(model, config, log_dir=log_dir, **wiring)
    if optimizer is not None:
        probe.attach_optimizer(optimizer)
    else:
        probe.attach_forward_counter(model)
    probe.snapshot(probe.step)
    return probe
