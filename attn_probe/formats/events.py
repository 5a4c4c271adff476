"""TensorBoard event files on disk: which files they are, their record framing, cutting a torn
last record and checking every record's checksums.

The one home of the event-file framing (TFRecord: u64 length, masked CRC-32C of the length, data,
masked CRC-32C of the data, all little-endian). Shared by the TensorBoard sink (resume, recovery),
the Trainer integration and the readers in ``attn_probe.analysis``. Standard library at import;
:func:`scan_event_file` imports numpy and TensorBoard's CRC when called.
"""

from __future__ import annotations

import os
import re
import struct
import time
from typing import Any

__all__ = ["is_event_file", "event_files", "has_event_files", "truncate_torn_record", "file_identities",
           "wait_for_a_later_name", "scan_event_file", "crc_tools", "masked_crc32c_many"]


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
_CRC = struct.Struct("<I")
#: bytes of a record besides its data
_FRAME = _RECORD_HEADER.size + _CRC.size


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
                end = good + _FRAME + length
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


# --------------------------------------------------------------------------------------------
# Checking every record's checksums (the readers: TensorBoard's loader stops silently at a bad one)
# --------------------------------------------------------------------------------------------

#: bytes of the file checked at once
_WINDOW = 32 << 20
#: records of one length checked together with numpy; fewer go through TensorBoard's crc
_BATCH_MIN = 16


def crc_tools() -> tuple[Any, Any]:
    """TensorBoard's own ``masked_crc32c`` (its event writer uses it) and its CRC-32C table."""
    import numpy as np
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as tb

    return tb.masked_crc32c, np.asarray(tb.CRC_TABLE, dtype=np.uint32)


def masked_crc32c_many(buf: Any, starts: Any, length: int, table: Any) -> Any:
    """Masked CRC-32C of ``buf[s:s+length]`` for every ``s`` in ``starts``, vectorised over
    the records (one numpy step per byte position), as TensorBoard's ``masked_crc32c``."""
    import numpy as np

    crc = np.full(len(starts), 0xFFFFFFFF, dtype=np.uint32)
    for j in range(length):
        crc = table[(crc ^ buf[starts + j]) & 0xFF] ^ (crc >> 8)
    crc ^= np.uint32(0xFFFFFFFF)
    return (((crc >> 15) | (crc << 17)) + np.uint32(0xA282EAD8)).astype(np.uint32)


def _first_bad_record(buf: Any, rel: Any, lengths: Any, tools: tuple[Any, Any]) -> tuple[int, str] | None:
    """``(index, problem)`` of the first record in ``buf`` (at offsets ``rel``) whose length
    or data fails its checksum, or ``None``."""
    import numpy as np

    masked_crc32c, table = tools
    stored = lambda at: (buf[at].astype(np.uint32) | (buf[at + 1].astype(np.uint32) << 8)  # noqa: E731
                         | (buf[at + 2].astype(np.uint32) << 16) | (buf[at + 3].astype(np.uint32) << 24))
    n = len(rel)
    bad_len = masked_crc32c_many(buf, rel, 8, table) != stored(rel + 8)
    bad_data = np.zeros(n, dtype=bool)
    data_at, crc_at = rel + _RECORD_HEADER.size, rel + _RECORD_HEADER.size + lengths
    for length in np.unique(lengths):
        idx = np.nonzero(lengths == length)[0]
        if len(idx) >= _BATCH_MIN:
            bad_data[idx] = masked_crc32c_many(buf, data_at[idx], int(length), table) != stored(crc_at[idx])
        else:
            for i in idx:
                a = int(data_at[i])
                bad_data[i] = masked_crc32c(buf[a:a + int(length)].tobytes()) != int(stored(crc_at[i:i + 1])[0])
    first_len = int(np.argmax(bad_len)) if bad_len.any() else n
    first_data = int(np.argmax(bad_data)) if bad_data.any() else n
    if first_len == n and first_data == n:
        return None
    if first_len <= first_data:
        return first_len, "record length fails its checksum"
    return first_data, "record data fails its checksum"


def _zero_tail(fh: Any, off: int) -> bool:
    fh.seek(off)
    while chunk := fh.read(1 << 20):
        if chunk.strip(b"\0"):
            return False
    return True


def scan_event_file(path: str | os.PathLike) -> tuple[int, str] | None:
    """Check the record framing of an event file to its end: ``(byte offset, what is wrong)``
    of the first corrupt record, or ``None`` when every record is intact.

    TensorBoard's loader stops at a corrupt record (and says so only at debug level), so
    everything after that offset is lost to it. A torn last record (a file still being
    written, or cut by a crash) is not corruption, and neither is an all-zero tail (a
    crash after the file grew but before its data reached the disk). Checksums are TensorBoard's
    masked CRC-32C, computed with numpy over many records at once.
    """
    import numpy as np

    tools = crc_tools()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        # walk the framing: where each record starts and how long its data is
        offsets: list[int] = []
        lengths: list[int] = []
        off = 0
        tail: bytes | None = None  # header of a last record that runs past the end
        while off + _RECORD_HEADER.size <= size:
            fh.seek(off)
            head = fh.read(_RECORD_HEADER.size)
            if len(head) < _RECORD_HEADER.size:
                break
            length = _RECORD_HEADER.unpack(head)[0]
            if off + _FRAME + length > size:
                tail = head
                break
            offsets.append(off)
            lengths.append(length)
            off += _FRAME + length
        # check the records window by window; the first bad one is reported
        offs, lens = np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        ends = offs + _FRAME + lens
        i = 0
        while i < len(offs):
            j = max(i + 1, int(np.searchsorted(ends, offs[i] + _WINDOW, side="right")))
            fh.seek(int(offs[i]))
            raw = fh.read(int(ends[j - 1] - offs[i]))
            if len(raw) < ends[j - 1] - offs[i]:
                return None  # the file shrank while we read it
            found = _first_bad_record(np.frombuffer(raw, dtype=np.uint8), offs[i:j] - offs[i], lens[i:j], tools)
            if found is not None:
                bad_off = int(offs[i + found[0]])
                return None if _zero_tail(fh, bad_off) else (bad_off, found[1])
            i = j
        if tail is not None and tools[0](tail[:8]) != _CRC.unpack(tail[8:])[0]:
            # not a torn record: its length is garbage
            return None if _zero_tail(fh, off) else (off, "record length fails its checksum")
    return None
