"""The lossless trajectory sink: ``attn_probe.jsonl`` beside the event files.

Schema: :mod:`attn_probe.trajectory_format` (one JSON object per value). Snapshots are
appended with ``os.write`` and fsync'd; the snapshots waiting in the sink's lane go out in one
write and one fsync (:meth:`TrajectorySink.log_batch`), so a crash loses at most the
snapshots being written. It is a ``lossless`` sink: when its lane is full the training thread
waits (bounded) for room instead of dropping a snapshot (:mod:`attn_probe.sinks.dispatch`).

The file only ever holds complete lines:

* a write that fails (a full disk) is rolled back: the file is truncated to its size before
  that snapshot, so a failed snapshot leaves no partial line;
* opening the file (at start, and when :meth:`TrajectorySink.recover` reopens it after a
  failure) cuts a torn last line left by a crash;
* a file deleted or replaced under the open handle (a cleanup removing the run directory, a
  tmp reaper, the file moved away) is noticed at the next snapshot, before and after it is
  written (``os.fstat`` of the handle against ``os.stat`` of the path: the path missing,
  another inode there, or no link left), and the file is recreated at its path (its directory
  too, and the directory's lock, :func:`attn_probe.logdir.restore_lock`); a snapshot that went
  into the deleted file is written again into the new one. One warning per incident says what
  the file held that went with it and from which step the new file holds the trajectory;
* on resume, rows with ``step >= resume_step`` (and unreadable lines) are dropped first, so
  steps stay unique and ordered (:func:`attn_probe.logdir.cut_trajectory`: one chunked scan in
  constant memory; when the kept rows are a prefix of the file, the usual case, it is cut in
  place at the first dropped line's byte offset, which needs no free space; otherwise the kept
  rows are streamed into a temporary file that is removed again if the write fails; every
  failure a :class:`~attn_probe.logdir.LogDirError`).
"""

from __future__ import annotations

import json
import os

from ..isolation import safe_warn
from ..logdir import cut_trajectory
from ..trajectory_format import FIELDS, TRAJECTORY_FILENAME, encode_value
from . import RunInfo, Sink, Snapshot

__all__ = ["TrajectorySink", "last_complete_line_end"]

_CHUNK = 1 << 16


def last_complete_line_end(fd: int) -> int:
    """Offset just past the last ``\\n`` of the file behind ``fd`` (0 when it has none)."""
    end = os.fstat(fd).st_size
    pos = end
    while pos > 0:
        start = max(0, pos - _CHUNK)
        chunk = os.pread(fd, pos - start, start)
        i = chunk.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0


