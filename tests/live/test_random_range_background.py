"""The random-matrix range is computed off the training thread (issue 44, "What to build" 3).

Attach starts it on a thread of its own and returns; the rows reach the trajectory with a later
snapshot, or at ``close()`` (and at interpreter exit) on their own; not ready by then, a warning
says they are lost. The reference is the public function itself, called for the layer's shape
and the probe's bound (:func:`attn_probe.baselines.random_range.random_range`).

The computation is held by a gate around the real :func:`random_range_rows` (it records the
thread that calls it, waits for the gate, then computes as usual): on code that computes the range
inside attach, the gate times out on the caller's thread and the tests say so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
from helpers import REPO, tiny_llama

import attn_probe
from attn_probe.baselines import random_range as rr
from attn_probe.baselines.random_range import PROBE_ENTRIES, LayerShape, random_range
from attn_probe.live.stages import random_range as range_stage
from attn_probe.sinks import Sink

#: how long the gate holds the computation when nobody opens it (the old code's attach waits this long)
GATE_SECONDS = 3.0
#: tiny_llama's layers: d 32, 4 query heads of 8, 2 KV heads
SHAPE = LayerShape(32, 8, 4, 2)
NAMES = ("random_symmetry", "random_symmetry_sd", "random_directionality", "random_directionality_sd")
VOCAB = 40


class Gate:
    """Hold :func:`random_range_rows` until :meth:`open`; record the threads that called it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        self.callers: list[int] = []
        real = rr.random_range_rows

        def held(*args, **kwargs):
            self.callers.append(threading.get_ident())
            self.opened.wait(GATE_SECONDS)
            return real(*args, **kwargs)

        monkeypatch.setattr(rr, "random_range_rows", held)

    def open(self) -> None:
        self.opened.set()


class Kept(Sink):
    def __init__(self):
        self.snapshots = []

    def start(self, run):
        pass

    def log(self, snapshot):
        self.snapshots.append(snapshot)

    def finish(self):
        pass


@pytest.fixture(autouse=True)
def fresh_cache():
    rr.clear_cache()  # a cached range would be taken without computing
    yield
    rr.clear_cache()


def rows_of(log_dir) -> list[dict]:
    with open(os.path.join(log_dir, "attn_probe.jsonl")) as f:
        return [json.loads(line) for line in f if '"run_header"' not in line]


def random_rows(log_dir) -> list[dict]:
    return [r for r in rows_of(log_dir) if r["metric"].startswith("random_")]


def check_values(found: list[dict], per_head: bool) -> None:
    """The rows are the range of the layers' shape, as the public function computes it."""
    want = random_range(SHAPE, budget=None, max_entries=PROBE_ENTRIES, per_head=per_head, cache=False)
    heads = [None, 0, 1, 2, 3] if per_head else [None]
    keys = sorted(((r["layer"], r["head"], r["metric"]) for r in found), key=str)
    assert keys == sorted(((layer, h, m) for layer in (0, 1) for h in heads for m in NAMES), key=str)
    for r in found:
        field = ("head_" if r["head"] is not None else "") + r["metric"][len("random_") :]
        assert r["value"] == getattr(want, field), (r, field)  # exact: the same seeded draws, float64 in JSON


def step(model, opt, i: int) -> None:
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(i))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("per_head", [False, True], ids=["layers", "heads"])
def test_attach_returns_before_the_range_and_a_later_snapshot_writes_it(tmp_path, monkeypatch, per_head):
    gate = Gate(monkeypatch)
    model = tiny_llama(vocab=VOCAB)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = Kept()
    probe = attn_probe.watch(
        model, optimizer=opt, log_dir=str(tmp_path), every=1, per_head=per_head, sinks=[kept]
    )
    try:
        # computed on a thread of the probe's own, not in attach on the caller's thread
        assert gate.callers and threading.get_ident() not in gate.callers, "the range was computed in attach"
        assert probe.random_range.thread_id == gate.callers[0]
        assert not gate.opened.is_set()  # attach returned while the range was still held
        assert probe.flush()
        assert {r["step"] for r in rows_of(tmp_path)} == {0} and random_rows(tmp_path) == []
        gate.open()
        assert probe.random_range.wait(60)
        step(model, opt, 1)  # the snapshot at step 1 carries them
        step(model, opt, 2)
    finally:
        gate.open()
        probe.close()
    found = random_rows(tmp_path)
    assert {r["step"] for r in found} == {1}
    check_values(found, per_head)
    # the sinks got them once, beside the records of one snapshot
    assert [len(s.baselines) for s in kept.snapshots] == [0, len(found), 0]


def test_close_right_after_attach_waits_for_the_range_and_writes_it(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    kept = Kept()
    probe = attn_probe.watch(tiny_llama(vocab=VOCAB), log_dir=str(tmp_path), every=1, sinks=[kept])
    opener = threading.Timer(0.3, gate.open)
    opener.start()
    try:
        probe.close()  # the range is still held when close() starts
    finally:
        opener.cancel()
        gate.open()
    assert gate.callers and threading.get_ident() not in gate.callers
    found = random_rows(tmp_path)
    assert {r["step"] for r in found} == {0}  # the last snapshot's step
    check_values(found, per_head=False)
    # written on their own: a snapshot with the range and no records (no tracker values, no statistics)
    assert [(len(s.records), len(s.baselines)) for s in kept.snapshots][-1] == (0, len(found))
    assert probe.failures == 0


def test_a_range_not_ready_at_close_is_said_lost_never_silently_absent(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    monkeypatch.setattr(range_stage, "CLOSE_WAIT", 0.2)
    probe = attn_probe.watch(tiny_llama(vocab=VOCAB), log_dir=str(tmp_path), every=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            probe.close()
    finally:
        gate.open()
    lost = [str(w.message) for w in caught if "random-matrix range" in str(w.message)]
    assert len(lost) == 1 and "lost" in lost[0] and "0.2 s after close()" in lost[0], lost
    assert probe.failures == 1
    assert random_rows(tmp_path) == [] and {r["step"] for r in rows_of(tmp_path)} == {0}


def test_other_ranks_compute_no_range(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    gate.open()
    probe = attn_probe.Probe(tiny_llama(vocab=VOCAB), every=1, is_main_process=False)
    probe.snapshot(0)
    probe.close()
    assert probe.random_range is None and gate.callers == []


def test_a_process_that_never_closes_writes_the_range_at_exit(tmp_path):
    """A real interpreter that attaches and exits without close(): the exit hook waits for the range."""
    script = textwrap.dedent(f"""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        import attn_probe
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size={VOCAB}, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                                             max_position_embeddings=16))
        probe = attn_probe.watch(model, log_dir={str(tmp_path)!r}, every=1)
        print("attached", flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0 and "attached" in done.stdout, done.stderr
    found = random_rows(tmp_path)
    assert found and {r["step"] for r in found} == {0}
    check_values(found, per_head=False)
