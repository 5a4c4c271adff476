"""The emergence events in the dynamics figure: a vertical marker per series at its median layer's
departure (dotted) and takeoff (dashed), in the series' colour (:mod:`attn_probe.analysis.emergence`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: legend labels of the two markers
DEPARTURE_LABEL = "departure (median layer, 3 sd)"
TAKEOFF_LABEL = "takeoff (median layer, half rise)"
_STYLE = {"departure": ":", "takeoff": "--"}


def draw_events(axes: Sequence[Any], metrics: Sequence[str], events: Any, series: Sequence[tuple[str, str]],
                colours: Sequence[str]) -> list[tuple[Any, str]]:
    """Draw the median layer's events of ``events`` (:func:`~attn_probe.analysis.emergence.emergence`'s
    table) in the panel of their metric, series ``i`` in ``colours[i]``. Returns ``(legend handle,
    label)`` of each kind of marker drawn (grey, once)."""
    from matplotlib.lines import Line2D

    from .emergence import EMERGED, median_events
    from .table import is_na

    med = median_events(events)
    med = med[med["status"] == EMERGED]
    drawn: set[str] = set()
    for ax, metric in zip(axes, metrics, strict=True):
        for i, (run, group) in enumerate(series):
            rows = med[(med["run"] == run) & (med["group"] == group) & (med["metric"] == metric)]
            for row in rows.itertuples(index=False):
                for kind in ("departure", "takeoff"):
                    step = getattr(row, kind)
                    if is_na(step):
                        continue
                    ax.axvline(int(step), color=colours[i % len(colours)], linestyle=_STYLE[kind], linewidth=1.1,
                               alpha=0.85, zorder=1.8)
                    drawn.add(kind)
    k = float(events["k"].iloc[0]) if len(events) else 3.0
    labels = {"departure": DEPARTURE_LABEL.replace("3 sd", f"{k:g} sd"), "takeoff": TAKEOFF_LABEL}
    return [(Line2D([], [], color="0.35", linestyle=_STYLE[kind], linewidth=1.1), labels[kind])
            for kind in ("departure", "takeoff") if kind in drawn]
