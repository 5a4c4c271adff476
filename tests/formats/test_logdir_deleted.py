"""The log directory or the trajectory file deleted or replaced while a plain loop runs.

The trajectory sink must notice (its open file left the path), recreate the file (and the
directory, and the directory's lock), keep every row written after the deletion where readers
look, and say once what went with the deleted file and from which step logging resumed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import RandomTokens, tiny_bert

import attn_probe
from attn_probe.formats.logdir import LOCK_FILENAME, LogDirInUseError, LogDirLock
from attn_probe.formats.trajectory import TRAJECTORY_FILENAME
from attn_probe.sinks import Record, Snapshot
from attn_probe.sinks.trajectory import TrajectorySink


def layer0_steps(path):
    with open(path) as f:
        rows = [json.loads(line) for line in f if '"run_header"' not in line]
    return [r["step"] for r in rows if r["metric"] == "symmetry" and r["layer"] == 0 and r["head"] is None]


def run_loop(log_dir, steps, at, action, about="trajectory file"):
    """A plain loop with ``watch`` (one snapshot per update); ``action(log_dir)`` before update ``at``.

    Returns the probe's warnings that mention ``about`` (from any thread) and whether another
    process, or a second probe here, could lock the directory right after the loop (before ``close()``).
    """
    model = tiny_bert()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = RandomTokens()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = attn_probe.watch(model, optimizer=opt, log_dir=str(log_dir), every=1)
        for i in range(steps):
            if i == at:
                assert probe.flush()
                action(log_dir)
            batch = data[i]
            model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
            opt.step()
            opt.zero_grad()
        assert probe.flush()
        lockable = other_process_can_lock(log_dir / LOCK_FILENAME) or second_probe_can_lock(log_dir)
        probe.close()
    return [str(w.message) for w in caught if about in str(w.message)], lockable


def second_probe_can_lock(log_dir):
    try:
        LogDirLock(log_dir).acquire().release()
    except LogDirInUseError:
        return False
    return True


def other_process_can_lock(lock_file):
    code = ("import fcntl, os, sys\n"
            "try:\n    fd = os.open(sys.argv[1], os.O_RDWR)\nexcept OSError:\n    sys.exit(3)\n"
            "try:\n    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n    sys.exit(1)\n")
    return subprocess.run([sys.executable, "-c", code, str(lock_file)]).returncode != 1  # 3: no lock file


def remove_and_make_again(d):  # another process (or TensorBoard's sink) makes it again first
    shutil.rmtree(d)
    d.mkdir()


# TensorBoard's writer thread dies when its directory vanishes (its sink replaces the writer)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("action", [shutil.rmtree, remove_and_make_again], ids=["removed", "removed-and-made-again"])
def test_log_dir_deleted_mid_run_is_recreated_and_the_rows_after_it_kept(tmp_path, action):
    run = tmp_path / "run"
    messages, lockable = run_loop(run, 7, 3, action)
    # steps 0..3 went with the directory; 4..7 are in the recreated file, where readers look
    assert layer0_steps(run / TRAJECTORY_FILENAME) == [4, 5, 6, 7]
    (warned,) = messages
    assert "was deleted together with its directory" in warned
    assert "this run's steps 0 to 3 (4 snapshots), are lost" in warned
    assert "Logging resumed at step 4" in warned
    assert not lockable  # the lock file was recreated and locked again: a second writer is refused
    df = attn_probe.load_trajectory(str(run))
    assert sorted(set(df["step"])) == [4, 5, 6, 7]
    from attn_probe.cli import main

    assert main(["export", str(run), "-o", str(tmp_path / "out.jsonl")]) == 0
    with open(tmp_path / "out.jsonl") as f:
        assert sorted({json.loads(line)["step"] for line in f if '"run_header"' not in line}) == [4, 5, 6, 7]
    # the recreated event file has the run's layout and configuration text again, and the scores
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    assert {"custom_scalars__config__", "attn_probe/config/text_summary"} <= set(ea.Tags()["tensors"])
    assert [e.step for e in ea.Scalars("attn_probe/self/symmetry/layer_00")] == [4, 5, 6, 7]


def test_trajectory_file_deleted_keeps_the_directory_and_its_lock(tmp_path):
    run = tmp_path / "run"
    messages, lockable = run_loop(run, 5, 2, lambda d: os.remove(d / TRAJECTORY_FILENAME))
    assert layer0_steps(run / TRAJECTORY_FILENAME) == [3, 4, 5]
    (warned,) = messages
    assert f"{run / TRAJECTORY_FILENAME} was deleted while" in warned
    assert "this run's steps 0 to 2 (3 snapshots), are lost" in warned and "resumed at step 3" in warned
    assert not lockable


def test_trajectory_file_replaced_mid_run_gets_the_later_rows(tmp_path):
    run = tmp_path / "run"

    def restore_a_backup(d):  # e.g. a copy taken earlier, moved back over the file
        path = d / TRAJECTORY_FILENAME
        with open(path) as f:
            first = f.readline() + f.readline()  # the run header and the first row
        (d / "backup").write_text(first)
        os.replace(d / "backup", path)

    messages, _ = run_loop(run, 4, 2, restore_a_backup)
    assert layer0_steps(run / TRAJECTORY_FILENAME) == [0, 3, 4]  # the backup's row, then the new ones
    (warned,) = messages
    assert "another file now stands at its path" in warned and "steps 0 to 2 (3 snapshots)" in warned
    assert "resumed at step 3, appended to the file now at that path" in warned


def test_snapshot_written_into_a_file_deleted_during_the_write_is_written_again(tmp_path, monkeypatch):
    """Deleted between the check before a snapshot and its fsync: the check after it writes it again."""
    sink = TrajectorySink(str(tmp_path))
    sink.start(attn_probe.sinks.RunInfo({}, {}, ["self"], ["symmetry"], False))

    def snap(step):
        return Snapshot(step, 0.0, [Record("self", 0, None, "symmetry", 0.5)])

    sink.log(snap(0))
    real_fsync, calls = os.fsync, []

    def fsync_then_delete(fd):
        real_fsync(fd)
        if not calls:
            calls.append(fd)
            os.remove(tmp_path / TRAJECTORY_FILENAME)

    monkeypatch.setattr("attn_probe.sinks.trajectory.os.fsync", fsync_then_delete)
    with pytest.warns(RuntimeWarning, match=r"this run's step 0, are lost\. Logging resumed at step 1"):
        sink.log(snap(1))
    sink.log(snap(2))
    sink.finish()
    assert layer0_steps(tmp_path / TRAJECTORY_FILENAME) == [1, 2]
    assert sink.recreated == 1


def test_event_file_deleted_alone_is_replaced_with_its_layout_and_a_warning(tmp_path):
    run = tmp_path / "run"

    def delete_event_files(d):
        for f in d.iterdir():
            if "tfevents" in f.name:
                f.unlink()

    (warned,), _ = run_loop(run, 6, 3, delete_event_files, about="TensorBoard event file")
    assert "events it held (up to step 3) are lost" in warned and "continues from step 4" in warned
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    assert {"custom_scalars__config__", "attn_probe/config/text_summary"} <= set(ea.Tags()["tensors"])
    assert [e.step for e in ea.Scalars("attn_probe/self/symmetry/layer_00")] == [4, 5, 6]
    assert layer0_steps(run / TRAJECTORY_FILENAME) == [0, 1, 2, 3, 4, 5, 6]  # the trajectory is untouched


#: a writer in a process of its own: a plain loop with ``watch``; one update, "ready", then it waits
#: for a line on stdin, takes one more update and closes
WRITER = """
import sys
sys.path.insert(0, sys.argv[2])
import torch
from helpers import RandomTokens, tiny_bert
import attn_probe
model = tiny_bert()
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
data = RandomTokens()
probe = attn_probe.watch(model, optimizer=opt, log_dir=sys.argv[1], every=1)
def update(i):
    batch = data[i]
    model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    opt.step()
    opt.zero_grad()
