"""TensorBoard sink: one ``add_scalar`` per tag of :func:`attn_probe.formats.tags.scalar_tag`.

Writes, into one run directory (the training run's own, so loss and scores sit together):

* scalars ``attn_probe/{group}/{metric}/layer_{LL}[/head_{HH}]`` and ``.../{median,q25,q75}``
  (``.../max`` too for the norms);
* once at start, a custom_scalars layout (:func:`custom_scalars_layout`: first the paper's figure,
  symmetry's median with the q25-q75 band, in a category of its own; then per group a Margin
  chart per other metric, a Multiline chart of the per-layer curves, the norms in a category of
  their own with their max) and the
  configuration / model description as text;
* optional W_qk heatmaps under ``attn_probe_heatmap/{group}/layer_{LL}``;
* once per layer and score, a text entry when its symmetry or directionality left the random
  range by a causal rule (:mod:`attn_probe.sinks.emergence`, tags
  ``attn_probe_emergence/{group}/{metric}/...``).

Never ``add_scalars`` (one run directory per key). Flushes at snapshot boundaries only.
``torch.utils.tensorboard`` is imported in :meth:`TensorBoardSink.start`. A resumed run marks
its restart so TensorBoard drops the interrupted run's later steps, whichever writer is used;
a dead or deleted event file is replaced by a new one (:meth:`TensorBoardSink.recover`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import threading
from typing import Any

from ..formats.events import event_files, file_identities, truncate_torn_record, wait_for_a_later_name
from ..formats.tags import BAND_STATS, PREFIX, STATS, scalar_tag, stats_for
from ..isolation import safe_warn
from . import RunInfo, Sink, Snapshot
from .emergence import LiveEmergence

__all__ = ["TensorBoardSink", "custom_scalars_layout", "paper_category", "band_chart_title", "heatmap_tag", "emit_session_start", "writer_log_dir",
           "CONFIG_TEXT_TAG"]

CONFIG_TEXT_TAG = f"{PREFIX}/config"
HEATMAP_PREFIX = f"{PREFIX}_heatmap"


def heatmap_tag(group: str, layer: int) -> str:
    return f"{HEATMAP_PREFIX}/{group}/layer_{layer:02d}"


#: the paper's figure: a score's median across layers with its interquartile band
PAPER_METRIC = "symmetry"
#: metrics logged once per run (the random-matrix range, ``random_*``): no per-step charts
ONCE_PER_RUN_PREFIX = "random_"


def band_chart_title(metric: str) -> str:
    """Title of the Margin chart of ``metric``'s median across layers with its q25-q75 band."""
    return f"{metric}: median across layers (q25-q75)"


def paper_category(group: str) -> str:
    """Title of the category holding the paper's figure of ``group`` alone (the first one shown)."""
    return f"{PREFIX}/{group}: {PAPER_METRIC}, the paper's figure"


