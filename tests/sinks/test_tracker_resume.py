"""On resume, no tracker ends up with duplicate or dropped probe steps (issue 14).

A run logs its snapshots and stops (it ends, and its tracker run is finished, as a process
killed after its last snapshot would leave it); it is then resumed from an earlier checkpoint
into the *same* tracker run and the same probe run directory. Each tracker must then hold every probe step
exactly once: the steps it already had keep the values sent before the resume (they are not
sent again), the later ones equal the resumed run's ``attn_probe.jsonl``. A resumed training
that logs into a *new* tracker run gets all of its steps.

Real libraries, offline: a local MLflow server (read back with ``MlflowClient``), W&B offline
(every ``.wandb`` file of the run read back; offline, a resumed run writes a file of its own),
trackio with ``TRACKIO_DIR`` (its SQLite store), a real Trainer and a real Accelerator.

Plain loops: steps 0..6, then resumed at step 3 with other weights (so the two runs' values
differ) up to step 9. Trainer and Accelerate: every=2, steps 0..6 with a checkpoint at 4, then
resumed from it up to step 10.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from tracker_servers import (
    SEQ,
    VOCAB,
    expected_metrics,
    tiny_bert,
    trackio_rows,
    train_steps,
    use_mlflow_server,
    wandb_offline_env,
    wandb_resumed_history,
)

import attn_probe
from attn_probe.sinks import RunInfo
from attn_probe.sinks.trackers import STEP_KEY
from attn_probe.sinks.wandb import probe_run_id

TESTS = Path(__file__).resolve().parents[1]  # tests/: helpers, tracker_servers
#: the probe's record of the last step each tracker run got, beside attn_probe.jsonl
SENT_FILENAME = "attn_probe_trackers.json"
FIRST, RESUME_AT, LAST = 6, 3, 9  # plain loops
NOTE = "attn_probe: resuming at step"

Series = dict[int, dict[str, float]]


def same(a, b, rel=1e-12) -> bool:
    a, b = float(a), float(b)
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=rel * 1e-3)


def assert_same_series(got: Series, want: Series, rel: float = 1e-12) -> None:
    assert sorted(got) == sorted(want)
    for step in want:
        assert sorted(got[step]) == sorted(want[step]), f"keys at step {step}"
        bad = {k: (got[step][k], v) for k, v in want[step].items() if not same(got[step][k], v, rel)}
        assert not bad, f"step {step}: {bad}"


def kept_then_resumed(before: Series, after: Series, held_through: int) -> Series:
    """What a tracker run must hold: its values from before the resume up to ``held_through``,
    the resumed run's after it."""
    return {s: (before[s] if s <= held_through else after[s]) for s in after}


def assert_values_differ(before: Series, after: Series, step: int) -> None:
    """The resumed run's values differ from the first run's: the test can tell which were sent."""
    assert any(not same(before[step][k], v) for k, v in after[step].items() if not math.isnan(v))


#: the trajectory's own resume line (issue 29: what the cut dropped, from which run), not a tracker note
CUT = re.compile(r"^attn_probe: resuming at step \d+: dropped \d+ lines at steps >= \d+ of run ")


def resume_notes(caught) -> list[str]:
    """The trackers' resume notes (one per tracker run resumed), without the trajectory's cut line."""
    return [str(w.message) for w in caught if str(w.message).startswith(NOTE) and not CUT.match(str(w.message))]


