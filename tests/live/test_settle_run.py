"""resume_policy.settle_run/retry_dir: the run-directory decision carried out through a framework
adapter (RunDirs), with a recording fake framework: real directories and trajectory files, no Trainer,
no Lightning. What the framework's TensorBoard writer is told, the directory and identity returned,
and the warnings, for each kind of run."""

from __future__ import annotations

import os
import warnings

import pytest

from attn_probe.formats.logdir import LogDirError, LogDirInUseError
from attn_probe.formats.trajectory import TRAJECTORY_FILENAME, encode_header
from attn_probe.live.resume_policy import SavedRun, retry_dir, settle_run


class FakeDirs:
    """A framework whose TensorBoard writer defaults to ``default``, is open in ``opened``, and records
    every directory it is pointed at."""

    def __init__(self, default: str, opened: list[str] | None = None, fixed: bool = False) -> None:
        self.default, self.opened, self.fixed, self.pointed = default, list(opened or []), fixed, []

    def default_dir(self) -> str:
        return self.default

    def open_dirs(self) -> list[str]:
        return list(self.opened)

    def point(self, directory: str) -> None:
        self.pointed.append(directory)


def run_dir(path, *run_ids: str) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, TRAJECTORY_FILENAME), "wb") as fh:
        for i, rid in enumerate(run_ids):
            fh.write(encode_header(rid, 10 * i, wall_time=1.0e9 + i))
    return str(path)


