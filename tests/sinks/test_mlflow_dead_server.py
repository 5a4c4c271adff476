"""MLflow's server dies mid-run: close() stays bounded, the lost steps are named, the other sinks get every step.

A real ``mlflow server`` (:class:`tracker_servers.MlflowServer`, its own, since the test kills
it) receives the probe's snapshots through :class:`MlflowSink` at every step; after step
``KILL_AFTER`` the server is killed (SIGKILL to its process group). Each scenario runs in a
subprocess bounded by a timeout, so that MLflow's HTTP retries and its own exit hook stay out
of the test process.

* ``fast-fail``: ``MLFLOW_HTTP_REQUEST_MAX_RETRIES=0`` and a short request timeout, so every
  batch to the dead server fails within seconds. ``sink_stats()`` and the warnings name exactly
  the steps after the kill as lost (the sink's batches are synchronous, on its own lane; the
  ``synchronous`` argument, kept for compatibility, changes nothing: both values are run).
* ``retrying``: MLflow's default retries (minutes against a dead server). ``close()`` returns
  within ``sink_timeout`` and a margin, gives the sink up, and names the steps it did not
  deliver, the one it was sending first (not confirmed stored). (The script ends with ``os._exit``: MLflow's own exit hook waits
  for its retrying batches, which is MLflow's, not the probe's.)

In every case the TensorBoard and JSONL sinks get every step.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: helpers, tracker_servers
ROOT = os.path.dirname(TESTS)
SINK_TIMEOUT = 15.0
#: close() may exceed sink_timeout by this much (the final snapshot, the other sinks, a loaded machine)
MARGIN = 10.0

SCRIPT = """
import json, os, signal, sys, time, warnings
sys.path.insert(0, {tests!r})
import torch
from tracker_servers import MlflowServer, tiny_bert, VOCAB, SEQ
import attn_probe
from attn_probe.sinks.mlflow import MlflowSink
import mlflow

SYNC, STEPS, KILL_AFTER, LOG_DIR = {sync!r}, 8, 4, {log_dir!r}
torch.set_num_threads(1)
server = MlflowServer({server_root!r})
client = mlflow.MlflowClient(server.uri)
run_id = client.create_run("0").info.run_id

model = tiny_bert()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
warnings.simplefilter("always")
out = {{}}
with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    probe = attn_probe.watch(model, optimizer=opt, log_dir=LOG_DIR, every=1, sink_timeout={timeout!r},
                             sinks=[MlflowSink(run_id, tracking_uri=server.uri, synchronous=SYNC)])
    for i in range(STEPS):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if i == STEPS - 2:
            time.sleep(3)  # the batches sent to the dead server fail meanwhile (fast-fail scenario)
        if i == KILL_AFTER - 1:
            assert probe.flush(timeout=60)
            out["before_kill"] = [vars(s) for s in probe.sink_stats() if s.sink == "MlflowSink"][0]
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
    time.sleep(1)  # the lanes take the last snapshot
    out["before_close"] = [vars(s) for s in probe.sink_stats() if s.sink == "MlflowSink"][0]
    dispatcher = probe.outputs.dispatcher  # probe.sink_stats() is empty once closed
    t = time.monotonic()
    probe.close()
    out["close_s"] = time.monotonic() - t
    out["stats"] = [dict(vars(s)) for s in dispatcher.stats()]
out["warnings"] = [str(w.message) for w in record if "attn_probe" in str(w.message)]
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)  # MLflow's own exit hook may wait for its retrying batches: not the probe's to bound
"""


def run_scenario(tmp_path, *, sync: bool, fast_fail: bool) -> tuple[dict, str]:
    log_dir = str(tmp_path / "run")
    (tmp_path / "mlflow").mkdir()
    code = SCRIPT.format(tests=TESTS, sync=sync, log_dir=log_dir, server_root=str(tmp_path / "mlflow"),
                         timeout=SINK_TIMEOUT)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_TRACKING_URI"):
        env.pop(key, None)
    if fast_fail:
        env.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="5")
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=400, env=env, cwd=str(tmp_path))
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, f"rc={res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):]), log_dir


def every_step(log_dir: str) -> tuple[list[int], list[int]]:
    """The steps in ``attn_probe.jsonl`` and in the TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    jsonl = sorted({json.loads(line)["step"] for line in open(os.path.join(log_dir, "attn_probe.jsonl"))
                    if line.strip() and "step" in json.loads(line)})
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tag = next(t for t in acc.Tags()["scalars"] if t.startswith("attn_probe/"))
    return jsonl, sorted({e.step for e in acc.Scalars(tag)})


def mlflow_stats(out: dict) -> dict:
    return next(s for s in out["stats"] if s["sink"] == "MlflowSink")


