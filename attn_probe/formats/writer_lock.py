"""The trajectory file's own lock: one writer of ``attn_probe.jsonl`` at a time, whatever happened
to the directory's lock file (:mod:`attn_probe.formats.logdir`).

A temp-file reaper can delete ``<log_dir>/.attn_probe.lock`` under a running probe; its
``lockf`` then guards nothing, and a second process locks a new file at that path. The writer of
the trajectory file therefore also holds an exclusive ``fcntl.flock`` on the file itself for its
life (:func:`lock_writer`). ``flock`` belongs to the open file, not to the process: a second
writer in the same process is refused too, and closing another descriptor of the file (a reader)
does not drop it. Where there are no such locks (Windows, where ``fcntl`` is missing; a
filesystem answering ``ENOLCK``) only the lock file guards. On NFS, Linux emulates ``flock`` with
a POSIX lock, which this process drops when it closes any descriptor of the file: the writer
takes it again each time it (re)opens the file. Only the standard library is imported here.
"""

from __future__ import annotations

import errno
import os

from .logdir import NO_LOCKING, LogDirInUseError, log_dir_error, os_error_reason

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows: only the directory's lock file guards
    fcntl = None  # type: ignore[assignment]

__all__ = ["lock_writer"]


def lock_writer(path: str | os.PathLike, fd: int | None = None) -> int:
    """Open ``path`` to read and append (creating it) and hold an exclusive ``fcntl.flock`` on it; returns the descriptor.

    The one writer of a file holds it for its life: a second :func:`lock_writer` of the same file,
    in another process or in this one, raises :class:`LogDirInUseError` while the descriptor is
    open (the OS drops the lock when it is closed, or when the process ends however it ends).
    ``fd``: a descriptor of ``path`` already held, locked again (a no-op where the lock is held;
    on NFS, where closing another descriptor of the file may have dropped it) and returned when it
    still is the file at ``path``; else it is closed once the file now at ``path`` is locked. A
    file replaced between its opening and its locking is opened again. Without ``fcntl`` (Windows)
    or on a filesystem without locks the descriptor is returned unlocked. A file that cannot be
    opened is a :class:`LogDirError` saying why.
    """
    path = os.fspath(path)
    while True:
        reuse = fd is not None and _same_file(fd, path)
        try:
            mine = fd if reuse else os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise log_dir_error(
                f"attn_probe cannot write its trajectory file {path!r}: {os_error_reason(exc)}. "
                "Pass a writable log_dir=",
                exc.errno,
            ) from exc
        assert mine is not None
        if fcntl is not None:
            try:
                fcntl.flock(mine, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in NO_LOCKING:
                    if not reuse:
                        os.close(mine)
                    if exc.errno not in (errno.EACCES, errno.EAGAIN, errno.EWOULDBLOCK):
                        raise
                    raise LogDirInUseError(
                        f"attn_probe: {path!r} is being written by another writer (another process, or another "
                        "probe in this one, holds the file's own lock, whether or not the directory's lock file "
                        "is still there); two writers in one file would interleave their rows. Give this run "
                        "its own log_dir=, or stop the other one",
                        log_dir=os.path.dirname(path) or ".",
                    ) from exc
        if _same_file(mine, path):
            if fd is not None and not reuse:
                try:
                    os.close(fd)  # the file that left the path: its lock guards nothing now
                except OSError:
                    pass
            return mine
        if not reuse:  # replaced before it was locked: lock the file now at the path
            os.close(mine)


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False
