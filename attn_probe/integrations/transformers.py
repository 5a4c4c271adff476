"""Trainer integration: ``attn_probe.attach(trainer, every=100)`` or ``callbacks=[AttnProbeCallback(every=100)]``.

Snapshots at ``on_train_begin`` (step 0, or the resume step), at ``on_step_end`` when the
schedule fires (``state.global_step`` counts optimizer updates) and at the last step
(``global_step >= max_steps`` or ``control.should_training_stop``, before the tracker
callbacks close their runs in ``on_train_end``), and at ``on_train_end`` unless that step was
already taken.

:func:`attach` puts the callback first in the Trainer's callback list, so that its
``on_train_begin`` can tell the Trainer's ``TensorBoardCallback`` which directory to use on a
resumed run before that callback opens its writer. With ``callbacks=[...]`` the callback
runs after the integrations and finds the Trainer's ``CallbackHandler`` on the call stack
(a fallback that warns when it finds nothing).

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
from transformers.trainer_callback import ExportableState

from ..extraction import entry_point, find_attention
from ..formats.logdir import default_log_dir
from ..isolation import safe_warn
from ..live.config import ProbeConfig, config_from_options
from ..live.probe import Probe
from ..live.resume_policy import LiveRunField, RunPlan, relative_to, retry_dir, saved_run, settle_run
from ..live.schedules import ScheduleLike
from ..live.stages.alerting import print_line
from .trainer_trackers import reporting_callbacks, trainer_targets, trainer_wandb_sink, wandb_callbacks

__all__ = ["AttnProbeCallback", "attach", "trainer_log_dir"]

#: options of the callback itself, beside the ProbeConfig fields
CALLBACK_OPTIONS = ("trackers", "trackers_per_head", "wandb_separate_run")
#: options of how the probe writes, left out of the checkpoint state (as before they were fields)
_WRITING_OPTIONS = ("background", "sink_queue", "sink_timeout", "async_scoring", "async_max_bytes")
#: key that :meth:`AttnProbeCallback.state` adds to the saved args: a Trainer restoring callback
#: states (``restore_callback_states_from_checkpoint=True``) gets the attached instance back
RESTORE_KEY = "attn_probe_restore"


def _find_callback_handler() -> Any:
    """The ``CallbackHandler`` dispatching the current event (found on the call stack).

    Why the stack (issue 30 kept it, ``docs/architecture.md``): a callback given as
    ``callbacks=[...]`` is never handed its handler (events receive args, state, control and
    the model/optimizer/... keyword arguments, not the handler or the other callbacks), and the
    handler is needed before ``TensorBoardCallback`` opens its writer. :func:`attach` sets
    ``handler`` explicitly, and then this is never called.
    """
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


class TrainerDirs:
    """The Trainer's TensorBoard run as the run-directory policy reads it
    (:class:`attn_probe.live.resume_policy.RunDirs`): its ``TensorBoardCallback`` instances."""

    fixed = False

    def __init__(self, args: Any, handler: Any) -> None:
        self.args, self.handler = args, handler

    def default_dir(self) -> str:
        return trainer_log_dir(self.args, self.handler)

    def open_dirs(self) -> list[str]:
        return [str(cb.logging_dir) for cb in _tensorboard_callbacks(self.handler)
                if getattr(cb, "tb_writer", None) is not None and getattr(cb, "logging_dir", None)]

    def point(self, directory: str) -> None:
        for cb in _tensorboard_callbacks(self.handler):
            if getattr(cb, "tb_writer", None) is None:
                cb.logging_dir = directory  # no public setter exists; TENSORBOARD_LOGGING_DIR is global


class AttnProbeCallback(TrainerCallback, ExportableState):
    """Log W_qk symmetry/directionality into the Trainer's TensorBoard run and ``attn_probe.jsonl``.

    ``every`` is an int or a callable ``step -> bool``; ``log_dir`` overrides the Trainer's
    TensorBoard directory; ``sinks`` adds sinks; ``trackers`` (default ``True``) also sends
    the values to the Trainer's other reporting integrations (W&B, MLflow, trackio, ...; a
    list of integration names narrows them, ``False`` turns it off) and ``trackers_per_head``
    adds per-head values there; W&B (``report_to=["wandb"]``) gets them in a W&B run of the
    probe's own beside the Trainer's, in its group, unless ``wandb_separate_run=False``: then
    they join the Trainer's rows and those that cannot are counted
    (:class:`~attn_probe.sinks.wandb.WandbSink`); ``announce=False`` leaves out the one-line status (what is
    watched, and its TensorBoard command) printed at the start, for a caller that prints its own;
    every other option is a field of
    :class:`~attn_probe.live.config.ProbeConfig` (``metrics``, ``per_head``, ``groups``,
    ``layers``, ``num_std``, ``images_every``, ...), validated here: a misspelled or invalid
    option raises ``TypeError``/``ValueError`` when the callback is built.

    An unsupported model raises :class:`~attn_probe.UnsupportedModelError` when the Trainer
    is built; an unwritable log directory raises :class:`~attn_probe.live.probe.LogDirError` at
    the start of ``train()``. Nothing after that stops training.

    With ``restore_callback_states_from_checkpoint=True`` the Trainer rebuilds stateful
    callbacks as ``AttnProbeCallback(**saved_args)``; while it does so (inside its
    ``_load_callback_state``) that call returns the instance attached to the Trainer, with its
    options and sinks, instead of a new one built from the saved args. The Trainer then sets the
    checkpoint's saved attributes on it: they land in :attr:`restored_attributes` and never
    replace the live run's identity (:attr:`run_id`, :attr:`run_log_dir`, ...), which
    ``on_train_begin`` decides from the checkpoint's record against the runs the trajectory holds.
    """

    #: this run's id (:func:`attn_probe.formats.trajectory.new_run_id`; saved with checkpoints):
    #: a resume continues the run of the checkpoint's id, whatever the directories are named
    run_id = LiveRunField()
    #: where this run's probe writes (saved with checkpoints)
    run_log_dir = LiveRunField()
    #: the same, relative to the Trainer's ``output_dir`` when it lies inside it (survives a move)
    run_log_dir_relative = LiveRunField()
    #: the Trainer's ``output_dir`` of that run: a checkpoint resumed under another one branches
    run_output_dir = LiveRunField()

    # Why ``__new__`` and the call stack (issue 30 kept them; docs/architecture.md): the Trainer
    # restores callback states by calling ``type(callback)(**saved_args)`` inside its
    # ``_load_callback_state`` and replacing the attached instance with the result; no hook of
    # the Trainer lets a callback take part. Only ``__new__`` can hand back the attached instance
    # (its options and sinks), and only the caller's frame says which Trainer (and so which of
    # several attached instances in one process) is restoring, and gives its args and state for the
    # early choice of the run directory. An explicit registry of attached instances could not tell
    # two Trainers apart, nor serve ``callbacks=[...]`` (never attached), without changing behaviour.
    def __new__(cls, *args: Any, **kwargs: Any) -> AttnProbeCallback:
        if not args and (kwargs.get(RESTORE_KEY) or not kwargs):  # earlier versions saved args {}
            live = _attached_instance_being_restored(cls, marked=bool(kwargs))
            if live is not None:
                return live
        return super().__new__(cls)

    def __init__(
        self,
        every: ScheduleLike | None = 100,
        *,
        log_dir: str | None = None,
        sinks: Sequence[Any] | None = None,
        trackers: bool | Sequence[str] = True,
        trackers_per_head: bool = False,
        wandb_separate_run: bool = True,
        announce: bool = True,
        **options: Any,
    ) -> None:
        if "_json_args" in self.__dict__:
            return  # the attached instance handed back to a Trainer restoring callback states (__new__)
        options.pop(RESTORE_KEY, None)
        self.config: ProbeConfig = config_from_options(every=every, log_dir=log_dir, sinks=sinks,
                                                       allowed_extra=CALLBACK_OPTIONS, **options)
        if not isinstance(trackers, bool):
            trackers = tuple(trackers)
            if not all(isinstance(t, str) for t in trackers):
                raise TypeError(f"trackers must be True, False or integration names, got {trackers!r}")
        self.log_dir = log_dir
        self.sinks = list(sinks) if sinks is not None else None
        self.trackers = trackers
        self.trackers_per_head = bool(trackers_per_head)
        #: W&B: a run of the probe's own beside the Trainer's (``True``) or joining its rows (``False``)
        self.wandb_separate_run = bool(wandb_separate_run)
        #: print the one-line "watching ..." status (with its TensorBoard command) at the start
        self.announce = bool(announce)
        self.probe: Probe | None = None
        self.handler: Any = None  # the Trainer's CallbackHandler, set by attach()
        #: the live run's fields (:attr:`run_id`, :attr:`run_log_dir`, ...), written by this callback only
        self._live_run: dict[str, str | None] = dict.fromkeys(
            ("run_id", "run_log_dir", "run_log_dir_relative", "run_output_dir"))
        #: attributes set from outside, e.g. by a Trainer restoring callback states from a checkpoint:
        #: information about that checkpoint, never this run's identity (:class:`LiveRunField`)
        self.restored_attributes: dict[str, Any] = {}
        #: ``(step, plan)`` chosen while the Trainer restored callback states
        self._early_choice: tuple[int, RunPlan] | None = None
        #: ``(parent run directory, step)`` of a run branched from another output_dir's checkpoint
        self.parent_run: tuple[str, int] | None = None
        #: the run headers' identity fields of this run (run_id, parent_run_id, parent_step, ...)
        self._identity: dict[str, Any] = {}
        self._json_args = _json_safe_options(every=every, log_dir=log_dir, trackers=trackers,
                                             trackers_per_head=trackers_per_head, wandb_separate_run=wandb_separate_run,
                                             **{k: v for k, v in options.items() if k not in _WRITING_OPTIONS})

    # -- checkpoints (transformers' ExportableState) ------------------------------------------
    def state(self) -> dict[str, Any]:
        """Saved in ``trainer_state.json``: the run directory, so that a resumed run continues it.

        ``run_log_dir`` is the path as used; ``run_log_dir_relative`` the same relative to the
        Trainer's ``output_dir`` (``None`` when outside it), which a resumed run resolves against
        its own ``output_dir``, so the run is found after the output directory was moved or copied;
        ``run_output_dir`` that ``output_dir``: a resume under another one branches (a new run);
        ``run_id`` the run's id, by which a resume recognises its run in a trajectory file (two
        runs whose directories have the same name stay two runs).
        The args carry :data:`RESTORE_KEY`, by which the attached instance is kept on restore.
        """
        return {"args": {**(self._json_args or {}), RESTORE_KEY: True},
                "attributes": {"run_log_dir": self.run_log_dir, "run_log_dir_relative": self.run_log_dir_relative,
                               "run_output_dir": self.run_output_dir, "run_id": self.run_id}}

    # -- copies and pickles ------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """What a pickle or a copy of the callback carries: its options and the run's identity.

        Not the Trainer's :attr:`handler`, which :func:`attach` sets (through it the Trainer's model,
        optimizer, scheduler and data loaders: weak references that do not pickle, and objects a
        copy of the callback must not hold), nor the live :attr:`probe` (threads and open files;
        ``None`` after ``train()``). A copy gets a handler again from :func:`attach`, or finds its
        Trainer's on the call stack as a callback passed in ``callbacks=[...]`` does."""
        return {**self.__dict__, "handler": None, "probe": None}

    @entry_point("AttnProbeCallback")  # the outermost mark wins: attach() marks itself first
    def _check_model(self, model: Any) -> None:
        find_attention(model, groups=self.config.groups, layers=self.config.layers, **self.config.find_kwargs)

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is not None:
            self._check_model(model)  # UnsupportedModelError before any training

    def _handler(self) -> Any:
        if self.handler is not None:
            return self.handler
        handler = _find_callback_handler()
        if handler is None:
            _warn("attn_probe: could not find the Trainer's callback handler on the call stack; the "
                  "probe writes to its own directory and does not send values to the Trainer's trackers. "
                  "Use attn_probe.attach(trainer, ...) instead of callbacks=[...] to avoid this.")
        return handler

    def _plan(self, args: Any, state: Any, handler: Any) -> RunPlan:
        """The run directory and identity, from :func:`attn_probe.live.resume_policy.settle_run`, which
        decides and carries it out on the Trainer's TensorBoard run (:class:`TrainerDirs`): ``log_dir=``,
        else the saved run on resume (found by its run id), else the Trainer's TensorBoard run."""
        step = int(state.global_step)
        saved = saved_run(getattr(state, "stateful_callbacks", None)) if step > 0 else None
        return settle_run(step, saved, TrainerDirs(args, handler), log_dir=self.log_dir, output_dir=args.output_dir,
                          env_dir=os.getenv("TENSORBOARD_LOGGING_DIR"))

    def _take(self, plan: RunPlan) -> None:
        """Make ``plan``'s identity this run's (:attr:`run_id`, :attr:`parent_run`, the header fields)."""
        self._live_run["run_id"] = plan.run_id
        self._identity = dict(plan.identity)
        self.parent_run = plan.parent_run

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        # the training loop entered again without ending (auto_find_batch_size after an out-of-memory
        # error) or a second train() call: start over at this step, dropping the rows written from it on
        restart = self.probe is not None
        previous_id = self.run_id
        if restart:
            self.probe.close(final_snapshot=False)
            self.probe = None
            if state.is_world_process_zero:
                _warn(f"attn_probe: the Trainer entered its training loop again at step {state.global_step} "
                      "without ending the last one (auto_find_batch_size after an out-of-memory error, or "
                      "train() after one that raised); the probe starts over there: the trajectory rows "
                      "from that step on are replaced by this loop's.")
        main = bool(state.is_world_process_zero)
        step = int(state.global_step)
        self._max_steps = int(getattr(state, "max_steps", 0) or 0)
        plan, purge_stale, handler = None, True, None
        sinks = list(self.sinks or [])
        if main:
            handler = self._handler()
            early, self._early_choice = self._early_choice, None
            plan = early[1] if early is not None and early[0] == step else self._plan(args, state, handler)
            self._take(plan)
            if step > 0:
                purge_stale = not self._restart_via_trainer_writer(handler, plan.directory, step)
            trackers = reporting_callbacks(handler, self.trackers)
            begin = {"model": model, **kwargs}
            on_wandb = wandb_callbacks(trackers)
            others = [cb for cb in trackers if cb not in on_wandb]
            if others:
                from ..sinks.trackers import TrackerFanOut

                sinks.append(TrackerFanOut(trainer_targets(others, args, state, begin_kwargs=begin),
                                           per_head=self.trackers_per_head))
            sinks.extend(trainer_wandb_sink(cb, args, state, separate_run=self.wandb_separate_run,
                                            per_head=self.trackers_per_head, begin_kwargs=begin)
                         for cb in on_wandb)
        from ..formats.logdir import LogDirError

        if restart and previous_id is not None:  # the same run, started over at this step
            self._live_run["run_id"] = previous_id
            self._identity = {"run_id": previous_id}

        def build(where: str | None) -> Probe:
            header = {"integration": "transformers.Trainer", "output_dir": str(args.output_dir), **self._identity}
            if main and self.parent_run is not None:  # lineage of a branched run, in its run header
                header.update(parent_run=self.parent_run[0], parent_step=self.parent_run[1])
            return Probe(model, self.config.replace(
                start_step=step, log_dir=where, sinks=sinks or None, is_main_process=main, purge_stale=purge_stale,
                restart=restart, extra_config=header,
            ))

        log_dir = plan.directory if plan is not None else None
        try:
            self.probe = build(log_dir)
        except LogDirError as exc:
            checkpoint_run = plan is not None and plan.from_checkpoint
            retry = retry_dir(plan, exc, TrainerDirs(args, handler), step, args.output_dir) if plan else None
            if retry is None:
                raise
            log_dir = retry
            if checkpoint_run:  # a fresh run instead of the checkpoint's: an identity of its own, in its header too
                self._take(plan)
            self.probe = build(log_dir)
        self._live_run.update(run_log_dir=log_dir, run_output_dir=os.path.abspath(str(args.output_dir)),
                              run_log_dir_relative=relative_to(log_dir, args.output_dir) if log_dir is not None else None)
        if main and self.announce:
            self.probe.announce(every=self.config.every, unit="optimizer steps")
        self.probe.snapshot(step)

    @staticmethod
    def _restart_via_trainer_writer(handler: Any, log_dir: str, step: int) -> bool:
        """On resume into a run that has event files, mark the restart in the Trainer's own file.

        TensorBoard reads a run's files in name order and a ``SessionLog.START`` marker drops
        everything read before it with a step ``>= step``. The Trainer's new event file is
        created before ours, so the marker must go into *its* file: placed in ours, it would
        also drop the Trainer's fresh losses. Returns whether the marker was written.
        """
        from ..formats.events import has_event_files
        from ..sinks.tensorboard import emit_session_start, writer_log_dir

        if not has_event_files(log_dir):
            return False
        for cb in _tensorboard_callbacks(handler):
            writer = getattr(cb, "tb_writer", None)
            if writer is not None and os.path.realpath(writer_log_dir(writer)) == os.path.realpath(log_dir):
                return emit_session_start(writer, step)
        return False

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        probe = self.probe
        if probe is not None and probe.measures_activations:  # attention_stats: this step's forwards if due
            probe.arm_after_update = False  # not after on_step_end: evaluation runs between the steps
            probe.arm_attention(int(state.global_step) + 1)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.probe is not None and self.probe.measures_activations:
            self.probe.stop_attention()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        probe = self.probe
        if probe is None:
            return
        step = int(state.global_step)
        last = bool(getattr(control, "should_training_stop", False)) or (self._max_steps > 0 and step >= self._max_steps)
        if last:  # async_scoring: the snapshot still being scored first, or the final one would be skipped
            _flush(probe)
        probe.on_update(step)
        if probe.stop_requested and not last:  # stop_on_alert: the same decision on every rank, same step
            control.should_training_stop = last = True
            _stop_for_alert(probe, args, control, step, main=bool(getattr(state, "is_world_process_zero", True)))
        if last:
            # the final snapshot now: the tracker callbacks end their runs in on_train_end,
            # which they receive before this callback does
            probe.snapshot(step)
            _flush(probe)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        probe = self.probe
        if probe is None:
            return
        probe.step = max(probe.step, int(state.global_step))
        probe.close()  # final snapshot unless already taken
        self.probe = None


