"""The log directory: one writer at a time (an OS lock), unique default names, write checks.

Multi-process cases run real processes. The children load ``attn_probe/formats/logdir.py`` by path
(it is stdlib-only), so they start in a fraction of a second instead of importing torch
through ``attn_probe/__init__``; every wait on a child is bounded.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import pytest

from attn_probe.formats import logdir
from attn_probe.formats.logdir import (
    LOCK_FILENAME,
    LogDirError,
    LogDirInUseError,
    LogDirLock,
    acquire_default,
    check_log_dir,
    default_log_dir,
    unique_log_dir,
)

pytestmark = pytest.mark.skipif(logdir.fcntl is None, reason="POSIX locks only")

TIMEOUT = 30.0
LOGDIR_PY = Path(logdir.__file__).resolve()

# A child: load logdir.py by path, run ACTION, print "ready <result>", then hold until stdin closes.
CHILD = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("attn_probe_logdir", sys.argv[1])
    ld = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ld
    spec.loader.exec_module(ld)
    action, target = sys.argv[2], sys.argv[3]
    try:
        if action == "lock":
            held = ld.LogDirLock(target).acquire()
            result = held.log_dir
        elif action == "default_fresh":
            held = ld.acquire_default(target, fresh=True)
            result = held.log_dir
        elif action == "default_shared":
            held = ld.acquire_default(target, fresh=False)
            result = held.log_dir
        else:
            raise SystemExit("unknown action")
    except ld.LogDirInUseError as exc:
        print("inuse", exc.host, exc.pid, "|", exc, flush=True)
        raise SystemExit(3)
    print("ready", result, flush=True)
    sys.stdin.read()  # hold until the parent closes stdin
""")


