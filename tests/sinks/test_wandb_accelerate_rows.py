"""Issue 29, Accelerate's W&B tracker: ``accelerator.log(..., step=s)`` passes ``step=`` to W&B.

A real ``Accelerator(log_with=["wandb"])`` (offline, read back from the ``.wandb`` file); the
probe snapshots every update, the user logs every third with ``step=`` (a sample counter). Its
values go into the tracker's run through ``WandbRows``: own rows until the user's first log,
then the user's open row, where two snapshots in one row cannot both land. The first lost one is
warned about with "1 lost so far" and the fix; every snapshot that lands equals the JSONL, and
every user log is at its own step (was: the probe's rows went in as commits, no word of any loss).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from tracker_servers import SEQ, VOCAB, expected_metrics, tiny_bert, wandb_history, wandb_offline_env

import attn_probe
from attn_probe.sinks.trackers import STEP_KEY

UPDATES = 6


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    yield from wandb_offline_env(monkeypatch, tmp_path)


def test_accelerate_user_with_step_is_warned_at_the_first_lost_snapshot(tmp_path, fresh_accelerate_state,
                                                                         wandb_offline):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, log_with=["wandb"], project_dir=str(tmp_path / "proj"))
    acc.init_trackers("acc-rows", init_kwargs={"wandb": {"dir": str(wandb_offline), "mode": "offline"}})
    model = tiny_bert(0, layers=1, hidden=16, heads=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    logged = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = attn_probe.watch(model, accelerator=acc, optimizer=opt, every=1, log_dir=str(tmp_path / "probe"))
        for i in range(UPDATES):
            ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(i))
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            if i % 3 == 2:
                acc.log({"loss": loss.item()}, step=10 * (i + 1))
                logged.append((10 * (i + 1), loss.item()))
        probe.close()
    acc.end_training()

    want = expected_metrics(tmp_path / "probe")
    assert sorted(want) == list(range(UPDATES + 1))
    history = wandb_history(wandb_offline)
    got = {int(r[STEP_KEY]): r for r in history if STEP_KEY in r}
    assert all(math.isclose(got[s][k], v, rel_tol=1e-6) or (math.isnan(v) and math.isnan(got[s][k]))
               for s in got for k, v in want[s].items())
    missing = [s for s in want if s not in got]
    said = [str(w.message) for w in caught if "attn_probe" in str(w.message)]
    assert missing and said, (sorted(got), said)
    assert f"snapshot at step {missing[0]} did not reach" in said[0] and "(1 lost so far)" in said[0]
    assert "separate_run=True" in said[0]
    assert {0, 1, 2, 3} <= set(got)  # before the user's first log: rows of their own
    losses = sorted((row["_step"], row["loss"]) for row in history if "loss" in row)
    assert [s for s, _ in losses] == [s for s, _ in logged]
    assert [v for _, v in losses] == pytest.approx([v for _, v in logged])
