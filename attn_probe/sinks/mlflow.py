"""MLflow sink for plain PyTorch loops: the probe's values as MLflow metrics, at the probe's step.

MLflow keeps every ``(step, value)`` of a metric, so the values are logged with ``step=`` (the
probe's step) and the user's own metrics are never affected. Logging goes through
``MlflowClient.log_batch`` (batches of at most 1,000 metrics), asynchronously by default;
:meth:`MlflowSink.finish` waits for every pending batch, so all values are stored when it
returns (and a failed batch raises there).

**Asynchronous failures.** An asynchronous batch that fails (a dead server) fails in MLflow's
own threads, after ``log`` returned. The sink keeps, per step sent, the futures of its batches
(``RunOperations``); the dispatcher asks :meth:`MlflowSink.settled` after every ``log``,
``flush`` and ``finish`` which steps are now known stored or lost (futures already completed
are checked at every ``log``, so a dead server is reported during the run, not only at
``close()``), and counts and warns about the lost ones by step like any failed snapshot.
:meth:`MlflowSink.unsettled` names the steps still waiting when ``close()`` gives up on it.

**Thread.** After ``start()``, the sink only calls its own ``MlflowClient`` with an explicit
``run_id`` (never MLflow's fluent API, whose active run is per thread); ``mlflow.active_run()``
is read in ``start()`` alone, which the dispatcher calls on the caller's thread. It is therefore
a background sink (``background = True``): a dead server blocks its own lane, never the
training step, and ``close()`` gives it up at the deadline.

Resume: on a resumed probe run, the snapshots the MLflow run already holds (read back from the
run's metric history through ``MlflowClient``, else the probe's record) are not sent again; see
:mod:`attn_probe.sinks.trackers`. With asynchronous logging a step is recorded as sent once its
batches are stored (at the next :meth:`MlflowSink.flush`).

This is a network sink (see :mod:`attn_probe.sinks.trackers`): over HTTP, MLflow retries a
dead server for minutes. ``mlflow`` is imported in :meth:`MlflowSink.start`
(``pip install 'attn-probe[mlflow]'``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from . import RunInfo, Snapshot
from .trackers import TrackerRun, TrackerSink, mlflow_run

__all__ = ["MlflowSink"]

#: MLflow's limit on the number of metrics in one ``log_batch`` request
BATCH = 1000
#: asynchronous batches kept before ``log`` waits for them
MAX_PENDING = 64


class MlflowSink(TrackerSink):
    """Send snapshots to an MLflow run.

    ``run_id``: the user's run, left open at ``finish()``. Without it, the active run
    (``mlflow.active_run()``) is used when neither ``experiment`` nor ``run_name`` is given and
    ``tracking_uri`` is unset or mlflow's own; otherwise a run is created in ``experiment`` (a
    name, created if missing; default: ``MLFLOW_EXPERIMENT_NAME``/``MLFLOW_EXPERIMENT_ID`` or
    the default experiment) and ended (``FINISHED``) by :meth:`finish`. ``synchronous=True``
    makes every ``log`` wait for the server.

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
        self.synchronous = bool(synchronous)
        self.client: Any = None
        self.run_id: str | None = None
        #: (step, futures of its batches) sent asynchronously, not yet known stored or lost
        self._inflight: list[tuple[int, list[Any]]] = []
        #: (step, None | exception) known since the last :meth:`settled`
        self._outcomes: list[tuple[int, BaseException | None]] = []
        self._batches: list[Any] = []  # the futures of the snapshot being sent
        self._lock = threading.Lock()

    @property
    def deferred(self) -> bool:
        """Whether ``log`` returning means only "queued" (asynchronous batches): the dispatcher
        then counts a snapshot once :meth:`settled` says whether it was stored."""
        return not self.synchronous

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
        self._inflight, self._outcomes, self._batches = [], [], []

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
        self._batches = []
        for i in range(0, len(metrics), BATCH):
            op = self.client.log_batch(self.run_id, metrics=metrics[i:i + BATCH],
                                       synchronous=self.synchronous)
            if not self.synchronous and op is not None:
                # RunOperations: its futures tell, without waiting, whether the batch is done
                futures = getattr(op, "_operation_futures", None)
                self._batches.extend(futures if isinstance(futures, list) else [op])

    def _sent(self, step: int) -> None:
        if self.synchronous:
            super()._sent(step)
            return
        batches, self._batches = self._batches, []
        with self._lock:
            self._inflight.append((int(step), batches))
        self._settle(wait=len(self._inflight) - MAX_PENDING)  # bounds memory

    @staticmethod
    def _done(batch: Any) -> bool:
        done = getattr(batch, "done", None)
        return bool(done()) if callable(done) else False

    @staticmethod
    def _error(batch: Any) -> BaseException | None:
        """``None`` if ``batch`` (a future, or a ``RunOperations``) stored its metrics; waits for it."""
        try:
            if callable(getattr(batch, "result", None)):
                batch.result()
            else:
                batch.wait()
        except Exception as exc:  # noqa: BLE001 - handed to the dispatcher
            return exc
        return None

    def _settle(self, wait: int = 0) -> None:
        """Move the leading in-flight steps whose batches are all done into the outcomes (in step
        order); the first ``wait`` of them are waited for."""
        while True:
            with self._lock:
                if not self._inflight:
                    return
                step, batches = self._inflight[0]
            if wait <= 0 and not all(self._done(b) for b in batches):
                return
            error = None
            for batch in batches:
                error = self._error(batch) or error
            with self._lock:
                self._inflight.pop(0)
                self._outcomes.append((step, error))
            if error is None:
                super()._sent(step)  # stored: record it for a resume
            wait -= 1

    def settled(self) -> list[tuple[int, BaseException | None]]:
        """Steps now known stored (``None``) or lost (the batch's exception), in step order, since
        the last call; futures that completed are checked without waiting."""
        self._settle()
        with self._lock:
            out, self._outcomes = self._outcomes, []
        return out

    def unsettled(self) -> list[int]:
        """Steps sent whose batches are not known stored or lost yet."""
        with self._lock:
            return [step for step, _ in self._inflight]

    def flush(self) -> None:
        """Wait until every batch sent so far is stored; raises if one failed (the failed steps
        are also in :meth:`settled`)."""
        with self._lock:
            n = len(self._inflight)
            known = len(self._outcomes)
        self._settle(wait=n)
        with self._lock:
            failed = [(step, err) for step, err in self._outcomes[known:] if err is not None]
        if failed:
            steps = ", ".join(str(step) for step, _ in failed)
            raise RuntimeError(f"MLflow did not store the metrics of step(s) {steps}: {failed[0][1]}") \
                from failed[0][1]

    def _close(self) -> None:
        try:
            self.flush()
        finally:
            if self.owns_run and self.run_id is not None:
                self.client.set_terminated(self.run_id, "FINISHED")
            self.run = None