# ------------------------------------------------------------------------------------ helpers
def _warn(message: str) -> None:
    """A RuntimeWarning that cannot raise (``python -W error`` turns warnings into exceptions)."""
    safe_warn(message, RuntimeWarning, stacklevel=3)


def _stop_for_alert(probe: Probe, args: Any, control: Any, step: int, *, main: bool) -> None:
    """stop_on_alert: ask the Trainer for a checkpoint of this step when its policy saves at all
    (``save_strategy`` not ``"no"``), so that the weights that fired can be inspected; the main
    process says so in one line."""
    strategy = str(getattr(getattr(args, "save_strategy", "no"), "value", getattr(args, "save_strategy", "no")))
    saving = strategy != "no"
    if saving:
        control.should_save = True
    if not main:
        return
    alert = probe.alerting.stop_alert if probe.alerting is not None else None
    cause = (f"the alert on {alert.metric} at step {alert.step} ({alert.group} layer {alert.layer}"
             f"{'' if alert.head is None else f' head {alert.head}'})" if alert is not None else "an alert")
    if saving:
        where = os.path.join(str(args.output_dir), f"checkpoint-{step}")
        kept = f"the Trainer saves a checkpoint of this step in {where} (save_strategy={strategy!r})"
    else:
        kept = ("no checkpoint is saved (save_strategy='no'); with save_strategy='steps' the Trainer would save "
                "the weights that fired")
    print_line(f"attn_probe: training stopped at step {step} because of {cause} (stop_on_alert=True); {kept}.")