def custom_scalars_layout(groups: list[str], metrics: list[str]) -> dict[str, dict[str, list[Any]]]:
    """``{category: {chart: [kind, tags]}}`` for ``SummaryWriter.add_custom_scalars``.

    TensorBoard's Custom Scalars (2.21) shows the categories in layout order, but within a
    category it draws the Multiline charts first and the Margin charts last. So the paper's
    figure (symmetry: median across layers with the q25-q75 band) gets a category of its own,
    ``attn_probe/{group}: symmetry, the paper's figure`` (:func:`paper_category`), ahead of the
    others: it is the first chart on the page. Then, per group, category ``attn_probe/{group}``
    holds the other scores' Margin charts and every score's per-layer Multiline chart. The
    magnitudes (:func:`attn_probe.formats.tags.stats_for` gives them a ``max``) get their own category
    ``attn_probe/{group}/norms``: the same two charts plus a Multiline chart of the across-layer
    max and median. ``qk_update`` (W_qk's change since the previous snapshot) gets the same charts in
    a category of its own, ``attn_probe/{group}/update rate``. Metrics logged once per run (``random_*``, the random-matrix range) get no
    chart. TensorBoard's layout has no axis-scale field; the log scale of the norm charts is a
    toggle in each chart's toolbar.
    """
    from ..core.update import UPDATE_METRIC  # torch, like stats_for's attn_probe.core

    metrics = [m for m in metrics if not m.startswith(ONCE_PER_RUN_PREFIX)]
    layout: dict[str, dict[str, list[Any]]] = {}
    for group in groups:  # the paper's figure of every group first
        if PAPER_METRIC in metrics:
            band = [scalar_tag(group, PAPER_METRIC, stat=s) for s in BAND_STATS]
            layout[paper_category(group)] = {band_chart_title(PAPER_METRIC): ["Margin", band]}
    for group in groups:
        scores: dict[str, list[Any]] = {}
        norms: dict[str, list[Any]] = {}
        update: dict[str, list[Any]] = {}
        for metric in metrics:
            stats = stats_for(metric)
            charts = update if metric == UPDATE_METRIC else norms if "max" in stats else scores
            if metric != PAPER_METRIC:
                band = [scalar_tag(group, metric, stat=s) for s in BAND_STATS]  # Margin: value, lower, upper
                charts[band_chart_title(metric)] = ["Margin", band]
            if "max" in stats:
                charts[f"{metric}: max and median across layers"] = [
                    "Multiline", [re.escape(scalar_tag(group, metric, stat=s)) + "$" for s in ("max", "median")]]
            per_layer = re.escape(f"{PREFIX}/{group}/{metric}/") + r"layer_\d+$"
            charts[f"{metric}: per layer"] = ["Multiline", [per_layer]]
        if scores:
            layout[f"{PREFIX}/{group}"] = scores
        if norms:
            layout[f"{PREFIX}/{group}/norms"] = norms
        if update:
            layout[f"{PREFIX}/{group}/update rate"] = update
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

        file_writer = writer.file_writer  # public attribute of torch's and tensorboardX's SummaryWriter
        file_writer.add_event(Event(step=int(step), session_log=SessionLog(status=SessionLog.START)))
        file_writer.flush()
    except Exception:  # noqa: BLE001 - a writer of another kind: the caller falls back
        return False
    return True


def _has_room(log_dir: str, need: int) -> bool:
    """``statvfs`` says at least ``need`` bytes are free (True where it cannot tell)."""
    try:
        st = os.statvfs(log_dir)
    except (OSError, AttributeError):
        return True
    if st.f_blocks == 0:  # no block accounting (some FUSE/network filesystems): cannot tell
        return True
    return st.f_bavail * st.f_frsize >= need


def _release(writer: Any, timeout: float = 2.0) -> None:
    """Close every file writer of ``writer`` through their public ``close()``, on a daemon thread
    given ``timeout`` seconds: a dead TensorBoard writer cannot flush, and may fail or block."""
    file_writers = list((getattr(writer, "all_writers", None) or {}).values()) or [writer]  # torch's, or any

    def close() -> None:
        for fw in file_writers:
            try:
                fw.close()
            except Exception:  # noqa: BLE001 - the old file is given up either way
                pass

    thread = threading.Thread(target=close, name="attn_probe tensorboard release", daemon=True)
    thread.start()
    thread.join(timeout)


