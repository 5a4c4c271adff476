"""The trackers' key budget: a layer's heads summed up in a few series instead of one per head.

With per-head values measured (``per_head=True``) and trackers not asked for every head
(``trackers_per_head``), each tracker gets, per layer and per-head metric, the summaries of
:func:`attn_probe.formats.tags.summary_names`:

* ``heads_min``, ``heads_median``, ``heads_max``: over the layer's heads (NaN left out; the
  median interpolates linearly, numpy's default; every one NaN when no head has a value);
* ``top_{R}`` and ``top_{R}_head`` for ``R = 1 .. k`` (``tracker_top_k``, default 3): the
  value of the R-th top head and that head's index. "Top" is the alarming end of the metric:
  the largest values, except for the metrics of :data:`LOW_FIRST` (a collapsed head has a low
  entropy; a strongly clipped head a low ``qk_clip_scale``), ranked from the smallest. Ties go to
  the lower head index; ranks beyond the heads with a value are NaN (value and index), so the
  set of keys is the same at every step.

That is ``3 + 2k`` series per layer and metric, whatever the head count. attn_probe.jsonl keeps
every head's value, and TensorBoard writes every head's tag (``per_head=True``), as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from ..formats.tags import HEAD_STATS
from . import Record

__all__ = ["DEFAULT_TOP_K", "LOW_FIRST", "head_summary", "head_budget", "top_k_of"]

#: top heads per layer and metric sent to the trackers unless ``tracker_top_k`` says otherwise
DEFAULT_TOP_K = 3
#: metrics whose alarming end is the low one: their top heads are the smallest values
LOW_FIRST = ("entropy", "qk_clip_scale")


def head_summary(values: dict[int, float], top_k: int, low_first: bool = False) -> dict[str, float]:
    """``{summary name: value}`` of one layer's ``{head: value}`` (see the module docstring)."""
    heads = sorted(values)
    arr = np.asarray([values[h] for h in heads], dtype=np.float64)
    keep = ~np.isnan(arr)
    out: dict[str, float] = {}
    if keep.any():
        have = arr[keep]
        for stat, value in zip(HEAD_STATS, (np.min(have), np.median(have), np.max(have)), strict=True):
            out[f"heads_{stat}"] = float(value)
    else:
        out.update({f"heads_{stat}": math.nan for stat in HEAD_STATS})
    ranked = sorted((h for h, ok in zip(heads, keep, strict=True) if ok),
                    key=lambda h: (values[h] if low_first else -values[h], h))
    for r in range(top_k):
        if r < len(ranked):
            out[f"top_{r + 1}"], out[f"top_{r + 1}_head"] = float(values[ranked[r]]), float(ranked[r])
        else:
            out[f"top_{r + 1}"] = out[f"top_{r + 1}_head"] = math.nan
    return out


def head_budget(records: Iterable[Record], top_k: int) -> dict[tuple[str, str, int, str], float]:
    """``(group, metric, layer, summary) -> value`` for every layer and metric with per-head records."""
    by_layer: dict[tuple[str, str, int], dict[int, float]] = {}
    for r in records:
        if r.head is not None:
            by_layer.setdefault((r.group, r.metric, r.layer), {})[r.head] = float(r.value)
    out: dict[tuple[str, str, int, str], float] = {}
    for (group, metric, layer), values in by_layer.items():
        for name, value in head_summary(values, top_k, metric in LOW_FIRST).items():
            out[(group, metric, layer, name)] = value
    return out


def top_k_of(config: dict | None) -> int | None:
    """The run's ``tracker_top_k`` from its recorded configuration (:class:`~attn_probe.sinks.RunInfo`
    ``config``); :data:`DEFAULT_TOP_K` where it is not recorded, ``None``: no summary."""
    if not isinstance(config, dict) or "tracker_top_k" not in config:
        return DEFAULT_TOP_K
    k = config["tracker_top_k"]
    return k if k is None or (isinstance(k, int) and not isinstance(k, bool) and k >= 0) else DEFAULT_TOP_K