def _flush(probe: Probe) -> None:
    try:
        probe.flush()
    except Exception:  # noqa: BLE001 - a failed flush must not stop the Trainer
        pass


def _json_safe_options(**options: Any) -> dict[str, Any] | None:
    """The constructor's options if they survive JSON (checkpoint state), else ``None``."""
    import json

    try:
        json.dumps(options)
    except (TypeError, ValueError):
        return None
    return options


def _attached_instance_being_restored(cls: type, *, marked: bool) -> Any:
    """The attached ``cls`` instance a Trainer's ``_load_callback_state`` is rebuilding, or ``None``.

    Called from ``cls.__new__``; the Trainer is found on the call stack (``marked``: the args
    carry :data:`RESTORE_KEY`; unmarked, from checkpoints of earlier versions, the caller must be
    the Trainer's ``_load_callback_state``). The Trainer removes the first instance of the class
    after each rebuild, so the first attached one not yet handed back is the one being rebuilt.
    Its run directory is chosen here, while the Trainer's TensorBoard writer is not open yet:
    the Trainer moves the instance to the end of its callback list, after TensorBoardCallback.
    """
    try:
        frame = sys._getframe(2)
    except ValueError:  # called with no Python caller
        return None
    for _ in range(4 if marked else 1):
        if frame is None:
            return None
        trainer = frame.f_locals.get("self")
        handler = getattr(trainer, "callback_handler", None)
        if handler is not None and hasattr(trainer, "state") and hasattr(trainer, "args") and (
                marked or frame.f_code.co_name == "_load_callback_state"):
            break
        frame = frame.f_back
    else:
        return None
    live = [cb for cb in handler.callbacks if type(cb) is cls and getattr(cb, "probe", None) is None]
    if not live:
        return None
    callback = live[0]
    callback.handler = handler
    callback._early_choice = None
    is_main = getattr(trainer, "is_world_process_zero", None)
    if callable(is_main) and is_main():
        callback._early_choice = (int(trainer.state.global_step), callback._plan(trainer.args, trainer.state, handler))
    return callback


