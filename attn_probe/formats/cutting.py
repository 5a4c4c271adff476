"""Cutting one run of a trajectory file back to a resume step, in constant memory: :func:`cut_run`.

The file is walked in order and each line is given to its run by a
:class:`~attn_probe.formats.runs.RunTracker` (the rules the reader follows too), so the cut
drops only the rows of the run being resumed: never those of another run, of a run whose
header cannot be read, of an earlier run with the same id, or of an earlier run written
before run headers. Only the standard library is imported here (and :mod:`attn_probe.formats.logdir`
for its errors, when cutting).
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .lines import (
    HEADER_KEY,
    MAX_LINE,
    SCAN_CHUNK,
    Unreadable,
    is_int64,
    line_blocks,
    line_step,
    loads,
    parse_header,
)
from .runs import HEADER_SIGNS, MAX_HEADER, Event, RunKey, RunTracker, looks_like_header, run_labels

__all__ = ["Cut", "Piece", "cut_run", "cut_trajectory", "pieces", "run_headers"]

#: a row as the sink writes it, with what tells its value apart: step, group, layer, head, metric
_ROW = re.compile(rb'^\{"step": (-?\d{1,19}), "wall_time": [^,\n]*, "group": "([A-Za-z0-9_]{1,128})", '
                  rb'"layer": (-?\d{1,19}), "head": (null|-?\d{1,19}), "metric": "([A-Za-z0-9_]{1,128})", '
                  rb'"value": [^}\n]*\}$', re.MULTILINE)
#: the step of a line as the trajectory sink writes it, after a newline
_STEP_AFTER_NEWLINE = re.compile(rb'\n\{"step": (-?\d{1,19})[,}]')

#: a piece of the file: (offset, data, run key, lines, lowest step, highest step, is a valid header);
#: the steps are ``None`` for a line without a readable step
Piece = tuple[int, "bytes | Unreadable", "RunKey | None", int, "int | None", "int | None", bool]


def _value_of(line: bytes) -> tuple[int | None, tuple | None]:
    """``(step, value key)`` of one line: ``(step, None)`` for a line with a step that is not a
    row, ``(None, None)`` for a line without a readable step."""
    m = _ROW.match(line.rstrip(b"\n"))
    if m is not None:
        return int(m.group(1)), m.groups()[1:]
    step = line_step(line)
    rec = loads(line) if step is not None else None
    if not isinstance(rec, dict):
        return step, None
    group, layer, head, metric = rec.get("group"), rec.get("layer"), rec.get("head"), rec.get("metric")
    if not (isinstance(group, str) and isinstance(metric, str) and is_int64(layer)
            and (head is None or is_int64(head))):
        return step, None
    try:
        return step, (group.encode(), str(layer).encode(), b"null" if head is None else str(head).encode(),
                      metric.encode())
    except UnicodeEncodeError:  # a lone surrogate (JSON's "\ud800"): not a row any reader keeps
        return step, None


def _damage(line: bytes) -> str:
    """Why a header-like line is not a readable header."""
    if len(line) > MAX_HEADER:
        return f"{len(line)} bytes, over the {MAX_HEADER}-byte limit of a header"
    rec = loads(line)
    if not isinstance(rec, dict):
        return "not valid JSON"
    if HEADER_KEY not in rec:
        return f"no {HEADER_KEY} object"
    return f"its {HEADER_KEY} has no valid run_id or step"


def _header_like_lines(block: bytes) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of each line of ``block`` that looks like a header, in order."""
    pos = 0
    while True:
        found = [at for at in (block.find(s, pos) for s in HEADER_SIGNS) if at >= 0]
        if not found:
            return
        at = min(found)
        start = block.rfind(b"\n", 0, at) + 1
        stop = block.index(b"\n", at) + 1
        yield start, stop
        pos = stop


