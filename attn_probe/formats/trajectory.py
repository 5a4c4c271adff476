"""The lossless trajectory file written beside the event files: ``attn_probe.jsonl``.

The one home of the format: record encoding, the run header, reading records back and scanning
for run headers; which run each line belongs to is :mod:`attn_probe.formats.runs`, the resume
cut (:func:`cut_run`, re-exported here) :mod:`attn_probe.formats.cutting`. The sink
(:mod:`attn_probe.sinks.trajectory`), the resume and the readers
(:mod:`attn_probe.analysis.reading`) all use it. Only the standard library is imported here
(and :mod:`attn_probe.formats.logdir` for its errors).

One JSON object per line and per value::

    {"step": 100, "wall_time": 1732280000.1, "group": "self", "layer": 3, "head": null,
     "metric": "symmetry", "value": 0.41}

``head`` is ``null`` for the layer-level matrix; ``value`` is ``null`` for NaN. Lines are
appended and flushed at every snapshot. Readers skip a truncated last line.

**Run header.** Each run (and each resumption of it) begins its rows with one header record:
the row keys, all ``null`` but ``step`` (the step the rows that follow start at) and
``wall_time`` (the start time), and a ``run_header`` object::

    {"step": 0, "wall_time": 1732280000.0, "group": null, "layer": null, "head": null,
     "metric": null, "value": null,
     "run_header": {"version": 1, "run_id": "9f1c...", "start_time": "2026-11-27T10:00:00+00:00",
                    "resumed": false, "parent_run": null, "parent_step": null, "parent_dir": null,
                    "config": {...}, "model": {...}}}

``run_id`` is a random id (``uuid4().hex``) kept across resumptions of the run: every row after
a header, up to the next header, belongs to that header's run. ``resumed`` marks a header
written by a resumed run (its id may be new when the run it continues had none: a checkpoint
written before run ids existed). A run branched from another run's checkpoint names that run's
id and step in ``parent_run``/``parent_step`` (``parent_dir``: its directory). ``config`` and
``model`` are the summary the TensorBoard run header holds. Rows before the first header
(files written before run headers existed) belong to no identified run. A header that cannot
be read, a missing one, and an id used by two runs are read by the rules of
:mod:`attn_probe.formats.runs`: a run's rows are never given to another run.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from typing import Any

from .cutting import Cut, cut_run, cut_trajectory  # noqa: F401  (re-exported)
from .lines import (  # noqa: F401  (re-exported: the format's names stay importable from here)
    HEADER_KEY,
    MAX_ID,
    MAX_LINE,
    SCAN_CHUNK,
    RunHeader,
    Unreadable,
    is_int64,
    line_blocks,
    line_step,
    loads,
    parse_header,
)
from .runs import MAX_HEADER

__all__ = [
    "FIELDS",
    "HEADER_KEY",
    "MAX_HEADER",
    "MAX_LINE",
    "SCAN_CHUNK",
    "TRAJECTORY_FILENAME",
    "Cut",
    "RunHeader",
    "Unreadable",
    "cut_run",
    "cut_trajectory",
    "decode_value",
    "encode_header",
    "encode_rows",
    "encode_value",
    "file_runs",
    "line_blocks",
    "new_run_id",
    "parse_header",
]

TRAJECTORY_FILENAME = "attn_probe.jsonl"
FIELDS = ("step", "wall_time", "group", "layer", "head", "metric", "value")
#: the format version a header records
VERSION = 1
#: a header line holds this literal (headers are found in a chunk by a fast substring search)
_HEADER_MARK = b'"' + HEADER_KEY.encode() + b'": '


def encode_value(value: float | None) -> float | None:
    """A value as written to JSON: ``null`` (``None``) for NaN, inf and ``None``."""
    return None if value is None or not math.isfinite(value) else float(value)


def decode_value(value: Any) -> float:
    """Inverse of :func:`encode_value`: ``null`` reads back as NaN."""
    return float("nan") if value is None else float(value)


def new_run_id() -> str:
    """A fresh random run id (32 hex digits): never derived from a time or a directory name."""
    return uuid.uuid4().hex


def encode_rows(snapshots: Sequence[Any]) -> bytes:
    """The rows of ``snapshots`` (objects with ``step``, ``wall_time`` and ``records``, and optionally
    ``baselines``: rows written once, after the records), one line per value."""
    lines = []
    for snapshot in snapshots:
        for r in (*snapshot.records, *getattr(snapshot, "baselines", ())):
            row = dict(zip(FIELDS, (snapshot.step, snapshot.wall_time, r.group, r.layer, r.head,
                                    r.metric, encode_value(r.value)), strict=True))
            note = getattr(r, "note", None)
            if note:  # an extra key: readers of the seven fields ignore it
                row["note"] = str(note)
            lines.append(json.dumps(row, allow_nan=False) + "\n")
    return "".join(lines).encode("utf-8")


def encode_header(run_id: str, step: int, *, wall_time: float, resumed: bool = False,
                  parent_run: str | None = None, parent_step: int | None = None, parent_dir: str | None = None,
                  config: dict[str, Any] | None = None, model: dict[str, Any] | None = None) -> bytes:
    """One header record (a line) starting a run's rows at ``step``; see the module docstring."""
    start = datetime.fromtimestamp(wall_time, tz=timezone.utc).isoformat(timespec="seconds")
    run = {"version": VERSION, "run_id": run_id, "start_time": start, "resumed": bool(resumed),
           "parent_run": parent_run, "parent_step": parent_step, "parent_dir": parent_dir,
           "config": config or {}, "model": model or {}}
    rec = {**dict.fromkeys(FIELDS), "step": int(step), "wall_time": wall_time, HEADER_KEY: run}
    return (json.dumps(rec, allow_nan=False, default=str) + "\n").encode("utf-8")


