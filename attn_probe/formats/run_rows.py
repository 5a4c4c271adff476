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
from .cutting import Piece, pieces
from .lines import MAX_LINE, SCAN_CHUNK, Unreadable
from .runs import RunKey, RunTracker

__all__ = ["RunRows"]

#: ``(step, group, layer, head, metric, value)`` of one row
Row = tuple[int, str, int, "int | None", str, float]


def _row_pattern(metrics: Collection[str]) -> re.Pattern[bytes]:
    names = b"|".join(re.escape(m.encode()) for m in sorted(metrics))
    # matched after a newline (a literal start lets the search skip to the next line at once; a
    # ``^`` in MULTILINE mode is tried at every byte)
    return re.compile(
        rb'\n\{"step": (-?\d{1,19}), "wall_time": [^,\n]*, "group": "([A-Za-z0-9_]{1,128})", '
        rb'"layer": (-?\d{1,19}), "head": (null|-?\d{1,19}), "metric": "(' + names + rb')", '
        rb'"value": ([^,}\n]*)\}(?=\n)'
    )


def _value(text: Any) -> float:
    if text is None or text == b"null":
        return math.nan
    return float(text)


class RunRows:
    """``(run key, step, rows)`` of every run of ``run_id`` in ``path``, one snapshot at a time, in file
    order, with ``rows`` the :data:`Row` s of ``metrics`` at that step. After the walk, :attr:`latest`
    is the key of the file's latest run of that id (``None``: none), the run a resumed probe continues
    (an id opened again, e.g. two files concatenated, is another run: another key).

    The walk can also be someone else's: :meth:`feed` takes the pieces of a walk in order (the
    resume cut's, :func:`~attn_probe.formats.cutting.cut_run` ``watch=``) and returns the snapshots
    they complete, :meth:`drain` the last ones. ``run_id=None`` then takes every run with an id, and
    ``below`` only the rows at steps below it of pieces with a readable step below it (what the cut
    back to the resume step ``below`` keeps of the run it cuts)."""

    def __init__(
        self,
        path: str | os.PathLike | None,
        run_id: str | None,
        metrics: Collection[str],
        *,
        chunk_size: int = SCAN_CHUNK,
        max_line: int = MAX_LINE,
        below: int | None = None,
    ) -> None:
        self.path, self.run_id, self.metrics = path, run_id, frozenset(metrics)
        self.chunk_size, self.max_line, self.below = chunk_size, max_line, below
        self.latest: RunKey | None = None
        self._pattern = _row_pattern(self.metrics)
        self._marks = [json.dumps(m).encode() for m in sorted(self.metrics)]  # any spelling of the row
        self._pending: dict[RunKey, tuple[int, list[Row]]] = {}

    def __iter__(self) -> Iterator[tuple[RunKey, int, list[Row]]]:
        tracker = RunTracker()
        self._pending = {}
        try:
            fh = open(self.path, "rb")  # type: ignore[arg-type]
        except FileNotFoundError:
            return
        with fh:
            for piece in pieces(fh, self.chunk_size, self.max_line, tracker):
                yield from self.feed(piece)
        yield from self.drain()
        if self.run_id is not None:
            self.latest = tracker.latest(self.run_id)

    def feed(self, piece: Piece) -> list[tuple[RunKey, int, list[Row]]]:
        """The snapshots that the next piece of the walk completes."""
        _offset, data, key, _lines, low, _high, header = piece
        if (
            header
            or key is None
            or key[0] != "run"
            or (self.run_id is not None and key[1] != self.run_id)
            or isinstance(data, Unreadable)
            or not self.metrics
            or (self.below is not None and (low is None or low >= self.below))
        ):
            return []
        done = []
        pending = self._pending
        for row in self._rows(data):
            if self.below is not None and row[0] >= self.below:
                continue
            held = pending.get(key)
            if held is not None and held[0] != row[0]:
                done.append((key, held[0], held[1]))
                held = None
            if held is None:
                held = pending[key] = (row[0], [])
            held[1].append(row)
        return done

    def drain(self) -> list[tuple[RunKey, int, list[Row]]]:
        """The snapshots still open at the end of the walk."""
        done = [(key, step, rows) for key, (step, rows) in self._pending.items()]
        self._pending = {}
        return done

    def forget(self, key: RunKey) -> None:
        """Drop the open snapshot of run ``key`` (its reader no longer follows it)."""
        self._pending.pop(key, None)

    def _rows(self, data: bytes) -> list[Row]:
        """The rows of ``metrics`` in a piece of complete lines (lines naming none are not parsed)."""
        marked = sum(data.count(mark) for mark in self._marks)
        if not marked:
            return []
        found = self._pattern.findall(b"\n" + data)
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
