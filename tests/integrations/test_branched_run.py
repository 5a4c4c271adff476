"""A run branched from another run's checkpoint (issue 23 item 1): real Trainer runs.

Run A (``output_dir=A``, checkpoints every 2 steps); run B with ``output_dir=B`` resumes from
``A/checkpoint-2``. B must leave every file of A's run byte-identical, write its own run under
B (trajectory from step 2 on, the Trainer's loss beside it), say in one line that it branched
from A's run at step 2, and record the parent in its TensorBoard run header. A plain resume in
the same output_dir continues the same run, also when that run had an explicit log_dir
outside the output_dir.
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings

from helpers import RandomTokens, make_args, tiny_bert, train_probed
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import Trainer

import attn_probe

make_args = functools.partial(make_args, report_to=["tensorboard"], save_strategy="steps", save_steps=2)


class OtherTokens(RandomTokens):
    """Other data than run A's (B is a different experiment)."""

    def __getitem__(self, i):
        return super().__getitem__(i + 1000)


def train(out, steps, resume=None, data=None, **options):
    return train_probed(make_args(out, steps), resume, data, **options)


def files(root):
    """Every file under ``root``: relative path -> sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def layer0_steps(path):
    with open(path) as f:
        rows = [json.loads(line) for line in f if '"run_header"' not in line]
    return [r["step"] for r in rows if r["metric"] == "symmetry" and r["layer"] == 0 and r["head"] is None]


def run_header(run_dir):
    """The configuration block of the probe's TensorBoard config text."""
    ea = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    ea.Reload()
    text = ea.Tensors("attn_probe/config/text_summary")[0].tensor_proto.string_val[0].decode()
    block = text.split("**configuration**\n\n```\n", 1)[1].split("\n```", 1)[0]
    return json.loads(block), ea


def test_branched_run_leaves_the_parent_untouched_and_writes_its_own_run(tmp_path):
    a, b = tmp_path / "A", tmp_path / "B"
    train(a, 6)
    (a_run,) = (a / "runs").iterdir()
    before = files(a / "runs")
    assert layer0_steps(a_run / "attn_probe.jsonl") == [0, 1, 2, 3, 4, 5, 6]

    messages = train(b, 6, resume=a / "checkpoint-2", data=OtherTokens())

    assert files(a / "runs") == before  # A's trajectory and event files byte-identical
    (b_run,) = (b / "runs").iterdir()
    assert layer0_steps(b_run / "attn_probe.jsonl") == [2, 3, 4, 5, 6]
    (line,) = [m for m in messages if "branched" in m]
    assert f"branched from the probe's run {a_run} at step 2" in line and str(b_run) in line and "\n" not in line
    config, ea = run_header(b_run)
    assert config["parent_run"] == str(a_run) and config["parent_step"] == 2
    assert config["output_dir"] == str(b)
    scalars = ea.Tags()["scalars"]
    assert "train/loss" in scalars  # the Trainer's loss of B goes to B's run
    assert [e.step for e in ea.Scalars("attn_probe/self/symmetry/layer_00")] == [2, 3, 4, 5, 6]
    # B's own checkpoint records B's run: resuming B continues B's run, not A's
    saved = json.loads((b / "checkpoint-4" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["AttnProbeCallback"]["attributes"]["run_log_dir"] == str(b_run)


def test_resume_of_the_branch_continues_the_branch(tmp_path):
    a, b = tmp_path / "A", tmp_path / "B"
    train(a, 4)
    before = files(a / "runs")
    train(b, 4, resume=a / "checkpoint-2")
    (b_run,) = (b / "runs").iterdir()
    messages = train(b, 6, resume=b / "checkpoint-4")
    assert files(a / "runs") == before
    assert [d.name for d in (b / "runs").iterdir()] == [b_run.name]
    assert layer0_steps(b_run / "attn_probe.jsonl") == [2, 3, 4, 5, 6]
    assert not [m for m in messages if "branched" in m or "new run directory" in m]


def test_branch_from_a_checkpoint_with_an_explicit_log_dir_leaves_that_directory_alone(tmp_path):
    a, b, logs = tmp_path / "A", tmp_path / "B", tmp_path / "logs" / "a"
    train(a, 4, log_dir=str(logs))
    before = files(logs)
    messages = train(b, 4, resume=a / "checkpoint-2")
    assert files(logs) == before
    (b_run,) = (b / "runs").iterdir()
    assert layer0_steps(b_run / "attn_probe.jsonl") == [2, 3, 4]
    (line,) = [m for m in messages if "branched" in m]
    assert str(logs) in line
    # A resumed in its own output_dir without log_dir= continues its run there (it is A's own)
    trainer = Trainer(model=tiny_bert(), args=make_args(a, 6), train_dataset=RandomTokens())
    attn_probe.attach(trainer, every=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(a / "checkpoint-4"))
    assert layer0_steps(logs / "attn_probe.jsonl") == [0, 1, 2, 3, 4, 5, 6]
    assert not [w for w in caught if "branched" in str(w.message) or "new run directory" in str(w.message)]
