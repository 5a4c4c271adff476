"""W&B, MLflow and trackio sinks, with the real libraries, offline.

Each tracker is read back through its own store (an MLflow server on localhost with a SQLite
store, W&B's offline run file, trackio's SQLite database) and compared with the probe's JSONL.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tracker_servers import (
    expected_metrics,
    tiny_bert,
    trackio_rows,
    train_steps,
    use_mlflow_server,
    wandb_history,
    wandb_metric_definitions,
    wandb_offline_env,
)

import attn_probe
from attn_probe.core import METRICS
from attn_probe.extraction.base import GROUPS
from attn_probe.formats.tags import STATS
from attn_probe.sinks import Record, RunInfo, Snapshot
from attn_probe.sinks.trackers import KEY_PATTERN, STEP_KEY, tracker_key, tracker_metrics

TESTS = Path(__file__).resolve().parents[1]  # tests/: helpers, tracker_servers
STEPS = 4


def same(a, b):
    a, b = float(a), float(b)
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


def assert_same_series(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]]):
    assert sorted(got) == sorted(want)
    for step in want:
        assert sorted(got[step]) == sorted(want[step]), f"keys at step {step}"
        bad = {k: (got[step][k], v) for k, v in want[step].items() if not same(got[step][k], v)}
        assert not bad, f"step {step}: {bad}"


def run_info() -> RunInfo:
    return RunInfo(config={}, model={}, groups=["self"], metrics=list(METRICS), per_head=True)


def train_with(sink, log_dir: Path, steps: int = STEPS, on_step=None, start_step: int = 0, seed: int = 0,
               **watch_options):
    model = tiny_bert(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with attn_probe.watch(model, optimizer=opt, log_dir=str(log_dir), every=1, sinks=[sink],
                          start_step=start_step, per_head=getattr(sink, "per_head", False), **watch_options):
        train_steps(model, opt, steps, on_step)
    return expected_metrics(log_dir, per_head=getattr(sink, "per_head", False))


# --------------------------------------------------------------------------- keys
def test_keys_are_valid_for_every_tracker_and_name_the_median():
    seen = set()
    for group in (*GROUPS, "odd group/x:y"):
        for metric in (*METRICS, "vo_symmetry", "we:ird metric"):
            median = tracker_key(group, metric, stat="median")
            assert "median" in median and metric.replace(" ", "_").replace(":", "_") in median
            keys = [tracker_key(group, metric, stat=s) for s in STATS]
            keys += [tracker_key(group, metric, layer=i, head=h) for i in (0, 7, 123) for h in (None, 0, 11)]
            for key in keys:
                assert KEY_PATTERN.match(key), key
                assert len(key) < 250  # MLflow's key length limit
            seen.update(keys)
    assert tracker_key("self", "symmetry", stat="median") == "attn_probe/self/symmetry/median"
    assert tracker_key("self", "symmetry", layer=3) == "attn_probe/self/symmetry/layer_03"
    assert tracker_key("cross", "directionality", layer=1, head=2) == "attn_probe/cross/directionality/layer_01/head_02"
    assert len(seen) == (len(GROUPS) + 1) * (len(METRICS) + 2) * (len(STATS) + 9)


def test_tracker_metrics_sends_layers_and_stats_and_heads_only_when_asked():
    records = [Record("self", 0, None, "symmetry", 0.5), Record("self", 0, 1, "symmetry", -0.25),
               Record("self", 1, None, "symmetry", float("nan"))]
    snap = Snapshot(step=3, wall_time=1.0, records=records,
                    stats={("self", "symmetry", s): 0.5 for s in ("median", "q25", "q75")})
    plain = {"attn_probe/self/symmetry/layer_00", "attn_probe/self/symmetry/layer_01",
             *(f"attn_probe/self/symmetry/{s}" for s in ("median", "q25", "q75"))}
    assert set(tracker_metrics(snap, top_k=None)) == plain
    # the default: per-head values summed up per layer (the key budget), never a head_ key
    default = tracker_metrics(snap)
    layer0 = "attn_probe/self/symmetry/layer_00/"
    assert set(default) == plain | {layer0 + n for n in ("heads_min", "heads_median", "heads_max", "top_1",
                                                          "top_1_head", "top_2", "top_2_head", "top_3", "top_3_head")}
    assert math.isnan(default["attn_probe/self/symmetry/layer_01"])
    assert default[layer0 + "heads_max"] == default[layer0 + "top_1"] == -0.25 and default[layer0 + "top_1_head"] == 1
    assert math.isnan(default[layer0 + "top_2"]) and math.isnan(default[layer0 + "top_2_head"])  # one head only
    every = tracker_metrics(snap, per_head=True)
    assert every["attn_probe/self/symmetry/layer_00/head_01"] == -0.25
    assert not any("heads_" in key or "/top_" in key for key in every)


@pytest.mark.parametrize("module, cls, args", [
    ("wandb", "attn_probe.sinks.wandb.WandbSink", {}),
    ("mlflow", "attn_probe.sinks.mlflow.MlflowSink", {}),
    ("trackio", "attn_probe.sinks.trackio.TrackioSink", {"project": "p"}),
])
def test_missing_library_names_the_extra(monkeypatch, module, cls, args):
    import importlib

    mod_name, _, name = cls.rpartition(".")
    sink = getattr(importlib.import_module(mod_name), name)(**args)
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(ImportError, match=rf"pip install 'attn-probe\[{module}\]'"):
        sink.start(run_info())


def test_tracker_libraries_are_imported_only_when_a_sink_starts():
    code = ("import sys, attn_probe, attn_probe.scoring.gguf, attn_probe.sinks.trackers, attn_probe.sinks.wandb, "
            "attn_probe.sinks.mlflow, attn_probe.sinks.trackio\n"
            "print(sorted(m for m in ('wandb', 'mlflow', 'trackio', 'gguf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- MLflow
@pytest.fixture
def mlflow_env(monkeypatch, mlflow_server):
    use_mlflow_server(monkeypatch, mlflow_server.uri)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    return mlflow_server.uri


def mlflow_series(client, run_id: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        if key.startswith("attn_probe/"):
            for m in client.get_metric_history(run_id, key):
                assert key not in out.get(m.step, {}), f"{key} logged twice at step {m.step}"
                out.setdefault(m.step, {})[key] = m.value
    return out


def test_mlflow_sink_creates_and_finishes_its_run(tmp_path, mlflow_env):
    from mlflow import MlflowClient

    from attn_probe.sinks.mlflow import MlflowSink

    sink = MlflowSink(tracking_uri=mlflow_env, experiment="attn-probe-tests", run_name="owned")
    want = train_with(sink, tmp_path / "run")
    client = MlflowClient(mlflow_env)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "owned"
    assert client.get_experiment(run.info.experiment_id).name == "attn-probe-tests"
    assert sorted(want) == list(range(STEPS + 1))
    assert_same_series(mlflow_series(client, sink.run_id), want)


@pytest.mark.parametrize("how", ["active_run", "run_id"])
def test_mlflow_sink_logs_into_the_users_run_and_leaves_it_open(tmp_path, mlflow_env, how):
    import mlflow
    from mlflow import MlflowClient

    from attn_probe.sinks.mlflow import MlflowSink

    with mlflow.start_run(run_name=f"user-{how}") as run:
        run_id = run.info.run_id
        sink = MlflowSink() if how == "active_run" else MlflowSink(run_id)
        losses = {}

        def user_logs(i, loss):
            losses[i] = loss
            mlflow.log_metric("loss", loss, step=i)  # the user's counter, far below the probe's

        want = train_with(sink, tmp_path / "run", on_step=user_logs, start_step=1000)
        client = MlflowClient(mlflow_env)
        assert client.get_run(run_id).info.status == "RUNNING"  # the sink left the user's run open
        mlflow.log_metric("after", 1.0, step=STEPS)
    assert sink.run_id == run_id and not sink.owns_run
    assert client.get_run(run_id).info.status == "FINISHED"
    assert sorted(want) == list(range(1000, 1000 + STEPS + 1))
    assert_same_series(mlflow_series(client, run_id), want)
    got_losses = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert got_losses == pytest.approx(losses, rel=1e-12)


# --------------------------------------------------------------------------- W&B
@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    yield from wandb_offline_env(monkeypatch, tmp_path)


def probe_rows(history: list[dict]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for row in history:
        if STEP_KEY in row:
            step = int(row[STEP_KEY])
            assert step not in out, f"probe step {step} in two rows"
            out[step] = {k: v for k, v in row.items() if k.startswith("attn_probe/") and k != STEP_KEY}
    return out


def test_wandb_sink_creates_and_finishes_its_run_with_its_own_step_axis(tmp_path, wandb_offline):
    import wandb

    from attn_probe.sinks.wandb import WandbSink

    sink = WandbSink(project="attn-probe-tests", dir=str(wandb_offline), mode="offline", per_head=True)
    want = train_with(sink, tmp_path / "run")
    assert sink.owns_run and wandb.run is None  # finished by the sink
    assert sorted(want) == list(range(STEPS + 1))
    assert any("/head_" in k for k in want[0])
    assert_same_series(probe_rows(wandb_history(wandb_offline)), want)
    defs = {(m.name or m.glob_name): m.step_metric for m in wandb_metric_definitions(wandb_offline)}
    assert defs.get("attn_probe/*") == STEP_KEY and STEP_KEY in defs


@pytest.mark.parametrize("style", ["step=", "step_metric", "silent"])
def test_wandb_sink_never_drops_the_users_logs(tmp_path, wandb_offline, style):
    """The user logs under their own counter, far below the probe's step, on both sides of its snapshot.
    ``WandbSink(run)`` logs into a W&B run of the probe's own beside the user's (issue 35; was: into the
    user's run, where with ``step=`` a snapshot was lost): every snapshot reaches it, nothing of the
    probe's is in the user's run, nothing of the user's is dropped, and no warning is needed."""
    import warnings

    import wandb

    from attn_probe.sinks.wandb import WandbSink, probe_run_id

    run = wandb.init(project="attn-probe-tests", dir=str(wandb_offline), mode="offline", group="g")
    if style == "step_metric":
        run.define_metric("train/step")
        run.define_metric("train/*", step_metric="train/step")
    logged: list[tuple[int, str, float]] = []

    def log(i, key, value):
        logged.append((i, key, value))
        if style == "step=":
            run.log({key: value}, step=i)
        else:
            run.log({f"train/{key}": value, "train/step": i})

    def user_logs(i, loss):
        log(i, "loss", loss)  # before opt.step(): before the probe's snapshot of this step
        return lambda: log(i, "lr", 0.5 / (i + 1))  # after it, same user step

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = train_with(WandbSink(run), tmp_path / "run", on_step=None if style == "silent" else user_logs,
                          start_step=1000)
    assert wandb.run is run  # still open: the probe's own run never took its place
    if style != "silent":
        log(STEPS, "loss", -1.0)
    run.finish()

    assert not [str(w.message) for w in caught if "attn_probe" in str(w.message)]
    assert_same_series(probe_rows(wandb_history(wandb_offline, run_id=probe_run_id(run.id))), want)
    history = wandb_history(wandb_offline, run_id=run.id)
    assert not any(k.startswith("attn_probe") for row in history for k in row)
    got = []
    for row in history:
        for key in ("loss", "lr"):
            if style == "step=" and key in row:
                got.append((row["_step"], key, row[key]))
            elif style == "step_metric" and f"train/{key}" in row:
                got.append((row["train/step"], key, row[f"train/{key}"]))
    assert sorted(got) == sorted(logged)


# --------------------------------------------------------------------------- trackio
TRACKIO_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import torch, trackio, attn_probe
from attn_probe.sinks.trackio import TrackioSink
from tracker_servers import tiny_bert, train_steps

quiet = dict(auto_log_cpu=False, auto_log_gpu=False)
model = tiny_bert(0); opt = torch.optim.SGD(model.parameters(), lr=0.5)
sink = TrackioSink(project="probe-tests", name="owned", **quiet)
with attn_probe.watch(model, optimizer=opt, log_dir={owned!r}, every=1, sinks=[sink]):
    train_steps(model, opt, {steps})
assert sink.owns_run

run = trackio.init(project="probe-tests", name="user", **quiet)
losses = {{}}
def user_logs(i, loss):
    losses[i] = loss
    run.log({{"loss": loss}}, step=i)
model = tiny_bert(1); opt = torch.optim.SGD(model.parameters(), lr=0.5)
sink = TrackioSink(run=run)
with attn_probe.watch(model, optimizer=opt, log_dir={user!r}, every=1, start_step=1000, sinks=[sink]):
    train_steps(model, opt, {steps}, user_logs)
assert not sink.owns_run
run.log({{"after": 1.0}}, step={steps})  # still the user's open run
trackio.finish()
print("LOSSES=" + json.dumps(losses))
"""


def test_trackio_sink_owned_and_users_run(tmp_path):
    pytest.importorskip("trackio")
    owned, user, store = tmp_path / "owned", tmp_path / "user", tmp_path / "trackio"
    script = TRACKIO_SCRIPT.format(tests=str(TESTS), owned=str(owned), user=str(user), steps=STEPS)
    env = {**os.environ, "TRACKIO_DIR": str(store), "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         env=env, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = json.loads(out.stdout.rsplit("LOSSES=", 1)[1])

    rows = trackio_rows(store, "probe-tests")
    for name, directory, first in (("owned", owned, 0), ("user", user, 1000)):
        got: dict[int, dict[str, float]] = {}
        for run_name, step, metrics in rows:
            probe = {k: float(v) for k, v in metrics.items() if k.startswith("attn_probe/")}
            if run_name == name and probe:
                assert not set(probe) & set(got.get(step, {})), f"step {step} logged twice"
                got.setdefault(step, {}).update(probe)
        want = expected_metrics(directory)
        assert sorted(want) == list(range(first, first + STEPS + 1))
        assert_same_series(got, want)
    user_rows = [(step, m) for run_name, step, m in rows if run_name == "user"]
    assert {str(s): m["loss"] for s, m in user_rows if "loss" in m} == pytest.approx(losses, rel=1e-12)
    assert (STEPS, {"after": 1.0}) in user_rows


def test_a_wandb_sink_whose_start_fails_gives_its_key_prefix_back(tmp_path, wandb_offline, monkeypatch):
    """A start that fails after the sink claimed its key prefix in the user's run releases it: the
    next probe on that run logs under ``attn_probe/``, not ``attn_probe_2/``."""
    import wandb

    from attn_probe.sinks.wandb import WandbSink

    run = wandb.init(project="attn-probe-tests", dir=str(wandb_offline), mode="offline")
    try:
        failing = WandbSink(run)

        def broken(*args, **kwargs):  # a failure after the claim, inside the open
            raise RuntimeError("set-up failed")

        monkeypatch.setattr(failing, "_separate_kwargs", broken)
        with pytest.raises(RuntimeError, match="set-up failed"):
            failing.start(run_info())
        failing.finish()  # a sink that never started: nothing to close, no error
        second = WandbSink(run)
        second.start(run_info())
        try:
            assert second.namespace == "attn_probe"
        finally:
            second.finish()
        third = WandbSink(run)  # and the prefix the second one held is free again after it finished
        third.start(run_info())
        try:
            assert third.namespace == "attn_probe"
        finally:
            third.finish()
    finally:
        run.finish()
