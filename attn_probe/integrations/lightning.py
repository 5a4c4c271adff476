"""Lightning integration: ``lightning.Trainer(callbacks=[AttnProbeCallback(every=100)])``.

The same callback serves the ``lightning`` package and the older ``pytorch_lightning`` one, with
either installed or both: it subclasses ``lightning.pytorch``'s ``Callback`` when ``lightning`` can
be imported, else ``pytorch_lightning``'s, and tells the loggers of both packages apart by
class (:func:`_is_tensorboard_logger`).

Built on the public :class:`~attn_probe.live.probe.Probe` API, as :mod:`attn_probe.integrations.accelerate`:

* **Model**: the submodule named by ``module="..."``; by default the one child of the
  ``LightningModule`` holding every attention layer, else the ``LightningModule`` itself
  (:meth:`AttnProbeCallback.watched_model`).
* **Steps**: Lightning's optimizer steps, ``trainer.global_step`` (gradient accumulation
  counted as Lightning counts it), read at ``on_train_batch_end`` after each batch that
  stepped; a snapshot when the schedule fires, and a final one at ``on_train_end``.
* **Where**: with a ``TensorBoardLogger``, into the logger's own ``SummaryWriter``
  (``logger.experiment``): one event stream with Lightning's scalars, and ``attn_probe.jsonl``
  in ``logger.log_dir``; otherwise ``log_dir=``, else ``<default_root_dir>/runs/<time>_<host>``.
  A ``WandbLogger`` gets them in a W&B run of the probe's own beside the logger's run, in its
  group (:class:`~attn_probe.sinks.wandb.WandbSink`: nothing is logged into the logger's run);
  other loggers (MLflow, CSV, ...) through ``logger.log_metrics`` (``trackers=``). A
  TensorBoardLogger on tensorboardX (Lightning's fallback when the ``tensorboard`` package is
  missing) is refused in one line: pass ``log_dir=``.
* **Ranks**: the probe is built on every rank (its collective protocol: the attention
  combine and the stop decision run on every rank); only global zero writes.
* **Attention statistics** (``attention_stats=True``): armed at ``on_train_batch_start`` of a
  due step's micro-batches, stopped at ``on_before_optimizer_step`` and at
  ``on_validation_start``: validation batches are never measured. A validation that falls
  inside an accumulation window (``val_check_interval`` not a multiple of
  ``accumulate_grad_batches``) ends that step's measurement early: its values then cover the
  micro-batches before the validation. Manual optimisation (``automatic_optimization=False``,
  one optimizer or several): the batch is the step. Its training forwards are measured when
  one of the optimizer steps it may take (``len(trainer.optimizers)`` of them) is due, and
  belong to the optimizer step Lightning counts at the batch's end.
* **Resume**: Lightning restores this callback's state (:meth:`AttnProbeCallback.load_state_dict`)
  before ``on_fit_start`` but ``global_step`` only after it, so the probe attaches at
  ``on_train_start``. The resumed step ``G`` is snapshotted unless the checkpoint says the
  run already holds it; continuing in the same directory drops the trajectory rows after it
  (and TensorBoard's events through the restart marker). A resumed ``TensorBoardLogger``
  opens a new ``version_N`` by default: one line says where the trajectory continues, and
  the run header records the parent run and step. ``fit`` called again on the same Trainer
  (no checkpoint: Lightning keeps ``global_step`` and the logger) continues the callback's own
  run the same way: one run id, each step once.
* **stop_on_alert**: ``trainer.should_stop`` is set on every rank at the same step (the
  probe's stop decision is agreed across ranks). Lightning ignores ``should_stop`` until
  ``min_steps``/``min_epochs`` are met: the run then stops at the first step where they are.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

try:  # the ``lightning`` package; else the older ``pytorch_lightning`` (neither type-checks callbacks by package)
    from lightning.pytorch.callbacks import Callback
except ImportError:
    from pytorch_lightning.callbacks import Callback

from ..extraction import entry_point, find_attention
from ..formats.logdir import default_log_dir
from ..live.config import ProbeConfig, config_from_options
from ..live.probe import Probe
from ..live.resume_policy import SavedRun, resumed_line, settle_run
from ..live.schedules import ScheduleLike
from ..live.stages.alerting import print_line

__all__ = ["AttnProbeCallback"]

#: options of the callback itself, beside the ProbeConfig fields
CALLBACK_OPTIONS = ("trackers", "trackers_per_head")


class AttnProbeCallback(Callback):
    """Log W_qk symmetry/directionality of a ``LightningModule`` into the run's TensorBoard logger.

    ``every`` is an int or a callable ``step -> bool`` over Lightning's optimizer steps
    (``trainer.global_step``); ``module`` names the submodule to watch (default: the child holding
    every attention layer, else the ``LightningModule``); ``log_dir`` overrides the logger's directory; ``sinks`` adds sinks;
    ``trackers`` (default ``True``) also sends the values to the Trainer's other loggers (a
    list of logger class names, e.g. ``["WandbLogger"]``, narrows them, ``False`` turns it
    off), ``trackers_per_head`` adds per-head values there. Every other option is a field of
    :class:`~attn_probe.live.config.ProbeConfig` (``attention_stats``, ``alerts``,
    ``stop_on_alert``, ``per_head``, ``pairs``, ``async_scoring``, ...), validated here: a
    misspelled or invalid option raises ``TypeError``/``ValueError`` when the callback is built.

    An unsupported model raises :class:`~attn_probe.UnsupportedModelError` at ``setup``, before
    any training step; nothing after ``on_train_start`` stops training.
    """

    def __init__(
        self,
        every: ScheduleLike | None = 100,
        *,
        module: str | None = None,
        log_dir: str | None = None,
        sinks: Sequence[Any] | None = None,
        trackers: bool | Sequence[str] = True,
        trackers_per_head: bool = False,
        **options: Any,
    ) -> None:
        self.config: ProbeConfig = config_from_options(every=every, log_dir=log_dir, sinks=sinks,
                                                       allowed_extra=CALLBACK_OPTIONS, **options)
        if module is not None and not isinstance(module, str):
            raise TypeError(f"module must be a submodule name (str), got {type(module).__name__}")
        if not isinstance(trackers, bool):
            trackers = tuple(trackers)
            if not all(isinstance(t, str) for t in trackers):
                raise TypeError(f"trackers must be True, False or logger class names, got {trackers!r}")
        self.module = module
        self.log_dir = log_dir
        self.sinks = list(sinks) if sinks is not None else None
        self.trackers = trackers
        self.trackers_per_head = bool(trackers_per_head)
        self.probe: Probe | None = None
        #: where this run's probe writes (global zero; saved with checkpoints)
        self.run_log_dir: str | None = None
        #: this run's id (global zero; saved with checkpoints): a resume continues the run of the
        #: checkpoint's id where the directory's trajectory holds it, whatever the directory is named
        self.run_id: str | None = None
        #: restored from a checkpoint by :meth:`load_state_dict`: ``{"run_log_dir", "run_id", "last_snapshot_step"}``
        self.restored: dict[str, Any] | None = None
        self._last_global_step = 0
        #: the last snapshot's step once the probe is closed (``trainer.save_checkpoint`` after ``fit``)
        self.last_snapshot_step: int | None = None

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Saved in Lightning checkpoints: the run directory, its run id and the last snapshot's step, so
        that a resumed run continues its own run (by id), says where its trajectory continues and takes
        no step twice."""
        probe = self.probe
        last = probe.last_snapshot_step if probe is not None else self.last_snapshot_step
        return {"run_log_dir": self.run_log_dir, "run_id": self.run_id, "last_snapshot_step": last}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning calls this before ``on_fit_start``; the probe attaches later, at ``on_train_start``."""
        self.restored = dict(state_dict) if isinstance(state_dict, dict) else None

    # -- the model -----------------------------------------------------------------------------
    def watched_model(self, pl_module: Any) -> Any:
        """The module the probe watches: the submodule named by ``module=``; by default the one child of
        ``pl_module`` holding every attention layer (``self.model``), else ``pl_module`` itself.

        Lightning calls ``training_step``, not the ``LightningModule``'s ``forward``, and the attention
        statistics count the forwards of the watched module entered with gradients enabled: the child
        is the module whose forward ``training_step`` calls in the usual layout.
        """
        if self.module is None:
            layers = find_attention(pl_module, groups=self.config.groups, layers=self.config.layers,
                                    **self.config.find_kwargs)
            wanted = {id(layer.module) for layer in layers}
            holders = [child for child in pl_module.children() if wanted <= {id(m) for m in child.modules()}]
            return holders[0] if len(holders) == 1 else pl_module
        try:
            return pl_module.get_submodule(self.module)
        except AttributeError as exc:
            raise ValueError(f"AttnProbeCallback(module={self.module!r}): {type(pl_module).__name__} has no such "
                             f"submodule ({exc})") from None

    @entry_point("AttnProbeCallback")
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":  # UnsupportedModelError before any training
            find_attention(self.watched_model(pl_module), groups=self.config.groups, layers=self.config.layers,
                           **self.config.find_kwargs)

    # -- where it writes (global zero) -----------------------------------------------------------
    def _tensorboard_writer(self, trainer: Any) -> Any:
        """The first TensorBoardLogger's ``SummaryWriter`` (torch's), or ``None`` without one."""
        for logger in trainer.loggers:
            if _is_tensorboard_logger(logger):
                writer = logger.experiment
                if not type(writer).__module__.startswith("torch.utils.tensorboard"):
                    raise TypeError(f"attn_probe: the TensorBoardLogger writes with {type(writer).__module__}."
                                    f"{type(writer).__name__} (tensorboardX), which the probe does not share; "
                                    "install tensorboard, or pass AttnProbeCallback(log_dir=...) for its own directory")
                return writer
        return None

    def _other_loggers(self, trainer: Any) -> list[Any]:
        if self.trackers is False:
            return []
        names = None if self.trackers is True else {str(n).lower() for n in self.trackers}
        return [lg for lg in trainer.loggers if not _is_tensorboard_logger(lg)
                and (names is None or type(lg).__name__.lower() in names)]

    # -- the run -------------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.probe is not None:  # fit() again on the same callback: start over
            self.probe.close(final_snapshot=False)
            self.last_snapshot_step, self.probe = self.probe.last_snapshot_step, None
        step = int(trainer.global_step)
        self._last_global_step = step
        main = bool(trainer.is_global_zero)
        restored, self.restored = self.restored, None  # a checkpoint's state serves the fit it was loaded for
        if restored is None and self.run_id is not None and self.last_snapshot_step is not None:
            # fit() again without a checkpoint: its own run goes on (Lightning keeps global_step and the
            # logger), one run whose rows from ``step`` on are cut and taken again (no step twice)
            restored = self.state_dict()
        restored = restored if step > 0 else None
        saved = None
        if restored:
            saved_id = restored.get("run_id")
            saved = SavedRun(restored.get("run_log_dir"), None, None, saved_id if isinstance(saved_id, str) else None)
        held = bool(restored) and restored.get("last_snapshot_step") == step  # the checkpoint's run holds step
        writer, log_dir, sinks = None, self.log_dir, list(self.sinks or [])
        header: dict[str, Any] = {"integration": _integration(trainer)}
        plan, continues = None, False
        if main:
            if log_dir is None:
                writer = self._tensorboard_writer(trainer)
            plan = settle_run(step, saved, LightningDirs(trainer, writer), log_dir=log_dir, output_dir=None)
            continues = plan.continues
            header.update(plan.identity)
            sinks.extend(_tracker_sinks(self._other_loggers(trainer), self.trackers_per_head))
            if log_dir is None and writer is None:
                log_dir = plan.directory
        # the same choice on every rank (the snapshot of the resumed step is a collective)
        continues = bool(trainer.strategy.broadcast(continues, src=0)) if step > 0 else False
        skip_resumed = held and not continues
        self.probe = Probe(self.watched_model(pl_module), self.config.replace(
            start_step=step, log_dir=log_dir, writer=writer, sinks=sinks or None, is_main_process=main,
            purge_stale=True, restart=False, extra_config=header))
        self.run_log_dir = self.probe.log_dir if main else None
        if plan is not None:
            self.run_id = plan.run_id
        if self.probe.measures_activations:
            self.probe.arm_after_update = False  # armed at on_train_batch_start: never for validation
        if main:
            self.probe.announce(every=self.config.every, unit="optimizer steps")
            resumed_line(plan, step, self.run_log_dir, skipped=skip_resumed)
        if not skip_resumed:
            self.probe.snapshot(step)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        probe = self.probe
        if probe is None or not probe.measures_activations:
            return
        step = int(trainer.global_step)
        if getattr(pl_module, "automatic_optimization", True):  # this micro-batch belongs to the next step
            probe.arm_attention(step + 1)
        else:  # manual optimisation: the batch is the step, however many optimizer steps it takes
            try:
                probe.arm_for_batch(range(step + 1, step + 1 + max(1, len(trainer.optimizers))))
            except Exception as exc:  # noqa: BLE001 - never stops training
                probe.failure_log.report("arming the attention capture", exc)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.probe is not None and self.probe.measures_activations \
                and getattr(pl_module, "automatic_optimization", True):  # manual: the batch's end stops it
            self.probe.stop_attention()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.probe is not None and self.probe.measures_activations:
            self.probe.stop_attention()  # validation forwards are not the step's

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        probe = self.probe
        step = int(trainer.global_step)
        if probe is not None and probe.measures_activations and not getattr(pl_module, "automatic_optimization", True):
            try:
                probe.end_batch(step)
            except Exception as exc:  # noqa: BLE001 - never stops training
                probe.failure_log.report("ending the attention capture's batch", exc)
        if probe is None or step == self._last_global_step:  # an accumulation micro-batch
            return
        self._last_global_step = step
        probe.on_update(step)
        if probe.stop_requested and not trainer.should_stop:  # the same decision on every rank, same step
            trainer.should_stop = True
            if trainer.is_global_zero:
                try:
                    _stop_line(probe, trainer, step)
                except Exception:  # noqa: BLE001 - a status line must never stop training
                    pass

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        probe = self.probe
        if probe is None:
            return
        step = int(trainer.global_step)
        last = probe.last_snapshot_step
        _flush(probe)
        if last is None or step > last:
            probe.snapshot(step)  # every rank: the same step
        probe.close(final_snapshot=False)
        self.last_snapshot_step = probe.last_snapshot_step
        self.probe = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.probe is not None:  # no final snapshot: other ranks may not reach it
            self.probe.close(final_snapshot=False)
            self.last_snapshot_step, self.probe = self.probe.last_snapshot_step, None


# ------------------------------------------------------------------------------------ helpers
class LightningDirs:
    """Lightning's TensorBoard run as the run-directory policy reads it
    (:class:`attn_probe.live.resume_policy.RunDirs`): the first ``TensorBoardLogger``'s open writer,
    else ``<default_root_dir>/runs/<time>_<host>``. Its directory is final (``fixed``): a logger's
    version directory cannot be moved, so nothing is pointed."""

    fixed = True

    def __init__(self, trainer: Any, writer: Any) -> None:
        self.trainer, self.writer = trainer, writer

    def default_dir(self) -> str:
        if self.writer is not None:
            from ..sinks.tensorboard import writer_log_dir

            return writer_log_dir(self.writer)
        return os.path.join(str(self.trainer.default_root_dir), default_log_dir())

    def open_dirs(self) -> list[str]:
        return [self.default_dir()] if self.writer is not None else []

    def point(self, directory: str) -> None:
        pass  # the logger's directory is fixed at its construction


def _is_tensorboard_logger(logger: Any) -> bool:
    """Whether ``logger`` is a ``TensorBoardLogger`` of ``lightning`` or of ``pytorch_lightning`` (whichever
    is loaded: a Trainer's loggers come from its own package, already imported)."""
    for package in ("lightning.pytorch.loggers", "pytorch_lightning.loggers"):
        cls = getattr(sys.modules.get(package), "TensorBoardLogger", None)
        if isinstance(cls, type) and isinstance(logger, cls):
            return True
    return False


def _integration(trainer: Any) -> str:
    """The run header's ``integration``: ``lightning.Trainer`` or ``pytorch_lightning.Trainer``."""
    package = type(trainer).__module__.split(".")[0]
    return "pytorch_lightning.Trainer" if package == "pytorch_lightning" else "lightning.Trainer"


def _flush(probe: Probe) -> None:
    try:
        probe.flush()
    except Exception:  # noqa: BLE001
        pass


def _tracker_sinks(loggers: list[Any], per_head: bool) -> list[Any]:
    """The sinks of the Trainer's other loggers: a ``WandbLogger`` gets a
    :class:`~attn_probe.sinks.wandb.WandbSink` beside its run (a W&B run of the probe's own, as the
    Trainer's and Accelerate's W&B runs get: nothing is logged into the logger's run), the others
    one :class:`~attn_probe.sinks.trackers.TrackerFanOut` through their ``log_metrics``."""
    on_wandb = [lg for lg in loggers if _is_logger(lg, "WandbLogger")]
    others = [lg for lg in loggers if not any(lg is w for w in on_wandb)]
    sinks: list[Any] = []
    if on_wandb:
        from ..sinks.wandb import WandbSink

        # logger.experiment: the logger's run, started by it on first use (Lightning's public accessor)
        sinks.extend(
            WandbSink(lambda lg=lg: lg.experiment, separate_run=True, per_head=per_head) for lg in on_wandb
        )
    if others:
        from ..sinks.trackers import TrackerFanOut

        sinks.append(TrackerFanOut([_logger_target(lg) for lg in others], per_head=per_head))
    return sinks


def _is_logger(logger: Any, name: str) -> bool:
    """Whether ``logger`` is the logger class ``name`` of ``lightning`` or of ``pytorch_lightning``."""
    for package in ("lightning.pytorch.loggers", "pytorch_lightning.loggers"):
        cls = getattr(sys.modules.get(package), name, None)
        if isinstance(cls, type) and isinstance(logger, cls):
            return True
    return False


def _logger_target(logger: Any) -> Any:
    """A Lightning logger as a target of the probe's tracker fan-out: values through ``log_metrics``."""
    from ..sinks.trackers import TrackerTarget
    from .tracker_run import tracker_run

    run = tracker_run(logger, "lightning")  # its version now, as the logger is set up
    return TrackerTarget(type(logger).__name__, lambda: run, lambda values, step: logger.log_metrics(values, step=step))


def _stop_line(probe: Probe, trainer: Any, step: int) -> None:
    """One line: why training stops, and when (``min_steps``/``min_epochs`` defer Lightning's stop)."""
    alert = probe.alerting.stop_alert if probe.alerting is not None else None
    cause = (f"the alert on {alert.metric} at step {alert.step} ({alert.group} layer {alert.layer}"
             f"{'' if alert.head is None else f' head {alert.head}'})" if alert is not None else "an alert")
    fit_loop = trainer.fit_loop
    # FitLoop._can_stop_early: Lightning's own test of min_steps/min_epochs (no public accessor)
    when = ("training stops after this step" if getattr(fit_loop, "_can_stop_early", True) else
            f"Lightning stops once min_steps={fit_loop.min_steps} / min_epochs={fit_loop.min_epochs} are met")
    print_line(f"attn_probe: trainer.should_stop set at step {step} because of {cause} (stop_on_alert=True); {when}.")

