"""The lossless trajectory file written beside the event files: ``attn_probe.jsonl``.

One JSON object per line and per value::

    {"step": 100, "wall_time": 1732280000.1, "group": "self", "layer": 3, "head": null,
     "metric": "symmetry", "value": 0.41}

``head`` is ``null`` for the layer-level matrix; ``value`` is ``null`` for NaN. Lines are
appended and flushed at every snapshot. Readers skip a truncated last line.
"""

from __future__ import annotations

import math
from typing import Any

TRAJECTORY_FILENAME = "attn_probe.jsonl"
FIELDS = ("step", "wall_time", "group", "layer", "head", "metric", "value")


def encode_value(value: float | None) -> float | None:
    """A value as written to JSON: ``null`` (``None``) for NaN, inf and ``None``."""
    return None if value is None or not math.isfinite(value) else float(value)


def decode_value(value: Any) -> float:
    """Inverse of :func:`encode_value`: ``null`` reads back as NaN."""
    return float("nan") if value is None else float(value)