class _Walk:
    """The state of one walk through the file beside its tracker: the file (to read back the
    values of a run's rows, :meth:`fill`) and where the current header-less run's rows have not
    been added to its values seen yet (rows above the run's first step need no look at their
    values: :meth:`RunSplitter.continues`; they are read only when a later row could start a run)."""

    def __init__(self, fd: int, tracker: RunTracker, chunk_size: int, max_line: int) -> None:
        self.fd, self.tracker, self.chunk_size, self.max_line = fd, tracker, chunk_size, max_line
        self.unseen_from: int | None = None

    def fill(self, upto: int) -> None:
        """Add the values of the rows from :attr:`unseen_from` to ``upto`` to the run's values seen."""
        start, self.unseen_from = self.unseen_from, None
        if start is None:
            return
        seen = self.tracker.splitter.seen
        carry = b""
        while start < upto:
            data = os.pread(self.fd, min(self.chunk_size, upto - start), start)
            if not data:
                break
            start += len(data)
            data = carry + data
            end = data.rfind(b"\n") + 1
            carry = data[end:] if len(data) - end <= self.max_line else b""
            block = data[:end]
            rows = _ROW.findall(block)
            if len(rows) == block.count(b"\n"):
                seen.update(r[1:] for r in rows)
                continue
            for line in block.splitlines(keepends=True):
                value = _value_of(line)[1] if len(line) <= self.max_line else None
                if value is not None:
                    seen.add(value)

    def rows(self, offset: int, piece: bytes, line_no: int) -> Iterator[Piece]:
        """The pieces of a run of non-header lines: whole when its rows plainly continue the run."""
        tracker = self.tracker
        lines = piece.count(b"\n")
        # taken at once only when no line can be over max_line (else line by line, which drops it)
        steps = _STEP_AFTER_NEWLINE.findall(b"\n" + piece) if len(piece) <= self.max_line else ()
        if len(steps) == lines == piece.count(b"}\n"):
            ints = list(map(int, steps))
            if tracker.headed:
                if (tracker.last is None or ints[0] >= tracker.last) and all(map(operator.le, ints, ints[1:])):
                    key = tracker.row_step(ints[-1], line_no + lines)
                    yield offset, piece, key, lines, ints[0], ints[-1], False
                    return
            elif tracker.key is not None and min(ints) > tracker.splitter.first:
                if self.unseen_from is None:
                    self.unseen_from = offset
                yield offset, piece, tracker.key, lines, min(ints), max(ints), False
                return
            elif not tracker.headed and len(ints) > 1:
                # rows that could start a run come first (a run's first snapshot): read those one by
                # one, the rest (all above the run's first step, which only goes down) at once
                first = tracker.splitter.first if tracker.key is not None else min(ints)
                low = max(i for i, v in enumerate(ints) if v <= first) + 1
                if low < len(ints):
                    split = 0
                    for _ in range(low):
                        split = piece.index(b"\n", split) + 1
                    yield from self.rows(offset, piece[:split], line_no)
                    yield from self.rows(offset + split, piece[split:], line_no + low)
                    return
        if not tracker.headed:
            self.fill(offset)
        at, n = 0, line_no
        while at < len(piece):
            nl = piece.index(b"\n", at) + 1
            n += 1
            step, value = _value_of(piece[at:nl]) if nl - at <= self.max_line else (None, None)
            if step is None:
                key = tracker.key
            elif tracker.headed:
                key = tracker.row_step(step, n)
            elif value is None:
                key = tracker.key if tracker.key is not None else tracker.new_legacy()
            else:
                key = tracker.legacy_row(value, step)
            yield offset + at, piece[at:nl], key, 1, step, step, False
            at = nl


def pieces(fh: Any, chunk_size: int, max_line: int, tracker: RunTracker) -> Iterator[Piece]:
    """The file in order as pieces, each given to its run by ``tracker``."""
    line_no = 0  # lines before the current piece
    walk = _Walk(fh.fileno(), tracker, chunk_size, max_line)
    for offset, block in line_blocks(fh, chunk_size, max_line):
        if isinstance(block, Unreadable):
            line_no += 1
            key = tracker.key
            if not block.torn and looks_like_header(block.head):
                key = tracker.unreadable_header(
                    line_no, f"{block.size} bytes, over the {max_line}-byte limit of a line", long=True)
            yield offset, block, key, 1, None, None, False
            continue
        start = 0
        for line_start, line_stop in _header_like_lines(block):
            if line_start > start:
                yield from walk.rows(offset + start, block[start:line_start], line_no)
                line_no += block.count(b"\n", start, line_start)
            line = block[line_start:line_stop]
            line_no += 1
            header = parse_header(loads(line)) if len(line) <= MAX_HEADER else None
            if header is not None:
                key = tracker.header(header.run_id, header.step, header.resumed, line_no)
                yield offset + line_start, line, key, 1, header.step, header.step, True
            else:
                key = tracker.unreadable_header(line_no, _damage(line), long=len(line) > MAX_HEADER)
                yield offset + line_start, line, key, 1, None, None, False
            start = line_stop
        if start < len(block):
            yield from walk.rows(offset + start, block[start:], line_no)
            line_no += block.count(b"\n", start)
    tracker.end()