class TensorBoardSink(Sink):
    """Write snapshots with a ``SummaryWriter`` of our own, or a borrowed one (flushed, never closed).

    **Resume** (``RunInfo.resume_step`` = G > 0): TensorBoard drops the interrupted run's events
    at steps >= G when it reads a ``SessionLog.START`` marker at G after them: ``purge_step=G``
    for our own writer in a directory that already holds event files, :func:`emit_session_start`
    into a borrowed writer's file. ``purge_stale=False`` when the caller marked the restart in
    another writer of the same directory (the Trainer's, see ``integrations/transformers.py``).

    **Faults**, through TensorBoard's public API only (docs/live-probe.md, sink faults): after a
    failed write (a dead writer) or an event file deleted or replaced under it (its inode,
    compared at every snapshot), :meth:`recover` continues in a new event file in the same
    directory; no new file while ``statvfs`` reports less than :data:`REOPEN_MIN_FREE` bytes free.
    """

    #: free bytes below which a reopen is not attempted
    REOPEN_MIN_FREE = 8192
    background = True

    def __init__(self, log_dir: str | None = None, *, writer: Any = None, max_queue: int = 1000,
                 purge_stale: bool = True, emergence: bool = True) -> None:
        if (log_dir is None) == (writer is None):
            raise ValueError("give exactly one of log_dir= and writer=")
        self.log_dir = log_dir if log_dir is not None else writer_log_dir(writer)
        self._writer = writer
        self._owned = writer is None
        self._max_queue = max_queue
        self._purge_stale = purge_stale
        self._broken = False
        #: (custom-scalars layout, configuration text, its step), written at start and again into
        #: a new event file when the run directory lost its files
        self._header: tuple[dict[str, Any], str, int] | None = None
        #: identities of the event files written (a file deleted or replaced under it is reopened)
        self._files: dict[str, tuple[int, int] | None] = {}
        #: event files present before the writer opened its current file (``None``: known)
        self._before: set[str] | None = None
        self._last_step: int | None = None
        #: the live emergence events (``None``: off, or turned off by a failure, warned once)
        self._emergence: LiveEmergence | None = LiveEmergence() if emergence else None

    def _open_own_writer(self, purge_step: int | None = None) -> Any:
        """A ``SummaryWriter`` of our own in ``log_dir``; on failure no new event file is left."""
        from torch.utils.tensorboard import SummaryWriter

        before = set(event_files(self.log_dir))
        try:
            return SummaryWriter(log_dir=self.log_dir, purge_step=purge_step, max_queue=self._max_queue,
                                 flush_secs=3600)
        except BaseException:
            self._remove_new_event_files(before)
            raise

    def _remove_new_event_files(self, before: set[str]) -> None:
        for name in set(event_files(self.log_dir)) - before:
            try:
                os.remove(os.path.join(self.log_dir, name))
            except OSError:
                pass

    def _track_files(self) -> None:
        """After a flush: remember which event file(s) the writer writes (those new since it opened,
        else the most recently written one: a borrowed writer's)."""
        if self._before is None:
            return
        names = event_files(self.log_dir)
        new = [n for n in names if n not in self._before]
        if not new and names:
            new = [max(names, key=lambda n: os.stat(os.path.join(self.log_dir, n)).st_mtime_ns)]
        self._files, self._before = file_identities(self.log_dir, new), None

    def start(self, run: RunInfo) -> None:
        resume = run.resume_step if run.resume_step and self._purge_stale else None
        before = set(event_files(self.log_dir))
        if self._owned:
            self._writer = self._open_own_writer(resume if resume and before else None)
        elif resume and not emit_session_start(self._writer, resume):
            safe_warn(f"attn_probe: cannot mark the restart at step {resume} in the given "
                      f"{type(self._writer).__name__} (it takes no raw events); TensorBoard may show the "
                      f"interrupted run's steps >= {resume} twice in {self.log_dir}.")
        try:
            w = self._writer
            text = "\n\n".join(
                f"**{title}**\n\n```\n{json.dumps(body, indent=2, default=str)}\n```"
                for title, body in (("configuration", run.config), ("model", run.model))
            )
            self._header = (custom_scalars_layout(run.groups, run.metrics), text, run.resume_step or 0)
            self._write_header(w)
            w.flush()
            if self._emergence is not None:
                try:
                    self._emergence.start(run, self.log_dir)
                except Exception as exc:  # noqa: BLE001 - plain reads of the run header; off rather than a failed attach
                    self._emergence = None
                    safe_warn(f"attn_probe: the live emergence events are off for this run ({type(exc).__name__}: "
                              f"{exc}); the scores are still written, and `attn-probe summary` reports the events "
                              "post hoc.")
            self._before = before
            self._track_files()
        except BaseException:
            if self._owned:  # attach fails: leave no half-written event file of ours behind
                _release(self._writer)
                self._remove_new_event_files(before)
                self._writer = None
            raise

    def _write_header(self, w: Any) -> None:
        """The run's custom-scalars layout and configuration text (once per event file)."""
        if self._header is not None:
            layout, text, step = self._header
            w.add_custom_scalars(layout)
            w.add_text(CONFIG_TEXT_TAG, text, global_step=step)

    def _file_left(self) -> str | None:
        """The event file being written, if it was deleted or replaced since it was opened.

        TensorBoard reopens its file by name at every write, so a deleted one would come back
        empty, without its header records, and the events before are gone silently.
        """
        now = file_identities(self.log_dir, [os.path.basename(p) for p in self._files])
        return next((path for path, ident in self._files.items() if now.get(path) != ident), None)

    def log(self, snapshot: Snapshot) -> None:
        left = self._file_left() if self._files and not self._broken else None
        if left is not None:
            self._broken = True
            self.recover(header=True)
            last = f"up to step {self._last_step}" if self._last_step is not None else "of this run"
            safe_warn(f"attn_probe: the TensorBoard event file {left} was deleted or replaced while this run "
                      f"wrote it; the events it held ({last}) are lost. A new event file in "
                      f"{self.log_dir} continues from step {snapshot.step}.")
        if not self._broken:
            try:
                self._writer.flush()  # raises when the writer died (its owner's write failed too)
            except Exception:  # noqa: BLE001 - replaced below
                self._broken = True
        if self._broken:
            self.recover()
        try:
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
            for tag, text, at in self._emergence_entries(snapshot):
                w.add_text(tag, text, global_step=at, walltime=wall)
            w.flush()
            self._track_files()
            self._last_step = step
        except BaseException:
            self._broken = True
            raise

    def _emergence_entries(self, snapshot: Snapshot) -> list[tuple[str, str, int]]:
        """The live emergence entries due at ``snapshot``; a failure turns them off (warned once)
        and never touches the scalars."""
        if self._emergence is None:
            return []
        try:
            return self._emergence.entries(snapshot)
        except Exception as exc:  # noqa: BLE001 - an event line must never cost the scalars
            self._emergence = None
            safe_warn(f"attn_probe: the live emergence events are off for this run ({type(exc).__name__}: {exc}); "
                      "the scores are still written, and `attn-probe summary` reports the events post hoc.")
            return []

    def recover(self, header: bool = False) -> None:
        """Continue in a new event file in the same directory: the dead file writers closed (their
        public ``close()``, bounded), a torn last record cut; our own writer replaced by a fresh
        ``SummaryWriter``, a borrowed torch one reset as its ``close()`` leaves it (its next write
        opens a new file), a borrowed one of another kind replaced by our own. The run's layout
        and text are written again when ``header`` (the old file was deleted) or the directory
        holds no event file. Raises while the disk is still full.
        """
        if not self._broken:
            return
        if not _has_room(self.log_dir, self.REOPEN_MIN_FREE):
            raise OSError(errno.ENOSPC, f"no room to reopen the event file in {self.log_dir}")
        w = self._writer
        os.makedirs(self.log_dir, exist_ok=True)
        emptied = header or not event_files(self.log_dir)  # the file went (deleted): its layout went too
        torch_like = hasattr(w, "all_writers") and hasattr(w, "file_writer")
        if torch_like or self._owned:
            _release(w)  # a borrowed writer of another kind is the user's to close
        for path in self._files:
            truncate_torn_record(path)
        wait_for_a_later_name(self.log_dir)
        before = set(event_files(self.log_dir))
        if not self._owned and torch_like:
            w.file_writer = w.all_writers = None  # as SummaryWriter.close() leaves it: reopens on next use
        else:
            new = self._open_own_writer()
            if not self._owned:
                safe_warn(f"attn_probe: the given {type(w).__name__} in {self.log_dir} failed and cannot be "
                          "reopened; the probe writes through a SummaryWriter of its own in the same directory.")
            self._writer, self._owned = new, True
        self._broken = False
        self._files, self._before = {}, before
        if emptied:
            self._write_header(self._writer)

    def flush(self) -> None:
        if self._writer is not None and not self._broken:
            self._writer.flush()

    def finish(self) -> None:
        w, self._writer = self._writer, None
        if w is None:
            return
        if self._owned:
            if self._broken:
                _release(w)
                return
            w.close()
        elif not self._broken:
            w.flush()
