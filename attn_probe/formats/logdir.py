"""The probe's log directory: choosing it, checking it, and holding it against a second writer.

Two writers in one log directory interleave their steps silently (both append to
``attn_probe.jsonl`` and write event files side by side, and the loader merges them into one
run). A probe therefore holds an OS advisory lock on its directory for its lifetime
(:class:`LogDirLock`: ``fcntl.lockf`` on ``<log_dir>/.attn_probe.lock``). The lock belongs to
the operating system, not to the file: it goes away when the process exits or dies, so a lock
file left behind by a crashed run, or by a job that is requeued on another host, blocks
nothing. Host and pid are written into the file only to name the holder in the error message.

When the lock file disappears while held (the whole directory deleted by a cleanup and recreated
by a sink that noticed), :func:`restore_lock` locks a new lock file at the same path, so a second
writer is still refused.

The lock file can also go while its directory stays (a temp-file reaper deleting old dot files):
its lock then guards nothing. The trajectory file's own lock (:mod:`attn_probe.formats.writer_lock`,
held by its writer for its life) still refuses a second writer then.

Where the directory was chosen by default rather than given by the user,
:func:`acquire_default` picks a unique name (``base``, ``base_1``, ``base_2``, ...) instead of
failing. Only the standard library is imported here.
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile
import threading
import time
import unicodedata
import weakref
from datetime import datetime
from typing import Any

try:  # POSIX; on other systems the lock is the in-process registry only
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "LOCK_FILENAME",
    "LogDirError",
    "LogDirInUseError",
    "LogDirLock",
    "NO_LOCKING",
    "acquire_default",
    "check_log_dir",
    "default_log_dir",
    "log_dir_error",
    "os_error_reason",
    "printable",
    "restore_lock",
    "unique_log_dir",
]

#: the lock file inside a locked log directory
LOCK_FILENAME = ".attn_probe.lock"
#: prefix of the write test's temporary file (removed again, also when the write fails)
_WRITE_TEST_PREFIX = ".attn_probe_write_test."
#: how many suffixed names (``_1``, ``_2``, ...) :func:`unique_log_dir` tries before giving up
_MAX_SUFFIX = 10_000
#: errno values that mean "this filesystem does not do POSIX locks"
NO_LOCKING = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class LogDirError(OSError):
    """The log directory cannot be created or written (raised at attach time)."""


class LogDirInUseError(LogDirError):
    """The log directory is locked by another writer (another process, or another probe here).

    ``host`` and ``pid`` name the holder as it recorded itself (``None`` where unknown).
    """

    def __init__(self, message: str = "", *, log_dir: str | None = None, host: str | None = None,
                 pid: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno.EBUSY
        self.log_dir = log_dir
        self.host = host
        self.pid = pid


def default_log_dir(root: str = "runs") -> str:
    """``runs/<Mon DD_HH-MM-SS>_<host>``, SummaryWriter's own default (not created here)."""
    return os.path.join(root, datetime.now().strftime("%b%d_%H-%M-%S") + "_" + socket.gethostname())


