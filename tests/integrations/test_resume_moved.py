"""Resume after the Trainer's output directory was moved, or when the saved run cannot be written.

The checkpoint records the probe's run directory relative to ``output_dir`` too, so a resumed
run continues the run in the moved directory (one trajectory, no duplicates) instead of
recreating the old path; a saved run that is gone or unwritable gives one warning and a fresh
run directory, never an error out of ``train()``.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
from helpers import make_args, train_probed
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

make_args = functools.partial(make_args, report_to=["tensorboard"], save_strategy="steps", save_steps=2)


def trajectories(root):
    return sorted(str(p) for p in root.rglob("attn_probe.jsonl"))


def layer0_steps(path):
    """Steps of layer 0's symmetry rows, in file order (a duplicate step shows twice)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if '"run_header"' not in line]
    return [r["step"] for r in rows if r["metric"] == "symmetry" and r["layer"] == 0 and r["head"] is None]


def train(out, steps, resume=None):
    return train_probed(make_args(out, steps), resume)


def saved_probe_state(checkpoint):
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return state["stateful_callbacks"]["AttnProbeCallback"]["attributes"]


def first_run_then_move(tmp_path):
    """Two steps with a checkpoint at step 2 in out_a, then ``mv out_a out_b``; returns the paths."""
    a, b = tmp_path / "out_a", tmp_path / "out_b"
    train(a, 2)
    (run,) = (a / "runs").iterdir()
    shutil.move(a, b)
    return a, b, run.name


@pytest.mark.parametrize("old_path", ["gone", "a_file"], ids=["old-path-gone", "old-path-blocked-by-a-file"])
def test_resume_continues_the_run_in_the_moved_output_dir(tmp_path, old_path):
    a, b, run = first_run_then_move(tmp_path)
    if old_path == "a_file":  # the old location cannot be created (another user's scratch, a read-only mount)
        a.write_text("not a directory")
    messages = train(b, 4, resume=b / "checkpoint-2")
    assert trajectories(tmp_path) == [str(b / "runs" / run / "attn_probe.jsonl")]  # nothing recreated at a
    assert layer0_steps(b / "runs" / run / "attn_probe.jsonl") == [0, 1, 2, 3, 4]
    assert [d.name for d in (b / "runs").iterdir()] == [run]
    ea = EventAccumulator(str(b / "runs" / run), size_guidance={"scalars": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("attn_probe/self/symmetry/layer_00")] == [0, 1, 2, 3, 4]
    assert not [m for m in messages if "cannot continue" in m or "new run directory" in m]
    assert saved_probe_state(b / "checkpoint-2")["run_log_dir_relative"] == os.path.join("runs", run)
    assert saved_probe_state(b / "checkpoint-4")["run_log_dir"] == str(b / "runs" / run)


def test_checkpoint_with_only_the_absolute_path_finds_the_moved_run(tmp_path):
    """Checkpoints written before the relative path was recorded keep working after a move."""
    a, b, run = first_run_then_move(tmp_path)
    state_file = b / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["stateful_callbacks"]["AttnProbeCallback"]["attributes"].pop("run_log_dir_relative", None)
    state_file.write_text(json.dumps(state))
    a.write_text("not a directory")
    messages = train(b, 4, resume=b / "checkpoint-2")
    assert trajectories(tmp_path) == [str(b / "runs" / run / "attn_probe.jsonl")]
    assert layer0_steps(b / "runs" / run / "attn_probe.jsonl") == [0, 1, 2, 3, 4]
    (warned,) = [m for m in messages if "no longer exists" in m]
    assert str(a / "runs" / run) in warned and str(b / "runs" / run) in warned


def test_unreachable_saved_run_falls_back_to_a_fresh_run_with_one_warning(tmp_path):
    """Resumed into another output_dir while the recorded path is blocked: a new run, not an error."""
    a, b, run = first_run_then_move(tmp_path)
    a.write_text("not a directory")
    c = tmp_path / "out_c"
    messages = train(c, 4, resume=b / "checkpoint-2")
    (fresh,) = (c / "runs").iterdir()
    assert layer0_steps(fresh / "attn_probe.jsonl") == [2, 3, 4]
    assert layer0_steps(b / "runs" / run / "attn_probe.jsonl") == [0, 1, 2]  # the earlier run, untouched
    (warned,) = [m for m in messages if "cannot continue" in m]
    assert str(a / "runs" / run) in warned and str(fresh) in warned and "from step 2" in warned
    ea = EventAccumulator(str(fresh), size_guidance={"scalars": 0})
    ea.Reload()
    assert "train/loss" in ea.Tags()["scalars"]  # the Trainer's TensorBoard follows the probe there


def test_unwritable_saved_run_falls_back_to_a_fresh_run_with_one_warning(tmp_path):
    """The saved run exists but its trajectory cannot be written: train() goes on in a new run."""
    out = tmp_path / "out"
    train(out, 2)
    (run,) = (out / "runs").iterdir()
    (run / "attn_probe.jsonl").unlink()
    (run / "attn_probe.jsonl").mkdir()  # stands for any write error (root ignores permissions)
    messages = train(out, 4, resume=out / "checkpoint-2")
    (fresh,) = [d for d in (out / "runs").iterdir() if d != run]
    assert layer0_steps(fresh / "attn_probe.jsonl") == [2, 3, 4]
    (warned,) = [m for m in messages if "cannot continue" in m]
    assert str(run) in warned and str(fresh) in warned
