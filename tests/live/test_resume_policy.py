"""The run-directory resume/branch policy (attn_probe.live.resume_policy) on plain values: real
directories and trajectory files, no Trainer, no transformers."""

from __future__ import annotations

import os
import time

from attn_probe.formats.trajectory import TRAJECTORY_FILENAME, encode_header
from attn_probe.live.resume_policy import (
    SavedRun,
    choose_run,
    holds_run,
    previous_runs,
    relative_to,
    resolve_saved_run,
    saved_run,
)


def _run_dir(path, *run_ids: str):
    """A run directory whose trajectory holds the runs ``run_ids`` (a header line each, then a row)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, TRAJECTORY_FILENAME), "wb") as fh:
        for i, rid in enumerate(run_ids):
            fh.write(encode_header(rid, 10 * i, wall_time=1.0e9 + i))
            fh.write(b'{"step": %d, "wall_time": 1.0, "group": "encoder", "layer": 0, "head": null, '
                     b'"metric": "symmetry", "value": 0.5}\n' % (10 * i))
    return str(path)


def _state(**attributes):
    return {"AttnProbeCallback": {"args": {}, "attributes": attributes}}


def test_saved_run_reads_the_checkpoint_attributes():
    state = _state(run_log_dir="/a/runs/x", run_log_dir_relative="runs/x", run_output_dir="/a", run_id="r1")
    assert saved_run(state) == SavedRun("/a/runs/x", "runs/x", "/a", "r1")
    # several callbacks of the class: the last one's; older checkpoints: missing fields are None
    listed = {"AttnProbeCallback": [{"attributes": {"run_log_dir": "/old"}},
                                    {"attributes": {"run_log_dir": "/new", "run_log_dir_relative": "/abs"}}]}
    assert saved_run(listed) == SavedRun("/new", None, None, None)  # an absolute "relative" path is ignored
    assert saved_run(None) is None
    assert saved_run({"AttnProbeCallback": {"attributes": {"run_log_dir": ""}}}) is None
    assert saved_run({"OtherCallback": {}}) is None


def test_relative_to_and_holds_run(tmp_path):
    assert relative_to(str(tmp_path / "runs" / "x"), tmp_path) == os.path.join("runs", "x")
    assert relative_to(str(tmp_path), tmp_path) == "."
    assert relative_to(str(tmp_path.parent / "elsewhere"), tmp_path) is None
    d = _run_dir(tmp_path / "run", "a", "b")
    assert holds_run(d, "a") and holds_run(d, "b") and not holds_run(d, "c")
    assert not holds_run(str(tmp_path / "missing"), "a")


def test_step_zero_and_no_checkpoint_take_the_trainer_run(tmp_path):
    saved = SavedRun(_run_dir(tmp_path / "runs" / "x", "r1"), "runs/x", str(tmp_path), "r1")
    for step, s in ((0, saved), (5, None)):
        choice = choose_run(step, s, log_dir=None, output_dir=tmp_path)
        assert (choice.kind, choice.run_id, choice.parent_id) == ("default", None, None)
    # TENSORBOARD_LOGGING_DIR set: the Trainer's directory, no lookup of the saved one elsewhere; it
    # continues the checkpoint's run when that directory holds it (its stale rows are then cut)
    env_dir = _run_dir(tmp_path / "env", "r0", "r1")
    choice = choose_run(5, saved, log_dir=None, output_dir=tmp_path, trainer_dir_from_env=True, trainer_dir=env_dir)
    assert (choice.kind, choice.directory, choice.run_id, choice.parent_id) == ("default", None, "r1", None)
    # a directory without the checkpoint's run: a new run, the checkpoint's run its parent
    other = _run_dir(tmp_path / "other", "r0")
    choice = choose_run(5, saved, log_dir=None, output_dir=tmp_path, trainer_dir_from_env=True, trainer_dir=other)
    assert (choice.kind, choice.run_id, choice.parent_id, choice.parent_step) == ("default", None, "r1", 5)


def test_resume_continues_the_saved_run_by_id(tmp_path):
    run = _run_dir(tmp_path / "runs" / "x", "r1")
    choice = choose_run(7, SavedRun(run, "runs/x", str(tmp_path), "r1"), log_dir=None, output_dir=tmp_path)
    assert (choice.kind, choice.directory, choice.run_id, choice.parent_id) == ("continue", run, "r1", None)
    assert not choice.legacy and not choice.relocated


def test_a_directory_holding_another_run_of_the_same_name_is_not_continued(tmp_path):
    # the directory has the saved name but holds another run (two runs started in the same second, or
    # its header edited): never written, a new run whose parent is the checkpoint's run; the problem
    # names what the directory holds (not "another output_dir": the checkpoint's run was this one's)
    run = _run_dir(tmp_path / "runs" / "x", "other")
    choice = choose_run(7, SavedRun(run, "runs/x", str(tmp_path), "r1"), log_dir=None, output_dir=tmp_path)
    assert (choice.kind, choice.directory, choice.run_id) == ("fresh", None, None)
    assert (choice.parent_id, choice.parent_step) == ("r1", 7)
    trajectory = os.path.join(run, TRAJECTORY_FILENAME)
    assert choice.problem == (f"{trajectory} holds no header of run r1 saved with the checkpoint, only of other: "
                              "another run's file, or that header was edited or damaged")
    # the header deleted: said so
    with open(trajectory, "rb") as fh:
        rows = [line for line in fh if b'"run_header"' not in line]
    with open(trajectory, "wb") as fh:
        fh.writelines(rows)
    choice = choose_run(7, SavedRun(run, "runs/x", str(tmp_path), "r1"), log_dir=None, output_dir=tmp_path)
    assert (choice.kind, choice.parent_id) == ("fresh", "r1")
    assert choice.problem == (f"{trajectory} holds no readable run header: the header of run r1 saved with the "
                              "checkpoint was deleted or damaged")
    os.remove(trajectory)
    choice = choose_run(7, SavedRun(run, "runs/x", str(tmp_path), "r1"), log_dir=None, output_dir=tmp_path)
    assert (choice.kind, choice.problem) == ("fresh", f"{trajectory} no longer exists")


def test_a_moved_output_dir_keeps_its_run(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    _run_dir(new / "runs" / "x", "r1")
    saved = SavedRun(str(old / "runs" / "x"), "runs/x", str(old), "r1")
    choice = choose_run(4, saved, log_dir=None, output_dir=new)
    assert (choice.kind, choice.directory, choice.run_id) == ("continue", str(new / "runs" / "x"), "r1")
    assert not choice.relocated  # found by the recorded relative path
    # a checkpoint from before the relative path: found by its trailing components, and said so
    legacy = SavedRun(str(old / "runs" / "x"), None, None, None)
    found = resolve_saved_run(legacy, new)
    assert (found.directory, found.relocated) == (str(new / "runs" / "x"), True)
    choice = choose_run(4, legacy, log_dir=None, output_dir=new)
    assert (choice.kind, choice.run_id, choice.legacy) == ("continue", None, True)


def test_a_checkpoint_of_another_output_dir_branches(tmp_path):
    a, b = tmp_path / "A", tmp_path / "B"
    parent = _run_dir(a / "runs" / "x", "r1")
    choice = choose_run(10, SavedRun(parent, "runs/x", str(a), "r1"), log_dir=None, output_dir=b)
    assert (choice.kind, choice.directory, choice.run_id) == ("branch", None, None)
    assert (choice.parent_id, choice.parent_step) == ("r1", 10)
    # the same run saved with B as its output_dir (an explicit log_dir outside it): continued
    choice = choose_run(10, SavedRun(parent, None, str(b), "r1"), log_dir=None, output_dir=b)
    assert (choice.kind, choice.directory) == ("continue", parent)


def test_a_deleted_run_gives_a_new_run(tmp_path):
    # a checkpoint without run id (its output_dir is this one): a fresh run, naming the problem
    saved = SavedRun(str(tmp_path / "runs" / "gone"), "runs/gone", str(tmp_path), None)
    choice = choose_run(3, saved, log_dir=None, output_dir=tmp_path)
    assert (choice.kind, choice.run_id, choice.parent_id, choice.parent_step) == ("fresh", None, None, 3)
    assert choice.problem == "it no longer exists"
    # with a run id: the same, the saved run its parent (it was this output_dir's run: not a branch)
    choice = choose_run(3, saved._replace(run_id="r1"), log_dir=None, output_dir=tmp_path)
    assert (choice.kind, choice.parent_id, choice.parent_step) == ("fresh", "r1", 3)
    assert choice.problem == "it no longer exists"


def test_an_explicit_log_dir_continues_only_its_own_run(tmp_path):
    mine = _run_dir(tmp_path / "mine", "r1")
    choice = choose_run(5, SavedRun(mine, None, str(tmp_path), "r1"), log_dir=mine, output_dir=tmp_path)
    assert (choice.kind, choice.directory, choice.run_id, choice.parent_id) == ("given", mine, "r1", None)
    other = str(tmp_path / "other")
    choice = choose_run(5, SavedRun(mine, None, str(tmp_path), "r1"), log_dir=other, output_dir=tmp_path)
    assert (choice.kind, choice.directory, choice.run_id, choice.parent_id) == ("given", other, None, "r1")
    choice = choose_run(5, SavedRun(mine, None, None, None), log_dir=other, output_dir=tmp_path)
    assert (choice.run_id, choice.legacy) == (None, True)  # a checkpoint from before run ids
    assert choose_run(0, None, log_dir="~/x", output_dir=tmp_path).directory == os.path.expanduser("~/x")


def test_previous_runs_oldest_first_without_the_current(tmp_path):
    first = _run_dir(tmp_path / "runs" / "b", "r1")
    second = _run_dir(tmp_path / "runs" / "a", "r2")
    os.makedirs(tmp_path / "runs" / "empty")  # no trajectory: not a probe run
    now = time.time()
    os.utime(first, (now - 100, now - 100))
    os.utime(second, (now, now))
    assert previous_runs(str(tmp_path), str(tmp_path / "runs" / "c")) == [first, second]
    assert previous_runs(str(tmp_path), second) == [first]
    assert previous_runs(str(tmp_path / "nothing"), second) == []