def start_child(action: str, target: Path | str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(LOGDIR_PY), action, str(target)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def first_line(proc: subprocess.Popen, timeout: float = TIMEOUT) -> str:
    """The child's first stdout line, or a test failure after ``timeout`` seconds."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            raise AssertionError(f"child gave no answer within {timeout} s")
    finally:
        sel.close()
    line = proc.stdout.readline().strip()
    if not line:
        proc.wait(timeout=TIMEOUT)
        raise AssertionError(f"child exited {proc.returncode}: {proc.stderr.read()}")
    return line


def stop(proc: subprocess.Popen) -> None:
    try:
        if proc.poll() is None:
            proc.stdin.close()
            proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:  # pragma: no cover - a hang fails, never blocks the suite
        proc.kill()
        proc.wait(timeout=TIMEOUT)
        raise
    finally:
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None and not f.closed:
                f.close()


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=TIMEOUT)
        for f in (p.stdin, p.stdout, p.stderr):
            if f is not None and not f.closed:
                f.close()


def test_second_process_gets_a_clear_error_naming_host_and_pid_then_locks_after_exit(tmp_path, children):
    run = tmp_path / "run"
    first = start_child("lock", run)
    children.append(first)
    assert first_line(first) == f"ready {run}"

    # another process: refused, with the holder's host and pid
    second = start_child("lock", run)
    children.append(second)
    line = first_line(second)
    assert line.startswith(f"inuse {socket.gethostname()} {first.pid} |"), line
    assert str(run) in line and f"pid {first.pid}" in line and "already in use" in line
    assert second.wait(timeout=TIMEOUT) == 3

    # this process too (the OS lock, not the registry: nothing of this process holds it)
    with pytest.raises(LogDirInUseError) as info:
        LogDirLock(run).acquire()
    assert info.value.pid == first.pid and info.value.host == socket.gethostname()
    assert info.value.errno == errno.EBUSY and isinstance(info.value, LogDirError)

    stop(first)
    assert first.returncode == 0
    assert not (run / LOCK_FILENAME).exists()  # released cleanly: the lock file is removed
    third = start_child("lock", run)
    children.append(third)
    assert first_line(third) == f"ready {run}"
    stop(third)


def test_a_killed_holder_leaves_a_lock_file_that_does_not_block(tmp_path, children):
    run = tmp_path / "run"
    holder = start_child("lock", run)
    children.append(holder)
    assert first_line(holder) == f"ready {run}"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=TIMEOUT)
    assert f"pid={holder.pid}" in (run / LOCK_FILENAME).read_text()  # stale file left behind
    with LogDirLock(run) as lock:
        assert lock.locked and lock.holder()["pid"] == str(os.getpid())


def test_stale_lock_file_from_a_dead_pid_on_another_host_does_not_block(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=TIMEOUT)
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILENAME).write_text(f"host=node-that-was-requeued\npid={dead.pid}\nsince=yesterday\n")
    lock = LogDirLock(run).acquire()
    try:
        assert lock.locked and lock.os_locked
        assert lock.holder() == {"host": socket.gethostname(), "pid": str(os.getpid()),
                                 "since": lock.holder()["since"]}
    finally:
        lock.release()
    assert not lock.locked and not (run / LOCK_FILENAME).exists()


def test_same_process_double_lock_is_refused_and_does_not_drop_the_first(tmp_path, children):
    run = tmp_path / "run"
    first = LogDirLock(run).acquire()
    try:
        for other in (run, str(run) + "/", tmp_path / "." / "run"):  # any spelling of the directory
            with pytest.raises(LogDirInUseError, match="another attn_probe in this process") as info:
                LogDirLock(other).acquire()
            assert info.value.pid == os.getpid()
        assert first.holder()["pid"] == str(os.getpid())  # reading it here keeps the OS lock
        # the OS lock is still held: another process is refused
        child = start_child("lock", run)
        children.append(child)
        assert first_line(child).startswith(f"inuse {socket.gethostname()} {os.getpid()} |")
    finally:
        first.release()
    first.release()  # idempotent
    with LogDirLock(run) as again:  # free again in this process
        assert again.locked
    assert not again.locked


def test_error_messages(tmp_path):
    run = tmp_path / "run"
    with LogDirLock(run):
        with pytest.raises(LogDirError) as info:
            LogDirLock(run).acquire()
    msg = str(info.value)
    assert msg.startswith("attn_probe: log directory") and repr(str(run)) in msg
    assert f"pid {os.getpid()}" in msg and socket.gethostname() in msg and "log_dir=" in msg
    assert "[Errno" not in msg

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(LogDirError, match="cannot write its log directory") as info:
        check_log_dir(blocker / "sub")
    assert "[Errno" not in str(info.value) and info.value.errno is not None
    with pytest.raises(LogDirError, match="not a directory"):
        check_log_dir(blocker)
    with pytest.raises(LogDirError, match="cannot write its log directory"):
        LogDirLock(blocker / "sub").acquire()
    assert LogDirError.__doc__ == "The log directory cannot be created or written (raised at attach time)."


def test_check_log_dir_creates_and_leaves_nothing_behind(tmp_path):
    target = tmp_path / "a" / "b"
    assert check_log_dir(target) == str(target)
    assert target.is_dir() and list(target.iterdir()) == []
    assert check_log_dir(target) == str(target)  # existing directory: fine


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only directories")
def test_read_only_directory_is_a_log_dir_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(LogDirError, match="permission denied"):
            check_log_dir(ro)
    finally:
        ro.chmod(0o700)


def test_full_disk_is_a_log_dir_error_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "run"
    target.mkdir()
    real_fsync = os.fsync

    def full(fd):  # what a full filesystem answers once the write reaches the disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(LogDirError, match="the disk is full") as info:
        check_log_dir(target)
    assert info.value.errno == errno.ENOSPC and not isinstance(info.value, LogDirInUseError)
    assert list(target.iterdir()) == []
    monkeypatch.setattr(os, "fsync", real_fsync)

    class Vfs:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Vfs)
    with pytest.raises(LogDirError, match=r"nearly full \(40960 bytes free, 1000000 needed\)"):
        check_log_dir(target, need_bytes=1_000_000)
    assert check_log_dir(target, need_bytes=40_000) == str(target)
    assert list(target.iterdir()) == []


@pytest.fixture
def tiny_fs(tmp_path):
    """A 64 KiB tmpfs mounted for the test (root only; skipped where mounting is not allowed)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                       capture_output=True, text=True, timeout=TIMEOUT)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=TIMEOUT)


