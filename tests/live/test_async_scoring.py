"""The asynchronous scoring mode (``async_scoring=True``): same numbers as the synchronous mode,
scored from copies taken at the snapshot, one in flight, failures isolated, nothing lost at close."""

from __future__ import annotations

import json
import threading
import warnings

import pytest
import torch
from helpers import tiny_bert, tiny_llama

import attn_probe
from attn_probe.live.stages.measurement import Measurement
from attn_probe.scoring.pairs import QKPair


def llama(layers=4):
    return tiny_llama(0, layers)


def jsonl(log_dir):
    out = {}
    with open(f"{log_dir}/attn_probe.jsonl") as f:
        for line in f:
            if '"run_header"' in line:  # a run header, not a row
                continue
            rec = json.loads(line)
            if "metric" in rec:
                out[(rec["step"], rec["group"], rec["layer"], rec.get("head"), rec["metric"])] = rec["value"]
    return out


def train_step(model, opt, gen):
    ids = torch.randint(0, 40, (2, 8), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


class Gate:
    """Holds the worker inside ``Measurement.score_stacked`` (the scoring core) until released."""

    def __init__(self, monkeypatch):
        self.entered, self.release = threading.Event(), threading.Event()
        real = Measurement.score_stacked

        def gated(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                self.entered.set()
                assert self.release.wait(30)
            return real(*args, **kwargs)

        monkeypatch.setattr(Measurement, "score_stacked", gated)


@pytest.mark.parametrize("per_head", [False, True])
def test_async_equals_sync_over_a_training_run(tmp_path, per_head):
    runs = {}
    for mode in (False, True):
        model = llama()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        gen = torch.Generator().manual_seed(1)
        probe = attn_probe.watch(model, log_dir=str(tmp_path / str(mode)), every=2, optimizer=opt,
                                 per_head=per_head, async_scoring=mode)
        for _ in range(7):
            train_step(model, opt, gen)
            probe.flush()  # no skips: every step of the synchronous run is compared
        probe.close()
        runs[mode] = jsonl(tmp_path / str(mode))
    sync, asyn = runs[False], runs[True]
    assert {k[0] for k in sync} == {0, 2, 4, 6, 7}
    assert set(asyn) == set(sync)
    for key, value in asyn.items():
        assert abs(value - sync[key]) <= 1e-6 * max(1.0, abs(sync[key])), key


def test_scores_the_weights_of_the_snapshot_not_later_ones(tmp_path, monkeypatch):
    model = llama(layers=2)
    want = {(r["layer"], m): r[m] for r in attn_probe.score_model(model) for m in ("symmetry", "spectral_norm")}
    gate = Gate(monkeypatch)
    probe = attn_probe.watch(model, log_dir=str(tmp_path / "run"), every=1000, async_scoring=True)
    assert gate.entered.wait(30)  # the attach snapshot (step 0) is being scored from its copies
    with torch.no_grad():  # training moves on meanwhile: the weights change under the worker
        for p in model.parameters():
            p.mul_(-3.0).add_(1.0)
    gate.release.set()
    probe.close(final_snapshot=False)
    got = jsonl(tmp_path / "run")
    for (layer, metric), value in want.items():
        assert got[(0, "self", layer, None, metric)] == pytest.approx(value, rel=1e-6, abs=1e-6), (layer, metric)


def test_a_snapshot_due_while_one_is_scored_is_skipped_and_counted(tmp_path, monkeypatch):
    model = llama(layers=2)
    gate = Gate(monkeypatch)
    probe = attn_probe.watch(model, log_dir=str(tmp_path / "run"), every=1, async_scoring=True)
    assert gate.entered.wait(30)
    with pytest.warns(RuntimeWarning, match="still being scored"):
        probe.on_update()  # step 1: due, skipped
    probe.on_update()  # step 2: skipped, counted without a warning
    assert probe.skipped_snapshots == 2
    gate.release.set()
    assert probe.flush()
    probe.on_update()  # step 3: scored
    probe.close(final_snapshot=False)
    assert sorted({k[0] for k in jsonl(tmp_path / "run")}) == [0, 3]


def test_a_failing_asynchronous_snapshot_is_reported_and_the_next_one_logs(tmp_path, monkeypatch):
    model = llama(layers=2)
    real = Measurement.score_stacked
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(Measurement, "score_stacked", flaky)
    probe = attn_probe.watch(model, log_dir=str(tmp_path / "run"), every=1, async_scoring=True)
    probe.flush()
    with pytest.warns(RuntimeWarning, match="device lost"):
        probe.on_update()  # step 1 fails on the worker
        probe.flush()
    probe.on_update()
    probe.close()
    assert probe.failures == 1
    assert sorted({k[0] for k in jsonl(tmp_path / "run")}) == [0, 2]


def test_close_waits_for_the_snapshot_in_flight_and_takes_the_final_one(tmp_path, monkeypatch):
    model = llama(layers=2)
    gate = Gate(monkeypatch)
    probe = attn_probe.watch(model, log_dir=str(tmp_path / "run"), every=1000, async_scoring=True)
    assert gate.entered.wait(30)
    probe.on_update(5)
    threading.Timer(0.3, gate.release.set).start()
    probe.close()  # waits for step 0, then the final snapshot at 5
    assert sorted({k[0] for k in jsonl(tmp_path / "run")}) == [0, 5]


def test_over_the_copy_budget_it_scores_synchronously_with_one_warning(tmp_path):
    model = llama(layers=2)
    with pytest.warns(RuntimeWarning, match="async_max_bytes"):
        probe = attn_probe.watch(model, log_dir=str(tmp_path / "run"), every=1, async_scoring=True,
                                 async_max_bytes=1000)
    assert not probe.measurement.pending()  # scored on the training thread
    snap = probe.snapshot(1)
    assert snap is not None and snap.records
    probe.close()
    assert sorted({k[0] for k in jsonl(tmp_path / "run")}) == [0, 1]


def test_pairs_that_score_themselves_get_copies_too(tmp_path, monkeypatch):
    seen = []

    class Own(QKPair):
        prefix = "own_"

        def score(self, layer, query, key, *, per_head, num_std):
            seen.append(query.data_ptr())
            return super().score(layer, query, key, per_head=per_head, num_std=num_std)

    model = llama(layers=2)
    weights = {p.data_ptr() for p in model.parameters()}
    probe = attn_probe.watch(model, log_dir=str(tmp_path / "run"), async_scoring=True,
                             pairs=[QKPair(("symmetry",)), Own(("symmetry",))])
    probe.close()
    assert seen and not weights & set(seen)
def tiny_trainer_setup(tmp_path, max_steps):
    """A tiny BERT, random MLM data and CPU TrainingArguments with ``max_steps``."""
    from transformers import TrainingArguments

    model = tiny_bert(0, vocab=40, seq=16, intermediate=48)
    data = [{"input_ids": torch.randint(0, 40, (8,)), "labels": torch.randint(0, 40, (8,))} for _ in range(16)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=max_steps,
                             report_to="none", logging_steps=100, save_strategy="no", use_cpu=True)
    return model, data, args


def test_async_mode_in_a_real_trainer(tmp_path):
    from transformers import Trainer

    from attn_probe.integrations.transformers import AttnProbeCallback

    model, data, args = tiny_trainer_setup(tmp_path, max_steps=8)
    cb = AttnProbeCallback(every=2, log_dir=str(tmp_path / "tb"), async_scoring=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no failure (a skip may happen on a slow machine)
        warnings.filterwarnings("ignore", message=".*still being scored.*")
        Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    steps = {k[0] for k in jsonl(tmp_path / "tb")}
    assert 8 in steps and steps <= {0, 2, 4, 6, 8}


def test_flush_reports_a_snapshot_still_being_scored(tmp_path, monkeypatch):
    model = llama(layers=2)
    gate = Gate(monkeypatch)
    probe = attn_probe.watch(model, log_dir=str(tmp_path / "run"), every=1000, async_scoring=True)
    assert gate.entered.wait(30)
    assert probe.flush(timeout=0.2) is False  # step 0 is still being scored
    gate.release.set()
    assert probe.flush() is True
    probe.close(final_snapshot=False)
    assert sorted({k[0] for k in jsonl(tmp_path / "run")}) == [0]


def test_close_with_a_stuck_worker_abandons_it_and_still_takes_the_final_snapshot(tmp_path, monkeypatch):
    model = llama(layers=2)
    gate = Gate(monkeypatch)
    probe = attn_probe.watch(model, log_dir=str(tmp_path / "run"), every=1000, async_scoring=True,
                             sink_timeout=0.5)
    assert gate.entered.wait(30)
    probe.on_update(5)
    with pytest.warns(RuntimeWarning, match="still being scored after 0.5 s at close"):
        probe.close()  # step 0 never finishes in time: abandoned; step 5 scored on this thread
    gate.release.set()
    assert sorted({k[0] for k in jsonl(tmp_path / "run")}) == [5]


def test_trainer_final_snapshot_reaches_the_sinks_before_train_end_while_one_is_in_flight(tmp_path, monkeypatch):
    """The tracker callbacks end their runs in on_train_end: the final snapshot must be out by then."""
    from transformers import Trainer, TrainerCallback

    from attn_probe.integrations.transformers import AttnProbeCallback

    class Steps:  # a sink on the training thread that records what reached it
        def __init__(self):
            self.steps = []

        def start(self, run):
            pass

        def log(self, snapshot):
            self.steps.append(snapshot.step)

        def finish(self):
            pass

    sink = Steps()
    seen_at_train_end = []

    class AtTrainEnd(TrainerCallback):  # runs before the probe's callback, like a tracker's
        def on_train_end(self, args, state, control, **kwargs):
            seen_at_train_end.extend(sink.steps)

    real = Measurement.score_stacked

    def slow(*args, **kwargs):  # the snapshot of step 2 is still scored when step 4 ends
        if threading.current_thread() is not threading.main_thread():
            threading.Event().wait(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(Measurement, "score_stacked", slow)
    model, data, args = tiny_trainer_setup(tmp_path, max_steps=3)
    cb = AttnProbeCallback(every=2, log_dir=str(tmp_path / "tb"), async_scoring=True, sinks=[sink])
    Trainer(model=model, args=args, train_dataset=data, callbacks=[AtTrainEnd(), cb]).train()
    assert 3 in seen_at_train_end, seen_at_train_end


EXIT_SCRIPT = """
import sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
import attn_probe
from attn_probe.scoring.pairs import QKPair

class SlowQK(QKPair):  # still scoring (in torch) when the script ends
    def score(self, *args, **kwargs):
        time.sleep(0.5)
        return super().score(*args, **kwargs)

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
model = LlamaForCausalLM(cfg)
probe = attn_probe.watch(model, log_dir=sys.argv[1], every=1000, pairs=[SlowQK()], async_scoring=True)
probe.flush()  # the attach snapshot (step 0) is written
probe.step = 7
probe.snapshot()  # in flight; the script ends without close()
print("pending", probe.measurement.pending(), flush=True)
"""


def test_a_probe_never_closed_writes_its_snapshot_in_flight_at_exit(tmp_path):
    # a real interpreter exit: the worker must not be left inside torch (it aborted the
    # process, exit 134), and the snapshot it was scoring reaches the files
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "never_closed.py"
    script.write_text(EXIT_SCRIPT)
    log_dir = tmp_path / "run"
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), str(log_dir)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pending True" in done.stdout
    assert sorted({key[0] for key in jsonl(log_dir)}) == [0, 7]
