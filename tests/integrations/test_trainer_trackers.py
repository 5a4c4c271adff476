"""A real Trainer reporting to MLflow / W&B: the probe's values reach the Trainer's own run.

``attn_probe.attach(trainer, every=2)`` (and ``callbacks=[AttnProbeCallback(...)]`` once) with
``report_to=["mlflow"]`` (a local tracking server, read back with ``MlflowClient``) and
``report_to=["wandb"]`` (offline, read back from the ``.wandb`` files). The tracker holds the
per-layer values and the across-layer stats at the probe's steps (the final step included),
equal to the JSONL: MLflow in the Trainer's run, beside its own loss; W&B in a run of the
probe's own beside the Trainer's. Nothing of the probe lands in ``trainer.state.log_history``.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path

import pytest
from helpers import RandomTokens, make_args, tiny_bert
from tracker_servers import (
    expected_metrics,
    use_mlflow_server,
    wandb_history,
    wandb_offline_env,
)
from transformers import Trainer

import attn_probe
from attn_probe.integrations.transformers import AttnProbeCallback

STEPS = 5
PROBE_STEPS = [0, 2, 4, 5]  # every=2, and the final step


def same(a, b) -> bool:
    a, b = float(a), float(b)
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def assert_same_series(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]]) -> None:
    assert sorted(got) == sorted(want) == PROBE_STEPS
    for step in want:
        assert sorted(got[step]) == sorted(want[step]), f"keys at step {step}"
        bad = {k: (got[step][k], v) for k, v in want[step].items() if not same(got[step][k], v)}
        assert not bad, f"step {step}: {bad}"
    keys = want[PROBE_STEPS[0]]
    assert any("/layer_" in k for k in keys)
    for stat in ("median", "q25", "q75"):
        assert any(k.endswith(f"/symmetry/{stat}") for k in keys), stat
    assert not any("/head_" in k for k in keys)  # per-head values only when asked


def probe_run_dir(out: Path) -> Path:
    runs = [d for d in (out / "runs").iterdir() if (d / "attn_probe.jsonl").is_file()]
    assert len(runs) == 1, runs
    return runs[0]


def no_probe_values_in_log_history(trainer: Trainer) -> None:
    history = trainer.state.log_history
    assert any("loss" in row for row in history)
    assert not [k for row in history for k in row if "attn_probe" in k]


def build(out: Path, report_to: list[str], how: str) -> Trainer:
    args = make_args(out, STEPS, report_to=report_to, logging_steps=1)
    if how == "callbacks":
        return Trainer(model=tiny_bert(), args=args, train_dataset=RandomTokens(),
                       callbacks=[AttnProbeCallback(every=2)])
    trainer = Trainer(model=tiny_bert(), args=args, train_dataset=RandomTokens())
    attn_probe.attach(trainer, every=2)
    return trainer


# --------------------------------------------------------------------------- MLflow
@pytest.mark.parametrize("how", ["attach", "callbacks"])
def test_trainer_reporting_to_mlflow_gets_the_probe_values_in_its_run(tmp_path, monkeypatch, mlflow_server, how):
    import mlflow
    from mlflow import MlflowClient

    experiment = f"trainer-{how}-{uuid.uuid4().hex[:8]}"
    use_mlflow_server(monkeypatch, mlflow_server.uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)

    trainer = build(tmp_path, ["mlflow"], how)
    trainer.train()
    flush = getattr(mlflow, "flush_async_logging", None)
    if flush is not None:
        flush()  # the Trainer's MLflowCallback logs with synchronous=False
    if mlflow.active_run() is not None:
        mlflow.end_run()

    client = MlflowClient(mlflow_server.uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1  # the Trainer's own run, no second one
    run_id = runs[0].info.run_id
    got: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        if key.startswith("attn_probe/"):
            for m in client.get_metric_history(run_id, key):
                assert key not in got.get(m.step, {}), f"{key} logged twice at step {m.step}"
                got.setdefault(m.step, {})[key] = m.value
    assert_same_series(got, expected_metrics(probe_run_dir(tmp_path)))
    losses = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in losses) == list(range(1, STEPS + 1))  # the Trainer's own loss
    no_probe_values_in_log_history(trainer)


# --------------------------------------------------------------------------- W&B
@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    yield from wandb_offline_env(monkeypatch, tmp_path, WANDB_PROJECT="attn-probe-trainer", WANDB_LOG_MODEL="false", WANDB_WATCH="false")


def test_trainer_reporting_to_wandb_gets_the_probe_values_in_a_run_of_its_own(tmp_path, wandb_offline):
    """``report_to=["wandb"]``: the probe's values go into a W&B run of its own beside the Trainer's
    (issue 35; was: into the Trainer's run through its callback's ``on_log``), in its group, finished
    at train end; the Trainer's run holds its own loss and nothing of the probe's."""
    import wandb
    from tracker_servers import finished_wandb_records

    from attn_probe.sinks.trackers import STEP_KEY
    from attn_probe.sinks.wandb import probe_run_id

    out = tmp_path / "out"
    trainer = build(out, ["wandb"], "attach")
    trainer.train()
    assert wandb.run is not None  # the Trainer's run, still open and still wandb.run
    trainer_run = wandb.run.id
    wandb.run.finish()

    got: dict[int, dict[str, float]] = {}
    for row in wandb_history(wandb_offline, run_id=probe_run_id(trainer_run)):  # finished: its exit record
        if STEP_KEY in row:
            step = int(row[STEP_KEY])
            assert step not in got, f"probe step {step} in two rows"
            got[step] = {k: v for k, v in row.items() if k.startswith("attn_probe/") and k != STEP_KEY}
    assert_same_series(got, expected_metrics(probe_run_dir(out)))
    run_record = next(r.run for r in finished_wandb_records(wandb_offline, run_id=probe_run_id(trainer_run))
                      if r.WhichOneof("record_type") == "run")
    assert run_record.job_type == "attn_probe" and trainer_run in run_record.config.SerializeToString().decode("latin-1")
    history = wandb_history(wandb_offline, run_id=trainer_run)
    assert not any(k.startswith("attn_probe") or "/attn_probe/" in k for row in history for k in row)
    assert [int(row["train/global_step"]) for row in history if "train/loss" in row] == list(range(1, STEPS + 1))
    no_probe_values_in_log_history(trainer)
