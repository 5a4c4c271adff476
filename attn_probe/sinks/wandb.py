"""Weights & Biases sink for plain PyTorch loops: the probe's values in a W&B run.

The probe gets its own step axis (:func:`~attn_probe.sinks.trackers.define_probe_axis`:
``attn_probe/*`` plotted against ``attn_probe/step``), carried by every payload. The sink never
passes ``step=`` to ``run.log`` (W&B drops a log whose ``step=`` is below the last one it saw)
and never reads ``run.step`` (a blocking round-trip to the W&B service). In the user's run the
values join the row the user has open (``commit=False``); docs/live-probe.md ("W&B rows") says
what that means. A background sink: a hung service blocks only its lane. On resume the steps
the run already holds are not sent again (:mod:`attn_probe.tracker_record`). ``wandb`` is
imported in :meth:`WandbSink.start` (``pip install 'attn-probe[wandb]'``).
"""

from __future__ import annotations

from typing import Any

from ..tags import PREFIX
from ..tracker_record import TrackerRun, wandb_run
from . import RunInfo, Snapshot
from .trackers import STEP_KEY, TrackerSink, define_probe_axis

__all__ = ["WandbSink"]


class WandbSink(TrackerSink):
    """Send snapshots to a W&B run.

    ``run``: the user's run (``wandb.init(...)``'s result), left open at ``finish()``. Without
    it, the active run (``wandb.run``) is used when no ``init_kwargs`` are given, else a run is
    created with ``wandb.init(**init_kwargs)`` and finished by :meth:`finish`. ``per_head``
    also sends one series per head. ``log_config`` records the probe's configuration under
    ``config["attn_probe"]``.

    Example:
        >>> run = wandb.init(project="my-project")                      # doctest: +SKIP
        >>> with attn_probe.watch(model, optimizer=opt, log_dir="runs/x", every=100,
        ...                       sinks=[WandbSink(run)]):              # doctest: +SKIP
        ...     train()
    """

    module = "wandb"
    extra = "wandb"
    #: driven from the dispatcher's lane: only ``run.log`` is called after ``start()``
    background = True

    def __init__(self, run: Any = None, *, per_head: bool = False, log_config: bool = True,
                 **init_kwargs: Any) -> None:
        super().__init__(per_head=per_head)
        self._given = run
        self._init_kwargs = init_kwargs
        self._log_config = log_config

    def _open(self, run_info: RunInfo) -> None:
        wandb = self._import()
        if self._given is not None:
            self.run, self.owns_run = self._given, False
        elif not self._init_kwargs and getattr(wandb, "run", None) is not None:
            self.run, self.owns_run = wandb.run, False
        else:
            self.run, self.owns_run = wandb.init(**self._init_kwargs), True
        define_probe_axis(self.run)
        if self._log_config:
            self.run.config.update({PREFIX: {"config": run_info.config, "model": run_info.model}},
                                   allow_val_change=True)

    def _tracker_run(self) -> TrackerRun:
        return wandb_run(self.run)

    def _send(self, snapshot: Snapshot, values: dict[str, float]) -> None:
        self.run.log({**values, STEP_KEY: int(snapshot.step)}, commit=self.owns_run)

    def _close(self) -> None:
        run, self.run = self.run, None
        if self.owns_run and run is not None:
            run.finish()