def run_probe(log_dir: Path, sink, *, updates: int, start_step: int = 0, seed: int = 0) -> None:
    model = tiny_bert(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with attn_probe.watch(model, optimizer=opt, log_dir=str(log_dir), every=1, sinks=[sink], start_step=start_step):
        train_steps(model, opt, updates)


def crash_and_resume(log_dir: Path, first_sink, resumed_sink, between=None) -> tuple[Series, Series, list[str]]:
    """Steps 0..FIRST into ``first_sink``; then resumed at RESUME_AT with other weights up to LAST."""
    run_probe(log_dir, first_sink, updates=FIRST)
    before = expected_metrics(log_dir)
    assert sorted(before) == list(range(FIRST + 1))
    if between is not None:
        between()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_probe(log_dir, resumed_sink, updates=LAST - RESUME_AT, start_step=RESUME_AT, seed=1)
    after = expected_metrics(log_dir)
    assert sorted(after) == list(range(LAST + 1))
    assert_values_differ(before, after, RESUME_AT)
    return before, after, resume_notes(caught)


# --------------------------------------------------------------------------- the guard and the record
def tracker_run(read_back=None, run_id="r1"):
    from attn_probe.sinks.tracker_record import TrackerRun

    return TrackerRun("fake", run_id, f"fake run {run_id}", read_back=read_back)


def test_the_tracker_wins_over_the_record_and_the_record_is_the_fallback(tmp_path):
    from attn_probe.sinks import tracker_record
    from attn_probe.sinks.tracker_record import NotReadable, ResendGuard, SentRecord

    assert tracker_record.SENT_FILENAME == SENT_FILENAME
    record = SentRecord(str(tmp_path))
    assert record.record(tracker_run(), 8)
    assert json.loads((tmp_path / SENT_FILENAME).read_text())["runs"]["fake:r1"]["last_step"] == 8
    assert not [p for p in tmp_path.iterdir() if p.name != SENT_FILENAME]  # no temporary file left

    def unreadable():
        raise NotReadable("offline")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        told = ResendGuard(tracker_run(lambda: 5), record, resume_step=3)  # the tracker holds up to 5
        fallback = ResendGuard(tracker_run(unreadable), record, resume_step=3)
        empty = ResendGuard(tracker_run(lambda: None), record, resume_step=3)  # the tracker holds no step
        other_run = ResendGuard(tracker_run(run_id="r2"), record, resume_step=3)  # a new tracker run
        fresh = ResendGuard(tracker_run(lambda: 5), record, resume_step=None)  # not a resume
        behind = ResendGuard(tracker_run(lambda: 2), record, resume_step=3)  # held less than the resume step
    assert (told.skip_through, told.source) == (5, "tracker")
    assert (fallback.skip_through, fallback.source) == (8, "record")
    assert empty.skip_through is None and other_run.skip_through is None and fresh.skip_through is None
    assert behind.skip_through == 2
    assert [told.wants(s) for s in (3, 5, 6)] == [False, False, True] and told.skipped == [3, 5]
    notes = resume_notes(caught)
    assert len(notes) == 2  # told and fallback; one line each
    assert all("\n" not in n for n in notes)
    assert "fake run r1 already holds the probe's snapshots up to step 5 (read back from the tracker)" in notes[0]
    assert "its snapshots at steps 3 to 5 are not sent to it again" in notes[0]
    assert "from the first one after step 5" in notes[0]
    assert f"as recorded in {record.path}" in notes[1] and "TensorBoard and attn_probe.jsonl" in notes[1]


def test_wandb_online_is_read_back_from_the_summary_and_offline_is_not():
    """W&B online cannot run here (no server): a stand-in with the two attributes the read-back
    uses. A resumed online run's summary holds the last ``attn_probe/step``; offline it is empty."""
    from types import SimpleNamespace

    from attn_probe.sinks.tracker_record import NotReadable, wandb_held_step, wandb_run

    online = SimpleNamespace(id="abc", offline=False, summary={STEP_KEY: 1000.0, "loss": 0.1})
    assert wandb_held_step(online, STEP_KEY) == 1000
    assert wandb_run(online).read_back() == 1000 and wandb_run(online).key == "wandb:abc"
    assert wandb_run(online, step_key=None).read_back is None  # the Trainer's W&B: the record only
    for run in (SimpleNamespace(id="abc", offline=False, summary={"loss": 0.1}),
                SimpleNamespace(id="abc", offline=True, summary={STEP_KEY: 1000})):
        with pytest.raises(NotReadable):
            wandb_held_step(run, STEP_KEY)


def test_a_slow_read_back_falls_back_to_the_record(tmp_path, monkeypatch):
    import threading

    from attn_probe.sinks import tracker_record
    from attn_probe.sinks.tracker_record import ResendGuard, SentRecord

    monkeypatch.setattr(tracker_record, "READ_BACK_TIMEOUT", 0.2)
    record = SentRecord(str(tmp_path))
    record.record(tracker_run(), 7)
    release = threading.Event()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard = ResendGuard(tracker_run(lambda: release.wait(30) and 99), record, resume_step=3)
    release.set()
    assert (guard.skip_through, guard.source) == (7, "record")


def test_the_record_never_raises_and_the_tracker_keeps_logging(tmp_path):
    """A record that cannot be written (here: its path is a directory) warns once, under -W error
    too (on stderr then); an unreadable record reads as absent."""
    from attn_probe.sinks.tracker_record import SentRecord, make_guard

    (tmp_path / SENT_FILENAME).mkdir()
    guard = make_guard(lambda: tracker_run(), str(tmp_path), resume_step=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # python -W error
        guard.sent(1)
        guard.sent(2)
    assert not [p for p in tmp_path.iterdir() if p.name != SENT_FILENAME]  # no temporary file left
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SentRecord(str(tmp_path / "other")).record(tracker_run(), 1)  # a missing directory: another file
    assert len(caught) == 1 and "could not record the steps sent to the trackers" in str(caught[0].message)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / SENT_FILENAME).write_text('{"format": "attn_probe.trackers/1", "runs": {"fake:r1": {"last_')
    assert SentRecord(str(broken)).last("fake:r1") is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert make_guard(lambda: 1 / 0, str(broken), resume_step=3) is None  # cannot tell the run: send all
    assert "every snapshot is sent to it" in str(caught[0].message)


def test_a_sink_learns_the_run_directory_from_the_dispatcher(tmp_path):
    from attn_probe.sinks.dispatch import SinkDispatcher
    from attn_probe.sinks.trajectory import TrajectorySink

    class Told:
        def __init__(self):
            self.run_dir = "unset"

        def bind_run_dir(self, run_dir):
            self.run_dir = run_dir

        def start(self, run):
            pass

        def log(self, snapshot):
            pass

        def finish(self):
            pass

    info = RunInfo(config={}, model={}, groups=["self"], metrics=["symmetry"], per_head=False)
    with_jsonl, alone = Told(), Told()
    for sinks in ([TrajectorySink(str(tmp_path / "run")), with_jsonl], [alone]):
        dispatcher = SinkDispatcher(sinks, background=False)
        dispatcher.start(info)
        dispatcher.close()
    assert with_jsonl.run_dir == str(tmp_path / "run") and alone.run_dir is None


# --------------------------------------------------------------------------- MLflow (plain loop)
@pytest.fixture
def mlflow_env(monkeypatch, mlflow_server):
    use_mlflow_server(monkeypatch, mlflow_server.uri)
    for key in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    return mlflow_server.uri


def mlflow_series(client, run_id: str, prefix: str = "attn_probe/") -> Series:
    """``{step: {key: value}}`` of the run's probe metrics; fails on a key logged twice at one step."""
    out: Series = {}
    for key in client.get_run(run_id).data.metrics:
        if key.startswith(prefix):
            for m in client.get_metric_history(run_id, key):
                assert key not in out.get(m.step, {}), f"{key} logged twice at step {m.step}"
                out.setdefault(m.step, {})[key] = m.value
    return out


def new_mlflow_run(client) -> str:
    experiment = client.create_experiment(f"resume-{uuid.uuid4().hex[:8]}")
    return client.create_run(experiment).info.run_id


@pytest.mark.parametrize("record", ["kept", "lost", "ahead"])
def test_mlflow_resumed_into_its_run_holds_each_step_once(tmp_path, mlflow_env, record):
    """The MLflow run is read back: the probe's record is not needed ("lost"), and when it claims
    more than the run holds ("ahead", e.g. batches lost in the crash) the run's own history wins."""
    from mlflow import MlflowClient

    from attn_probe.sinks.mlflow import MlflowSink

    client = MlflowClient(mlflow_env)
    run_id = new_mlflow_run(client)
    log_dir = tmp_path / "run"

    recorded = []

    def tamper():
        path = log_dir / SENT_FILENAME
        data = json.loads(path.read_text()) if path.exists() else {"runs": {}}
        recorded.append(data["runs"].get(f"mlflow:{run_id}", {}).get("last_step"))
        if record == "lost" and path.exists():
            path.unlink()
        elif record == "ahead":
            data["runs"][f"mlflow:{run_id}"] = {"last_step": LAST - 1}
            path.write_text(json.dumps(data))

    before, after, notes = crash_and_resume(log_dir, MlflowSink(run_id), MlflowSink(run_id), tamper)
    assert_same_series(mlflow_series(client, run_id), kept_then_resumed(before, after, FIRST))
    assert recorded == [FIRST]  # recorded once its batches were stored
    assert len(notes) == 1, notes
    assert f"MLflow run {run_id} already holds the probe's snapshots up to step {FIRST} (read back" in notes[0]
    assert f"steps {RESUME_AT} to {FIRST} are not sent to it again" in notes[0]
    assert json.loads((log_dir / SENT_FILENAME).read_text())["runs"][f"mlflow:{run_id}"]["last_step"] == LAST


def test_mlflow_resumed_into_a_new_run_gets_all_its_steps(tmp_path, mlflow_env):
    from mlflow import MlflowClient

    from attn_probe.sinks.mlflow import MlflowSink

    client = MlflowClient(mlflow_env)
    old, new = new_mlflow_run(client), new_mlflow_run(client)
    before, after, notes = crash_and_resume(tmp_path / "run", MlflowSink(old), MlflowSink(new))
    assert notes == []
    assert_same_series(mlflow_series(client, new), {s: v for s, v in after.items() if s >= RESUME_AT})
    assert_same_series(mlflow_series(client, old), before)
    runs = json.loads((tmp_path / "run" / SENT_FILENAME).read_text())["runs"]
    assert runs[f"mlflow:{old}"]["last_step"] == FIRST and runs[f"mlflow:{new}"]["last_step"] == LAST


# --------------------------------------------------------------------------- W&B offline (plain loop)
@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    yield from wandb_offline_env(monkeypatch, tmp_path)


def wandb_probe_rows(rows: list[dict], step_key: str = STEP_KEY, prefix: str = "attn_probe/") -> Series:
    """``{step: values}`` of the probe's rows; fails on a step in two rows."""
    out: Series = {}
    for row in rows:
        values = {k[len(prefix) - len("attn_probe/"):]: v for k, v in row.items()
                  if k.startswith(prefix) and k != STEP_KEY}
        if values:
            step = int(row[step_key])
            assert step not in out, f"probe step {step} in two rows"
            out[step] = values
    return out


@pytest.mark.parametrize("whose", ["sink's", "user's"])
def test_wandb_offline_resumed_into_its_run_holds_each_step_once(tmp_path, wandb_offline, whose):
    """Offline, the resumed run's summary is empty: the probe's record, keyed by the run id, says
    which steps the run holds. Beside a run of the user's, the probe logs into a W&B run of its own
    whose id is derived from the user's (issue 35): the user's resumed run resumes the probe's too."""
    import wandb

    from attn_probe.sinks.wandb import WandbSink

    run_id = f"resume{uuid.uuid4().hex[:6]}"
    init = dict(project="attn-probe-resume", id=run_id, resume="allow", mode="offline", dir=str(wandb_offline))
    runs = []

    def sink():
        if whose == "sink's":
            return WandbSink(**init)
        runs.append(wandb.init(**init))
        return WandbSink(runs[-1])

    def end_users_run():
        if runs:
            runs[-1].finish()

    before, after, notes = crash_and_resume(tmp_path / "run", sink(), _Lazy(sink), end_users_run)
    end_users_run()
    probe_id = run_id if whose == "sink's" else probe_run_id(run_id)
    got = wandb_probe_rows(wandb_resumed_history(wandb_offline, probe_id, files=2))
    want = kept_then_resumed(before, after, FIRST)
    assert_same_series(got, want)
    assert len(notes) == 1, notes
    assert f"W&B run {probe_id} already holds the probe's snapshots up to step {FIRST} (as recorded in" in notes[0]
    assert SENT_FILENAME in notes[0]


class _Lazy:
    """A sink built when the probe starts it (a W&B run of the user's is opened only then)."""

    def __init__(self, make):
        self._make = make
        self._sink = None

    def bind_run_dir(self, run_dir):
        self._run_dir = run_dir

    def start(self, run):
        self._sink = self._make()
        if hasattr(self, "_run_dir"):
            self._sink.bind_run_dir(self._run_dir)
        self._sink.start(run)

    def log(self, snapshot):
        self._sink.log(snapshot)

    def finish(self):
        self._sink.finish()


def test_wandb_offline_resumed_into_a_new_run_gets_all_its_steps(tmp_path, wandb_offline):
    from attn_probe.sinks.wandb import WandbSink

    init = dict(project="attn-probe-resume", resume="allow", mode="offline", dir=str(wandb_offline))
    old, new = f"old{uuid.uuid4().hex[:6]}", f"new{uuid.uuid4().hex[:6]}"
    before, after, notes = crash_and_resume(tmp_path / "run", WandbSink(id=old, **init), WandbSink(id=new, **init))
    assert notes == []
    assert_same_series(wandb_probe_rows(wandb_resumed_history(wandb_offline, new, files=1)),
                       {s: v for s, v in after.items() if s >= RESUME_AT})
    assert_same_series(wandb_probe_rows(wandb_resumed_history(wandb_offline, old, files=1)), before)


# --------------------------------------------------------------------------- the Trainer
TRAINER_FIRST, TRAINER_CKPT, TRAINER_LAST = 6, 4, 10  # every=2: steps 0, 2, 4, 6; resumed: 4, 6, 8, 10


def train_trainer(out: Path, report_to: list[str], max_steps: int, resume: bool = False):
    from helpers import RandomTokens, make_args
    from helpers import tiny_bert as trainer_bert
    from transformers import Trainer

    args = make_args(out, max_steps, report_to=report_to, logging_steps=1, save_strategy="steps",
                     save_steps=TRAINER_CKPT, run_name="resume-run")
    trainer = Trainer(model=trainer_bert(), args=args, train_dataset=RandomTokens())
    attn_probe.attach(trainer, every=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(out / f"checkpoint-{TRAINER_CKPT}") if resume else None)
    return resume_notes(caught)


def probe_run_dir(out: Path) -> Path:
    runs = [d for d in (out / "runs").iterdir() if (d / "attn_probe.jsonl").is_file()]
    assert len(runs) == 1, runs
    return runs[0]


def finish_mlflow() -> None:
    import mlflow

    flush = getattr(mlflow, "flush_async_logging", None)
    if flush is not None:
        flush()  # the Trainer's MLflowCallback logs with synchronous=False
    if mlflow.active_run() is not None:
        mlflow.end_run()


@pytest.mark.parametrize("tracker_run", ["same", "new"])
def test_trainer_resumed_from_a_checkpoint_mlflow_holds_each_step_once(tmp_path, monkeypatch, mlflow_env,
                                                                      tracker_run):
    from mlflow import MlflowClient

    experiment = f"trainer-resume-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    out = tmp_path / "out"
    assert train_trainer(out, ["mlflow"], TRAINER_FIRST) == []
    finish_mlflow()
    client = MlflowClient(mlflow_env)
    exp_id = client.get_experiment_by_name(experiment).experiment_id
    (first,) = [r.info.run_id for r in client.search_runs([exp_id])]
    before = expected_metrics(probe_run_dir(out))
    assert sorted(before) == [0, 2, 4, 6]

    if tracker_run == "same":
        monkeypatch.setenv("MLFLOW_RUN_ID", first)  # the Trainer's MLflowCallback resumes this run
    notes = train_trainer(out, ["mlflow"], TRAINER_LAST, resume=True)
    finish_mlflow()
    after = expected_metrics(probe_run_dir(out))
    assert sorted(after) == [0, 2, 4, 6, 8, 10]
    runs = [r.info.run_id for r in client.search_runs([exp_id])]
    if tracker_run == "same":
        assert runs == [first]
        assert_same_series(mlflow_series(client, first), kept_then_resumed(before, after, TRAINER_FIRST), rel=1e-6)
        assert len(notes) == 1, notes
        assert f"the Trainer's MLflow run {first} already holds the probe's snapshots up to step 6" in notes[0]
        assert "steps 4 to 6 are not sent to it again" in notes[0]
        # the Trainer's own loss is there too (it logs its steps 5 and 6 again itself: not the probe's doing)
        assert sorted({m.step for m in client.get_metric_history(first, "loss")}) == list(range(1, TRAINER_LAST + 1))
    else:
        (second,) = set(runs) - {first}
        assert notes == []
        assert_same_series(mlflow_series(client, second), {s: v for s, v in after.items() if s >= TRAINER_CKPT},
                           rel=1e-6)
        assert_same_series(mlflow_series(client, first), before, rel=1e-6)


@pytest.fixture
def wandb_trainer_env(monkeypatch, tmp_path):
    yield from wandb_offline_env(monkeypatch, tmp_path, WANDB_PROJECT="attn-probe-trainer-resume",
                                 WANDB_LOG_MODEL="false", WANDB_WATCH="false", WANDB_RESUME="allow")


@pytest.mark.parametrize("tracker_run", ["same", "new"])
def test_trainer_resumed_from_a_checkpoint_wandb_offline_holds_each_step_once(tmp_path, monkeypatch,
                                                                             wandb_trainer_env, tracker_run):
    import wandb

    first, second = f"tr{uuid.uuid4().hex[:6]}", f"tr{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("WANDB_RUN_ID", first)
    out = tmp_path / "out"
    assert train_trainer(out, ["wandb"], TRAINER_FIRST) == []
    wandb.run.finish()  # the WandbCallback leaves its run open; a crashed process ends it too
    wandb.teardown()  # a new process: W&B reads WANDB_RUN_ID once per process
    before = expected_metrics(probe_run_dir(out))

    if tracker_run == "new":
        monkeypatch.setenv("WANDB_RUN_ID", second)
    notes = train_trainer(out, ["wandb"], TRAINER_LAST, resume=True)
    wandb.run.finish()
    after = expected_metrics(probe_run_dir(out))
    assert sorted(after) == [0, 2, 4, 6, 8, 10]

    def probe_rows(run_id, files):  # the probe's own W&B run beside the Trainer's (issue 35)
        return wandb_probe_rows(wandb_resumed_history(wandb_trainer_env, probe_run_id(run_id), files=files))

    if tracker_run == "same":
        assert_same_series(probe_rows(first, 2), kept_then_resumed(before, after, TRAINER_FIRST), rel=1e-6)
        assert len(notes) == 1, notes
        assert f"W&B run {probe_run_id(first)} already holds the probe's snapshots up to step 6" in notes[0]
    else:
        assert notes == []
        assert_same_series(probe_rows(second, 1), {s: v for s, v in after.items() if s >= TRAINER_CKPT}, rel=1e-6)
        assert_same_series(probe_rows(first, 1), before, rel=1e-6)


# --------------------------------------------------------------------------- Accelerate
def test_accelerator_wandb_resumed_into_its_run_holds_each_step_once(tmp_path, wandb_offline,
                                                                     fresh_accelerate_state):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    run_id = f"acc{uuid.uuid4().hex[:6]}"
    log_dir = tmp_path / "probe"

    def session(start_step: int, updates: int, seed: int) -> list[str]:
        AcceleratorState._reset_state(True)  # a new process
        GradientState._reset_state()
        acc = Accelerator(cpu=True, log_with=["wandb"])
        acc.init_trackers("acc-resume", init_kwargs={"wandb": {"dir": str(wandb_offline), "mode": "offline",
                                                               "id": run_id, "resume": "allow"}})
        model = tiny_bert(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model, opt = acc.prepare(model, opt)
        with warnings.catch_warnings(record=True) as caught:  # until close: W&B's guard is made on its lane
            warnings.simplefilter("always")
            probe = attn_probe.watch(model, accelerator=acc, optimizer=opt, every=2, log_dir=str(log_dir),
                                     start_step=start_step)
            for i in range(updates):
                ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(i))
                acc.backward(model(input_ids=ids, labels=ids).loss)
                opt.step()
                opt.zero_grad()
            probe.close()
        acc.end_training()
        return resume_notes(caught)

    assert session(0, 6, seed=0) == []
    before = expected_metrics(log_dir)
    notes = session(4, 6, seed=1)
    after = expected_metrics(log_dir)
    assert sorted(before) == [0, 2, 4, 6] and sorted(after) == [0, 2, 4, 6, 8, 10]
    assert_values_differ(before, after, 4)
    got = wandb_probe_rows(wandb_resumed_history(wandb_offline, probe_run_id(run_id), files=2))
    assert_same_series(got, kept_then_resumed(before, after, 6))
    assert len(notes) == 1 and f"W&B run {probe_run_id(run_id)} already holds" in notes[0], notes


# --------------------------------------------------------------------------- trackio (own process: TRACKIO_DIR is read at import)
TRACKIO_SCRIPT = """
import json, shutil, sys, warnings
sys.path.insert(0, {tests!r})
warnings.simplefilter("always")
import torch, trackio, attn_probe
from attn_probe.sinks.trackio import TrackioSink
from tracker_servers import tiny_bert, train_steps
from helpers import RandomTokens, make_args
from helpers import tiny_bert as trainer_bert
from transformers import Trainer

notes = {{}}
def noted(key, fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    notes[key] = [str(w.message) for w in caught if str(w.message).startswith("attn_probe: resuming at step")
                  and ": dropped " not in str(w.message)]  # the trajectory's cut line is not a tracker note

def keep(run_dir, name):  # the JSONL as it is now (a resume rewrites it)
    shutil.copytree(run_dir, {root!r} + "/" + name, ignore=shutil.ignore_patterns("events.*", ".attn_probe.lock"))

# a plain loop: steps 0..6, resumed at 3 (other weights) up to 9 into the same trackio run, then
# resumed at 3 again into a new run
quiet = dict(auto_log_cpu=False, auto_log_gpu=False, resume="allow")
def plain(name, start, updates, seed):
    model = tiny_bert(seed); opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with attn_probe.watch(model, optimizer=opt, log_dir={plain!r}, every=1, start_step=start,
                          sinks=[TrackioSink(project="resume", name=name, **quiet)]):
        train_steps(model, opt, updates)
noted("plain-first", lambda: plain("r", 0, 6, 0)); keep({plain!r}, "plain-before")
noted("plain-same", lambda: plain("r", 3, 6, 1)); keep({plain!r}, "plain-after")
noted("plain-new", lambda: plain("r-new", 3, 6, 2)); keep({plain!r}, "plain-new")

# the Trainer, report_to="trackio": steps 0..6 with a checkpoint at 4, resumed from it up to 10;
# the TrackioCallback resumes the run of the same name
def trainer(max_steps, resume):
    args = make_args({out!r}, max_steps, report_to=["trackio"], logging_steps=1, save_strategy="steps",
                     save_steps=4, run_name="trainer-run", project="trainer")
    t = Trainer(model=trainer_bert(), args=args, train_dataset=RandomTokens())
    attn_probe.attach(t, every=2)
    t.train(resume_from_checkpoint={out!r} + "/checkpoint-4" if resume else None)
    return t.state.log_history
noted("trainer-first", lambda: trainer(6, False))
import glob
(run_dir,) = [d for d in glob.glob({out!r} + "/runs/*") if glob.glob(d + "/attn_probe.jsonl")]
keep(run_dir, "trainer-before")
noted("trainer-same", lambda: trainer(10, True)); keep(run_dir, "trainer-after")
print("NOTES=" + json.dumps(notes))
"""


def trackio_probe_series(rows, run_name: str, step_key: str | None = None, prefix: str = "attn_probe/") -> Series:
    out: Series = {}
    for name, step, metrics in rows:
        probe = {k[len(prefix) - len("attn_probe/"):]: float(v) for k, v in metrics.items() if k.startswith(prefix)}
        if name != run_name or not probe:
            continue
        step = int(metrics[step_key]) if step_key else step
        assert not set(probe) & set(out.get(step, {})), f"step {step} logged twice"
        out.setdefault(step, {}).update(probe)
    return out


def test_trackio_resumed_into_its_run_holds_each_step_once_plain_and_trainer(tmp_path):
    pytest.importorskip("trackio")
    store = tmp_path / "trackio"
    script = TRACKIO_SCRIPT.format(tests=str(TESTS), root=str(tmp_path), plain=str(tmp_path / "plain"),
                                   out=str(tmp_path / "out"))
    env = {**os.environ, "TRACKIO_DIR": str(store), "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False",
           "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    for key in ("TENSORBOARD_LOGGING_DIR", "TRACKIO_SPACE_ID"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env,
                         timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    notes = json.loads(out.stdout.rsplit("NOTES=", 1)[1])

    # plain loop: the resumed run holds 0..9 once, 3..6 from before the resume; the new run all of 3..9
    before, after, new = (expected_metrics(tmp_path / n) for n in ("plain-before", "plain-after", "plain-new"))
    assert_values_differ(before, after, RESUME_AT)
    rows = trackio_rows(store, "resume")
    assert_same_series(trackio_probe_series(rows, "r"), kept_then_resumed(before, after, FIRST))
    assert_same_series(trackio_probe_series(rows, "r-new"), {s: v for s, v in new.items() if s >= RESUME_AT})
    assert notes["plain-first"] == [] and notes["plain-new"] == []
    assert len(notes["plain-same"]) == 1 and "trackio run 'r' of project 'resume'" in notes["plain-same"][0]

    # the Trainer reporting to trackio gets the probe's values (train/ prefix, at train/global_step),
    # equal to the JSONL, and on resume each step once
    before, after = expected_metrics(tmp_path / "trainer-before"), expected_metrics(tmp_path / "trainer-after")
    assert sorted(before) == [0, 2, 4, 6] and sorted(after) == [0, 2, 4, 6, 8, 10]
    got = trackio_probe_series(trackio_rows(store, "trainer"), "trainer-run", step_key="train/global_step",
                               prefix="train/attn_probe/")
    assert_same_series(got, kept_then_resumed(before, after, TRAINER_FIRST), rel=1e-6)
    assert any(k.endswith("/symmetry/median") for k in got[0]) and any("/layer_" in k for k in got[0])
    losses = [m["train/global_step"] for name, _, m in trackio_rows(store, "trainer") if "train/loss" in m]
    assert sorted(set(losses)) == list(range(1, TRAINER_LAST + 1))  # the Trainer's own loss, beside
    assert notes["trainer-first"] == []
    assert len(notes["trainer-same"]) == 1 and "the Trainer's trackio run 'trainer-run'" in notes["trainer-same"][0]
