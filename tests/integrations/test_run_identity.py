"""A run is its run id (issue 35, "Lineage"): real Trainer runs with
``restore_callback_states_from_checkpoint=True``, which sets a checkpoint's saved attributes on the
live callback.

Run A (``output_dir=A``), branched from ``A/checkpoint-2`` into ``output_dir=B``: B's checkpoints
must record B's own run id (the id in B's trajectory header), never A's, and resuming B from its
own checkpoint continues B. Where the run-directory names collide (two jobs started in the same
second on one host get the same default name; forced here through the name the callback asks
:mod:`attn_probe.formats.logdir` for), branching back from B's checkpoint into A's ``output_dir`` must
leave every line of A's run as it was. A run header edited or deleted by hand gives a message
that says so, not "another output_dir". The references are the files read back line by line.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

import pytest
from helpers import lines_by_run, make_args, train_probed

import attn_probe.integrations.transformers as hf_integration

make_args = functools.partial(make_args, save_strategy="steps", save_steps=2,
                              restore_callback_states_from_checkpoint=True)
NAME = "Nov28_10-00-00_node1"  # the default run-directory name two jobs started in one second share
RUN_NAME = os.path.join("runs", NAME)


def train(out, steps, resume=None):
    return train_probed(make_args(out, steps), resume)


def headers(path):
    with open(path, "rb") as f:
        return [json.loads(line)["run_header"] for line in f if b'"run_header"' in line]


def saved_attributes(checkpoint):
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return state["stateful_callbacks"]["AttnProbeCallback"]["attributes"]


def layer0_steps(path):
    rows = [json.loads(line) for _, line in lines_by_run(path)]
    return [r["step"] for r in rows if r.get("metric") == "symmetry" and r["layer"] == 0 and r["head"] is None]


def test_branch_checkpoints_record_the_branch_id_and_resume_continues_it(tmp_path):
    a, b = tmp_path / "A", tmp_path / "B"
    train(a, 4)
    (a_run,) = (a / "runs").iterdir()
    (a_header,) = headers(a_run / "attn_probe.jsonl")
    train(b, 4, resume=a / "checkpoint-2")
    (b_run,) = (b / "runs").iterdir()
    (b_header,) = headers(b_run / "attn_probe.jsonl")
    assert b_header["run_id"] != a_header["run_id"] and b_header["parent_run"] == a_header["run_id"]
    # the branch's own checkpoint names the branch's run, not the parent's (restored over it before)
    saved = saved_attributes(b / "checkpoint-4")
    assert saved["run_id"] == b_header["run_id"]
    assert saved["run_log_dir"] == str(b_run)

    messages = train(b, 6, resume=b / "checkpoint-4")
    assert [d.name for d in (b / "runs").iterdir()] == [b_run.name]  # no fork into a new directory
    assert not [m for m in messages if "branched" in m or "new run directory" in m], messages
    ids = [h["run_id"] for h in headers(b_run / "attn_probe.jsonl")]
    assert ids == [b_header["run_id"]] * 2  # the branch, resumed: one run id
    assert layer0_steps(b_run / "attn_probe.jsonl") == [2, 3, 4, 5, 6]
    assert saved_attributes(b / "checkpoint-6")["run_id"] == b_header["run_id"]


def test_branching_back_into_the_parent_output_dir_keeps_every_parent_line(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_integration, "default_log_dir", lambda root="runs": os.path.join(root, NAME))
    a, b = tmp_path / "A", tmp_path / "B"
    train(a, 6)
    a_file = a / RUN_NAME / "attn_probe.jsonl"
    train(b, 6, resume=a / "checkpoint-2")
    assert (b / RUN_NAME / "attn_probe.jsonl").is_file()  # the branch's directory has the parent's name
    before = lines_by_run(a_file)
    (a_id,) = {run for run, _ in before}
    digest = hashlib.sha256(b"".join(line for _, line in before)).hexdigest()

    messages = train(a, 6, resume=b / "checkpoint-4")  # the branch's checkpoint, back under A

    after = lines_by_run(a_file)
    assert hashlib.sha256(b"".join(line for run, line in after if run == a_id)).hexdigest() == digest
    assert len([line for run, line in after if run == a_id]) == len(before)
    (b_id,) = {h["run_id"] for h in headers(b / RUN_NAME / "attn_probe.jsonl")}
    # a new run, the branch's child, in a directory of its own
    new = [d for d in (a / "runs").iterdir() if d.name != NAME]
    assert [d.name for d in new] == [f"{NAME}_1"]  # beside A's, never in it
    (header,) = headers(new[0] / "attn_probe.jsonl")
    assert header["run_id"] not in (a_id, b_id)
    assert (header["parent_run"], header["parent_step"]) == (b_id, 4)
    assert layer0_steps(new[0] / "attn_probe.jsonl") == [4, 5, 6]
    (line,) = [m for m in messages if "branched" in m]
    assert str(b) in line and b_id in line


@pytest.mark.parametrize("damage", ["edited", "deleted"])
def test_a_damaged_header_is_named_not_taken_for_another_output_dir(tmp_path, damage):
    a = tmp_path / "A"
    train(a, 4)
    (a_run,) = (a / "runs").iterdir()
    path = a_run / "attn_probe.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    header = json.loads(lines[0])
    a_id = header["run_header"]["run_id"]
    if damage == "edited":
        header["run_header"]["run_id"] = "0" * 32
        lines[0] = (json.dumps(header) + "\n").encode()
    else:
        del lines[0]
    path.write_bytes(b"".join(lines))
    kept = path.read_bytes()

    messages = train(a, 4, resume=a / "checkpoint-2")

    assert not [m for m in messages if "another output_dir" in m or "branched" in m], messages
    (line,) = [m for m in messages if "cannot continue" in m]
    assert a_id in line and str(path) in line
    assert ("edited" if damage == "edited" else "deleted") in line
    assert path.read_bytes() == kept  # not the resumed run's file any more: left as it is