def check_other_sinks(out: dict, log_dir: str) -> list[int]:
    jsonl, tb = every_step(log_dir)
    assert jsonl == tb and len(jsonl) >= 8, (jsonl, tb)
    for s in out["stats"]:
        if s["sink"] != "MlflowSink":
            assert s["lost"] == s["dropped"] == s["undelivered"] == 0, s
    return jsonl


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_dead_mlflow_server_names_the_lost_steps(tmp_path, sync):
    out, log_dir = run_scenario(tmp_path, sync=sync, fast_fail=True)
    steps = check_other_sinks(out, log_dir)
    before = out["before_kill"]
    assert before["lost"] == 0 and before["delivered"] >= 1, before
    sent_before = steps[:before["delivered"]]
    lost = [s for s in steps if s not in sent_before]
    assert lost, steps
    ml = mlflow_stats(out)
    assert out["close_s"] < SINK_TIMEOUT + MARGIN, out["close_s"]
    assert ml["delivered"] == len(sent_before), ml
    assert ml["lost_steps"] == lost and ml["lost"] == len(lost), (ml, lost)
    from attn_probe.sinks.dispatch import describe_steps

    named = [w for w in out["warnings"] if "MlflowSink" in w and describe_steps(lost) in w]
    assert named, (describe_steps(lost), out["warnings"])
    assert any(f"stopped at step {lost[0]}" in w for w in out["warnings"]), out["warnings"]
    # reported during the run (asynchronous: the failed batches' futures, checked at each log)
    during = out["before_close"]
    assert during["failing"] and during["lost_steps"][:1] == lost[:1], during


def test_dead_mlflow_server_with_mlflow_retrying_close_is_bounded(tmp_path):
    out, log_dir = run_scenario(tmp_path, sync=False, fast_fail=False)
    steps = check_other_sinks(out, log_dir)
    assert out["close_s"] < SINK_TIMEOUT + MARGIN, out["close_s"]
    before = out["before_kill"]
    after = steps[before["delivered"]:]
    ml = mlflow_stats(out)
    # MLflow is still retrying the steps after the kill: given up at the deadline, and named
    assert ml["delivered"] == before["delivered"], ml
    assert sorted(ml["lost_steps"] + ml["unconfirmed_steps"]) == after, (ml, after)
    given_up = [w for w in out["warnings"] if "MlflowSink" in w and "given up" in w]
    assert given_up and ("not confirmed stored" in given_up[0] or ml["lost_steps"]), out["warnings"]


# --------------------------------------------------------------------------- inline sinks, no server
class BlockingInline:
    """An inline sink (``background = False``) whose ``flush``/``finish`` block until released,
    as a tracker's flush does against a dead server; records the threads ``log`` ran on at once."""

    background = False

    def __init__(self):
        self.release = __import__("threading").Event()
        self.steps, self.finished, self.active = [], False, 0

    def start(self, run):
        pass

    def log(self, snapshot):
        self.steps.append(snapshot.step)

    def flush(self):
        self.release.wait(120)

    def finish(self):
        self.release.wait(120)
        self.finished = True


class Quick:
    background = False

    def __init__(self):
        self.steps, self.finished = [], False

    def start(self, run):
        pass

    def log(self, snapshot):
        self.steps.append(snapshot.step)

    def finish(self):
        self.finished = True


def test_inline_sink_flush_and_finish_are_bounded_by_the_deadline():
    import time
    import warnings

    from attn_probe.sinks import RunInfo, Snapshot
    from attn_probe.sinks.dispatch import SinkDispatcher

    run = RunInfo(config={}, model={}, groups=["self"], metrics=["symmetry"], per_head=False)
    blocking, quick = BlockingInline(), Quick()
    d = SinkDispatcher([blocking, quick], timeout=60)
    d.start(run)
    d.log(Snapshot(step=0, wall_time=0.0, records=[]))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        t = time.monotonic()
        assert d.flush(timeout=1.0) is False
        assert time.monotonic() - t < 5
        # the sink is still in flush(): the next snapshot is dropped for it (never called on two
        # threads at once), delivered to the other sink
        d.log(Snapshot(step=1, wall_time=0.0, records=[]))
        t = time.monotonic()
        assert d.close(timeout=1.0) is False
        assert time.monotonic() - t < 5
    assert blocking.steps == [0] and quick.steps == [0, 1] and quick.finished and not blocking.finished
    stats = {s.sink: s for s in d.stats()}
    assert stats["BlockingInline"].dropped == 1 and stats["Quick"].dropped == 0
    text = [str(w.message) for w in record]
    assert any("BlockingInline" in w and "given up" in w for w in text), text
    assert not any("Quick" in w for w in text), text
    blocking.release.set()  # the helper thread finishes the sink once the blocked call returns
    deadline = time.monotonic() + 10
    while not blocking.finished and time.monotonic() < deadline:
        time.sleep(0.05)
    assert blocking.finished


def test_inline_sink_left_open_is_flushed_and_finished_at_exit_without_hanging():
    # the exit hook flushes it and the finaliser finishes it: neither may start a thread then
    # (one started during interpreter finalisation never runs, and Thread.start() waits for it)
    code = textwrap.dedent("""
        from attn_probe.sinks import RunInfo, Snapshot
        from attn_probe.sinks.dispatch import SinkDispatcher

        class S:
            background = False
            def start(self, run): pass
            def log(self, snapshot): pass
            def flush(self): print("flushed", flush=True)
            def finish(self): print("finished", flush=True)

        d = SinkDispatcher([S()])
        d.start(RunInfo(config={}, model={}, groups=["self"], metrics=["symmetry"], per_head=False))
        d.log(Snapshot(step=0, wall_time=0.0, records=[]))
    """)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["flushed", "finished"], res.stdout
