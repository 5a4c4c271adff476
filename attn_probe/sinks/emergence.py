"""Live, causal emergence events: TensorBoard text written once when a layer's score left the random range.

The post-hoc rules (:mod:`attn_probe.analysis.emergence`, docs/post-hoc.md) use the whole run. Live,
only the snapshots so far are known, so the TensorBoard sink applies a causal rule to each layer's
``symmetry`` and ``directionality`` and to the median layer's (the across-layer median):

* the condition is ``|value - mean| > k sd`` (``k`` = :data:`DEFAULT_SDS`, the random range's
  ``mean`` and ``sd`` of the layer's shape; the median layer's: the median across layers of the
  means and of the sds, as post hoc);
* it is **confirmed** when it held at ``W`` consecutive snapshots (``W`` = :data:`DEFAULT_WINDOW`);
  a non-finite value is skipped (neither breaks nor extends the run of snapshots, as the post-hoc
  rules leave NaN out). One text entry is then written at the confirming step, under
  :func:`~attn_probe.formats.tags.emergence_tag`, naming the layer, the score, the step at which the
  condition started (the first of the ``W`` snapshots) and the step that confirmed it, and the
  range used. Once per layer and score per run: never again, even if the score comes back.
* where ``k sd`` covers the score's whole range ``[-1, 1]`` (directionality at ``d = 128``),
  nothing can fire: one entry per group and score (tag ``.../not_measurable``) names the layers,
  at the first snapshot that has the range.

The random range is the one the probe writes with a fresh run's first snapshot
(``Snapshot.baselines``). A resumed run has none (it was written before the interruption); its range
is computed again from the run header's layer shapes (the same seeded draws: the same numbers), on
the sink's thread, at its first snapshot. After a resume the event files of the run directory are
read once (on the sink's thread) for the entries written before the resume step: those are not
written again. The snapshots before the resume are not read, so a condition that held across the
resume is counted from the first snapshot after it. Everything here runs on the main process, from
the rows the probe already has (no collective), and is called inside the sink's own guard.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..formats.events import event_files
from ..formats.tags import EMERGENCE_PREFIX, emergence_tag
from . import RunInfo, Snapshot

__all__ = ["DEFAULT_SDS", "DEFAULT_WINDOW", "SCORES", "LiveEmergence", "written_before"]

#: standard deviations of the random range the score must lie beyond (``k``)
DEFAULT_SDS = 3.0
#: consecutive snapshots the condition must hold before it is written (``W``)
DEFAULT_WINDOW = 3
#: the scores with a random range
SCORES = ("symmetry", "directionality")
RANDOM_PREFIX = "random_"


@dataclass
class _Series:
    """The causal state of one layer's (``layer`` None: the median layer's) score."""

    mean: float
    sd: float
    started: int | None = None
    held: int = 0
    done: bool = False


def _layer_name(layer: int | None) -> str:
    return "the median layer" if layer is None else f"layer {layer}"


class LiveEmergence:
    """Per snapshot, the text entries ``(tag, text, step)`` due now (:meth:`entries`).

    ``k``: standard deviations; ``window``: consecutive snapshots. Pure bookkeeping: the caller
    writes the entries (the TensorBoard sink) and catches what this raises.
    """

    def __init__(self, k: float = DEFAULT_SDS, window: int = DEFAULT_WINDOW) -> None:
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k <= 0:
            raise ValueError(f"k must be a number of standard deviations > 0, got {k!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1 (snapshots), got {window!r}")
        self.k, self.window = float(k), window
        self._series: dict[tuple[str, str, int | None], _Series] | None = None
        #: tags already written (this run, or before its resume step)
        self.written: set[str] = set()
        self._shapes: list[dict[str, Any]] = []
        self._resume: int | None = None
        self._log_dir: str | None = None
        self._range_on_resume = True

    def start(self, run: RunInfo, log_dir: str | None = None) -> None:
        """Remember what a resumed run needs: its layer shapes, its resume step, its directory."""
        layers = run.model.get("attention_layers") if isinstance(run.model, dict) else None
        self._shapes = [a for a in layers if isinstance(a, dict)] if isinstance(layers, list) else []
        self._resume = run.resume_step or None
        self._log_dir = log_dir
        self._range_on_resume = bool(run.config.get("random_range", True)) if isinstance(run.config, dict) else True

    # -- the range ---------------------------------------------------------------------------------
    def _ranges(self, snapshot: Snapshot) -> dict[tuple[str, int, str], tuple[float, float]]:
        found: dict[tuple[str, int, str], float] = {}
        for r in snapshot.baselines:
            if r.head is None and r.metric.startswith(RANDOM_PREFIX):
                found[(r.group, r.layer, r.metric)] = float(r.value)
        if not found and self._resume and self._range_on_resume and self._shapes:
            self._range_on_resume = False  # tried once: not again at every snapshot
            found = self._ranges_from_shapes()
        out = {}
        for (group, layer, name), mean in found.items():
            metric = name[len(RANDOM_PREFIX):]
            if metric in SCORES and (group, layer, f"{name}_sd") in found:
                out[(group, layer, metric)] = (mean, found[(group, layer, f"{name}_sd")])
        return out

    def _ranges_from_shapes(self) -> dict[tuple[str, int, str], float]:
        """The range a fresh run writes, from the header's shapes (seeded, no time budget: the same values)."""
        from types import SimpleNamespace

        from ..baselines.random_range import PROBE_ENTRIES, random_range_rows

        layers = [SimpleNamespace(**{k: a[k] for k in ("group", "layer", "hidden_size", "head_dim", "num_heads",
                                                       "num_kv_heads")}) for a in self._shapes]
        rows, _ = random_range_rows(layers, metrics=SCORES, per_head=False, budget=None, max_entries=PROBE_ENTRIES)
        return {(g, int(lay), m): float(v) for g, lay, h, m, v in rows if h is None}

    def _begin(self, snapshot: Snapshot) -> list[tuple[str, str, int]]:
        """At the first snapshot with a range: the series, and the not-measurable entries."""
        ranges = self._ranges(snapshot)
        if not ranges:
            return []
        if self._resume and self._log_dir:
            self.written |= written_before(self._log_dir, self._resume)
        series: dict[tuple[str, str, int | None], _Series] = {}
        by_score: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for (group, layer, metric), (mean, sd) in ranges.items():
            series[(group, metric, layer)] = _Series(mean, sd)
            by_score.setdefault((group, metric), []).append((mean, sd))
        for (group, metric), values in by_score.items():
            means = sorted(m for m, _ in values)
            sds = sorted(s for _, s in values)
            series[(group, metric, None)] = _Series(_median(means), _median(sds))
        entries = []
        unmeasurable: dict[tuple[str, str], list[tuple[int | None, _Series]]] = {}
        for (group, metric, layer), s in series.items():
            if not (math.isfinite(s.mean) and math.isfinite(s.sd) and s.sd > 0):
                s.done = True
            elif s.mean + self.k * s.sd >= 1 and s.mean - self.k * s.sd <= -1:
                s.done = True
                unmeasurable.setdefault((group, metric), []).append((layer, s))
            if emergence_tag(group, metric, layer) in self.written:
                s.done = True
        for (group, metric), items in unmeasurable.items():
            tag = emergence_tag(group, metric, note="not_measurable")
            if tag in self.written:
                continue
            items.sort(key=lambda item: (item[0] is None, item[0] or 0))
            names = ", ".join(_layer_name(layer) for layer, _ in items)
            widest = max(s.sd for _, s in items)
            entries.append((tag, f"{metric} ({group}): not measurable at this width for {names}: {self.k:g} sd of "
                                 f"the random range (sd up to {widest:.3f}, {self.k:g} sd = {self.k * widest:.2f}) "
                                 "covers the score's whole range [-1, 1], so no departure can be written live.",
                            snapshot.step))
            self.written.add(tag)
        self._series = series
        return entries

    # -- per snapshot ---------------------------------------------------------------------------
    def entries(self, snapshot: Snapshot) -> list[tuple[str, str, int]]:
        """The text entries due at ``snapshot`` (``(tag, markdown text, step)``)."""
        out: list[tuple[str, str, int]] = []
        if self._series is None:
            out += self._begin(snapshot)
            if self._series is None:
                return out
        values: dict[tuple[str, str, int | None], float] = {}
        for r in snapshot.records:
            if r.head is None and r.metric in SCORES:
                values[(r.group, r.metric, r.layer)] = r.value
        for (group, metric, stat), value in snapshot.stats.items():
            if stat == "median" and metric in SCORES:
                values[(group, metric, None)] = value
        for key, value in values.items():
            s = self._series.get(key)
            if s is None or s.done or value is None or not math.isfinite(value):
                continue  # no range, already written, or not measured at this snapshot
            if abs(value - s.mean) > self.k * s.sd:
                s.started = snapshot.step if s.held == 0 else s.started
                s.held += 1
            else:
                s.started, s.held = None, 0
            if s.held >= self.window:
                s.done = True
                group, metric, layer = key
                tag = emergence_tag(group, metric, layer)
                self.written.add(tag)
                out.append((tag, self._text(group, metric, layer, s, value, snapshot.step), snapshot.step))
        return out

    def _text(self, group: str, metric: str, layer: int | None, s: _Series, value: float, step: int) -> str:
        lo, hi = s.mean - self.k * s.sd, s.mean + self.k * s.sd
        return (f"{metric} of {_layer_name(layer)} ({group}) left the random range: beyond {self.k:g} sd "
                f"(mean {s.mean:+.4f}, sd {s.sd:.4f}, range [{lo:+.4f}, {hi:+.4f}]) from step {s.started}, "
                f"confirmed at step {step} after {self.window} consecutive snapshots (value {value:+.4f}). "
                "Causal rule: the post-hoc departure of `attn-probe summary` uses the whole run and may differ.")