def _scan(fh: Any, resume_step: int, target: RunKey | None, chunk_size: int,
          max_line: int) -> Iterator[tuple[int, bytes | Unreadable, bool, int]]:
    """``(offset, data, keep, lines)`` covering the file in order (``data`` empty when dropped).

    Rows of the run ``target`` are dropped from ``resume_step`` on, with that run's lines without
    a readable step and its headers at or past it; every line of every other run is kept as it
    is (a line over ``max_line`` bytes as :class:`Unreadable`: copied, never held). A torn last
    line is dropped.
    """
    for offset, data, key, lines, low, high, _header in pieces(fh, chunk_size, max_line, RunTracker()):
        if isinstance(data, Unreadable):
            keep = not data.torn and key != target
            yield offset, data if keep else b"", keep, 1
        elif key != target:
            yield offset, data, True, lines
        elif low is None or high is None:
            yield offset, b"", False, lines
        elif high < resume_step or low >= resume_step:
            keep = high < resume_step
            yield offset, data if keep else b"", keep, lines
        else:  # rows on both sides of the resume step: line by line
            at = 0
            while at < len(data):
                nl = data.index(b"\n", at) + 1
                step = line_step(data[at:nl])
                keep = step is not None and step < resume_step
                yield offset + at, data[at:nl] if keep else b"", keep, 1
                at = nl


class _Drops:
    """What :func:`_scan` would drop for each run of the file were it the one cut, gathered on the
    first walk: the first line dropped, the lines dropped, the end of its last line kept, and the end
    of each run's last line (kept when another run is cut). A file whose lines after the first
    dropped one are all dropped too is then cut in place without a second walk."""

    def __init__(self, resume_step: int) -> None:
        self.resume_step = resume_step
        self.first: dict[RunKey, int] = {}  # first offset dropped, were the run cut
        self.lines: dict[RunKey, int] = {}  # lines dropped, were the run cut
        self.kept_end: dict[RunKey, int] = {}  # end of its last line kept, were the run cut
        self.end: dict[RunKey | None, int] = {}  # end of its last line (kept when another run is cut)
        self.torn: int | None = None  # offset of a torn last line (dropped whichever run is cut)

    def _drop(self, key: RunKey, offset: int, lines: int) -> None:
        self.first.setdefault(key, offset)
        self.lines[key] = self.lines.get(key, 0) + lines

    def add(self, piece: Piece) -> None:
        offset, data, key, lines, low, high, _header = piece
        if isinstance(data, Unreadable) and data.torn:
            self.torn = offset
            return
        end = offset + (data.size if isinstance(data, Unreadable) else len(data))
        self.end[key] = end
        if key is None:
            return
        if isinstance(data, Unreadable) or low is None or high is None or low >= self.resume_step:
            self._drop(key, offset, lines)
        elif high < self.resume_step:
            self.kept_end[key] = end
        else:  # rows on both sides of the resume step: line by line, as _scan
            at = 0
            while at < len(data):
                nl = data.index(b"\n", at) + 1
                step = line_step(data[at:nl])
                if step is not None and step < self.resume_step:
                    self.kept_end[key] = offset + nl
                else:
                    self._drop(key, offset + at, 1)
                at = nl

    def plan(self, target: RunKey) -> tuple[int | None, int, bool]:
        """``(offset of the first line dropped, lines dropped, whether a kept line follows it)`` when
        ``target`` is cut (``None``: nothing dropped)."""
        starts = [at for at in (self.first.get(target), self.torn) if at is not None]
        if not starts:
            return None, 0, False
        cut = min(starts)
        dropped = self.lines.get(target, 0) + (self.torn is not None)
        later = self.kept_end.get(target, 0) > cut or any(
            end > cut for key, end in self.end.items() if key != target)
        return cut, dropped, later


