"""What the live probe measures, one protocol for every kind of value (issue 36).

A **quantity** is one kind of value logged at a snapshot: the weight metrics, the heatmaps, the
attention statistics of the training forwards. Each answers the same three questions, and the
façade (:class:`~attn_probe.live.probe.Probe`) loops over its list of quantities without knowing
which is which:

- :meth:`Quantity.due`: is it measured at ``step``;
- :meth:`Quantity.take`: what it measures outside the weight walk, at the snapshot, on **every
  rank**, before the walk (its collectives, if any, run there, in the list's order on every
  rank); :meth:`Quantity.alert_rows` turns that into the rows alert rules see on every rank;
- :meth:`Quantity.rows`: the rows it returns, as :class:`Rows` (per layer, metric names and a host
  table ``(metrics, 1 + H)``; images), from the walk's :class:`Measured` values and what it took.

The assembly (:class:`~attn_probe.sinks.assembly.Assembler`) turns every quantity's rows into one
snapshot's records, so sinks, tags and exports need no change for a new quantity. Adding one is a
class here (or in its own module) and one line in :func:`build_quantities`; docs/architecture.md
works through the update rate and the QK-clip dry run as examples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..sinks.assembly import LayerTable
from .stages.alerting import attention_rows
from .stages.attention import AttentionStage
from .stages.measurement import Measured

__all__ = ["AttentionStatistics", "Heatmaps", "Quantity", "Rows", "WeightMetrics", "build_quantities"]


class Rows(NamedTuple):
    """What a quantity returns for one snapshot."""

    #: ``(layer, metric names, table)``: a host table ``(len(names), 1 + H)``, column 0 the layer
    tables: list[LayerTable]
    #: heatmaps by ``(group, layer)``
    images: dict[tuple[str, int], np.ndarray]
    #: its non-finite values are warned about (once per run): the weights' are a symptom
    checked: bool = False


NO_ROWS = Rows([], {})


class Quantity:
    """The protocol (a base class with the defaults of a quantity that needs none of it)."""

    #: its name, as the docs and the warnings say it
    name = "quantity"

    def due(self, step: int) -> bool:
        """Whether it is measured at ``step`` (may raise: a schedule is user code)."""
        return True

    def take(self, step: int) -> Any:
        """Before the weight walk, on every rank: what it measured outside the walk (``None``:
        nothing). May hold collectives, issued in the same order on every rank."""
        return None

    def alert_rows(self, taken: Any) -> list[dict[str, Any]] | None:
        """The rows the alert rules see on every rank, from what :meth:`take` returned."""
        return None

    def rows(self, measured: Measured, taken: Any) -> Rows:
        """The rows it returns at this snapshot (main process, maybe on the scoring worker)."""
        return NO_ROWS


class WeightMetrics(Quantity):
    """The scores of the weight pairs (symmetry, directionality, norms, ...): the walk's tables."""

    name = "weight metrics"

    def __init__(self, pair_metrics: Sequence[Sequence[str]], schedule: Callable[[int], bool] | None) -> None:
        self.pair_metrics = [tuple(m) for m in pair_metrics]
        self.schedule = schedule

    def due(self, step: int) -> bool:
        return self.schedule is not None and bool(self.schedule(step))

    def rows(self, measured: Measured, taken: Any) -> Rows:
        return Rows([(layer, metrics, table) for layer, tables in measured.tables
                     for metrics, table in zip(self.pair_metrics, tables, strict=True)], {}, checked=True)


class Heatmaps(Quantity):
    """W_qk heatmaps, on their own schedule; drawn from the layers the walk gathers."""

    name = "heatmaps"

    def __init__(self, schedule: Callable[[int], bool] | None) -> None:
        self.schedule = schedule

    def due(self, step: int) -> bool:
        return self.schedule is not None and bool(self.schedule(step))

    def rows(self, measured: Measured, taken: Any) -> Rows:
        return Rows([], dict(measured.images))


class AttentionStatistics(Quantity):
    """``max_logit``, ``entropy`` and what derives from them, measured in the training forwards
    of due steps (:class:`~attn_probe.live.stages.attention.AttentionStage` arms and collects)."""

    name = "attention statistics"

    def __init__(self, stage: AttentionStage, per_head: bool) -> None:
        self.stage = stage
        self.per_head = per_head

    def due(self, step: int) -> bool:
        return self.stage.due(step)

    def take(self, step: int) -> Any:
        return self.stage.take(step)  # the combine over ranks: a collective

    def alert_rows(self, taken: Any) -> list[dict[str, Any]] | None:
        if taken is None:
            return None
        return attention_rows(self.stage.layers, taken.tables, per_head=self.per_head, counted=taken.counted,
                              signed=taken.signed, tau=self.stage.tau)

    def rows(self, measured: Measured, taken: Any) -> Rows:
        return Rows(self.stage.extra_tables(measured.tables, taken), {})


def build_quantities(pair_metrics: Sequence[Sequence[str]], schedule: Callable[[int], bool] | None,
                     image_schedule: Callable[[int], bool] | None, attention: AttentionStage | None,
                     per_head: bool) -> list[Quantity]:
    """The probe's quantities, in the order they are taken and their rows assembled."""
    quantities: list[Quantity] = [WeightMetrics(pair_metrics, schedule), Heatmaps(image_schedule)]
    if attention is not None:
        quantities.append(AttentionStatistics(attention, per_head))
    return quantities

