"""Stage 3: a snapshot's records and statistics, from values already on the host.

The live probe (:class:`Assembler`) and checkpoint trajectories
(:func:`snapshot_from_rows`, :mod:`attn_probe.scoring.checkpoint`) assemble snapshots here, so the
records and the across-layer statistics (:func:`layer_statistics`: median, quartiles, ...
of the layer-level values, :func:`attn_probe.formats.tags.layer_stats`) are the same on every path.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..core import table_entries
from ..core.update import ABSENT_WHEN_UNDEFINED
from ..extraction import AttentionLayer
from ..formats.tags import layer_stats
from ..isolation import safe_warn
from . import Record, Snapshot

__all__ = ["Assembler", "layer_statistics", "records_from_rows", "snapshot_from_rows"]

#: one layer's values of one quantity: ``(layer, metric names, host table (len(names), 1 + H))``
LayerTable = tuple[AttentionLayer, Sequence[str], np.ndarray]


def layer_statistics(records: Iterable[Record]) -> dict[tuple[str, str, str], float]:
    """``(group, metric, stat) -> value`` across the layers, from the layer-level records."""
    by_key: dict[tuple[str, str], list[float]] = {}
    for r in records:
        if r.head is None:
            by_key.setdefault((r.group, r.metric), []).append(r.value)
    return {(group, metric, stat): value
            for (group, metric), vals in by_key.items()
            for stat, value in layer_stats(vals, metric).items()}


def records_from_rows(rows: Iterable[dict[str, Any]], metrics: Sequence[str]) -> list[Record]:
    """Records of rows ``{group, layer, head, <metric>: value}`` (:func:`attn_probe.score_model`)."""
    return [Record(r["group"], r["layer"], r["head"], m, float(r[m])) for r in rows for m in metrics]


def snapshot_from_rows(step: int, rows: Iterable[dict[str, Any]], metrics: Sequence[str]) -> Snapshot:
    """A :class:`~attn_probe.sinks.Snapshot` of post-hoc rows at ``step`` (checkpoint trajectories)."""
    records = records_from_rows(rows, metrics)
    return Snapshot(step=int(step), wall_time=time.time(), records=records, stats=layer_statistics(records))


class Assembler:
    """Snapshots of the live probe from every quantity's host tables; warns once about non-finite
    weight values.

    :meth:`assemble` takes the rows of each quantity (:class:`attn_probe.live.quantities.Rows`:
    ``tables``, ``images``, ``checked``), in the probe's order of quantities.
    """

    def __init__(self) -> None:
        self.warned_nonfinite = False

    def assemble(self, step: int, outputs: Sequence[Any]) -> Snapshot:
        """The snapshot at ``step``: a record per layer, head and metric, and the statistics.

        Records go layer by layer (in the order the first quantity lists its layers), each
        layer's quantities in the given order. Non-finite values of a quantity whose rows are
        ``checked`` (the weight metrics) are warned about once.
        """
        by_layer: dict[tuple[str, int], list[tuple[AttentionLayer, Sequence[str], np.ndarray, bool]]] = {}
        images: dict[tuple[str, int], np.ndarray] = {}
        for out in outputs:
            images.update(out.images)
            for layer, metrics, table in out.tables:
                by_layer.setdefault((layer.group, layer.layer), []).append((layer, metrics, table, out.checked))
        records: list[Record] = []
        nonfinite: list[str] = []
        for entries in by_layer.values():
            for layer, metrics, table, checked in entries:
                for head, metric, value in table_entries(metrics, table):
                    if metric in ABSENT_WHEN_UNDEFINED and not math.isfinite(value):
                        continue  # no previous snapshot (qk_update): no row
                    records.append(Record(layer.group, layer.layer, head, metric, value))
                    if checked and head is None and not math.isfinite(value):
                        nonfinite.append(f"{layer.name} {metric}")
        if nonfinite and not self.warned_nonfinite:
            self.warned_nonfinite = True
            safe_warn(
                f"attn_probe: non-finite weights or undefined scores at step {step} "
                f"({', '.join(nonfinite[:6])}{', ...' if len(nonfinite) > 6 else ''}); logged as NaN. "
                "This warning is shown once."
            )
        return Snapshot(step=step, wall_time=time.time(), records=records,
                        stats=layer_statistics(records), images=images)
