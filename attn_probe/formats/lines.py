"""Reading a trajectory file's lines back in bounded memory, and what a header record says.

The lowest layer of :mod:`attn_probe.formats`: complete lines a chunk at a time
(:func:`line_blocks`, whatever a line claims: a line over ``max_line`` bytes is skipped through
and reported as :class:`Unreadable`), the step of a row, and :func:`parse_header`. Used by the
format module (:mod:`attn_probe.formats.trajectory`, which re-exports these names), the run rules
(:mod:`attn_probe.formats.runs`), the cut (:mod:`attn_probe.formats.cutting`) and the readers.
Only the standard library is imported here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["HEADER_KEY", "MAX_LINE", "SCAN_CHUNK", "RunHeader", "Unreadable", "is_int64", "line_blocks",
           "line_step", "loads", "parse_header"]

#: the key of a header record's run object
HEADER_KEY = "run_header"
#: the longest run id a reader accepts (ours are 32 hex digits)
MAX_ID = 128


@dataclass(frozen=True)
class Unreadable:
    """A part of the file no reader holds: a line of ``size`` bytes over the readable length, or
    a torn last line (``torn``); ``head`` is its first bytes (to tell a header from a row)."""

    size: int
    torn: bool = False
    head: bytes = b""


@dataclass(frozen=True)
class RunHeader:
    """What a header record says about the run whose rows follow it."""

    run_id: str
    step: int
    resumed: bool = False
    parent_run: str | None = None
    parent_step: int | None = None


def is_int64(v: Any) -> bool:
    """Whether ``v`` is an int (not a bool) within int64."""
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def _is_id(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_ID and v.isprintable()


def parse_header(rec: Any) -> RunHeader | None:
    """The :class:`RunHeader` of a decoded line, or ``None`` when it is not a valid header record."""
    if not isinstance(rec, dict):
        return None
    run = rec.get(HEADER_KEY)
    step = rec.get("step")
    if not isinstance(run, dict) or not is_int64(step) or not _is_id(run.get("run_id")):
        return None
    parent, parent_step = run.get("parent_run"), run.get("parent_step")
    return RunHeader(run["run_id"], step, run.get("resumed") is True,
                     parent if _is_id(parent) else None, parent_step if is_int64(parent_step) else None)


def loads(line: bytes) -> Any:
    """``json.loads`` that fails with ``None`` on anything (deep nesting, huge numbers, ...)."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError, OverflowError, TypeError, MemoryError):
        return None


#: bytes read at once while scanning the trajectory file (default of ``chunk_size=``)
SCAN_CHUNK = 4 << 20
#: a line longer than this is unreadable (dropped, skipped through without holding it); default
#: of ``max_line=``
MAX_LINE = 16 << 20
#: the first bytes of an overlong line kept to tell a header from a row
_HEAD = 4096
#: the step of a line as the trajectory sink writes it (``{"step": 12, "wall_time": ...``)
_STEP_AT_START = re.compile(rb'\{"step": (-?\d{1,19})[,}]')


def line_step(line: bytes) -> int | None:
    """The step of one complete row, or ``None`` when it has none (torn, corrupt, no ``step``)."""
    m = _STEP_AT_START.match(line)
    if m is not None and line.endswith(b"}\n"):
        return int(m.group(1))
    rec = loads(line)
    step = rec.get("step") if isinstance(rec, dict) else None
    return step if is_int64(step) else None


def line_blocks(fh: Any, chunk_size: int = SCAN_CHUNK, max_line: int = MAX_LINE, *,
                keep_torn: bool = False) -> Iterator[tuple[int, bytes | Unreadable]]:
    """``(offset, block)`` of complete lines of a binary file, in order, reading ``chunk_size``
    bytes at once; ``(offset, Unreadable)`` for an unreadable part: a line over ``max_line`` bytes
    (skipped through without holding it; its size and first bytes are kept) or a torn last line.
    With ``keep_torn`` a torn last line that is not blank is yielded as it is (the readers count
    it as a corrupt line)."""
    offset = 0  # file offset of the first byte not yielded yet
    parts: list[bytes] = []  # the start of a line read so far (joined once its end is read: linear time)
    pending = 0  # bytes in ``parts``
    long_at: int | None = None  # the offset of the overlong line being skipped through
    long_head = b""
    while True:
        chunk = fh.read(chunk_size)
        if not chunk:
            break
        if long_at is not None:
            nl = chunk.find(b"\n")
            if nl < 0:
                offset += len(chunk)
                continue
            offset += nl + 1
            yield long_at, Unreadable(offset - long_at, False, long_head)
            chunk, long_at = chunk[nl + 1:], None
            if not chunk:
                continue
        end = chunk.rfind(b"\n") + 1
        if end == 0:
            if pending + len(chunk) > max_line:  # inside a line over max_line: skip through it
                long_at, long_head = offset, _head(parts + [chunk])
                offset += pending + len(chunk)
                parts, pending = [], 0
            else:
                parts.append(chunk)
                pending += len(chunk)
            continue
        block = b"".join([*parts, chunk[:end]]) if parts else chunk[:end]
        yield offset, block
        offset += len(block)
        rest = chunk[end:]
        parts, pending = ([rest], len(rest)) if rest else ([], 0)
    if long_at is not None:
        yield long_at, Unreadable(offset - long_at, True, long_head)
    elif parts:  # a torn last line
        buf = b"".join(parts)
        if not keep_torn:
            yield offset, Unreadable(len(buf), True, buf[:_HEAD])
        elif buf.strip():
            yield offset, buf


def _head(parts: list[bytes]) -> bytes:
    """The first :data:`_HEAD` bytes of the concatenation of ``parts``."""
    out, size = [], 0
    for part in parts:
        out.append(part[:_HEAD - size])
        size += len(out[-1])
        if size >= _HEAD:
            break
    return b"".join(out)