update(0)
assert probe.flush()
print("ready", flush=True)
sys.stdin.readline()
update(1)
probe.close()
print("done", flush=True)
"""


def test_a_second_writer_is_refused_after_the_lock_file_was_deleted(tmp_path):
    """Issue 44, finding 12: two processes appending to one ``attn_probe.jsonl`` after the directory's
    lock file was deleted (as a temp-file reaper would). The second writer was accepted and the rows
    interleaved. Now the first writer holds the trajectory file's own lock for its life: the second
    (this process) is refused before any of its sinks writes into the directory, and the file holds
    the first writer's run alone."""
    run = tmp_path / "run"
    tests_dir = os.path.dirname(os.path.abspath(__file__)) + "/.."
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(run), tests_dir], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        os.remove(run / LOCK_FILENAME)  # the reaper
        before = sorted(os.listdir(run))
        model = tiny_bert()
        with pytest.raises(LogDirInUseError, match="is being written by another writer"):
            attn_probe.watch(model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-2), log_dir=str(run),
                             every=1)
        assert sorted(os.listdir(run)) == before  # no event file, no lock file of the refused writer
        out, err = child.communicate("go\n", timeout=120)
        assert child.returncode == 0 and out.strip().endswith("done"), err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    df = attn_probe.load_trajectory(str(run))
    assert df["run_id"].nunique() == 1 and sorted(set(df["step"])) == [0, 1, 2]
    # the writer's lock went with it: the file can be written again
    sink = TrajectorySink(str(run))
    sink.claim()
    sink.finish()


def test_a_second_trajectory_sink_on_one_file_is_refused_in_one_process(tmp_path):
    """``flock`` belongs to the open file: a second writer of the same file in this process is refused
    too, and the first goes on writing (its lock is not dropped by the refusal)."""
    first = TrajectorySink(str(tmp_path))
    first.start(attn_probe.sinks.RunInfo({}, {}, ["self"], ["symmetry"], False))
    with pytest.raises(LogDirInUseError):
        TrajectorySink(str(tmp_path)).start(attn_probe.sinks.RunInfo({}, {}, ["self"], ["symmetry"], False))
    first.log(Snapshot(1, 1.0, [Record("self", 0, None, "symmetry", 0.5)]))
    with pytest.raises(LogDirInUseError):
        TrajectorySink(str(tmp_path)).claim()
    first.finish()
    again = TrajectorySink(str(tmp_path))
    again.claim()  # free once the first finished
    again.finish()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_forked_child_does_not_keep_the_writers_lock(tmp_path):
    """A ``flock`` belongs to the open file, which a fork shares (a DataLoader worker forked while the
    probe writes). The child lets its copy go: once the parent finished, the file is free, while the
    child still lives."""
    first = TrajectorySink(str(tmp_path))
    first.claim()
    read_end, write_end = os.pipe()
    up_read, up_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child (its at-fork handlers ran before fork() returned here): say so, wait until told
        os.close(write_end)
        os.write(up_write, b"u")
        os.read(read_end, 1)
        os._exit(0)
    try:
        os.close(read_end)
        assert os.read(up_read, 1) == b"u"
        first.finish()
        again = TrajectorySink(str(tmp_path))
        again.claim()  # refused before: the child's copy held the lock
        again.finish()
    finally:
        os.write(write_end, b"x")
        for fd in (write_end, up_read, up_write):
            os.close(fd)
        os.waitpid(pid, 0)
