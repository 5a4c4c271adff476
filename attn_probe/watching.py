"""``attn_probe.watch``: attach a probe to a training loop (above the probe and the integrations)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import config_from_options
from .live_view import tensorboard_command
from .probe import WIRING, Probe
from .schedules import ScheduleLike

__all__ = ["watch", "announce"]

#: options of ``watch(accelerator=...)`` only: what its non-TensorBoard trackers get
ACCELERATE_OPTIONS = ("trackers", "trackers_per_head")


def _singular(unit: str) -> str:
    """``"optimizer steps"`` -> ``"optimizer step"``, ``"training forward passes"`` -> ``"... pass"``."""
    for plural, one in (("passes", "pass"), ("steps", "step")):
        if unit.endswith(plural):
            return unit[: -len(plural)] + one
    return unit


def _describe_schedule(every: Any, unit: str) -> str:
    if every is None:
        return "on demand"
    if isinstance(every, int):
        return f"every {every} {unit}" if every != 1 else f"every {_singular(unit)}"
    return f"on the schedule {getattr(every, '__qualname__', repr(every))} ({unit})"


def announce(probe: Probe, *, every: Any, unit: str) -> None:
    """One line on stderr, main process only: what is watched, how often, where it goes.

    Printed rather than logged so that it shows with default logging settings; it names the
    ``tensorboard`` command of :func:`attn_probe.live_view.tensorboard_command` (an explicit
    ``--samples_per_plugin scalars=N``: TensorBoard's server keeps only 1,000 points per scalar tag
    without it, and ``N = 0`` keeps none).
    """
    import sys

    if not probe.is_main_process:
        return
    try:
        root = type(getattr(probe.model, "module", probe.model)).__name__
        n = len(probe.layers)
        where = probe.log_dir if probe.log_dir is not None else "the given sinks"
        line = (f"attn_probe: watching {n} attention layer{'s' if n != 1 else ''} of {root} "
                f"{_describe_schedule(every, unit)} -> {where}")
        if probe.log_dir is not None:
            line += f"  (live view: {tensorboard_command(probe.log_dir)})"
        print(line, file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a status line must never stop training
        pass


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
      (``trackers=``/``trackers_per_head=``, :mod:`attn_probe.integrations.accelerate`);
    * ``watch(model, every=100)``: counts training-mode forward passes of ``model``.

    ``every`` is an int or a callable ``step -> bool`` (:mod:`attn_probe.schedules`). The
    other options are the fields of :class:`~attn_probe.config.ProbeConfig` (``metrics``,
    ``per_head``, ``groups``, ``layers``, ``num_std``, ``images_every``, ``image_size``,
    ``image_mode``, ``pairs``, ``start_step``, ``find_kwargs``) and ``sinks``/``writer``;
    a misspelled or invalid one raises ``TypeError``/``ValueError`` here.
    """
    accelerate_only = {k: options.pop(k) for k in ACCELERATE_OPTIONS if k in options}
    if accelerate_only and accelerator is None:
        raise TypeError(f"{', '.join(sorted(accelerate_only))}: only with accelerator=")
    wiring = {k: options.pop(k) for k in list(options) if k in WIRING}
    config = config_from_options(every=every, allowed_extra=WIRING + ("optimizer", "accelerator"), **options)
    if accelerator is not None:
        from .integrations.accelerate import watch_accelerated

        return watch_accelerated(model, accelerator, config, log_dir=log_dir, optimizer=optimizer,
                                 **accelerate_only, **wiring)
    probe = Probe(model, config, log_dir=log_dir, **wiring)
    if optimizer is not None:
        probe.attach_optimizer(optimizer)
    else:
        probe.attach_forward_counter(model)
    announce(probe, every=config.every,
             unit="optimizer steps" if optimizer is not None else "training forward passes")
    probe.snapshot(probe.step)
    return probe
