"""Which tracker run a framework's tracker logs into: one :func:`tracker_run` for the Trainer's
reporting callbacks, Accelerate's trackers and Lightning's loggers.

The run is what the probe's resend guard (:mod:`attn_probe.sinks.tracker_record`) records and
reads back: MLflow's run (read back through its client), trackio's run (recorded), any other
tracker by its framework and name (recorded, without a run id). Only the *handle* differs by
framework: the Trainer's MLflow callback logs into MLflow's active run and its trackio callback
into trackio's current run (neither callback exposes it); an Accelerate ``GeneralTracker`` holds
its run as ``.tracker``; a Lightning logger has a ``version``.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["FRAMEWORKS", "tracker_run"]

#: framework -> how messages name its owner
FRAMEWORKS = {"trainer": "the Trainer's", "accelerate": "the accelerator's", "lightning": "the Trainer's"}


def tracker_run(tracker: Any, framework: str) -> Any:
    """The :class:`~attn_probe.sinks.tracker_record.TrackerRun` that ``tracker`` of ``framework``
    (``"trainer"``: a reporting callback, ``"accelerate"``: a ``GeneralTracker``, ``"lightning"``: a
    logger) logs into. (W&B is a sink of its own, never asked here.)"""
    from ..sinks.tracker_record import TrackerRun, mlflow_run, trackio_run

    if framework not in FRAMEWORKS:
        raise ValueError(f"tracker_run: framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    owner = FRAMEWORKS[framework]
    kind, name, run = _kind_name_run(tracker, framework)
    if kind == "mlflow" and run is not None:
        import mlflow

        run_id = run.info.run_id
        client = mlflow.MlflowClient(tracking_uri=mlflow.get_tracking_uri())
        return mlflow_run(client, run_id, label=f"{owner} MLflow run {run_id}")
    if kind == "trackio" and run is not None:
        return trackio_run(run, label=f"{owner} trackio run {getattr(run, 'name', None)!r}")
    if framework == "accelerate":
        return TrackerRun(f"accelerate:{name}", None, f"{owner} {name} tracker")
    if framework == "lightning":
        version = getattr(tracker, "version", None)
        return TrackerRun(f"lightning:{name}", None if version is None else str(version), f"{owner} {name}")
    return TrackerRun(f"trainer:{name}", None, f"{owner} {name}")


def _kind_name_run(tracker: Any, framework: str) -> tuple[str, str, Any]:
    """``(kind, name, run handle)``: kind ``"mlflow"``, ``"trackio"`` or ``""`` (recorded by name)."""
    if framework == "accelerate":
        name = str(getattr(tracker, "name", type(tracker).__name__)).lower()
        return (name if name in ("mlflow", "trackio") else ""), name, getattr(tracker, "tracker", None)
    name = type(tracker).__name__
    if framework == "lightning":
        return "", name, None
    integrations = sys.modules.get("transformers.integrations")

    def kind(class_name: str) -> bool:
        cls = getattr(integrations, class_name, None)
        return isinstance(cls, type) and isinstance(tracker, cls)

    if kind("MLflowCallback"):
        mlflow = sys.modules.get("mlflow")
        return "mlflow", name, mlflow.active_run() if mlflow is not None else None
    if kind("TrackioCallback"):
        from ..sinks.trackers import current_trackio_run

        trackio = sys.modules.get("trackio")
        return "trackio", name, current_trackio_run(trackio) if trackio is not None else None
    return "", name, None