def _identity(path: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``path``, ``None`` when it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class TrajectorySink(Sink):
    """Append one JSON line per value to ``<log_dir>/attn_probe.jsonl``."""

    background = True
    lossless = True

    def __init__(self, log_dir: str, filename: str = TRAJECTORY_FILENAME) -> None:
        self.path = os.path.join(log_dir, filename)
        self._fd: int | None = None
        self._size = 0  # bytes of complete lines in the file
        # what this sink wrote into the file now open (named when the file is deleted under it)
        self._inherited = False  # it held rows when opened (an earlier run, the part before a resume)
        self._written: tuple[int, int, int] | None = None  # (first step, last step, snapshots)
        #: how many times the file was found deleted or replaced and recreated
        self.recreated = 0

    def directory(self) -> str:
        return os.path.dirname(self.path) or "."

    def start(self, run: RunInfo) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if run.resume_step is not None:
            cut_trajectory(self.path, run.resume_step)
        elif os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            safe_warn(
                f"attn_probe: {self.path} already holds a trajectory; this run starts again at step 0 "
                "and its rows are appended after the old ones. Use a fresh log_dir for a new run.",
                stacklevel=2,
            )
        self._open()

    def _open(self) -> None:
        """Open for appending and cut a torn last line, so the next row starts on a line of its own."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            reader = os.open(self.path, os.O_RDONLY)
            try:
                good = last_complete_line_end(reader)
                if good < os.fstat(reader).st_size:
                    os.ftruncate(fd, good)
            finally:
                os.close(reader)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._size = fd, good
        self._inherited, self._written = good > 0, None
        self._dir_id = _identity(os.path.dirname(self.path) or ".")

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def log(self, snapshot: Snapshot) -> None:
        self.log_batch([snapshot])

    def log_batch(self, snapshots: list[Snapshot]) -> None:
        """Append the snapshots' rows in one write and one fsync (all of them, or none)."""
        if self._fd is None:
            raise RuntimeError("TrajectorySink.log() before start() or after a failure it could not undo")
        lines = []
        for snapshot in snapshots:
            for r in snapshot.records:
                row = dict(zip(FIELDS, (snapshot.step, snapshot.wall_time, r.group, r.layer, r.head,
                                        r.metric, encode_value(r.value)), strict=True))
                lines.append(json.dumps(row, allow_nan=False) + "\n")
        data = "".join(lines).encode("utf-8")
        step, last = snapshots[0].step, snapshots[-1].step
        self._reopen_if_detached(step)
        self._append(data)
        if self._reopen_if_detached(step):  # deleted while these snapshots were written: again
            self._append(data)
        first, _, count = self._written or (step, step, 0)
        self._written = (first, last, count + len(snapshots))

    def _append(self, data: bytes) -> None:
        assert self._fd is not None
        try:
            _write_all(self._fd, data)
            os.fsync(self._fd)
        except BaseException:
            self._roll_back()
            raise
        self._size += len(data)

    def _detached(self) -> str | None:
        """How the open file left its path (``None`` while it is still there): one fstat, one stat."""
        assert self._fd is not None
        try:
            held = os.fstat(self._fd)
        except OSError:
            return None
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            there = None
        except OSError:  # cannot tell (permissions): leave it
            return None
        if there is not None and os.path.samestat(held, there):
            return "was deleted" if held.st_nlink == 0 else None
        deleted = held.st_nlink == 0
        if _identity(os.path.dirname(self.path) or ".") != self._dir_id:  # gone, or made again since
            return "was deleted together with its directory" if deleted else "was moved away with its directory"
        if there is None:
            return "was deleted" if deleted else "was moved away"
        return "was deleted and another file now stands at its path" if deleted else "was replaced by another file"

    def _reopen_if_detached(self, step: int) -> bool:
        """Recreate the file (and its directory) at its path if the open one left it; warn what went."""
        how = self._detached()
        if how is None:
            return False
        gone = self._nlink() == 0
        held = self._held_text()
        fate = "are lost" if gone else "are no longer at that path"
        self._close_fd()
        directory = os.path.dirname(self.path) or "."
        try:
            made_dir = not os.path.isdir(directory)
            os.makedirs(directory, exist_ok=True)
            self._open()
        except OSError as exc:
            raise OSError(exc.errno, f"{self.path} {how} while written; the rows it held ({held}) {fate}; "
                          f"recreating it failed: {exc.strerror or exc}") from exc
        self.recreated += 1
        from ..logdir import restore_lock

        lock_note = ""
        if restore_lock(directory) is False:  # a no-op while the lock file is still in place
            lock_note = (" The directory's lock file went too and could not be locked again (another "
                         "writer took it?): a second writer would not be refused now.")
        others = (" The other files of the directory (TensorBoard's event files) went with it."
                  if how.endswith("with its directory") else "")
        where = ("appended to the file now at that path, after the rows it already holds" if self._inherited
                 else "in a new file at that path" + (" (its directory recreated)" if made_dir else ""))
        safe_warn(f"attn_probe: the trajectory file {self.path} {how} while this run was writing it; the rows "
                  f"it held, {held}, {fate}. Logging resumed at step {step}, {where}; training was not "
                  f"affected.{others}{lock_note}", stacklevel=2)
        return True

    def _nlink(self) -> int:
        try:
            return os.fstat(self._fd).st_nlink if self._fd is not None else 0
        except OSError:
            return 0

    def _held_text(self) -> str:
        """What the open file held, as named in the warning."""
        parts = []
        if self._written is not None:
            first, last, count = self._written
            parts.append(f"this run's step {first}" if count == 1 else
                         f"this run's steps {first} to {last} ({count} snapshots)")
        if self._inherited:
            parts.append("the rows from before this run")
        return " and ".join(parts) if parts else "no rows yet"

    def _roll_back(self) -> None:
        """Truncate to the size before the failed snapshot; if that fails too, close (recover reopens)."""
        try:
            assert self._fd is not None
            os.ftruncate(self._fd, self._size)
        except (OSError, AssertionError):
            self._close_fd()

    def recover(self) -> None:
        """Reopen the file after a failure (its directory too, if it went), cutting any torn line."""
        self._close_fd()
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._open()

    def finish(self) -> None:
        self._close_fd()
