"""The QK-clip dry run: what MuonClip would do to each head, from the measured logits.

Kimi K2's MuonClip rescales a head's query and key weights after an update by
``gamma = min(1, tau / S_max)``, where ``S_max`` is the head's largest attention logit in the
batch. This module states, without touching the model, the factor it would apply:

.. math:: \\text{qk\\_clip\\_scale}_h = \\min\\left(1, \\frac{\\tau}{S^h_{max}}\\right), \\qquad
          S^h_{max} = \\max_{b, i, j} \\ell_{bhij}

**Convention.** ``S_max`` is the *signed* maximum (``max_logit_signed``), as MuonClip defines it,
logged beside the probe's ``max_logit`` (the largest *absolute* logit, ``max |l|``): a head whose
logits are large and negative has a large ``max_logit`` and no clip. Both are taken over the
same entries (the keys visible to each counted query token, over every counted forward of the
step, combined over ranks by max) of the same logits ``l = s q.k``: after the model's scaling
``s`` and rotary embeddings, before softcapping and additive position biases
(:mod:`attn_probe.activations.statistics`). A head at or below ``tau`` (also one with ``S_max <= 0``)
has scale 1; above it, ``tau / S_max`` (0 for an infinite logit). ``heads_over_tau`` counts,
per layer, the heads with ``S_max > tau``, i.e. those MuonClip would clip.

Per layer: ``max_logit_signed`` is the max over heads, ``qk_clip_scale`` the min over heads
(the strictest clip), ``heads_over_tau`` the count (a layer-only value, no per-head series).
Every value is NaN where nothing was counted; the rules see no value there (they run on every
rank with ``max_logit``'s, on the counted columns only: :func:`attn_probe.live.stages.alerting.attention_rows`).
A NaN logit is not "nothing counted": the head's values are NaN, and so are its layer's three
values (a NaN head is never left out of the max, the min or the count), so the rules fire on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["DEFAULT_TAU", "SIGNED_METRIC", "SCALE_METRIC", "OVER_METRIC", "CLIP_METRICS", "clip_scale",
           "heads_over_tau", "signed_columns", "clip_tables"]

#: MuonClip's threshold in Kimi K2
DEFAULT_TAU = 100.0
#: the signed max logit (MuonClip's ``S_max``), per head and per layer
SIGNED_METRIC = "max_logit_signed"
#: ``min(1, tau / S_max)``, per head and per layer (min over heads)
SCALE_METRIC = "qk_clip_scale"
#: heads with ``S_max > tau``, per layer only
OVER_METRIC = "heads_over_tau"
#: the metrics this module adds to the attention statistics, in table order
CLIP_METRICS: tuple[str, ...] = (SIGNED_METRIC, SCALE_METRIC, OVER_METRIC)


def check_tau(tau: object) -> float:
    """``tau`` as a float; ``ValueError`` (one line) unless it is a finite number > 0."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
        raise ValueError(f"qk_clip_tau must be a finite number > 0 (MuonClip's threshold on the logit), got {tau!r}")
    return float(tau)


def clip_scale(s_max: np.ndarray, tau: float) -> np.ndarray:
    """``min(1, tau / S_max)`` elementwise: 1 where ``S_max <= tau``, NaN where ``S_max`` is NaN."""
    s = np.asarray(s_max, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(s > tau, tau / np.where(s > tau, s, 1.0), 1.0)
    return np.where(np.isnan(s), math.nan, out)


def heads_over_tau(s_max: np.ndarray, tau: float) -> float:
    """How many of the heads' ``S_max`` exceed ``tau``: heads where nothing was counted (``-inf``)
    are left out; NaN when a counted head is NaN (a NaN logit) or when no head was counted."""
    s = np.asarray(s_max, dtype=np.float64)
    counted = s != -math.inf
    if not counted.any() or np.isnan(s).any():
        return math.nan
    return float(np.count_nonzero(s[counted] > tau))


def signed_columns(signed_max: np.ndarray, heads: Sequence[int]) -> list[np.ndarray]:
    """Per layer ``(1 + H,)``: column 0 the max over heads, then each head's signed max, as the
    accumulators hold them: ``-inf`` where nothing was counted, NaN where a logit was NaN (the
    layer too: a NaN head is never left out of its max). :func:`clip_tables` writes ``-inf`` as NaN."""
    flat = np.asarray(signed_max, dtype=np.float64)
    out, start = [], 0
    for h in heads:
        cols = flat[start:start + h]
        start += h
        layer = math.nan if np.isnan(cols).any() else float(cols.max()) if h else -math.inf
        out.append(np.concatenate([[layer], cols]))
    return out


def clip_tables(column: np.ndarray, tau: float, per_head: bool) -> list[tuple[tuple[str, ...], np.ndarray]]:
    """The dry run of one layer from its :func:`signed_columns` entry, as ``(metric names, table)``
    for the assembly: ``max_logit_signed`` and ``qk_clip_scale`` (``(2, 1 + H)``, or ``(2, 1)``
    without ``per_head``), then ``heads_over_tau`` (``(1, 1)``, counted over all heads). NaN where
    nothing was counted (``-inf`` in ``column``); a NaN head makes its layer's values NaN."""
    column = np.asarray(column, dtype=np.float64)
    heads = column[1:]
    counted = heads != -math.inf
    shown = np.where(column == -math.inf, math.nan, column)
    scales = np.where(counted, clip_scale(np.where(counted, heads, math.nan), tau), math.nan)
    if not counted.any() or np.isnan(heads).any():
        layer_scale = math.nan
    else:
        layer_scale = float(scales[counted].min())
    table = np.stack([shown, np.concatenate([[layer_scale], scales])])
    return [((SIGNED_METRIC, SCALE_METRIC), table if per_head else table[:, :1]),
            ((OVER_METRIC,), np.array([[heads_over_tau(heads, tau)]]))]