# --------------------------------------------------------------------------------------------
# Scanning and cutting, in constant memory
# --------------------------------------------------------------------------------------------

def _header_in(line: bytes) -> RunHeader | None:
    """The header of one complete line when it is a header record (cheap reject first)."""
    if _HEADER_MARK not in line or len(line) > MAX_HEADER:
        return None
    return parse_header(loads(line))


def _split_at_headers(block: bytes) -> Iterator[tuple[int, int, RunHeader | None]]:
    """``(start, stop, header)`` pieces of a block of complete lines: runs of rows (``header``
    ``None``) and single header lines, in order. One substring search when there is no header."""
    start = 0
    at = block.find(_HEADER_MARK)
    while at >= 0:
        line_start = block.rfind(b"\n", 0, at) + 1
        line_stop = block.index(b"\n", at) + 1
        header = _header_in(block[line_start:line_stop])
        if header is not None:
            if line_start > start:
                yield start, line_start, None
            yield line_start, line_stop, header
            start = line_stop
        at = block.find(_HEADER_MARK, line_stop)
    if start < len(block):
        yield start, len(block), None


def file_runs(path: str | os.PathLike, *, chunk_size: int = SCAN_CHUNK,
              max_line: int = MAX_LINE) -> list[RunHeader]:
    """The header records of a trajectory file, in file order (``[]`` for a missing file).

    One chunked pass with a substring search per chunk; memory does not grow with the file.
    ``chunk_size`` is the bytes read at once and ``max_line`` the longest readable line (a
    longer one is skipped unread); both bound the memory used, neither changes the result for
    lines shorter than ``max_line``.
    """
    out: list[RunHeader] = []
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return out
    with fh:
        for _offset, block in line_blocks(fh, chunk_size, max_line):
            if isinstance(block, bytes) and _HEADER_MARK in block:
                out.extend(h for _, _, h in _split_at_headers(block) if h is not None)
    return out

