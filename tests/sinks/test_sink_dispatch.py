"""The sink dispatcher: isolation, background lanes, bounded queues, flush/close, -W error, exit."""

import contextvars
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
from helpers import tiny_bert

import attn_probe
from attn_probe.sinks import RunInfo, Snapshot
from attn_probe.sinks.dispatch import SinkDispatcher, describe_steps

RUN = RunInfo(config={}, model={}, groups=["self"], metrics=["symmetry"], per_head=False)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: helpers, tracker_servers
ROOT = os.path.dirname(TESTS)


def snap(step):
    return Snapshot(step=step, wall_time=0.0, records=[])


class ListSink:
    """Records the steps it was given and the thread that gave them."""

    background = True  # safe to call from the dispatcher's thread

    def __init__(self, fail_steps=(), delay=0.0):
        self.steps, self.threads, self.fail_steps, self.delay = [], set(), set(fail_steps), delay
        self.started = self.finished = False
        self.flushes = 0

    def start(self, run):
        self.started = True

    def log(self, snapshot):
        if self.delay:
            time.sleep(self.delay)
        self.threads.add(threading.get_ident())
        if snapshot.step in self.fail_steps:
            raise OSError(28, "No space left on device")
        self.steps.append(snapshot.step)

    def flush(self):
        self.flushes += 1

    def finish(self):
        self.finished = True


