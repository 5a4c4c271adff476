"""TensorBoard sink: one ``add_scalar`` per tag of :func:`attn_probe.tags.scalar_tag`.

Writes, into one run directory (the training run's own, so loss and scores sit together):

* scalars ``attn_probe/{group}/{metric}/layer_{LL}[/head_{HH}]`` and ``.../{median,q25,q75}``
  (``.../max`` too for the norms);
* once at start, a custom_scalars layout (:func:`custom_scalars_layout`: per group, a Margin
  chart median with the q25-q75 band per metric, a Multiline chart of the per-layer curves,
  the norms in a category of their own with their max) and the
  configuration / model description as text;
* optional W_qk heatmaps under ``attn_probe_heatmap/{group}/layer_{LL}``.

Never ``add_scalars`` (one run directory per key). Flushes at snapshot boundaries only.
``torch.utils.tensorboard`` is imported in :meth:`TensorBoardSink.start`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from ..tags import BAND_STATS, PREFIX, STATS, scalar_tag, stats_for
from . import RunInfo, Snapshot

__all__ = ["TensorBoardSink", "custom_scalars_layout", "heatmap_tag", "emit_session_start", "has_event_files",
           "is_event_file", "writer_log_dir", "CONFIG_TEXT_TAG"]

CONFIG_TEXT_TAG = f"{PREFIX}/config"
HEATMAP_PREFIX = f"{PREFIX}_heatmap"


def heatmap_tag(group: str, layer: int) -> str:
    return f"{HEATMAP_PREFIX}/{group}/layer_{layer:02d}"


def custom_scalars_layout(groups: list[str], metrics: list[str]) -> dict[str, dict[str, list[Any]]]:
    """``{category: {chart: [kind, tags]}}`` for ``SummaryWriter.add_custom_scalars``.

    Per group, category ``attn_probe/{group}`` holds the scores (symmetry, directionality, ...):
    a Margin chart (median with the q25-q75 band) and a Multiline chart of the per-layer
    curves per metric. The magnitudes (:func:`attn_probe.tags.stats_for` gives them a ``max``)
    get their own category ``attn_probe/{group}/norms``: the same two charts plus a Multiline
    chart of the across-layer max and median. TensorBoard's layout has no axis-scale field;
    the log scale of the norm charts is a toggle in each chart's toolbar.
    """
    layout: dict[str, dict[str, list[Any]]] = {}
    for group in groups:
        scores: dict[str, list[Any]] = {}
        norms: dict[str, list[Any]] = {}
        for metric in metrics:
            stats = stats_for(metric)
            charts = norms if "max" in stats else scores
            band = [scalar_tag(group, metric, stat=s) for s in BAND_STATS]  # Margin: value, lower, upper
            charts[f"{metric}: median across layers (q25-q75)"] = ["Margin", band]
            if "max" in stats:
                charts[f"{metric}: max and median across layers"] = [
                    "Multiline", [re.escape(scalar_tag(group, metric, stat=s)) + "$" for s in ("max", "median")]]
            per_layer = re.escape(f"{PREFIX}/{group}/{metric}/") + r"layer_\d+$"
            charts[f"{metric}: per layer"] = ["Multiline", [per_layer]]
        if scores:
            layout[f"{PREFIX}/{group}"] = scores
        if norms:
            layout[f"{PREFIX}/{group}/norms"] = norms
    return layout


def writer_log_dir(writer: Any) -> str:
    """The directory of a ``SummaryWriter`` (torch's or tensorboardX's)."""
    if hasattr(writer, "get_logdir"):
        return str(writer.get_logdir())
    return str(getattr(writer, "log_dir", None) or writer.logdir)


def emit_session_start(writer: Any, step: int) -> bool:
    """Write TensorBoard's restart marker (``SessionLog.START`` at ``step``) through ``writer``.

    Readers then drop every event of the run with a step ``>= step`` that they read before
    the marker: what ``SummaryWriter(purge_step=step)`` does, for a writer already open.
    Returns ``False`` when ``writer`` cannot take raw events.
    """
    try:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        file_writer = writer._get_file_writer()
        file_writer.add_event(Event(step=int(step), session_log=SessionLog(status=SessionLog.START)))
        file_writer.flush()
    except Exception:  # noqa: BLE001 - a writer of another kind: the caller falls back
        return False
    return True


def is_event_file(name: str) -> bool:
    """Whether a file name is a TensorBoard event file (TensorBoard's own rule: ``tfevents`` in it)."""
    return "tfevents" in os.path.basename(name)


def has_event_files(log_dir: str) -> bool:
    """Whether ``log_dir`` itself (not below it) already holds TensorBoard event files."""
    try:
        with os.scandir(log_dir) as entries:
            return any(is_event_file(e.name) and e.is_file() for e in entries)
    except OSError:
        return False


class TensorBoardSink:
    """Write snapshots with a ``SummaryWriter`` of our own, or a borrowed one.

    ``writer`` (e.g. Accelerate's tracker's) is flushed but never closed. With our own
    writer, a resumed run (``RunInfo.resume_step``) in a directory that already holds event
    files opens the writer with ``purge_step=resume_step``, so TensorBoard discards the stale
    steps ``>= resume_step`` of the interrupted run.
    """

    def __init__(self, log_dir: str | None = None, *, writer: Any = None, max_queue: int = 1000,
                 purge_stale: bool = True) -> None:
        if (log_dir is None) == (writer is None):
            raise ValueError("give exactly one of log_dir= and writer=")
        self.log_dir = log_dir if log_dir is not None else writer_log_dir(writer)
        self._writer = writer
        self._owned = writer is None
        self._max_queue = max_queue
        self._purge_stale = purge_stale

    @property
    def writer(self) -> Any:
        return self._writer

    def start(self, run: RunInfo) -> None:
        if self._owned:
            from torch.utils.tensorboard import SummaryWriter

            stale = self._purge_stale and run.resume_step and has_event_files(self.log_dir)
            purge = run.resume_step if stale else None
            self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=purge,
                                         max_queue=self._max_queue, flush_secs=3600)
        w = self._writer
        w.add_custom_scalars(custom_scalars_layout(run.groups, run.metrics))
        text = "\n\n".join(
            f"**{title}**\n\n```\n{json.dumps(body, indent=2, default=str)}\n```"
            for title, body in (("configuration", run.config), ("model", run.model))
        )
        w.add_text(CONFIG_TEXT_TAG, text, global_step=run.resume_step or 0)
        w.flush()

    def log(self, snapshot: Snapshot) -> None:
        w = self._writer
        step, wall = snapshot.step, snapshot.wall_time
        for r in snapshot.records:
            w.add_scalar(scalar_tag(r.group, r.metric, layer=r.layer, head=r.head), r.value, step,
                         walltime=wall)
        for (group, metric, stat), value in snapshot.stats.items():
            assert stat in STATS
            w.add_scalar(scalar_tag(group, metric, stat=stat), value, step, walltime=wall)
        for (group, layer), image in snapshot.images.items():
            w.add_image(heatmap_tag(group, layer), image, step, walltime=wall, dataformats="HWC")
        w.flush()

    def finish(self) -> None:
        if self._writer is None:
            return
        if self._owned:
            self._writer.close()
            self._writer = None
        else:
            self._writer.flush()