@dataclass(frozen=True)
class Cut:
    """What :func:`cut_run` did: lines dropped, the id of the run cut (``None``: a run without
    one, or none cut), whether that run was the one asked for, and how many other runs the file
    keeps. ``events`` are what the file's reading found on the way (lines of run headers that
    cannot be read, ids used by two runs, steps going back without a header: the first few, with
    their line numbers; :class:`~attn_probe.formats.runs.Event`); ``unidentified`` is how many runs
    written before run headers it holds; ``last_unreadable`` whether the file's last run is one
    whose header cannot be read (nothing of it is cut)."""

    dropped: int
    run_id: str | None
    found: bool
    other_runs: int
    events: tuple[Event, ...] = ()
    unidentified: int = 0
    last_unreadable: bool = False
    #: the run cut, as the file's walk keys it (``None``: none cut), and whether the file was rewritten
    #: (kept lines after dropped ones) rather than cut in place or left as it was
    target: RunKey | None = None
    rewritten: bool = False


def _copy(src: int, dst: int, offset: int, size: int) -> None:
    """Copy ``size`` bytes of ``src`` from ``offset`` to the end of ``dst``, a chunk at a time."""
    while size > 0:
        data = os.pread(src, min(size, SCAN_CHUNK), offset)
        if not data:
            raise OSError(0, "the file shrank while it was being cut")
        view = memoryview(data)
        while view:
            view = view[os.write(dst, view):]
        offset += len(data)
        size -= len(data)