def settle(*args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = settle_run(*args, **kwargs)
    return plan, [str(w.message) for w in caught]


def test_fresh_session_takes_the_framework_default_and_a_new_id(tmp_path):
    dirs = FakeDirs(str(tmp_path / "runs" / "now"))
    plan, said = settle(0, SavedRun("/x", None, None, "r0"), dirs, log_dir=None, output_dir=tmp_path)
    assert plan.directory == dirs.default and plan.chosen_by_default and not plan.from_checkpoint
    assert set(plan.identity) == {"run_id"} and len(plan.run_id) == 32  # the checkpoint is ignored at step 0
    assert dirs.pointed == [] and said == []


def test_given_log_dir_points_the_writer_there_and_branches_by_id(tmp_path):
    mine = run_dir(tmp_path / "mine", "r1")
    dirs = FakeDirs(str(tmp_path / "runs" / "now"))
    plan, said = settle(5, SavedRun(mine, None, str(tmp_path), "r1"), dirs, log_dir=mine, output_dir=tmp_path)
    assert (plan.directory, plan.run_id, dirs.pointed) == (mine, "r1", [mine])
    other = str(tmp_path / "other")
    plan, _ = settle(5, SavedRun(mine, None, str(tmp_path), "r1"), dirs, log_dir=other, output_dir=tmp_path)
    assert plan.directory == other and plan.run_id != "r1"
    assert (plan.identity["parent_run_id"], plan.identity["parent_step"]) == ("r1", 5)
    # the framework's own directory set by the user (TENSORBOARD_LOGGING_DIR): never pointed elsewhere
    dirs = FakeDirs(mine)
    plan, _ = settle(5, SavedRun(mine, None, str(tmp_path), "r1"), dirs, log_dir=None, output_dir=tmp_path,
                     env_dir=mine)
    assert plan.directory == mine and plan.run_id == "r1" and dirs.pointed == [] and not plan.chosen_by_default


def test_continue_points_the_writer_and_warns_when_it_is_open_elsewhere(tmp_path):
    run = run_dir(tmp_path / "runs" / "x", "r1")
    saved = SavedRun(run, "runs/x", str(tmp_path), "r1")
    dirs = FakeDirs(str(tmp_path / "runs" / "now"), opened=[str(tmp_path / "runs" / "now")])
    plan, said = settle(7, saved, dirs, log_dir=None, output_dir=tmp_path)
    assert (plan.directory, plan.run_id, plan.from_checkpoint) == (run, "r1", True)
    assert dirs.pointed == [run]
    (line,) = said
    assert run in line and str(tmp_path / "runs" / "now") in line and "attach" in line
    quiet = FakeDirs(str(tmp_path / "runs" / "now"))  # writer not open yet (attach): it follows, no warning
    assert settle(7, saved, quiet, log_dir=None, output_dir=tmp_path)[1] == []


def test_branch_takes_an_unused_sibling_and_names_the_parent(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    parent = run_dir(a / "runs" / "x", "r1")
    busy = run_dir(b / "runs" / "now", "someone-else")  # the default name already holds another run
    dirs = FakeDirs(busy)
    plan, said = settle(10, SavedRun(parent, "runs/x", str(a), "r1"), dirs, log_dir=None, output_dir=b)
    assert plan.directory not in (busy, parent) and os.path.dirname(plan.directory) == os.path.dirname(busy)
    assert dirs.pointed == [plan.directory] and plan.parent_run == (parent, 10)
    assert plan.identity["parent_run_id"] == "r1" and plan.run_id != "r1"
    (line,) = said
    assert "branched" in line and parent in line and plan.directory in line and plan.run_id in line


def test_fresh_when_the_saved_run_is_gone_joins_an_open_writer(tmp_path):
    saved = SavedRun(str(tmp_path / "runs" / "gone"), "runs/gone", str(tmp_path), "r1")
    opened = str(tmp_path / "runs" / "open")
    dirs = FakeDirs(opened, opened=[opened])
    plan, said = settle(3, saved, dirs, log_dir=None, output_dir=tmp_path)
    assert plan.directory == opened and dirs.pointed == [] and plan.identity["parent_run_id"] == "r1"
    (line,) = said
    assert "cannot continue" in line and saved.path in line and opened in line


def test_fixed_directory_continues_only_the_run_it_holds(tmp_path):
    logger_dir = run_dir(tmp_path / "version_0", "r1")
    dirs = FakeDirs(logger_dir, opened=[logger_dir], fixed=True)
    plan, said = settle(4, SavedRun(logger_dir, None, None, "r1"), dirs, log_dir=None, output_dir=None)
    assert (plan.directory, plan.run_id, plan.continues, plan.parent_run) == (logger_dir, "r1", True, None)
    new_version = str(tmp_path / "version_1")
    dirs = FakeDirs(new_version, opened=[new_version], fixed=True)
    plan, said = settle(4, SavedRun(logger_dir, None, None, "r1"), dirs, log_dir=None, output_dir=None)
    assert plan.directory == new_version and not plan.continues and plan.run_id != "r1"
    assert plan.identity["parent_run"] == logger_dir and plan.identity["parent_run_id"] == "r1"
    assert dirs.pointed == [] and said == []  # a fixed directory is never re-pointed; the line comes later


def test_retry_dir_in_use_and_unwritable_checkpoint_run(tmp_path):
    default = str(tmp_path / "runs" / "now")
    os.makedirs(default)  # another run holds it
    dirs = FakeDirs(default)
    plan, _ = settle(0, None, dirs, log_dir=None, output_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match="in use by another run"):
        sibling = retry_dir(plan, LogDirInUseError("busy"), dirs, 0, tmp_path)
    assert sibling != default and os.path.dirname(sibling) == os.path.dirname(default)
    given, _ = settle(0, None, dirs, log_dir=str(tmp_path / "mine"), output_dir=tmp_path)
    assert retry_dir(given, LogDirInUseError("busy"), dirs, 0, tmp_path) is None  # the user's choice: raise
    run = run_dir(tmp_path / "runs" / "x", "r1")
    plan, _ = settle(6, SavedRun(run, "runs/x", str(tmp_path), "r1"), FakeDirs(default), log_dir=None,
                     output_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match="cannot continue"):
        fresh = retry_dir(plan, LogDirError("read-only"), FakeDirs(default), 6, tmp_path)
    assert fresh not in (None, run) and plan.directory == fresh and not plan.from_checkpoint
    assert plan.run_id != "r1" and plan.identity["parent_run_id"] == "r1"
    assert retry_dir(given, LogDirError("read-only"), dirs, 0, tmp_path) is None  # not a checkpoint's run
