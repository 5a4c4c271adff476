"""MLflow sink for plain PyTorch loops: the probe's values as MLflow metrics, at the probe's step.

Values are logged with ``step=`` (the probe's step), so the user's own metrics are unaffected,
through ``MlflowClient.log_batch`` in synchronous batches of at most 1,000 metrics: a failed
batch raises in ``log``, and the dispatcher names the lost step. After ``start()`` the sink only
calls its own client with an explicit ``run_id`` (never the fluent API, whose active run is per
thread), so it runs on a lane of its own and a dead server blocks only that lane
(docs/live-probe.md, writing off the training step). On resume the steps the run already holds
are not sent again (:mod:`attn_probe.sinks.tracker_record`). ``mlflow`` is imported in
:meth:`MlflowSink.start` (``pip install 'attn-probe[mlflow]'``).
"""

from __future__ import annotations

import os
from typing import Any

from . import RunInfo, Snapshot
from .tracker_record import TrackerRun, mlflow_run
from .trackers import TrackerSink

__all__ = ["MlflowSink"]

#: MLflow's limit on the number of metrics in one ``log_batch`` request
BATCH = 1000


class MlflowSink(TrackerSink):
    """Send snapshots to an MLflow run.

    ``run_id``: the user's run, left open at ``finish()``. Without it, the active run
    (``mlflow.active_run()``) is used when neither ``experiment`` nor ``run_name`` is given and
    ``tracking_uri`` is unset or mlflow's own; otherwise a run is created in ``experiment`` (a
    name, created if missing; default: ``MLFLOW_EXPERIMENT_NAME``/``MLFLOW_EXPERIMENT_ID`` or
    the default experiment) and ended (``FINISHED``) by :meth:`finish`. ``synchronous`` is
    accepted for compatibility: batches are always synchronous, on the sink's own lane.

    Example:
        >>> with mlflow.start_run() as run:                              # doctest: +SKIP
        ...     with attn_probe.watch(model, optimizer=opt, log_dir="runs/x", every=100,
        ...                           sinks=[MlflowSink(run.info.run_id)]):
        ...         train()
    """

    module = "mlflow"
    extra = "mlflow"
    #: driven from the dispatcher's lane: only ``self.client`` and ``self.run_id`` are used after ``start()``
    background = True

    def __init__(self, run_id: str | None = None, *, tracking_uri: str | None = None,
                 experiment: str | None = None, run_name: str | None = None,
                 tags: dict[str, str] | None = None, per_head: bool = False,
                 synchronous: bool = False) -> None:
        super().__init__(per_head=per_head)
        self._given = run_id
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.tags = dict(tags or {})
        del synchronous  # accepted for compatibility: batches are always synchronous, on the sink's lane
        self.client: Any = None
        self.run_id: str | None = None

    def _open(self, run_info: RunInfo) -> None:
        mlflow = self._import()
        uri = self.tracking_uri or mlflow.get_tracking_uri()
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        active = mlflow.active_run()
        same_store = self.tracking_uri is None or self.tracking_uri == mlflow.get_tracking_uri()
        if self._given is not None:
            self.run_id, self.owns_run = str(self._given), False
        elif active is not None and same_store and self.experiment is None and self.run_name is None:
            self.run_id, self.owns_run = active.info.run_id, False
        else:
            experiment_id = self._experiment_id()
            run = self.client.create_run(experiment_id, run_name=self.run_name, tags=self.tags or None)
            self.run_id, self.owns_run = run.info.run_id, True
        self.run = self.run_id

    def _tracker_run(self) -> TrackerRun:
        return mlflow_run(self.client, str(self.run_id))

    def _experiment_id(self) -> str:
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name:
            found = self.client.get_experiment_by_name(name)
            return found.experiment_id if found is not None else self.client.create_experiment(name)
        return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"

    def _send(self, snapshot: Snapshot, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp, step = self.timestamp_ms(snapshot), int(snapshot.step)
        metrics = [Metric(key, value, stamp, step) for key, value in values.items()]
        for i in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + BATCH], synchronous=True)

    def _close(self) -> None:
        if self.owns_run and self.run_id is not None:
            self.client.set_terminated(self.run_id, "FINISHED")
        self.run = None