def cut_run(path: str | os.PathLike, resume_step: int, run_id: str | None = None, *,
            otherwise: str = "last", chunk_size: int = SCAN_CHUNK, max_line: int = MAX_LINE,
            watch: Callable[[Piece], Any] | None = None) -> Cut:
    """Drop one run's lines at ``step >= resume_step`` from a trajectory file, in constant memory.

    The run cut is the latest run of ``run_id`` when the file holds a header of it; else, by
    ``otherwise``: ``"last"`` the file's last run (nothing when that run's header cannot be read;
    in a file without headers, the last of its runs, told apart by their steps starting again),
    ``"unidentified"`` the last run of rows before the first header (a run resumed from a
    checkpoint written before run ids), ``"none"`` no run (a new run: nothing of it is in the
    file). Which line belongs to which run follows :mod:`attn_probe.formats.runs`. Every line of
    every other run is kept byte for byte (a line over ``max_line`` bytes is copied without being
    held). Also dropped: that run's lines without a readable step, its lines over ``max_line``
    bytes, a torn last line. When every kept line comes before the first dropped one the file is
    cut at that line's byte offset in place (no free space needed); otherwise the kept lines are
    streamed into a temporary file beside it, which replaces it (and is removed if that fails). A
    missing file cuts nothing. Every failure is a :class:`~attn_probe.formats.logdir.LogDirError` naming
    the file and the cause. ``chunk_size`` (bytes read at once) and ``max_line`` bound the memory
    used, as in :func:`~attn_probe.formats.trajectory.file_runs`.

    The file is walked once to find the run and what to drop, and cut in place from what that walk
    found; only a file that must be rewritten is walked again. ``watch`` is called with each
    :data:`Piece` of that first walk, in order (the resume's alert replay reads its rows there:
    :mod:`attn_probe.formats.run_rows`); ``Cut.target`` then names the run cut as the walk keyed it.
    """
    from .logdir import LogDirError, check_log_dir, log_dir_error, os_error_reason

    path = os.fspath(path)
    resume_step = int(resume_step)
    if otherwise not in ("last", "unidentified", "none"):
        raise ValueError(f"otherwise must be 'last', 'unidentified' or 'none', got {otherwise!r}")

    def failed(exc: BaseException) -> LogDirError:
        reason = "out of memory" if isinstance(exc, MemoryError) else os_error_reason(exc) \
            if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        return log_dir_error(f"attn_probe cannot cut its trajectory file {path!r} back to the resume step "
                             f"{resume_step}: {reason}. The run's earlier steps are untouched; free the cause "
                             "or resume with a fresh log_dir=", getattr(exc, "errno", None))

    tmp: str | None = None
    try:
        if not os.path.lexists(path):
            return Cut(0, run_id, False, 0)
        tracker = RunTracker()
        drops = _Drops(resume_step)
        with open(path, "rb") as fh:
            for piece in pieces(fh, chunk_size, max_line, tracker):
                drops.add(piece)
                if watch is not None:
                    watch(piece)
        latest = tracker.latest(run_id) if run_id is not None else None
        found = latest is not None
        last_unreadable = tracker.key is not None and tracker.key[0] == "unknown"
        target: RunKey | None
        if found:
            target = latest
        elif otherwise == "last":
            target = None if last_unreadable else tracker.key
        elif otherwise == "unidentified":
            target = tracker.last_legacy
        else:
            target = None
        name = run_id if found else target[1] if target is not None and target[0] == "run" else None

        def result(dropped: int, rewritten: bool = False) -> Cut:
            return Cut(dropped, name, found,
                       tracker.runs - (1 if target is not None else 0), tuple(tracker.events),
                       tracker.last_legacy[1] if tracker.last_legacy else 0, last_unreadable,
                       target, rewritten)

        if target is None:
            return result(0)
        cut, dropped, rewrite = drops.plan(target)
        if cut is None:
            return result(0)
        if not rewrite:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.ftruncate(fd, cut)
                os.fsync(fd)
            finally:
                os.close(fd)
            return result(dropped)
        check_log_dir(os.path.dirname(path) or ".", need_bytes=os.path.getsize(path))
        tmp = f"{path}.tmp{os.getpid()}"
        dropped = 0
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with open(path, "rb") as fh:
                for offset, data, keep, lines in _scan(fh, resume_step, target, chunk_size, max_line):
                    if not keep:
                        dropped += lines
                    elif isinstance(data, Unreadable):
                        _copy(fh.fileno(), fd, offset, data.size)
                    else:
                        view = memoryview(data)
                        while view:
                            view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = None
        return result(dropped, rewritten=True)
    except LogDirError:
        raise
    except (OSError, MemoryError) as exc:
        raise failed(exc) from exc
    finally:
        if tmp is not None:
            try:
                os.remove(tmp)
            except OSError:
                pass


def cut_trajectory(path: str | os.PathLike, resume_step: int, *, chunk_size: int = SCAN_CHUNK,
                   max_line: int = MAX_LINE) -> int:
    """:func:`cut_run` of the file's last run; returns the number of lines dropped."""
    return cut_run(path, resume_step, chunk_size=chunk_size, max_line=max_line).dropped


def run_headers(path: str | os.PathLike, *, chunk_size: int = SCAN_CHUNK,
                max_line: int = MAX_LINE) -> dict[str, dict[str, Any]]:
    """``{run label: run_header object}`` of every run of a trajectory file with a readable header:
    its first header's, keyed by the label the readers show in ``run_id``
    (:func:`attn_probe.formats.runs.run_labels`). The file is walked as the readers and the resume
    cut walk it (:class:`~attn_probe.formats.runs.RunTracker`), in constant memory: a run's
    header is never given to another run. ``{}`` for a missing file."""
    path = os.fspath(path)
    keys: list[RunKey] = []
    ids: list[str | None] = []
    first: dict[RunKey, dict[str, Any]] = {}
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return {}
    with fh:
        for _offset, data, key, _lines, _low, _high, is_header in pieces(fh, chunk_size, max_line, RunTracker()):
            if not is_header or key is None or key in first or not isinstance(data, bytes):
                continue
            rec = loads(data)
            header = rec.get(HEADER_KEY) if isinstance(rec, dict) else None
            if not isinstance(header, dict):  # pragma: no cover - a valid header has it
                continue
            first[key] = header
            keys.append(key)
            ids.append(key[1] if key[0] == "run" else str(header.get("run_id")))
    return {label: first[key] for key, label in zip(keys, run_labels(keys, ids), strict=True) if label is not None}
