"""One run's values of a few metrics, read back from a trajectory file in order, in constant memory.

A resumed probe rebuilds what its alert rules had seen before the resume from the file it
continues (the JSONL is the record of the run): :class:`RunRows` walks the file once, gives each
line to its run by the rules every reader follows (:class:`~attn_probe.formats.runs.RunTracker`,
through the resume cut's walk), and yields, snapshot by snapshot, the rows of the runs with one
run id, only for the metrics asked for. Lines that name none of them are never parsed. Only the
standard library is imported here.

The values are those written: a NaN and an infinite value both read back as NaN (the format
writes ``null`` for each).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Collection, Iterator
from typing import Any

# the resume cut's walk: each piece of the file with its run, by the rules every reader follows
from .cutting import pieces
from .lines import MAX_LINE, SCAN_CHUNK, Unreadable
from .runs import RunKey, RunTracker

__all__ = ["RunRows"]

#: ``(step, group, layer, head, metric, value)`` of one row
Row = tuple[int, str, int, "int | None", str, float]


def _row_pattern(metrics: Collection[str]) -> re.Pattern[bytes]:
    names = b"|".join(re.escape(m.encode()) for m in sorted(metrics))
    return re.compile(
        rb'^\{"step": (-?\d{1,19}), "wall_time": [^,\n]*, "group": "([A-Za-z0-9_]{1,128})", '
        rb'"layer": (-?\d{1,19}), "head": (null|-?\d{1,19}), "metric": "(' + names + rb')", '
        rb'"value": ([^,}\n]*)\}$',
        re.MULTILINE,
    )


def _value(text: Any) -> float:
    if text is None or text == b"null":
        return math.nan
    return float(text)


class RunRows:
    """``(run key, step, rows)`` of every run of ``run_id`` in ``path``, one snapshot at a time, in file
    order, with ``rows`` the :data:`Row` s of ``metrics`` at that step. After the walk, :attr:`latest`
    is the key of the file's latest run of that id (``None``: none), the run a resumed probe continues
    (an id opened again, e.g. two files concatenated, is another run: another key)."""

    def __init__(
        self,
        path: str | os.PathLike,
        run_id: str,
        metrics: Collection[str],
        *,
        chunk_size: int = SCAN_CHUNK,
        max_line: int = MAX_LINE,
    ) -> None:
        self.path, self.run_id, self.metrics = path, run_id, frozenset(metrics)
        self.chunk_size, self.max_line = chunk_size, max_line
        self.latest: RunKey | None = None
        self._pattern = _row_pattern(self.metrics)
        self._marks = [json.dumps(m).encode() for m in sorted(self.metrics)]  # any spelling of the row

    def __iter__(self) -> Iterator[tuple[RunKey, int, list[Row]]]:
        tracker = RunTracker()
        pending: dict[RunKey, tuple[int, list[Row]]] = {}
        try:
            fh = open(self.path, "rb")
        except FileNotFoundError:
            return
        with fh:
            for _offset, data, key, _lines, _low, _high, header in pieces(
                fh, self.chunk_size, self.max_line, tracker
            ):
                if (
                    header
                    or key is None
                    or key[0] != "run"
                    or key[1] != self.run_id
                    or isinstance(data, Unreadable)
                    or not self.metrics
                ):
                    continue
                for row in self._rows(data):
                    held = pending.get(key)
                    if held is not None and held[0] != row[0]:
                        yield key, held[0], held[1]
                        held = None
                    if held is None:
                        held = pending[key] = (row[0], [])
                    held[1].append(row)
        for key, (step, rows) in pending.items():
            yield key, step, rows
        self.latest = tracker.latest(self.run_id)

    def _rows(self, data: bytes) -> list[Row]:
        """The rows of ``metrics`` in a piece of complete lines (lines naming none are not parsed)."""
        marked = sum(data.count(mark) for mark in self._marks)
        if not marked:
            return []
        found = self._pattern.findall(data)
        if len(found) == marked:  # every line naming a metric is a row as the sink writes it
            return [
                (int(s), g.decode(), int(lay), None if h == b"null" else int(h), m.decode(), _value(v))
                for s, g, lay, h, m, v in found
            ]
        rows: list[Row] = []
        for line in data.splitlines():
            if not any(mark in line for mark in self._marks):
                continue
            try:
                rec = json.loads(line)
                step, group, layer, head = rec["step"], rec["group"], rec["layer"], rec["head"]
                if rec["metric"] in self.metrics and isinstance(group, str):
                    rows.append(
                        (
                            int(step),
                            group,
                            int(layer),
                            None if head is None else int(head),
                            rec["metric"],
                            _value(rec["value"]),
                        )
                    )
            except (ValueError, KeyError, TypeError):
                continue  # not a row: no value to replay
        return rows
