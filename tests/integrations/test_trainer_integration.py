"""attach(trainer), the one-line announcement, the final snapshot before on_train_end, resume into the saved run."""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import pytest
import torch
from helpers import RandomTokens, make_args, tiny_bert
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
from transformers import Trainer, TrainerCallback

import attn_probe
from attn_probe.integrations.transformers import AttnProbeCallback
from attn_probe.sinks.live_view import SCALARS_PER_TAG

make_args = functools.partial(make_args, report_to=["tensorboard"])


def steps_in(log_dir):
    with open(os.path.join(log_dir, "attn_probe.jsonl")) as f:
        return sorted({json.loads(line)["step"] for line in f if '"run_header"' not in line})


def test_attach_puts_the_callback_first_and_logs_into_the_trainers_tensorboard_run(tmp_path, capsys):
    trainer = Trainer(model=tiny_bert(), args=make_args(tmp_path, 6), train_dataset=RandomTokens())
    cb = attn_probe.attach(trainer, every=2)
    assert trainer.callback_handler.callbacks[0] is cb
    with pytest.raises(ValueError, match="already has"):
        attn_probe.attach(trainer, every=2)
    trainer.train()
    err = capsys.readouterr().err
    assert "attn_probe: watching 2 attention layers of BertForMaskedLM every 2 optimizer steps ->" in err
    assert f"--samples_per_plugin scalars={SCALARS_PER_TAG}" in err
    assert "--samples_per_plugin scalars=0" not in err
    runs = [d for d in (tmp_path / "runs").iterdir()]
    assert len(runs) == 1  # scores and the Trainer's loss in one run
    ea = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0})
    ea.Reload()
    assert "train/loss" in ea.Tags()["scalars"]
    assert [e.step for e in ea.Scalars("attn_probe/self/symmetry/layer_00")] == [0, 2, 4, 6]
    # the printed live view names the directory holding the run: TensorBoard reads the run there
    # under its own name (given the run directory itself, it would call the run ".")
    (logdir,) = re.findall(r"\(live view: tensorboard --logdir (\S+) --samples_per_plugin", err)
    assert Path(logdir) == tmp_path / "runs"
    served = EventMultiplexer().AddRunsFromDirectory(logdir)
    assert served.Runs().keys() == {runs[0].name}


class Order(TrainerCallback):
    """Records, at on_train_end, the steps the probe had written by then (as a tracker would see)."""

    def __init__(self, log_dir):
        self.log_dir, self.seen = log_dir, None

    def on_train_end(self, args, state, control, **kw):
        self.seen = steps_in(self.log_dir)


def test_final_snapshot_is_taken_before_other_callbacks_end_their_runs(tmp_path):
    log_dir = tmp_path / "probe"
    order = Order(log_dir)
    trainer = Trainer(model=tiny_bert(), args=make_args(tmp_path, 5), train_dataset=RandomTokens(),
                      callbacks=[order, AttnProbeCallback(every=2, log_dir=str(log_dir))])
    trainer.train()
    # the recorder runs *before* the probe in on_train_end, like the tracker integrations
    assert order.seen == [0, 2, 4, 5]
    assert steps_in(log_dir) == [0, 2, 4, 5]


def test_missing_callback_handler_warns(tmp_path):
    cb = AttnProbeCallback(every=1)
    args = make_args(tmp_path, 1)

    class State:
        is_world_process_zero = True
        global_step = 0
        max_steps = 1
        stateful_callbacks = {}

    with pytest.warns(RuntimeWarning, match="callback handler"):
        cb.on_train_begin(args, State(), None, model=tiny_bert())
    cb.on_train_end(args, State(), None)


def test_resumed_run_continues_the_run_saved_with_the_checkpoint(tmp_path):
    out = tmp_path / "out"
    kw = dict(save_strategy="steps", save_steps=4)
    first = Trainer(model=tiny_bert(), args=make_args(out, 8, **kw), train_dataset=RandomTokens())
    attn_probe.attach(first, every=3)
    first.train()
    (run_dir,) = list((out / "runs").iterdir())
    saved = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["AttnProbeCallback"]["attributes"]["run_log_dir"] == str(run_dir)
    import time

    time.sleep(1.1)  # a real resume starts later: a new default run name would differ
    second = Trainer(model=tiny_bert(), args=make_args(out, 8, **kw), train_dataset=RandomTokens())
    attn_probe.attach(second, every=3)
    second.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert [d.name for d in (out / "runs").iterdir()] == [run_dir.name]  # no second run directory
    assert steps_in(run_dir) == [0, 3, 4, 6, 8]
    ea = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("attn_probe/self/symmetry/layer_00")] == [0, 3, 4, 6, 8]
    assert [e.step for e in ea.Scalars("train/loss")] == [2, 6, 8]  # the Trainer's loss in the same run


def test_invalid_tracker_option_fails_at_construction():
    with pytest.raises(TypeError, match="trackers"):
        AttnProbeCallback(trackers=[1, 2])


def test_a_training_loop_entered_again_replaces_the_rows_of_the_abandoned_one(tmp_path):
    # auto_find_batch_size: after an out-of-memory error the Trainer shrinks the batch and runs its
    # training loop again from step 0, with no on_train_end in between
    class OutOfMemoryOnce(TrainerCallback):
        fired = False

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2 and not self.fired:
                self.fired = True
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    out = tmp_path / "out"
    trainer = Trainer(model=tiny_bert(), args=make_args(out, 5, auto_find_batch_size=True),
                      train_dataset=RandomTokens(), callbacks=[OutOfMemoryOnce()])
    attn_probe.attach(trainer, every=1)
    with pytest.warns(RuntimeWarning, match="entered its training loop again at step 0"):
        trainer.train()
    assert trainer._train_batch_size < 8  # it retried with a smaller batch
    (run_dir,) = list((out / "runs").iterdir())
    with open(run_dir / "attn_probe.jsonl") as f:
        rows = [json.loads(line) for line in f if '"run_header"' not in line]
    keys = [(r["step"], r["group"], r["layer"], r.get("head"), r["metric"]) for r in rows]
    assert len(keys) == len(set(keys))  # each step once: the first attempt's rows were dropped
    assert sorted({k[0] for k in keys}) == [0, 1, 2, 3, 4, 5]
    # the rows left are the second loop's: step 5 equals the trained model's scores
    want = {(r["group"], r["layer"]): r["symmetry"] for r in attn_probe.score_model(trainer.model)}
    got = {(r["group"], r["layer"]): r["value"] for r in rows
           if r["step"] == 5 and r["metric"] == "symmetry" and r.get("head") is None}
    assert got == pytest.approx(want, abs=1e-6)
