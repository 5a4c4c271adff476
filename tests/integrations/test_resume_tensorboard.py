"""Every resume path leaves each step once in TensorBoard, with the resumed run's values.

Read back with TensorBoard's own EventAccumulator (``size_guidance`` 0: every event). The
Trainer path is covered in ``test_faults.py``; here: Accelerate's tracker writer, a plain
loop with the probe's own writer, and a plain loop with a borrowed ``writer=``.
"""

import json
import os
import time

import pytest
import torch
from helpers import SEQ, VOCAB, tiny_bert
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import attn_probe

TAGS = ("attn_probe/self/symmetry/layer_00", "attn_probe/self/directionality/median")


def batch(i):
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(i))
    return ids


def trajectory(log_dir):
    with open(os.path.join(log_dir, "attn_probe.jsonl")) as f:
        return [json.loads(line) for line in f if '"run_header"' not in line]


def check_each_step_once_with_resumed_values(log_dir, want_steps, resume_step):
    rows = trajectory(log_dir)
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps) and sorted(set(steps)) == want_steps
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    ea.Reload()
    for tag in TAGS:
        events = ea.Scalars(tag)
        assert [e.step for e in events] == want_steps, tag  # each step exactly once, in order
    # the values at and after the resume step are the resumed run's (its trajectory rows)
    jsonl = {r["step"]: r["value"] for r in rows if r["layer"] == 0 and r["metric"] == "symmetry" and r["head"] is None}
    tb = {e.step: e.value for e in ea.Scalars(TAGS[0])}
    assert all(tb[s] == pytest.approx(jsonl[s], abs=1e-6) for s in want_steps if s >= resume_step)
    return ea


def accelerate_run(project_dir, seed, first_update, last_update, **watch_kw):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(project_dir))
    accelerator.init_trackers("run")
    model = tiny_bert(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = accelerator.prepare(model, opt)
    probe = attn_probe.watch(model, accelerator=accelerator, every=5, metrics=("symmetry", "directionality"),
                             **watch_kw)
    for update in range(first_update + 1, last_update + 1):
        ids = batch(seed * 1000 + update)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        accelerator.log({"loss": loss.item()}, step=update)
    assert probe.step == last_update
    probe.close()
    accelerator.end_training()


def test_accelerate_resume_through_the_tracker_writer(tmp_path, fresh_accelerate_state):
    accelerate_run(tmp_path, seed=0, first_update=0, last_update=73)  # the interrupted run reached step 73
    # a real resume starts in a later second: event files are named by start time (1 s resolution)
    time.sleep(1.1)
    accelerate_run(tmp_path, seed=1, first_update=60, last_update=73, start_step=60)  # resumed from step 60
    want = [*range(0, 75, 5), 73]
    ea = check_each_step_once_with_resumed_values(tmp_path / "run", sorted(want), resume_step=60)
    # the user's own stale losses are dropped too: each step once (60 was logged before the checkpoint)
    assert [e.step for e in ea.Scalars("loss")] == [*range(1, 60), *range(61, 74)]


def plain_run(log_dir, seed, start, stop, borrowed):
    from torch.utils.tensorboard import SummaryWriter

    model = tiny_bert(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    writer = SummaryWriter(str(log_dir)) if borrowed else None
    where = {"writer": writer} if borrowed else {"log_dir": str(log_dir)}
    with attn_probe.watch(model, optimizer=opt, every=5, start_step=start, metrics=("symmetry", "directionality"),
                          **where):
        for i in range(start, stop):
            ids = batch(seed * 1000 + i)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    if writer is not None:
        writer.close()


@pytest.mark.parametrize("borrowed", [False, True], ids=["own-writer", "borrowed-writer"])
def test_plain_loop_resume(tmp_path, borrowed):
    plain_run(tmp_path, seed=0, start=0, stop=13, borrowed=borrowed)  # 0, 5, 10, 13
    time.sleep(1.1)
    plain_run(tmp_path, seed=1, start=6, stop=13, borrowed=borrowed)  # resumed at 6: 6, 10, 13
    check_each_step_once_with_resumed_values(tmp_path, [0, 5, 6, 10, 13], resume_step=6)
