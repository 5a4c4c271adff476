"""``watch(model, accelerator=acc)`` sends the probe's values to the accelerator's trackers.

A real ``Accelerator(log_with=["wandb", "tensorboard"])`` (W&B offline, read back from the
``.wandb`` files): a W&B run of the probe's own, beside the accelerator's, gets the per-layer
values and median/q25/q75 at the probe's steps on the probe's own step axis, equal to the
JSONL; the accelerator's run holds the user's loss logged with ``accelerator.log`` under a
counter that runs far ahead of the probe's, and nothing of the probe's; TensorBoard (written
by the probe itself) holds each probe tag once per step. ``optimizer=`` picks the optimizer.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tracker_servers import SEQ, VOCAB, expected_metrics, tiny_bert, wandb_history, wandb_offline_env

import attn_probe
from attn_probe.sinks.trackers import STEP_KEY
from attn_probe.sinks.wandb import probe_run_id

UPDATES = 5


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    yield from wandb_offline_env(monkeypatch, tmp_path)


def same(a, b) -> bool:
    a, b = float(a), float(b)
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def test_accelerator_wandb_tracker_gets_the_probe_values(tmp_path, fresh_accelerate_state, wandb_offline):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, log_with=["wandb", "tensorboard"], project_dir=str(tmp_path / "proj"))
    acc.init_trackers("acc-run", init_kwargs={"wandb": {"dir": str(wandb_offline), "mode": "offline"}})
    model = tiny_bert()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    probe = attn_probe.watch(model, accelerator=acc, optimizer=opt, every=2)
    assert probe.log_dir is not None
    logged = []
    for i in range(UPDATES):
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(i))
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        user_step = 1000 + 10 * i  # the user's counter runs far ahead of the probe's step
        acc.log({"loss": loss.item()}, step=user_step)
        logged.append((user_step, loss.item()))
    assert probe.step == UPDATES
    probe.close()
    acc_run_id = acc.get_tracker("wandb", unwrap=True).id
    acc.end_training()

    want = expected_metrics(probe.log_dir)
    assert sorted(want) == [0, 2, 4, 5]
    # the probe's values: a W&B run of the probe's own beside the accelerator's, every snapshot a row
    got: dict[int, dict[str, float]] = {}
    for row in wandb_history(wandb_offline, run_id=probe_run_id(acc_run_id)):
        if STEP_KEY in row:
            step = int(row[STEP_KEY])
            assert step not in got, f"probe step {step} in two rows"
            got[step] = {k: v for k, v in row.items() if k.startswith("attn_probe/") and k != STEP_KEY}
    assert sorted(got) == sorted(want)
    for step in want:
        assert sorted(got[step]) == sorted(want[step])
        assert all(same(got[step][k], v) for k, v in want[step].items()), step
    assert any(k.endswith("/symmetry/median") for k in got[0]) and not any("/head_" in k for k in got[0])
    history = wandb_history(wandb_offline, run_id=acc_run_id)
    assert not any(k.startswith("attn_probe") for row in history for k in row)  # nothing of the probe's
    # the user's losses all survive (W&B drops a log whose step= is below the last one it saw)
    losses = sorted((row["_step"], row["loss"]) for row in history if "loss" in row)
    assert [s for s, _ in losses] == [s for s, _ in logged]
    assert [v for _, v in losses] == pytest.approx([v for _, v in logged])

    # TensorBoard: the probe wrote into the tracker's run, each tag once per step
    ea = EventAccumulator(str(probe.log_dir), size_guidance={"scalars": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("attn_probe/self/symmetry/layer_00")] == [0, 2, 4, 5]
    assert [e.step for e in ea.Scalars("loss")] == [s for s, _ in logged]


def test_accelerate_optimizer_argument_and_tracker_options(tmp_path, fresh_accelerate_state):
    from accelerate import Accelerator

    from attn_probe.integrations.accelerate import other_trackers

    acc = Accelerator(cpu=True)
    model = tiny_bert()
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, raw)
    assert other_trackers(acc) == []
    with pytest.raises(TypeError, match="only with accelerator="):
        attn_probe.watch(model, optimizer=opt, trackers=False, log_dir=str(tmp_path / "x"))
    for n, given in enumerate((opt, raw)):  # the AcceleratedOptimizer or the torch optimizer inside it
        probe = attn_probe.watch(model, accelerator=acc, optimizer=given, every=1, log_dir=str(tmp_path / f"r{n}"),
                                 trackers=False)
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
        assert probe.step == 1
        probe.close()


def test_accelerator_mlflow_tracker_gets_the_probe_values(tmp_path, monkeypatch, fresh_accelerate_state, mlflow_server):
    import uuid

    from accelerate import Accelerator
    from mlflow import MlflowClient
    from tracker_servers import use_mlflow_server

    experiment = f"acc-{uuid.uuid4().hex[:8]}"
    use_mlflow_server(monkeypatch, mlflow_server.uri)
    acc = Accelerator(cpu=True, log_with=["mlflow"], project_dir=str(tmp_path / "proj"))
    acc.init_trackers(experiment)
    model = tiny_bert()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    probe = attn_probe.watch(model, accelerator=acc, every=2, log_dir=str(tmp_path / "probe"))
    for i in range(UPDATES):
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(i))
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        acc.log({"loss": loss.item()}, step=i + 1)
    probe.close()
    acc.end_training()

    client = MlflowClient(mlflow_server.uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1
    run_id = runs[0].info.run_id
    got: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        if key.startswith("attn_probe/"):
            for m in client.get_metric_history(run_id, key):
                assert key not in got.get(m.step, {}), f"{key} logged twice at step {m.step}"
                got.setdefault(m.step, {})[key] = m.value
    want = expected_metrics(tmp_path / "probe")
    assert sorted(got) == sorted(want) == [0, 2, 4, 5]
    for step in want:
        assert sorted(got[step]) == sorted(want[step])
        assert all(same(got[step][k], v) for k, v in want[step].items()), step
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(1, UPDATES + 1))
