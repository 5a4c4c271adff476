"""trackio sink for plain PyTorch loops: the probe's values in a trackio run, at the probe's step.

trackio keeps every row with its step, so values are logged with ``step=`` without affecting
the user's metrics. ``trackio.init`` finishes the run current in the process, so the sink never
creates a run while one is active: it uses that run (when its project matches) or asks for
``run=``. On resume, the probe's record says which steps the run already holds (trackio offers
no cheap read-back; :mod:`attn_probe.sinks.tracker_record`). ``trackio`` is imported in
:meth:`TrackioSink.start` (``pip install 'attn-probe[trackio]'``).
"""

from __future__ import annotations

from typing import Any

from . import RunInfo, Snapshot
from .tracker_record import TrackerRun, trackio_run
from .trackers import TrackerSink, current_trackio_run

__all__ = ["TrackioSink"]


class TrackioSink(TrackerSink):
    """Send snapshots to a trackio run.

    ``run``: the user's run (``trackio.init(...)``'s result), left open at ``finish()``.
    Without it, the current trackio run is used if there is one (``project``, if given, must be
    its project); otherwise ``trackio.init(project=project, name=name, **init_kwargs)`` creates
    a run, which :meth:`finish` finishes. ``per_head`` also sends one series per head.

    Example:
        >>> with attn_probe.watch(model, optimizer=opt, log_dir="runs/x", every=100,
        ...                       sinks=[TrackioSink(project="my-project")]):  # doctest: +SKIP
        ...     train()
    """

    module = "trackio"
    extra = "trackio"

    def __init__(self, project: str | None = None, *, run: Any = None, name: str | None = None,
                 per_head: bool = False, **init_kwargs: Any) -> None:
        super().__init__(per_head=per_head)
        if run is None and project is None:
            raise ValueError("TrackioSink needs project= (to create a run) or run= (the user's run)")
        self.project = project
        self.name = name
        self._given = run
        self._init_kwargs = init_kwargs

    def _open(self, run_info: RunInfo) -> None:
        trackio = self._import()
        if self._given is not None:
            self.run, self.owns_run = self._given, False
            return
        current = current_trackio_run(trackio)
        if current is not None:
            project = getattr(current, "project", None)
            if self.project is not None and project is not None and project != self.project:
                raise ValueError(
                    f"a trackio run of project {project!r} is active and trackio.init() would finish it; "
                    f"pass TrackioSink(run=that_run) or finish it before logging to project {self.project!r}"
                )
            self.run, self.owns_run = current, False
            return
        kwargs = dict(self._init_kwargs)
        kwargs.setdefault("config", {"attn_probe": {"config": run_info.config, "model": run_info.model}})
        self.run = trackio.init(project=self.project, name=self.name, **kwargs)
        self.owns_run = True

    def _tracker_run(self) -> TrackerRun:
        return trackio_run(self.run)

    def _send(self, snapshot: Snapshot, values: dict[str, float]) -> None:
        self.run.log(values, step=int(snapshot.step))

    def _close(self) -> None:
        run, self.run = self.run, None
        if not self.owns_run or run is None:
            return
        trackio = self._import()
        if current_trackio_run(trackio) is run:
            trackio.finish()  # also clears trackio's current run
        else:
            run.finish()
