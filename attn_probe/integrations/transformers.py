"""Trainer integration: ``Trainer(..., callbacks=[attn_probe.AttnProbeCallback(every=100)])``.

Snapshots at ``on_train_begin`` (step 0, or the resume step), at ``on_step_end`` when the
schedule fires (``state.global_step`` counts optimizer updates), and at ``on_train_end``
unless that step was already taken.

Log directory, unless ``log_dir=`` is given: the Trainer's own TensorBoard run, so that loss
and scores sit in one run. transformers 5's ``TensorBoardCallback`` uses the
``TENSORBOARD_LOGGING_DIR`` environment variable, else ``output_dir/runs/<time>_<host>``
computed at its ``on_train_begin``; this callback reads the directory the Trainer's
TensorBoardCallback settled on (or hands it ours if it has not chosen yet), and applies the
same rule itself when the Trainer does not report to TensorBoard.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback

from ..config import ProbeConfig, config_from_options
from ..extraction import find_attention
from ..probe import Probe, default_log_dir
from ..schedules import ScheduleLike

__all__ = ["AttnProbeCallback", "trainer_log_dir"]


def _find_callback_handler() -> Any:
    """The ``CallbackHandler`` dispatching the current event (found on the call stack)."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__name__ == "CallbackHandler" and hasattr(owner, "callbacks"):
            return owner
        frame = frame.f_back
    return None


def _tensorboard_callbacks(handler: Any) -> list[Any]:
    if handler is None:
        return []
    from transformers.integrations import TensorBoardCallback

    return [cb for cb in handler.callbacks if isinstance(cb, TensorBoardCallback)]


def trainer_log_dir(args: Any, handler: Any = None) -> str:
    """Where the Trainer's TensorBoard logging writes (transformers 5 rule).

    ``TENSORBOARD_LOGGING_DIR`` (user-expanded) if set, else the directory the Trainer's
    ``TensorBoardCallback`` chose, else ``args.output_dir/runs/<Mon DD_HH-MM-SS>_<host>``.
    When the TensorBoardCallback has not chosen yet, it is told to use the same directory.
    """
    env = os.getenv("TENSORBOARD_LOGGING_DIR")
    if env is not None:
        return os.path.expanduser(env)
    tb_callbacks = _tensorboard_callbacks(handler)
    for cb in tb_callbacks:
        if getattr(cb, "logging_dir", None):
            return str(cb.logging_dir)
    log_dir = os.path.join(args.output_dir, default_log_dir())
    for cb in tb_callbacks:
        if getattr(cb, "tb_writer", None) is None:
            cb.logging_dir = log_dir  # it has not started: make it write where we write
    return log_dir


class AttnProbeCallback(TrainerCallback):
    """Log W_qk symmetry/directionality into the Trainer's TensorBoard run and ``attn_probe.jsonl``.

    ``every`` is an int or a callable ``step -> bool``; ``log_dir`` overrides the Trainer's
    TensorBoard directory; ``sinks`` adds sinks; every other option is a field of
    :class:`~attn_probe.config.ProbeConfig` (``metrics``, ``per_head``, ``groups``,
    ``layers``, ``num_std``, ``images_every``, ...), validated here: a misspelled or invalid
    option raises ``TypeError``/``ValueError`` when the callback is built.

    An unsupported model raises :class:`~attn_probe.UnsupportedModelError` when the Trainer
    is built; an unwritable log directory raises :class:`~attn_probe.probe.LogDirError` at
    the start of ``train()``. Nothing after that stops training.
    """

    def __init__(
        self,
        every: ScheduleLike | None = 100,
        *,
        log_dir: str | None = None,
        sinks: Sequence[Any] | None = None,
        **options: Any,
    ) -> None:
        self.config: ProbeConfig = config_from_options(every=every, allowed_extra=("log_dir", "sinks"), **options)
        self.log_dir = log_dir
        self.sinks = list(sinks) if sinks is not None else None
        self.probe: Probe | None = None

    def _check_model(self, model: Any) -> None:
        find_attention(model, groups=self.config.groups, layers=self.config.layers, **self.config.find_kwargs)

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is not None:
            self._check_model(model)  # UnsupportedModelError before any training

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.probe is not None:  # a second train() call on the same callback
            self.probe.close(final_snapshot=False)
            self.probe = None
        main = bool(state.is_world_process_zero)
        step = int(state.global_step)
        log_dir, purge_stale = None, True
        if main:
            handler = _find_callback_handler()
            log_dir = self.log_dir if self.log_dir is not None else trainer_log_dir(args, handler)
            if step > 0:
                purge_stale = not self._restart_via_trainer_writer(handler, log_dir, step)
        self.probe = Probe(
            model,
            self.config.replace(start_step=step),
            log_dir=log_dir,
            sinks=self.sinks,
            is_main_process=main,
            purge_stale=purge_stale,
            extra_config={"integration": "transformers.Trainer", "output_dir": str(args.output_dir)},
        )
        self.probe.snapshot(step)

    @staticmethod
    def _restart_via_trainer_writer(handler: Any, log_dir: str, step: int) -> bool:
        """On resume into a run that has event files, mark the restart in the Trainer's own file.

        TensorBoard reads a run's files in name order and a ``SessionLog.START`` marker drops
        everything read before it with a step ``>= step``. The Trainer's new event file is
        created before ours, so the marker must go into *its* file: placed in ours, it would
        also drop the Trainer's fresh losses. Returns whether the marker was written.
        """
        from ..sinks.tensorboard import emit_session_start, has_event_files, writer_log_dir

        if not has_event_files(log_dir):
            return False
        for cb in _tensorboard_callbacks(handler):
            writer = getattr(cb, "tb_writer", None)
            if writer is not None and os.path.realpath(writer_log_dir(writer)) == os.path.realpath(log_dir):
                return emit_session_start(writer, step)
        return False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.probe is not None:
            self.probe.on_update(int(state.global_step))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        probe = self.probe
        if probe is None:
            return
        probe.step = max(probe.step, int(state.global_step))
        probe.close()  # final snapshot unless already taken
        self.probe = None