class BlockingSink(ListSink):
    """Blocks in log() until released (a network sink retrying a dead server)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def log(self, snapshot):
        self.entered.set()
        self.release.wait()
        super().log(snapshot)


def ours(record):
    return [str(w.message) for w in record if "attn_probe" in str(w.message)]


def test_a_failing_sink_neither_stops_nor_silences_the_others():
    bad, good = ListSink(fail_steps={1, 2}), ListSink()
    d = SinkDispatcher([bad, good])
    d.start(RUN)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(5):
            d.log(snap(step))
        assert d.close(timeout=10)
    assert good.steps == [0, 1, 2, 3, 4] and bad.steps == [0, 3, 4]
    assert bad.finished and good.finished
    msgs = ours(record)
    assert len(msgs) == 2, msgs  # stopped, resumed: nothing else
    assert "ListSink stopped at step 1" in msgs[0] and "No space left on device" in msgs[0]
    assert "ListSink resumed at step 3" in msgs[1] and "lost steps 1, 2" in msgs[1]
    (bad_stats, good_stats) = d.stats()
    assert (bad_stats.delivered, bad_stats.lost, bad_stats.lost_steps, bad_stats.failing) == (3, 2, [1, 2], False)
    assert (good_stats.delivered, good_stats.lost) == (5, 0)


def test_a_blocked_sink_blocks_neither_the_caller_nor_the_others_and_close_is_bounded():
    blocked, good = BlockingSink(), ListSink()
    d = SinkDispatcher([blocked, good], queue_size=4)
    d.start(RUN)
    try:
        spent = 0.0
        for step in range(10):
            t0 = time.perf_counter()
            d.log(snap(step))
            spent += time.perf_counter() - t0
            deadline = time.monotonic() + 5
            while len(good.steps) <= step and time.monotonic() < deadline:  # the healthy lane keeps up
                time.sleep(0.001)
        assert spent < 1.0  # the training step never waits on a sink
        assert blocked.entered.wait(5)
        assert good.steps == list(range(10))  # the healthy lane got everything...
        assert d.flush(timeout=0.3) is False  # ... while the blocked one cannot get there
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            assert d.close(timeout=0.5) is False
            assert time.perf_counter() - t0 < 3.0
        msgs = ours(record)
        # step 0 is in flight; 1..9 queued into 4 places: the 5 oldest (1..5) were dropped; 6..9 wait
        assert any("did not finish within 0.5 s" in m and "5 snapshots not delivered" in m for m in msgs), msgs
        assert any("dropped 5 snapshots (queue of 4)" in m for m in msgs), msgs
        assert good.finished and not blocked.finished
    finally:
        blocked.release.set()
    deadline = time.monotonic() + 5
    while not blocked.finished and time.monotonic() < deadline:  # the abandoned lane finishes later
        time.sleep(0.01)
    assert blocked.steps == [0] and blocked.finished
    stats = {s.sink: s for s in d.stats()}
    assert (stats["BlockingSink"].dropped, stats["BlockingSink"].undelivered) == (5, 5)


def test_full_queue_drops_the_oldest_waiting_snapshot_and_warns_once():
    blocked = BlockingSink()
    d = SinkDispatcher([blocked], queue_size=3)
    d.start(RUN)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        d.log(snap(0))
        assert blocked.entered.wait(5)  # 0 in flight
        for step in range(1, 8):
            d.log(snap(step))  # 1..7 into 3 places: 1..4 dropped
        drops = ours(record)
        blocked.release.set()
        assert d.close(timeout=10)
    assert blocked.steps == [0, 5, 6, 7]  # the newest are kept
    assert len(drops) == 1 and "dropped its oldest waiting snapshot (step 1)" in drops[0]


def test_flush_waits_for_delivery_and_runs_the_sinks_flush():
    slow = ListSink(delay=0.05)
    d = SinkDispatcher([slow])
    d.start(RUN)
    for step in range(5):
        d.log(snap(step))
    assert d.flush(timeout=10)
    assert slow.steps == [0, 1, 2, 3, 4] and slow.flushes == 1
    d.close()


def test_inline_mode_and_inline_sinks_run_on_the_callers_thread():
    plain = ListSink()

    class ThreadLocalSink(ListSink):
        background = False  # e.g. a library keeping its active run per thread

    class Undeclared:  # says nothing about threads: called on the caller's thread too
        def __init__(self):
            self.threads = set()

        def start(self, run):
            pass

        def log(self, snapshot):
            self.threads.add(threading.get_ident())

        def finish(self):
            pass

    local, undeclared = ThreadLocalSink(), Undeclared()
    d = SinkDispatcher([plain, local, undeclared])
    d.start(RUN)
    d.log(snap(0))
    d.close()
    me = threading.get_ident()
    assert local.threads == undeclared.threads == {me} and plain.threads and me not in plain.threads
    sync = ListSink()
    d = SinkDispatcher([sync], background=False)
    d.start(RUN)
    d.log(snap(0))
    assert sync.steps == [0] and sync.threads == {me}  # written when log() returns
    d.close()


def test_background_lanes_see_the_callers_context_variables():
    var = contextvars.ContextVar("current_run", default=None)
    seen = []

    class ContextSink(ListSink):
        def log(self, snapshot):
            seen.append(var.get())

    d = SinkDispatcher([ContextSink()])
    d.start(RUN)
    token = var.set("run-a")
    d.log(snap(0))
    var.reset(token)
    d.log(snap(1))
    d.close()
    assert seen == ["run-a", None]


def test_start_failure_finishes_the_sinks_already_started():
    first = ListSink()

    class Broken(ListSink):
        def start(self, run):
            raise OSError(28, "No space left on device")

    d = SinkDispatcher([first, Broken()])
    with pytest.raises(OSError):
        d.start(RUN)
    assert first.finished and isinstance(d.failed_sink, Broken)


def test_describe_steps():
    assert describe_steps([5]) == "step 5"
    assert describe_steps([5, 10]) == "steps 5, 10"
    assert describe_steps(list(range(100, 250, 5))) == "steps 100 to 245 (30 snapshots)"


def test_probe_flush_makes_the_files_readable_while_open(tmp_path):
    model = tiny_bert()
    probe = attn_probe.Probe(model, log_dir=str(tmp_path), every=None, metrics=("symmetry",))
    for step in range(3):
        probe.snapshot(step)
    assert probe.flush(timeout=30)
    with open(tmp_path / "attn_probe.jsonl") as f:
        assert sorted({json.loads(line)["step"] for line in f if '"run_header"' not in line}) == [0, 1, 2]
    stats = probe.sink_stats()
    assert [s.sink.split("(")[0] for s in stats] == ["TensorBoardSink", "TrajectorySink"]
    assert all(s.delivered == 3 and s.background for s in stats)
    probe.close()
    assert probe.flush() is True and probe.sink_stats() == []


def test_probe_background_false_writes_before_snapshot_returns(tmp_path):
    probe = attn_probe.Probe(tiny_bert(), log_dir=str(tmp_path), every=None, metrics=("symmetry",),
                             background=False)
    probe.snapshot(0)
    with open(tmp_path / "attn_probe.jsonl") as f:
        assert {json.loads(line)["step"] for line in f if '"run_header"' not in line} == {0}
    assert not any(s.background for s in probe.sink_stats())
    probe.close()


def run_script(code, timeout=120):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-W", "error", "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


FAILING_SINK_SCRIPT = """
import torch, attn_probe
from transformers import BertConfig, BertForMaskedLM
torch.manual_seed(0)
model = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=12))

