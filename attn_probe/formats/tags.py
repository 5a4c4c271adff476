"""The one tag grammar for scalars, used both for writing and for reading back.

``attn_probe/{group}/{metric}/layer_{LL}``            one layer (layer-level matrix)
``attn_probe/{group}/{metric}/layer_{LL}/head_{HH}``  one head (opt-in)
``attn_probe/{group}/{metric}/{stat}``                across layers: ``median``, ``q25``, ``q75``,
                                                      and ``max`` for the magnitudes
``attn_probe/{group}/{metric}/layer_{LL}/{summary}``  over one layer's heads (the trackers' key
                                                      budget): ``heads_min``, ``heads_median``,
                                                      ``heads_max``; ``top_{R}`` the value of the
                                                      R-th top head, ``top_{R}_head`` its index

Text (not scalars): ``attn_probe_emergence/{group}/{metric}/layer_{LL}`` (or ``/median``,
``/not_measurable``), the live emergence events (:func:`emergence_tag`).

``metric`` is a name of :data:`attn_probe.core.METRICS` for W_qk (``symmetry``,
``directionality``, ``spectral_norm``, ...); other weight pairs add metrics with a prefix
(e.g. ``ov_symmetry``) without changing the grammar.

The across-layer statistics are defined here too (:data:`STAT_QUANTILES`,
:func:`layer_stats`, :func:`stats_for`), so that the probe, the checkpoint summary and the
post-hoc readers compute the same numbers. The per-layer summaries over heads are named here
(:data:`HEAD_STATS`, :func:`summary_names`) and computed by :mod:`attn_probe.sinks.head_budget`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

PREFIX = "attn_probe"
#: every across-layer statistic the grammar knows
STATS = ("median", "q25", "q75", "max")
#: the statistics of every metric: the median and the interquartile band (the paper's figure)
BAND_STATS = ("median", "q25", "q75")
#: quantile level of each across-layer statistic (linear interpolation, numpy's default)
STAT_QUANTILES: dict[str, float] = {"median": 0.5, "q25": 0.25, "q75": 0.75, "max": 1.0}
#: the paper's two scores, drawn first
METRICS = ("symmetry", "directionality")
#: the statistics over one layer's heads (tag ``heads_{stat}``; median: numpy's linear interpolation)
HEAD_STATS = ("min", "median", "max")
_SUMMARY = rf"heads_(?:{'|'.join(HEAD_STATS)})|top_[1-9]\d*(?:_head)?"

_TAG = re.compile(
    rf"^{PREFIX}/(?P<group>[A-Za-z0-9_]+)/(?P<metric>[A-Za-z0-9_]+)/"
    rf"(?:(?P<stat>{'|'.join(STATS)})|layer_(?P<layer>\d+)(?:/head_(?P<head>\d+)|/(?P<summary>{_SUMMARY}))?)$"
)


#: text entries of the live emergence events (:mod:`attn_probe.sinks.emergence`), outside the scalar grammar
EMERGENCE_PREFIX = f"{PREFIX}_emergence"


def emergence_tag(group: str, metric: str, layer: int | None = None, note: str | None = None) -> str:
    """Text tag of a live emergence event: ``attn_probe_emergence/{group}/{metric}/layer_{LL}``,
    ``.../median`` (the median layer, ``layer=None``) or ``.../{note}`` (``not_measurable``)."""
    last = note if note is not None else "median" if layer is None else f"layer_{layer:02d}"
    return f"{EMERGENCE_PREFIX}/{group}/{metric}/{last}"


@dataclass(frozen=True)
class TagParts:
    group: str
    metric: str
    layer: int | None = None
    head: int | None = None
    stat: str | None = None
    #: a summary over the layer's heads (:func:`summary_names`), not a value of the layer itself
    summary: str | None = None


def summary_names(top_k: int) -> tuple[str, ...]:
    """The summaries of one layer's heads with ``top_k`` top heads: :data:`HEAD_STATS` as
    ``heads_{stat}``, then ``top_{R}`` and ``top_{R}_head`` for ``R = 1 .. top_k``.

    Example:
        >>> summary_names(2)
        ('heads_min', 'heads_median', 'heads_max', 'top_1', 'top_1_head', 'top_2', 'top_2_head')
    """
    tops = tuple(name for r in range(1, top_k + 1) for name in (f"top_{r}", f"top_{r}_head"))
    return (*(f"heads_{s}" for s in HEAD_STATS), *tops)


def scalar_tag(group: str, metric: str, layer: int | None = None, head: int | None = None,
               stat: str | None = None, summary: str | None = None) -> str:
    """Tag of one scalar series; exactly one of ``layer`` and ``stat`` is given; ``summary`` (a
    name of :func:`summary_names`) goes with ``layer`` and no ``head``."""
    if (layer is None) == (stat is None):
        raise ValueError("give exactly one of layer= and stat=")
    if summary is not None:
        if layer is None or head is not None or not re.fullmatch(_SUMMARY, summary):
            raise ValueError(f"summary must be one of heads_min/median/max, top_R, top_R_head (with layer=, "
                             f"without head=), got {summary!r}")
        return f"{PREFIX}/{group}/{metric}/layer_{layer:02d}/{summary}"
    if stat is not None:
        if stat not in STATS or head is not None:
            raise ValueError(f"stat must be one of {STATS} (without head), got {stat!r}")
        return f"{PREFIX}/{group}/{metric}/{stat}"
    tag = f"{PREFIX}/{group}/{metric}/layer_{layer:02d}"
    return tag if head is None else f"{tag}/head_{head:02d}"


def parse_tag(tag: str) -> TagParts | None:
    """Inverse of :func:`scalar_tag`; ``None`` for tags that are not attn_probe's."""
    m = _TAG.match(tag)
    if m is None:
        return None
    layer = m.group("layer")
    head = m.group("head")
    return TagParts(
        group=m.group("group"),
        metric=m.group("metric"),
        layer=int(layer) if layer is not None else None,
        head=int(head) if head is not None else None,
        stat=m.group("stat"),
        summary=m.group("summary"),
    )


def stats_for(metric: str) -> tuple[str, ...]:
    """The across-layer stats written for ``metric``: :data:`BAND_STATS`, plus ``max`` for the
    magnitudes (:func:`attn_probe.core.is_magnitude`: norms, stable rank, ``qk_bound``).

    Example:
        >>> stats_for("symmetry"), stats_for("ov_spectral_norm")
        (('median', 'q25', 'q75'), ('median', 'q25', 'q75', 'max'))
    """
    from ..core import is_magnitude

    return (*BAND_STATS, "max") if is_magnitude(metric) else BAND_STATS


def layer_stats(values: Iterable[float | None], metric: str | None = None) -> dict[str, float]:
    """``{stat: value}`` over the finite ``values``: the stats of ``metric`` (:func:`stats_for`),
    or every stat of :data:`STATS` when ``metric`` is not given.

    Quantiles interpolate linearly between order statistics (``max`` is the 1.0 quantile);
    ``None``/NaN/inf values are left out, and every stat is NaN when no value is finite.

    Example:
        >>> layer_stats([1.0, 4.0, float("nan"), 2.0, 3.0], "symmetry")
        {'median': 2.5, 'q25': 1.75, 'q75': 3.25}
    """
    import numpy as np

    stats = STATS if metric is None else stats_for(metric)
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    arr = arr[np.isfinite(arr)]
    if arr.size == 0:
        return dict.fromkeys(stats, math.nan)
    qs = np.quantile(arr, [STAT_QUANTILES[s] for s in stats])
    return {s: float(q) for s, q in zip(stats, qs, strict=True)}
