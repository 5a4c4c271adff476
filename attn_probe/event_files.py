"""TensorBoard event files on disk: which files they are, and cutting a torn last record.

Shared by the TensorBoard sink (resume, recovery), the Trainer integration and the readers in
``attn_probe.analysis``. Standard library only.
"""

from __future__ import annotations

import os
import re
import struct
import time

__all__ = ["is_event_file", "event_files", "has_event_files", "truncate_torn_record", "file_identities",
           "wait_for_a_later_name"]


def is_event_file(name: str) -> bool:
    """Whether a file name is a TensorBoard event file (TensorBoard's own rule: ``tfevents`` in it)."""
    return "tfevents" in os.path.basename(name)


def event_files(log_dir: str) -> list[str]:
    """The names of the event files in ``log_dir`` itself (not below it), sorted; ``[]`` if unreadable."""
    try:
        with os.scandir(log_dir) as entries:
            return sorted(e.name for e in entries if is_event_file(e.name) and e.is_file())
    except OSError:
        return []


def has_event_files(log_dir: str) -> bool:
    """Whether ``log_dir`` itself (not below it) already holds TensorBoard event files."""
    return bool(event_files(log_dir))


#: an event file's records: uint64 length, uint32 crc of it, data, uint32 crc of the data
_RECORD_HEADER = struct.Struct("<QI")
_RECORD_OVERHEAD = _RECORD_HEADER.size + 4


def truncate_torn_record(path: str) -> int:
    """Cut a torn last record off an event file (a write that hit a full disk); returns bytes cut.

    Walks the record framing from the start (the lengths only: CRCs are the reader's job) and
    truncates the file after its last complete record. A file that cannot be read is left alone.
    """
    try:
        size = os.path.getsize(path)
        good = 0
        with open(path, "rb") as f:
            while good + _RECORD_HEADER.size <= size:
                f.seek(good)
                (length, _crc) = _RECORD_HEADER.unpack(f.read(_RECORD_HEADER.size))
                end = good + _RECORD_OVERHEAD + length
                if end > size:
                    break
                good = end
        if good < size:
            os.truncate(path, good)
        return size - good
    except OSError:
        return 0


def wait_for_a_later_name(log_dir: str) -> None:
    """Sleep (at most ~1 s) until a new event file would sort after every one in ``log_dir``.

    Event files are named ``events.out.tfevents.<seconds>.<host>.<pid>.<counter>`` and read in
    name order; the counter sorts as text (``10`` before ``9``), so a file opened in the same
    second as an older one may be read first. A reopened writer must come last.
    """
    newest = 0
    for name in event_files(log_dir):
        match = re.search(r"tfevents\.(\d+)\.", name)
        if match:
            newest = max(newest, int(match.group(1)))
    now = time.time()
    if int(now) <= newest:
        time.sleep(min(1.05, newest + 1 - now + 0.01))


def file_identities(log_dir: str, names: list[str]) -> dict[str, tuple[int, int] | None]:
    """``path -> (device, inode)`` of event files in ``log_dir`` (``None``: the path is gone)."""
    out: dict[str, tuple[int, int] | None] = {}
    for name in names:
        path = os.path.join(log_dir, name)
        try:
            st = os.stat(path)
            out[path] = (st.st_dev, st.st_ino)
        except OSError:
            out[path] = None
    return out