@entry_point("attach")
def attach(trainer: Any, every: ScheduleLike | None = 100, **options: Any) -> AttnProbeCallback:
    """Attach a probe to ``trainer``: ``attn_probe.attach(trainer, every=100)``; returns the callback.

    The explicit alternative to ``callbacks=[AttnProbeCallback(...)]``: no stack inspection,
    and the callback is put first in the Trainer's callback list, so that a resumed run's
    directory is chosen before the Trainer's TensorBoard writer opens and the final snapshot
    reaches the trackers before they end their runs. Options as :class:`AttnProbeCallback`.
    Attached after ``trainer.train()`` it warns: it measures only during a later ``train()``.
    """
    callback = AttnProbeCallback(every, **options)
    handler = trainer.callback_handler
    if any(isinstance(cb, AttnProbeCallback) for cb in handler.callbacks):
        raise ValueError("this Trainer already has an AttnProbeCallback")
    trained = int(getattr(getattr(trainer, "state", None), "global_step", 0) or 0)
    if trained > 0:
        _warn(f"attn_probe.attach: this Trainer has already trained ({trained} steps); the probe measures "
              "nothing until trainer.train() runs again. Attach before calling trainer.train(), or score the "
              "trained model now with attn_probe.score_model(trainer.model).")
    if getattr(trainer, "model", None) is not None:
        callback._check_model(trainer.model)
    callback.handler = handler
    handler.callbacks.insert(0, callback)
    if hasattr(trainer, "state") and getattr(trainer.state, "stateful_callbacks", None) is not None:
        # checkpoints save ExportableState callbacks listed in the state
        stateful = trainer.state.stateful_callbacks
        if isinstance(stateful, dict):
            stateful.setdefault("AttnProbeCallback", callback.state())
    return callback