def os_error_reason(exc: OSError) -> str:
    """One clause saying why an operation on a log directory or its files failed (disk full, ...)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full ({exc.strerror})"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied ({exc.strerror})"
    if exc.errno == errno.EROFS:
        return f"the filesystem is read-only ({exc.strerror})"
    return exc.strerror or str(exc) or type(exc).__name__


def log_dir_error(message: str, code: int | None) -> LogDirError:
    """A :class:`LogDirError` whose ``str`` is ``message`` alone and whose ``errno`` is ``code``."""
    err = LogDirError(message)  # one argument: str(err) is the message alone
    err.errno = code
    return err


def _cannot_write(path: str, exc: OSError) -> LogDirError:
    return log_dir_error(f"attn_probe cannot write its log directory {path!r}: {os_error_reason(exc)}. "
                  "Pass a writable log_dir=", exc.errno)


#: Unicode categories escaped by :func:`printable`: controls, format characters (bidi
#: overrides, zero-width ones), line/paragraph separators, surrogates, unassigned
_UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def printable(text: object) -> str:
    """``text`` safe to print in one terminal line: control characters escaped.

    A run name or path comes from the file system or a user: ``\\x1b[2J`` would clear the
    terminal, a newline would forge an extra line. Every character of a category in
    :data:`_UNPRINTABLE` (and non-ASCII spaces) is written as its Python escape (``\\n``,
    ``\\x1b``, ``\\u202e``); everything else, backslashes included, is kept as is.
    """
    text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch == " " or (ch.isprintable() and unicodedata.category(ch) not in _UNPRINTABLE)
                   else ch.encode("unicode_escape").decode("ascii") for ch in text)


def _check_local(path: str) -> None:
    """Refuse a URL (``s3://bucket/x``): the log directory lives on the local file system."""
    if "://" in path:
        raise log_dir_error(
            f"attn_probe cannot use {path!r} as its log directory: it looks like a URL "
            "(it contains '://'), and the probe writes to the local file system. Pass a local path "
            "(mount the remote storage, or copy the run there afterwards)", errno.EINVAL)


def check_log_dir(path: str | os.PathLike, *, need_bytes: int = 0) -> str:
    """Create ``path`` if needed and prove it writable; returns it as a string.

    A small file is written, flushed, fsync'd and removed, so a full disk, a read-only
    filesystem or missing permissions surface here as :class:`LogDirError` (never a bare
    ``OSError``), and no temporary file is left behind, whatever fails. ``need_bytes`` also
    requires that much free space (e.g. room to rewrite the trajectory file on resume).
    """
    path = os.fspath(path)
    _check_local(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        if not (os.path.exists(path) and not os.path.isdir(path)):
            raise _cannot_write(path, exc) from exc
    if not os.path.isdir(path):
        raise log_dir_error(f"attn_probe cannot use {path!r} as its log directory: it is not a directory",
                     errno.ENOTDIR)
    test: str | None = None
    try:
        fd, test = tempfile.mkstemp(prefix=_WRITE_TEST_PREFIX, dir=path)
        try:
            os.write(fd, b"attn_probe write test\n")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _cannot_write(path, exc) from exc
    finally:
        if test is not None:
            try:
                os.remove(test)
            except OSError:
                pass
    if need_bytes > 0:
        try:
            st = os.statvfs(path)
        except (OSError, AttributeError):  # pragma: no cover - no statvfs: nothing to check
            return path
        free = st.f_bavail * st.f_frsize
        if free < need_bytes:
            raise log_dir_error(f"attn_probe cannot write its log directory {path!r}: the disk is nearly full "
                         f"({free} bytes free, {need_bytes} needed). Free some space or pass another log_dir=",
                         errno.ENOSPC)
    return path


# --------------------------------------------------------------------------------------------
# The lock
# --------------------------------------------------------------------------------------------

#: (st_dev, st_ino) of a locked directory -> the lock holding it, for locks of this process.
#: POSIX record locks belong to the process, so a second probe in the same process would be
#: granted the OS lock again; it must be refused here instead, *before* it opens the lock file
#: (closing any descriptor of that file would drop the first probe's OS lock).
_HELD: dict[tuple[int, int], tuple[int, weakref.ref[LogDirLock]]] = {}
_HELD_GUARD = threading.RLock()  # re-entrant: a collected lock's __del__ may run inside


def _dir_key(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _held_here(key: tuple[int, int]) -> LogDirLock | None:
    entry = _HELD.get(key)
    if entry is None:
        return None
    pid, ref = entry
    lock = ref()
    if pid != os.getpid() or lock is None or not lock.locked:  # forked child, or collected
        del _HELD[key]
        return None
    return lock


def _read_holder(path: str, fd: int | None = None) -> dict[str, str]:
    """``{"host": ..., "pid": ..., "since": ...}`` as far as the lock file says.

    Reads through ``fd`` when this process holds the lock: opening and closing the file
    again would drop the process's POSIX lock.
    """
    try:
        if fd is not None:
            raw = os.pread(fd, 4096, 0)
        else:
            with open(path, "rb") as fh:
                raw = fh.read(4096)
    except OSError:
        return {}
    text = raw.decode("utf-8", errors="replace")
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() in ("host", "pid", "since"):
            out[key.strip()] = value.strip()
    return out


def _describe(holder: dict[str, str]) -> str:
    if not holder.get("host") and not holder.get("pid"):
        return "another process (host and pid not recorded yet)"
    since = f", since {holder['since']}" if holder.get("since") else ""
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}{since}"


class LogDirLock:
    """An OS advisory lock on a log directory, held for a probe's lifetime.

    ``acquire()`` creates the directory if needed and locks ``<log_dir>/.attn_probe.lock``
    with ``fcntl.lockf``; it raises :class:`LogDirInUseError` naming the holder's host and
    pid when another process holds it, or another :class:`LogDirLock` of this process. The
    OS drops the lock when the process ends, however it ends, so a stale lock file (a dead
    pid, a requeued job on another host) never blocks. ``release()`` unlocks and removes the
    lock file; it is idempotent and also runs on ``with`` exit and when the lock is collected.

    On a filesystem without POSIX locks (``ENOLCK``; some FUSE mounts) the lock degrades to
    this process's registry and ``os_locked`` is False. POSIX locks belong to the process and
    are dropped when *any* descriptor of the file is closed in it: code in the holding process
    must not open the lock file itself (use :meth:`holder`).

    Example:
        >>> with LogDirLock("runs/x"):        # doctest: +SKIP
        ...     train()
    """

    def __init__(self, log_dir: str | os.PathLike, *, filename: str = LOCK_FILENAME) -> None:
        self.log_dir = os.fspath(log_dir)
        self.path = os.path.join(self.log_dir, filename)
        self._fd: int | None = None
        self._key: tuple[int, int] | None = None
        self._owner = 0  # pid that acquired: a forked child must not remove its parent's lock file
        self.os_locked = False

    @property
    def locked(self) -> bool:
        """Whether this object holds the directory now."""
        return self._key is not None

    def holder(self) -> dict[str, str]:
        """What the lock file says about its holder (``host``, ``pid``, ``since``); may be empty."""
        with _HELD_GUARD:
            try:
                here = _held_here(_dir_key(self.log_dir))
            except OSError:
                return {}
            if here is not None:  # held in this process: never open the file again here
                return _read_holder(here.path, here._fd) if here._fd is not None else {
                    "host": socket.gethostname(), "pid": str(os.getpid())}
            return _read_holder(self.path)

    def acquire(self, timeout: float = 0.0) -> LogDirLock:
        """Lock the directory (creating it); returns ``self``.

        With ``timeout > 0`` a lock held by another *process* is retried until then (useful
        on NFS, where a dead client's lock lasts until its lease expires). Raises
        :class:`LogDirInUseError` when the directory stays locked, :class:`LogDirError` when
        it cannot be created or written.
        """
        if self.locked:
            return self
        _check_local(self.log_dir)
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            key = _dir_key(self.log_dir)
        except OSError as exc:
            raise _cannot_write(self.log_dir, exc) from exc
        deadline = time.monotonic() + max(0.0, timeout)
        with _HELD_GUARD:
            other = _held_here(key)
            if other is not None:
                raise LogDirInUseError(
                    f"attn_probe: log directory {self.log_dir!r} is already in use by another attn_probe "
                    f"in this process (host {socket.gethostname()}, pid {os.getpid()}); two writers in one "
                    "directory would interleave their steps. Close the other probe first, or give each "
                    "probe its own log_dir=",
                    log_dir=self.log_dir, host=socket.gethostname(), pid=os.getpid(),
                )
            while True:
                holder = self._try_lock()
                if holder is None:
                    break
                if time.monotonic() >= deadline:
                    pid = holder.get("pid", "")
                    raise LogDirInUseError(
                        f"attn_probe: log directory {self.log_dir!r} is already in use by another writer "
                        f"({_describe(holder)}); two writers in one directory would interleave their "
                        "steps. Give this run its own log_dir=, or stop the other one",
                        log_dir=self.log_dir, host=holder.get("host") or None,
                        pid=int(pid) if pid.isdigit() else None,
                    )
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            self._key, self._owner = key, os.getpid()
            _HELD[key] = (os.getpid(), weakref.ref(self))
        self._record()
        return self

    def _try_lock(self) -> dict[str, str] | None:
        """Take the OS lock: ``None`` on success, else what is known of the holder."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise _cannot_write(self.log_dir, exc) from exc
            if fcntl is None:  # pragma: no cover - no POSIX locks on this platform
                self._fd, self.os_locked = fd, False
                return None
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EACCES, errno.EAGAIN):
                    holder = _read_holder(self.path)
                    if not holder:  # the holder may be writing its name right now
                        time.sleep(0.05)
                        holder = _read_holder(self.path)
                    return holder
                if exc.errno in NO_LOCKING:
                    # keep the descriptor-free registry lock only; nothing to hold open
                    self._fd, self.os_locked = None, False
                    return None
                raise _cannot_write(self.log_dir, exc) from exc
            # A releasing holder unlinks the file before it unlocks: if we locked a file that
            # is no longer at self.path, another process may lock the new one; start again.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except OSError:
                same = False
            if same:
                self._fd, self.os_locked = fd, True
                return None
            os.close(fd)

    def restore(self) -> bool:
        """Lock a new lock file when the held one was deleted or replaced; returns whether it is held now.

        The OS lock sits on the file, not on its name: once the file (or its whole directory) is
        deleted, another writer could lock a new file at the same path. This recreates the
        directory if needed and locks the file at ``self.path`` again (a no-op while the held file
        is still in place). Returns ``False``, changing nothing, when not held or when another
        writer took the new file first; raises nothing.
        """
        if not self.locked:
            return False
        with _HELD_GUARD:
            try:
                if self._fd is not None:
                    held = os.fstat(self._fd)
                    if held.st_nlink > 0 and os.path.samestat(held, os.stat(self.path)):
                        return True
                elif _dir_key(self.log_dir) == self._key:  # no lock file held: the directory is the same
                    return True
            except OSError:
                pass
            try:
                os.makedirs(self.log_dir, exist_ok=True)
                key = _dir_key(self.log_dir)
            except OSError:
                return False
            other = _held_here(key)
            if other is not None and other is not self:
                return False
            old_fd = self._fd
            try:
                holder = self._try_lock()
            except LogDirError:
                return False
            if holder is not None:  # another writer locked the new file first
                return False
            if old_fd is not None and old_fd != self._fd:
                try:
                    os.close(old_fd)  # the deleted file's descriptor: its lock guards nothing now
                except OSError:
                    pass
            entry = _HELD.get(self._key) if self._key is not None else None
            if entry is not None and entry[1]() is self:
                del _HELD[self._key]
            self._key = key
            _HELD[key] = (os.getpid(), weakref.ref(self))
        self._record()
        return True

    def _record(self) -> None:
        """Write host and pid into the lock file (for the other writer's error message only)."""
        if self._fd is None:
            return
        text = (f"host={socket.gethostname()}\npid={os.getpid()}\n"
                f"since={datetime.now().isoformat(timespec='seconds')}\n").encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, text, 0)
        except OSError:  # a full disk must not fail the lock itself; the message says "unknown"
            pass

    def release(self) -> None:
        """Unlock and remove the lock file; does nothing when not held."""
        with _HELD_GUARD:
            key, fd = self._key, self._fd
            self._key, self._fd, self.os_locked = None, None, False
            if key is not None:
                entry = _HELD.get(key)
                if entry is not None and entry[1]() is self:
                    del _HELD[key]
            if fd is not None and self._owner != os.getpid():  # forked child: not ours to remove
                try:
                    os.close(fd)
                except OSError:
                    pass
            elif fd is not None:
                try:  # unlink while still locked, so nobody locks a file about to vanish
                    if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                        os.remove(self.path)
                except OSError:
                    pass
                try:
                    os.close(fd)  # drops the OS lock
                except OSError:
                    pass

    def __enter__(self) -> LogDirLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __repr__(self) -> str:
        return f"LogDirLock({self.log_dir!r}, locked={self.locked})"


def restore_lock(log_dir: str | os.PathLike) -> bool | None:
    """:meth:`LogDirLock.restore` for the lock this process holds on ``log_dir`` (by path).

    For a sink that found its directory deleted and recreated it. Returns ``None`` when this
    process holds no lock on that path; never raises.
    """
    target = os.path.abspath(os.fspath(log_dir))
    with _HELD_GUARD:
        for pid, ref in list(_HELD.values()):
            lock = ref()
            if pid == os.getpid() and lock is not None and lock.locked and os.path.abspath(lock.log_dir) == target:
                return lock.restore()
    return None


# --------------------------------------------------------------------------------------------
# Default directories: unique instead of failing
# --------------------------------------------------------------------------------------------


def _candidates(base: str) -> Any:
    yield base
    for i in range(1, _MAX_SUFFIX):
        yield f"{base}_{i}"


def unique_log_dir(base: str | os.PathLike | None = None) -> str:
    """Create and return ``base`` or, if it exists, ``base_1``, ``base_2``, ... (the first free).

    ``base`` defaults to :func:`default_log_dir`. The directory is created with one atomic
    ``mkdir``, so two processes that start in the same second never get the same name.
    Raises :class:`LogDirError` when the parent cannot be written.
    """
    base = os.fspath(base) if base is not None else default_log_dir()
    parent = os.path.dirname(base.rstrip(os.sep))
    try:
        if parent:
            os.makedirs(parent, exist_ok=True)
        for cand in _candidates(base):
            try:
                os.mkdir(cand)
            except FileExistsError:
                continue
            return cand
    except OSError as exc:
        raise _cannot_write(parent or base, exc) from exc
    raise log_dir_error(f"attn_probe: no free log directory name like {base!r} (tried {_MAX_SUFFIX})", errno.EEXIST)


def acquire_default(base: str | os.PathLike | None = None, *, fresh: bool = True) -> LogDirLock:
    """Choose, check and lock a log directory that the user did not name; returns the held lock.

    ``base`` (default :func:`default_log_dir`) is used if possible, else ``base_1``,
    ``base_2``, ...: with ``fresh=True`` the first name that does not exist yet (see
    :func:`unique_log_dir`); with ``fresh=False`` the first that no other writer holds, so a
    directory that already exists (e.g. made by the Trainer's TensorBoard callback in this
    process) is kept when it is free. The chosen directory is ``lock.log_dir``; release the
    lock when the run ends. Raises :class:`LogDirError` when nothing can be written.
    """
    base = os.fspath(base) if base is not None else default_log_dir()
    names = iter(lambda: unique_log_dir(base), None) if fresh else _candidates(base)
    for cand in names:
        lock = LogDirLock(cand)
        try:
            lock.acquire()
        except LogDirInUseError:  # another writer holds it (or took a fresh name meanwhile)
            continue
        try:
            check_log_dir(lock.log_dir)
        except BaseException:
            lock.release()
            raise
        return lock
    raise log_dir_error(f"attn_probe: every log directory name like {base!r} is in use", errno.EEXIST)
