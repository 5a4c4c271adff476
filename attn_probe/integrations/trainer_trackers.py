"""The Trainer's reporting integrations (W&B, MLflow, trackio, ...) as the probe's tracker sinks.

W&B gets a :class:`~attn_probe.sinks.wandb.WandbSink` (:func:`trainer_wandb_sink`: by default a
W&B run of the probe's own beside the Trainer's); the others get the values through their own
``on_log`` (:func:`trainer_targets`, for :class:`~attn_probe.sinks.trackers.TrackerFanOut`).
Used by :mod:`attn_probe.integrations.transformers`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["reporting_callbacks", "wandb_callbacks", "trainer_targets", "trainer_wandb_sink"]


def reporting_callbacks(handler: Any, which: bool | Sequence[str]) -> list[Any]:
    """The Trainer's reporting integration callbacks other than TensorBoard (the probe writes that)."""
    if handler is None or which is False:
        return []
    from transformers.integrations import INTEGRATION_TO_CALLBACK, TensorBoardCallback

    wanted = [cls for name, cls in INTEGRATION_TO_CALLBACK.items()
              if cls is not TensorBoardCallback and (which is True or name in which)]
    return [cb for cb in handler.callbacks if isinstance(cb, tuple(wanted))]


def trainer_targets(callbacks: Sequence[Any], args: Any, state: Any, *,
                    begin_kwargs: dict[str, Any] | None = None) -> list[Any]:
    """The Trainer's tracker callbacks as targets (:class:`~attn_probe.sinks.trackers.TrackerTarget`) of
    the probe's tracker fan-out: each gets the values through its own ``on_log``.

    Each tracker applies its own conventions (MLflow's step, ...) in the Trainer's own run. Nothing goes
    through ``Trainer.log``: no progress-bar lines, no ``log_history`` entries, no duplicate
    TensorBoard tags. The state passed is a copy whose ``global_step`` is the snapshot's step.
    Its run is identified (:func:`~attn_probe.integrations.tracker_run.tracker_run`) before its first snapshot; a callback
    that has not set itself up yet (with :func:`attach` the probe's ``on_train_begin`` runs
    first) gets the ``on_train_begin`` it was about to get, with the Trainer's arguments
    (``begin_kwargs``: the model, ...), so that its run exists.
    """
    import copy

    from transformers import TrainerControl

    from ..sinks.trackers import TrackerTarget
    from .tracker_run import tracker_run

    def target(cb: Any) -> TrackerTarget:
        def run() -> Any:
            _set_up(cb, args, state, begin_kwargs)
            return tracker_run(cb, "trainer")

        def send(values: dict[str, float], step: int) -> None:
            at = copy.copy(state)
            at.global_step = step
            cb.on_log(args, at, TrainerControl(), logs=values)

        return TrackerTarget(type(cb).__name__, run, send)

    return [target(cb) for cb in callbacks]


def _set_up(cb: Any, args: Any, state: Any, begin_kwargs: dict[str, Any] | None) -> None:
    """Give a tracker callback that has not set itself up yet the ``on_train_begin`` it was about to get."""
    from transformers import TrainerControl

    if getattr(cb, "_initialized", None) is False and not getattr(state, "is_hyper_param_search", False):
        cb.on_train_begin(args, state, TrainerControl(), **dict(begin_kwargs or {}))


def wandb_callbacks(callbacks: Sequence[Any]) -> list[Any]:
    """The Trainer's W&B callbacks among ``callbacks``."""
    import transformers.integrations as integrations

    cls = getattr(integrations, "WandbCallback", None)
    return [cb for cb in callbacks if isinstance(cls, type) and isinstance(cb, cls)]


def trainer_wandb_sink(cb: Any, args: Any, state: Any, *, separate_run: bool, per_head: bool,
                       begin_kwargs: dict[str, Any] | None = None) -> Any:
    """The Trainer's W&B callback as a :class:`~attn_probe.sinks.wandb.WandbSink` beside (or, with
    ``separate_run=False``, into) the run it logs into, found at the sink's start, after the callback
    set itself up. The probe's configuration goes into its own run only."""
    from ..sinks.wandb import WandbSink

    def user_run() -> Any:
        _set_up(cb, args, state, begin_kwargs)
        return getattr(sys.modules.get("wandb"), "run", None)

    return WandbSink(user_run, separate_run=separate_run, per_head=per_head, log_config=separate_run)
