"""The lossless trajectory sink: ``attn_probe.jsonl`` beside the event files.

Schema: :mod:`attn_probe.formats.trajectory` (one JSON object per value). Snapshots are
appended with ``os.write`` and fsync'd; the snapshots waiting in the sink's lane go out in one
write and one fsync (:meth:`TrajectorySink.log_batch`), so a crash loses at most the
snapshots being written. It is a ``lossless`` sink: when its lane is full the training thread
waits (bounded) for room instead of dropping a snapshot (:mod:`attn_probe.sinks.dispatch`).

One writer only: the sink holds an exclusive ``flock`` on the file for its life
(:func:`attn_probe.formats.writer_lock.lock_writer`; :meth:`TrajectorySink.claim`, taken before the
resume cut and, by the probe, before any sink of the directory starts), so a second writer is
refused with :class:`~attn_probe.formats.logdir.LogDirInUseError` even when the directory's lock
file was deleted (a temp-file reaper).

The file only ever holds complete lines:

* a write that fails (a full disk) is rolled back: the file is truncated to its size before
  that snapshot, so a failed snapshot leaves no partial line;
* opening the file (at start, and when :meth:`TrajectorySink.recover` reopens it after a
  failure) cuts a torn last line left by a crash;
* a file deleted or replaced under the open handle (a cleanup removing the run directory, a
  tmp reaper, the file moved away) is noticed at the next snapshot, before and after it is
  written (``os.fstat`` of the handle against ``os.stat`` of the path: the path missing,
  another inode there, or no link left), and the file is recreated at its path (its directory
  too, and the directory's lock, :func:`attn_probe.formats.logdir.restore_lock`); a snapshot that went
  into the deleted file is written again into the new one. One warning per incident says what
  the file held that went with it and from which step the new file holds the trajectory;
* each run begins its rows with a run header record (:func:`attn_probe.formats.trajectory.encode_header`):
  its run id (``run_id`` of the run's configuration, as the Trainer callback passes it from the
  checkpoint, else a fresh random id; a resume without one continues the file's last run), the
  start step and time, the configuration and model summary, and a branched run's parent; a file
  recreated after a deletion gets one again;
* on resume, that run's rows with ``step >= resume_step`` (and its unreadable lines) are
  dropped first, so its steps stay unique and ordered; every other run in the file is kept byte
  for byte (:func:`attn_probe.formats.trajectory.cut_run`: one chunked scan in constant memory;
  when the kept rows are a prefix of the file, the usual case, it is cut in place at the first
  dropped line's byte offset, which needs no free space; otherwise the kept rows are streamed
  into a temporary file that is removed again if the write fails; every failure a
  :class:`~attn_probe.formats.logdir.LogDirError`). One warning line says what was cut from which run.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any

from ..formats.runs import describe_events
from ..formats.trajectory import TRAJECTORY_FILENAME, cut_run, encode_header, encode_rows, new_run_id
from ..isolation import safe_warn
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


#: the sinks holding their file's lock in this process (see :func:`_let_go_in_child`)
_HOLDERS: weakref.WeakSet[TrajectorySink] = weakref.WeakSet()


def _let_go_in_child() -> None:
    """In a forked child (a DataLoader worker): close the inherited descriptors of the files this
    process writes. A ``flock`` belongs to the open file, which a fork shares: a child keeping it
    would hold the writer's lock after its parent let it go (a new probe in the same directory
    refused while persistent workers live). Closing the child's copy leaves the parent's lock held."""
    for sink in list(_HOLDERS):
        fd, sink._fd = sink._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_let_go_in_child)


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
        #: the id of the run this sink writes (set at start; recorded in its header records)
        self.run_id: str | None = None
        self._header: dict[str, Any] = {}
        self._start_step = 0
        #: a reader of the resume cut's walk (``watch(piece)``, then ``finish(path, cut, run_id)``): the
        #: alert replay reads its rows there (:meth:`~attn_probe.live.stages.alerting.Alerting.resume_watch`)
        self.watch: Any = None

    def directory(self) -> str:
        return os.path.dirname(self.path) or "."

    def claim(self) -> None:
        """Hold the file against a second writer from now on (:func:`~attn_probe.formats.writer_lock.lock_writer`):
        raises :class:`~attn_probe.formats.logdir.LogDirInUseError` while another writer holds it.
        :meth:`start` claims it where this was not called; :meth:`finish` lets it go."""
        from ..formats.writer_lock import lock_writer

        if self._fd is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._fd = lock_writer(self.path)
            _HOLDERS.add(self)

    def start(self, run: RunInfo) -> None:
        self.claim()
        try:
            self._start(run)
        except BaseException:
            self._close_fd()
            raise

    def _start(self, run: RunInfo) -> None:
        config = dict(run.config or {})
        given = config.get("run_id") if isinstance(config.get("run_id"), str) and config.get("run_id") else None
        resumed = run.resume_step is not None
        if resumed:
            # a run id given but not in the file: a new (branched) run, or one resumed from a checkpoint
            # written before run ids (``continues_unidentified``), whose rows have no header
            otherwise = "last" if given is None else "unidentified" if config.get("continues_unidentified") \
                else "none"
            watch, self.watch = self.watch, None
            cut = cut_run(self.path, run.resume_step, given, otherwise=otherwise, watch=watch)
            self.run_id = given or cut.run_id or new_run_id()
            if watch is not None:
                watch.finish(self.path, cut, self.run_id)
            if cut.dropped:
                which = (f"run {cut.run_id}" if cut.run_id is not None
                         else f"the last of the {cut.unidentified} runs written before run ids were recorded"
                         if cut.unidentified > 1 else "the rows written before run ids were recorded")
                kept = f"; the {cut.other_runs} other run{'s' if cut.other_runs != 1 else ''} in it kept as they were" \
                    if cut.other_runs else ""
                safe_warn(f"attn_probe: resuming at step {run.resume_step}: dropped {cut.dropped} line"
                          f"{'s' if cut.dropped != 1 else ''} at steps >= {run.resume_step} of {which} from "
                          f"{self.path}{kept}.", RuntimeWarning, stacklevel=2)
            if cut.last_unreadable:
                safe_warn(f"attn_probe: resuming at step {run.resume_step}: the last run in {self.path} has no "
                          f"readable run header (the file holds {describe_events(list(cut.events))}); which run it "
                          "was cannot be known, so none of "
                          f"its rows were cut, and this run goes on as run {self.run_id} (the two load as "
                          "separate runs).", RuntimeWarning, stacklevel=2)
        else:
            self.run_id = given or new_run_id()
            if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
                safe_warn(
                    f"attn_probe: {self.path} already holds a trajectory; this run (id {self.run_id}) starts "
                    "again at step 0 and its rows are appended after the old ones, after a run header of its "
                    "own. Use a fresh log_dir for a new run.",
                    stacklevel=2,
                )
        parent_step = config.get("parent_step")
        self._header = {
            "resumed": resumed,
            "parent_run": config.get("parent_run_id") if isinstance(config.get("parent_run_id"), str) else None,
            "parent_step": parent_step if isinstance(parent_step, int) else None,
            "parent_dir": config.get("parent_run") if isinstance(config.get("parent_run"), str) else None,
            "config": config, "model": dict(run.model or {}),
        }
        self._start_step = run.resume_step or 0
        self._open()
        self._append(self._header_line(self._start_step))

    def _header_line(self, step: int, *, resumed: bool | None = None) -> bytes:
        """This run's header record, starting its rows at ``step``."""
        assert self.run_id is not None
        fields = dict(self._header)
        if resumed is not None:
            fields["resumed"] = resumed
        return encode_header(self.run_id, step, wall_time=time.time(), **fields)

    def _open(self) -> None:
        """Open for appending (the descriptor claimed, where it still is the file at the path) under
        the writer's lock, and cut a torn last line, so the next row starts on a line of its own."""
        from ..formats.writer_lock import lock_writer

        held, self._fd = self._fd, None
        try:
            fd = lock_writer(self.path, held)
        except BaseException:
            if held is not None:
                try:
                    os.close(held)
                except OSError:
                    pass
            raise
        try:  # read through the locked descriptor: closing another one could drop an NFS lock
            good = last_complete_line_end(fd)
            if good < os.fstat(fd).st_size:
                os.ftruncate(fd, good)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._size = fd, good
        _HOLDERS.add(self)
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
        data = encode_rows(snapshots)
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
            self._append(self._header_line(step, resumed=True))  # the rows that follow are this run's
        except OSError as exc:
            raise OSError(exc.errno, f"{self.path} {how} while written; the rows it held ({held}) {fate}; "
                          f"recreating it failed: {exc.strerror or exc}") from exc
        self.recreated += 1
        from ..formats.logdir import restore_lock

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
        step = self._written[1] if self._written else self._start_step
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._open()
        if self._size == 0 and self.run_id is not None:  # a new file: its rows need this run's header
            self._append(self._header_line(step, resumed=True))

    def finish(self) -> None:
        self._close_fd()
