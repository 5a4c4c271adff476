"""Fault injection: the probe never stops training; resume keeps steps unique and ordered."""

import json
import math
import os
import time
import warnings

import pytest
import torch
from helpers import SEQ, VOCAB, RandomTokens, make_args, tiny_bert
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import Trainer

import attn_probe
from attn_probe.core import DEFAULT_METRICS
from attn_probe.live.probe import LogDirError, Probe, QKPair


def jsonl(log_dir):
    with open(os.path.join(log_dir, "attn_probe.jsonl")) as f:
        return [json.loads(line) for line in f if '"run_header"' not in line]


def probe_warnings(record):
    return [w for w in record if "attn_probe" in str(w.message)]


class ExplodingPair(QKPair):
    """A real score pair that fails at chosen steps (the pair extension point)."""

    def __init__(self, fail_calls):
        self.calls, self.fail_calls = 0, set(fail_calls)

    def score(self, layer, query, key, **kw):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise RuntimeError("injected failure inside the probe")
        return super().score(layer, query, key, **kw)


def test_exception_inside_the_probe_never_stops_training(tmp_path):
    # every=1 over 6 steps, 2 layers: calls 1-2 at step 0, 3-4 at step 1, 5 fails at step 2 (its second
    # layer is then not scored), 6-7 step 3, 8-9 step 4, 10 fails at step 5
    pair = ExplodingPair(fail_calls={5, 10})
    cb = attn_probe.AttnProbeCallback(every=1, log_dir=str(tmp_path / "tb"), pairs=[pair])
    trainer = Trainer(model=tiny_bert(), args=make_args(tmp_path, 6), train_dataset=RandomTokens(), callbacks=[cb])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    assert trainer.state.global_step == 6  # training completed
    ours = probe_warnings(record)
    assert len(ours) == 1  # warned once although it failed twice
    assert "injected failure" in str(ours[0].message) and "Traceback" in str(ours[0].message)
    steps = sorted({r["step"] for r in jsonl(tmp_path / "tb")})
    assert steps == [0, 1, 3, 4, 6]  # the failing snapshots are skipped, the others written


def test_nan_weights_are_logged_as_nan_with_one_warning(tmp_path):
    model = tiny_bert()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        probe = attn_probe.watch(model, optimizer=opt, log_dir=str(tmp_path), every=1)
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()  # snapshot at step 1, healthy
        with torch.no_grad():  # a NaN in one layer (training on would spread it everywhere)
            model.bert.encoder.layer[1].attention.self.query.weight[0, 0] = float("nan")
        probe.snapshot(2)
        probe.snapshot(3)
        probe.close()
    assert len(probe_warnings(record)) == 1
    rows = jsonl(tmp_path)
    layer1 = [r for r in rows if r["layer"] == 1 and r["step"] >= 2]
    layer0 = [r for r in rows if r["layer"] == 0]
    assert layer1 and all(r["value"] is None for r in layer1)  # NaN -> null in the trajectory
    assert all(r["value"] is not None and math.isfinite(r["value"]) for r in layer0)
    ea = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    ea.Reload()
    assert all(math.isnan(e.value) for e in ea.Scalars("attn_probe/self/symmetry/layer_01") if e.step >= 2)
    assert all(math.isfinite(e.value) for e in ea.Scalars("attn_probe/self/symmetry/median"))  # finite layers


def test_resume_from_checkpoint_continues_without_duplicates(tmp_path, monkeypatch):
    log_dir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(log_dir))  # both runs log into one TensorBoard run
    kw = dict(save_strategy="steps", save_steps=4, report_to=["tensorboard"])
    first = Trainer(model=tiny_bert(), args=make_args(tmp_path / "out", 8, **kw), train_dataset=RandomTokens(),
                    callbacks=[attn_probe.AttnProbeCallback(every=3)])
    first.train()  # snapshots 0, 3, 6, 8; "crash" after step 8, resume from step 4
    assert sorted({r["step"] for r in jsonl(log_dir)}) == [0, 3, 6, 8]
    # a real resume starts in a later second: event files are named by start time (1 s
    # resolution), then by a per-process counter that sorts as text ("10" < "9")
    time.sleep(1.1)
    second = Trainer(model=tiny_bert(), args=make_args(tmp_path / "out", 8, **kw), train_dataset=RandomTokens(),
                     callbacks=[attn_probe.AttnProbeCallback(every=3)])
    second.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    rows = jsonl(log_dir)
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps) and sorted(set(steps)) == [0, 3, 4, 6, 8]
    # 5 snapshots x 2 layers x the metrics, and the random-matrix range once (2 layers x 4): no duplicates
    assert len(rows) == 5 * 2 * len(DEFAULT_METRICS) + 2 * 4

    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    ea.Reload()
    for tag in ("attn_probe/self/symmetry/layer_00", "attn_probe/self/directionality/median"):
        assert [e.step for e in ea.Scalars(tag)] == [0, 3, 4, 6, 8], tag
    # the Trainer's own losses survive: first run up to step 2, resumed run from step 6 on
    assert [e.step for e in ea.Scalars("train/loss")] == [2, 6, 8]
    # the resumed values at step 8 are the resumed run's (its trajectory rows)
    resumed8 = {(r["layer"], r["metric"]): r["value"] for r in rows if r["step"] == 8}
    tb8 = {e.step: e.value for e in ea.Scalars("attn_probe/self/symmetry/layer_00")}[8]
    assert tb8 == pytest.approx(resumed8[(0, "symmetry")], abs=1e-6)


def test_unwritable_log_dir_fails_at_start(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the log directory should go")
    with pytest.raises(LogDirError, match="cannot write its log directory"):
        Probe(tiny_bert(), log_dir=str(blocker / "runs"))
    cb = attn_probe.AttnProbeCallback(every=1, log_dir=str(blocker / "runs"))
    trainer = Trainer(model=tiny_bert(), args=make_args(tmp_path, 3), train_dataset=RandomTokens(), callbacks=[cb])
    with pytest.raises(LogDirError):
        trainer.train()
    assert trainer.state.global_step == 0  # nothing trained: the error came at the start
    if os.geteuid() != 0:  # permissions do not bind root
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(LogDirError):
            Probe(tiny_bert(), log_dir=str(ro / "x"))


def test_plain_loop_resume_with_start_step_purges_stale_steps(tmp_path):
    def train(probe_kwargs, steps, seed):
        model = tiny_bert(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with attn_probe.watch(model, optimizer=opt, log_dir=str(tmp_path), every=1, **probe_kwargs):
            for i in range(steps):
                ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(i))
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()

    train({}, 4, seed=0)  # steps 0..4, then "crash"
    train({"start_step": 2}, 2, seed=1)  # resume at step 2 with other weights: steps 2..4 again
    rows = jsonl(tmp_path)
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps) and len(rows) == 5 * 2 * len(DEFAULT_METRICS) + 2 * 4  # + the range, once
    ea = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    ea.Reload()
    events = ea.Scalars("attn_probe/self/symmetry/layer_00")
    assert [e.step for e in events] == [0, 1, 2, 3, 4]
    resumed = {r["step"]: r["value"] for r in rows if r["layer"] == 0 and r["metric"] == "symmetry"}
    assert [e.value for e in events] == pytest.approx([resumed[s] for s in range(5)], abs=1e-6)
