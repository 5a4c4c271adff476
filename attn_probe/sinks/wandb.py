"""Weights & Biases sink for plain PyTorch loops: the probe's values in a W&B run.

The probe gets its own step axis (:func:`~attn_probe.sinks.trackers.define_probe_axis`:
``attn_probe/*`` plotted against ``attn_probe/step``), carried by every payload. The sink never
passes ``step=`` to ``run.log`` (W&B drops a log whose ``step=`` is below the last one it saw)
and never reads ``run.step`` (a blocking round-trip to the W&B service). In a run the sink
created each snapshot is a row of its own. In the user's run, how the user logs decides
(:class:`~attn_probe.sinks.trackers.WandbRows`): rows of the probe's own on W&B's default Step
axis when the user never passes ``step=``; otherwise the snapshot joins the user's open row and
a snapshot that cannot reach W&B is warned about, naming ``separate_run=True`` (a probe-owned
run in the same process and group), which loses none whatever the user does. docs/live-probe.md
("W&B rows") says more. A background sink: a hung service blocks only its lane. On resume the
steps the run already holds are not sent again (:mod:`attn_probe.tracker_record`). ``wandb`` is
imported in :meth:`WandbSink.start` (``pip install 'attn-probe[wandb]'``).
"""

from __future__ import annotations

from typing import Any

from ..isolation import safe_warn
from ..tags import PREFIX
from ..tracker_record import TrackerRun, wandb_run
from . import RunInfo, Snapshot
from .trackers import STEP_KEY, TrackerSink, WandbRows, define_probe_axis

__all__ = ["WandbSink"]


class WandbSink(TrackerSink):
    """Send snapshots to a W&B run.

    ``run``: the user's run (``wandb.init(...)``'s result), left open at ``finish()``. Without
    it, the active run (``wandb.run``) is used when no ``init_kwargs`` are given, else a run is
    created with ``wandb.init(**init_kwargs)`` and finished by :meth:`finish`. ``per_head``
    also sends one series per head. ``log_config`` records the probe's configuration under
    ``config["attn_probe"]``.

    ``separate_run=True``: the probe logs into a W&B run of its own, created beside the user's
    run (``run``, else ``wandb.run``) with ``wandb.init(reinit="create_new")`` in the same
    project, entity, mode, directory and group (``job_type="attn_probe"``, named after the
    user's run, whose id is in its config), and finished by :meth:`finish`. Every snapshot is a
    row of its own there, whatever the user's run does (``step=`` or not); ``wandb.run`` and
    ``wandb.log`` stay the user's. ``init_kwargs`` override those settings.

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
                 separate_run: bool = False, **init_kwargs: Any) -> None:
        super().__init__(per_head=per_head)
        self._given = run
        self._init_kwargs = init_kwargs
        self._log_config = log_config
        self.separate_run = bool(separate_run)
        #: how snapshots go into a run the sink does not own (``None`` in its own run)
        self.rows: WandbRows | None = None

    def _open(self, run_info: RunInfo) -> None:
        wandb = self._import()
        if self.separate_run:
            self.run, self.owns_run = wandb.init(**self._separate_kwargs(wandb)), True
        elif self._given is not None:
            self.run, self.owns_run = self._given, False
        elif not self._init_kwargs and getattr(wandb, "run", None) is not None:
            self.run, self.owns_run = wandb.run, False
        else:
            self.run, self.owns_run = wandb.init(**self._init_kwargs), True
        define_probe_axis(self.run)
        if self._log_config:
            self.run.config.update({PREFIX: {"config": run_info.config, "model": run_info.model}},
                                   allow_val_change=True)
        if not self.owns_run:
            self.rows = WandbRows(self.run, f"W&B run {self.run.id}")

    def _separate_kwargs(self, wandb: Any) -> dict[str, Any]:
        """``wandb.init`` arguments of the probe's own run: beside the user's run, same group."""
        user = self._given if self._given is not None else getattr(wandb, "run", None)
        kwargs: dict[str, Any] = {"reinit": "create_new", "job_type": "attn_probe"}
        if user is None:
            safe_warn("attn_probe: WandbSink(separate_run=True) found no W&B run of yours (pass run= or call "
                      "wandb.init first); the probe's run is created from W&B's settings alone.")
        else:
            settings = getattr(user, "settings", None)
            kwargs.update(project=user.project, entity=user.entity or None,
                          name=f"{user.name or user.id}-attn_probe", config={f"{PREFIX}/user_run": user.id})
            if user.group:
                kwargs["group"] = user.group
            mode = getattr(settings, "mode", None)
            if mode in ("online", "offline", "disabled"):
                kwargs["mode"] = mode
            root = getattr(settings, "root_dir", None)
            if root:
                kwargs["dir"] = root
        kwargs.update(self._init_kwargs)
        return kwargs

    def _tracker_run(self) -> TrackerRun:
        return wandb_run(self.run)

    def _send(self, snapshot: Snapshot, values: dict[str, float]) -> None:
        payload = {**values, STEP_KEY: int(snapshot.step)}
        if self.rows is not None:
            self.rows.send(payload, int(snapshot.step))
        else:
            self.run.log(payload, commit=True)

    def _close(self) -> None:
        run, self.run = self.run, None
        rows, self.rows = self.rows, None
        if rows is not None:
            rows.close()
        if self.owns_run and run is not None:
            run.finish()