def _median(values: list[float]) -> float:
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def _records(path: str) -> Iterable[bytes]:
    """The records of one TFRecord file (an event file); stops at a torn or short record."""
    with open(path, "rb") as fh:
        while True:
            head = fh.read(12)
            if len(head) < 12:
                return
            (length,) = struct.unpack("<Q", head[:8])
            data = fh.read(length)
            if len(data) < length or len(fh.read(4)) < 4:
                return
            yield data


def written_before(log_dir: str, step: int) -> set[str]:
    """The emergence tags (:func:`~attn_probe.formats.tags.emergence_tag`) of ``log_dir``'s event
    files written at a step before ``step`` and not dropped by a later restart marker
    (``SessionLog.START``), in file-name order. Unreadable files count as empty."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    key = EMERGENCE_PREFIX.encode()
    found: dict[str, int] = {}
    for name in event_files(log_dir):
        try:
            for data in _records(os.path.join(log_dir, name)):
                if key not in data and len(data) > 64:
                    continue  # neither an entry of ours nor a (small) restart marker: not parsed
                event = Event.FromString(data)
                if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                    found = {tag: s for tag, s in found.items() if s < event.step}
                for value in event.summary.value:
                    if value.tag.startswith(EMERGENCE_PREFIX):
                        found.setdefault(value.tag.removesuffix("/text_summary"), event.step)
        except Exception:  # noqa: BLE001 - a damaged file: what was read counts
            continue
    return {tag for tag, s in found.items() if s < step}