class Failing:
    background = {background}
    def start(self, run): pass
    def log(self, snapshot): raise OSError(28, "No space left on device")
    def flush(self): raise OSError(28, "No space left on device")
    def finish(self): raise OSError(5, "Input/output error")

opt = torch.optim.SGD(model.parameters(), lr=0.1)
probe = attn_probe.watch(model, optimizer=opt, log_dir={log_dir!r}, every=1, sinks=[Failing()],
                         metrics=("symmetry",))
ids = torch.randint(0, 50, (2, 12))
model(input_ids=ids, labels=ids).loss.backward()
opt.step()
probe.flush()
probe.close()  # the final snapshot's sink fails, and so does finish()
print("SAVED THE MODEL")
"""


@pytest.mark.parametrize("background", [True, False])
def test_sink_failures_never_raise_under_W_error(tmp_path, background):
    out = run_script(FAILING_SINK_SCRIPT.format(log_dir=str(tmp_path / "run"), background=background))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SAVED THE MODEL" in out.stdout
    assert "logging to Failing stopped at step 0" in out.stderr  # told on stderr instead
    assert "closing Failing failed" in out.stderr


EXIT_SCRIPT = """
import threading, time
from attn_probe.sinks import RunInfo, Snapshot
from attn_probe.sinks import dispatch
dispatch.EXIT_TIMEOUT = 2.0

class Slow:
    background = True
    def start(self, run): pass
    def log(self, snapshot):
        time.sleep(0.05)
        with open({path!r}, "a") as f:
            f.write(f"{{snapshot.step}}\\n")
    def finish(self): pass

class Stuck:
    background = True
    def start(self, run): pass
    def log(self, snapshot): threading.Event().wait()  # never returns
    def finish(self): pass

d = dispatch.SinkDispatcher([Slow(), Stuck()])
d.start(RunInfo(config={{}}, model={{}}, groups=[], metrics=[], per_head=False))
for step in range(10):
    d.log(Snapshot(step=step, wall_time=0.0, records=[]))
print("LEAVING", flush=True)  # never closed: the exit hook drains what it can, bounded
"""


def test_interpreter_exit_drains_an_unclosed_dispatcher_and_never_hangs(tmp_path):
    path = tmp_path / "steps.txt"
    t0 = time.monotonic()
    out = run_script(EXIT_SCRIPT.format(path=str(path)), timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert time.monotonic() - t0 < 30
    assert path.read_text().split() == [str(s) for s in range(10)]  # the healthy lane was drained at exit


def test_a_dispatcher_dropped_without_close_still_writes_and_finishes():
    import gc

    sink = ListSink(delay=0.02)
    d = SinkDispatcher([sink])
    d.start(RUN)
    for step in range(3):
        d.log(snap(step))
    del d
    gc.collect()
    deadline = time.monotonic() + 10
    while not sink.finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.steps == [0, 1, 2] and sink.finished