def test_a_really_full_disk_is_a_log_dir_error_and_the_lock_still_works(tiny_fs):
    run = tiny_fs / "run"
    run.mkdir()
    filler = tiny_fs / "filler"
    with open(filler, "wb", buffering=0) as f:  # fill the filesystem to the last block
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    with pytest.raises(LogDirError, match="the disk is full") as info:
        check_log_dir(run)
    assert info.value.errno == errno.ENOSPC
    assert list(run.iterdir()) == []  # no temporary file left behind
    with LogDirLock(run) as lock:  # an empty lock file needs no block; the holder line is optional
        assert lock.locked
    filler.unlink()  # space is back
    assert check_log_dir(run, need_bytes=32 * 1024) == str(run)
    with pytest.raises(LogDirError, match="nearly full"):
        check_log_dir(run, need_bytes=1 << 20)
    assert list(run.iterdir()) == []


def test_default_dir_is_summary_writers_convention(monkeypatch):
    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2025, 3, 7, 9, 5, 3)

    monkeypatch.setattr(logdir, "datetime", Frozen)
    assert default_log_dir() == os.path.join("runs", f"Mar07_09-05-03_{socket.gethostname()}")
    assert default_log_dir("out/runs") == os.path.join("out/runs", f"Mar07_09-05-03_{socket.gethostname()}")


def test_two_default_dirs_in_the_same_second_get_unique_names(tmp_path, monkeypatch):
    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2025, 3, 7, 9, 5, 3)

    monkeypatch.setattr(logdir, "datetime", Frozen)
    monkeypatch.chdir(tmp_path)
    base = default_log_dir()
    a, b = acquire_default(), acquire_default()
    try:
        assert (a.log_dir, b.log_dir) == (base, base + "_1")
        assert a.locked and b.locked
    finally:
        a.release()
        b.release()
    assert unique_log_dir() == base + "_2"  # fresh names skip existing directories
    # fresh=False keeps an existing directory when nobody holds it, skips a held one
    with acquire_default(fresh=False) as c:
        assert c.log_dir == base
        with acquire_default(fresh=False) as d:
            assert d.log_dir == base + "_1"


@pytest.mark.parametrize("action", ["default_fresh", "default_shared"])
def test_two_processes_choosing_the_same_default_at_once_get_different_dirs(tmp_path, children, action):
    base = tmp_path / "runs" / "Mar07_09-05-03_host"
    procs = [start_child(action, base) for _ in range(3)]
    children.extend(procs)
    lines = [first_line(p) for p in procs]
    dirs = sorted(line.split(" ", 1)[1] for line in lines)
    assert all(line.startswith("ready ") for line in lines), lines
    assert dirs == sorted([str(base), f"{base}_1", f"{base}_2"])
    for p in procs:
        stop(p)
        assert p.returncode == 0


def test_timeout_waits_for_the_holder(tmp_path, children):
    run = tmp_path / "run"
    holder = start_child("lock", run)
    children.append(holder)
    assert first_line(holder) == f"ready {run}"
    t0 = time.monotonic()
    with pytest.raises(LogDirInUseError):
        LogDirLock(run).acquire(timeout=0.3)
    assert 0.25 <= time.monotonic() - t0 < 10
    holder.stdin.close()  # the holder exits while we wait
    with LogDirLock(run).acquire(timeout=TIMEOUT) as lock:
        assert lock.locked
    holder.wait(timeout=TIMEOUT)


def test_a_collected_lock_frees_the_directory(tmp_path):
    import gc

    run = tmp_path / "run"
    LogDirLock(run).acquire()  # dropped at once: its finaliser releases it
    gc.collect()
    with LogDirLock(run) as lock:
        assert lock.locked
