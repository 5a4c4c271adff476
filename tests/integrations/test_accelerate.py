"""Counting real optimizer updates: Accelerate with gradient accumulation, plain loops, skipped steps."""

import json
import os

import pytest
import torch
from helpers import SEQ, VOCAB, tiny_bert
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import attn_probe
from attn_probe.live.schedules import every


def batches(n, size=4):
    return [torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def snapshot_steps(log_dir):
    with open(os.path.join(log_dir, "attn_probe.jsonl")) as f:
        return sorted({json.loads(line)["step"] for line in f if '"run_header"' not in line})


def expected_steps(schedule, updates):
    fired = [s for s in range(updates + 1) if schedule(s)]
    return fired if fired[-1] == updates else fired + [updates]  # close() adds the final state


def test_accelerate_gradient_accumulation_and_tracker(tmp_path, fresh_accelerate_state):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3, log_with="tensorboard",
                              project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    model = tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(torch.cat(batches(11)), batch_size=4)  # 11 micro-batches
    model, opt, loader = accelerator.prepare(model, opt, loader)
    schedule = every(2)
    probe = attn_probe.watch(model, accelerator=accelerator, every=schedule)
    updates = micro = 0
    for ids in loader:
        micro += 1
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            if accelerator.sync_gradients:  # the reference: Accelerate's own notion of an update
                updates += 1
                accelerator.log({"loss": loss.item()}, step=updates)
    assert micro == 11 and updates == 4  # 3, 6, 9 and the end of the data loader
    assert probe.step == updates
    probe.close()
    accelerator.end_training()
    run = tmp_path / "run"  # the tracker's run directory: loss and scores side by side
    assert snapshot_steps(run) == expected_steps(schedule, updates) == [0, 2, 4]
    ea = EventAccumulator(str(run), size_guidance={"scalars": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("loss")] == [1, 2, 3, 4]
    assert [e.step for e in ea.Scalars("attn_probe/self/symmetry/layer_01")] == [0, 2, 4]


def test_accelerate_requires_prepared_optimizer(tmp_path, fresh_accelerate_state):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="after accelerator.prepare"):
        attn_probe.watch(tiny_bert(), accelerator=accelerator, log_dir=str(tmp_path))


def test_watch_before_init_trackers_says_the_trackers_get_nothing(tmp_path, fresh_accelerate_state, monkeypatch):
    import warnings

    from accelerate import Accelerator

    monkeypatch.chdir(tmp_path)  # the probe's default directory lands here
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path / "project"))
    model = tiny_bert()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    with pytest.warns(RuntimeWarning, match=r"logs with tensorboard, but accelerator.init_trackers\(\) has not run"):
        attn_probe.watch(model, accelerator=accelerator).close()
    accelerator.init_trackers("run")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*init_trackers.*")
        probe = attn_probe.watch(model, accelerator=accelerator)
    probe.close()
    accelerator.end_training()
    assert snapshot_steps(tmp_path / "project" / "run") == [0]  # in the tracker's run once it is started


def test_plain_loop_counts_optimizer_steps_not_micro_batches(tmp_path):
    model = tiny_bert()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = every(3)
    probe = attn_probe.watch(model, optimizer=opt, log_dir=str(tmp_path), every=schedule)
    updates = 0
    for i, ids in enumerate(batches(14)):
        (model(input_ids=ids, labels=ids).loss / 2).backward()
        if i % 2 == 1:  # accumulate 2 micro-batches per update
            opt.step()
            opt.zero_grad()
            updates += 1
    probe.close()
    assert updates == 7 and snapshot_steps(tmp_path) == expected_steps(schedule, updates) == [0, 3, 6, 7]


def test_grad_scaler_skipped_steps_are_not_counted(tmp_path):
    model = tiny_bert()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    probe = attn_probe.watch(model, optimizer=opt, log_dir=str(tmp_path), every=1)
    applied = 0
    for i, ids in enumerate(batches(6)):
        scaler.scale(model(input_ids=ids, labels=ids).loss).backward()
        if i in (1, 4):  # an overflowing gradient: the scaler skips this optimizer step
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        applied += scaler.get_scale() >= before  # the scale shrinks exactly when a step was skipped
        opt.zero_grad()
    probe.close()
    assert applied == 4 and probe.step == 4
    assert snapshot_steps(tmp_path) == [0, 1, 2, 3, 4]
