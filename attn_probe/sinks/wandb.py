"""Weights & Biases sink for plain PyTorch loops: the probe's values in a W&B run.

The probe gets its own step axis: ``define_metric("attn_probe/*", step_metric="attn_probe/step")``
and every payload carries ``attn_probe/step``. The sink never passes ``step=`` to ``run.log``:
W&B drops a log whose ``step=`` is lower than the last one it saw, so a probe step ahead of
the user's counter would drop the user's loss.

Rows. W&B's history is one sequence of rows, and ``run.log`` without ``step=`` writes into the
open row. In a run the sink created, each snapshot is one committed row. In the user's run the
values join the row the user has open (``commit=False``) and are committed with it, so a user
who logs one step in several ``run.log(..., step=s)`` calls, with the probe's snapshot between
them, loses nothing. At most one snapshot goes into a row; the next one waits until the user
opens a new row, and when a third arrives first (the user logs less often than the probe
snapshots, or not at all) the sink commits its row itself. So if you pass ``step=`` yourself,
use a counter that advances at least as often as the probe's snapshots (the optimizer step), or
give your metrics a step metric of their own; a log at a ``step=`` the sink has already
committed past is dropped by W&B. ``finish()`` writes the waiting snapshot into a new row.

Resume: on a resumed probe run, the snapshots the W&B run already holds are not sent again
(:mod:`attn_probe.sinks.trackers`): online, the last ``attn_probe/step`` is read back from
``run.summary``; offline (whose resumed run starts with an empty summary) the probe's record
in its run directory, keyed by ``run.id``, says it. A step is recorded when its row is handed
to ``run.log``.

This is a network sink (see :mod:`attn_probe.sinks.trackers`); ``wandb`` is imported in
:meth:`WandbSink.start` (``pip install 'attn-probe[wandb]'``).
"""

from __future__ import annotations

from typing import Any

from ..tags import PREFIX
from . import RunInfo, Snapshot
from .trackers import STEP_KEY, TrackerRun, TrackerSink, wandb_run

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

    def __init__(self, run: Any = None, *, per_head: bool = False, log_config: bool = True,
                 **init_kwargs: Any) -> None:
        super().__init__(per_head=per_head)
        self._given = run
        self._init_kwargs = init_kwargs
        self._log_config = log_config
        self._row: int | None = None
        self._held: dict[str, float] | None = None

    def _open(self, run_info: RunInfo) -> None:
        wandb = self._import()
        if self._given is not None:
            self.run, self.owns_run = self._given, False
        elif not self._init_kwargs and getattr(wandb, "run", None) is not None:
            self.run, self.owns_run = wandb.run, False
        else:
            self.run, self.owns_run = wandb.init(**self._init_kwargs), True
        self.run.define_metric(STEP_KEY)
        self.run.define_metric(f"{PREFIX}/*", step_metric=STEP_KEY)
        if self._log_config:
            self.run.config.update({PREFIX: {"config": run_info.config, "model": run_info.model}},
                                   allow_val_change=True)
        self._row, self._held = None, None

    def _tracker_run(self) -> TrackerRun:
        return wandb_run(self.run)

    def _sent(self, step: int) -> None:
        if self.owns_run:
            super()._sent(step)
        # in the user's run the step is recorded when _write hands its row to run.log

    def _send(self, snapshot: Snapshot, values: dict[str, float]) -> None:
        payload = {**values, STEP_KEY: int(snapshot.step)}
        if self.owns_run:
            self.run.log(payload)
            return
        self._write(payload)

    def _write(self, payload: dict[str, float] | None) -> None:
        """Place ``payload`` (``None``: only the waiting one) into the user's open row, one snapshot a row."""
        run = self.run
        row_taken = self._row is not None and run.step == self._row
        if row_taken and self._held is not None:
            run.log({}, commit=True)  # two snapshots waiting: commit the row holding ours
            row_taken = False
        if row_taken:
            self._held = payload
            return
        first, self._held = (self._held, payload) if self._held is not None else (payload, None)
        if first is not None:
            run.log(first, commit=False)
            self._row = run.step
            TrackerSink._sent(self, int(first[STEP_KEY]))

    def _close(self) -> None:
        run = self.run
        try:
            if run is not None and not self.owns_run and self._held is not None:
                if run.step == self._row:
                    run.log({}, commit=True)
                self._write(None)
        finally:
            self.run = None
            self._row, self._held = None, None
            if self.owns_run and run is not None:
                run.finish()
