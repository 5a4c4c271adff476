"""Issue 44 item 8: alert state survives a resume. A growth rule fires in a resumed run exactly
where it fires in the uninterrupted run, resumed before or after the fire: the rules' windows are
rebuilt from the run's rows that the trajectory file holds (the JSONL is the record)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

import attn_probe  # noqa: E402
from attn_probe.live.alerts import AlertRule  # noqa: E402
from tests.helpers import tiny_llama  # noqa: E402

#: each step scales every q_proj by C: ||W_qk||_F grows by C a step, x2 after 7.5 steps
C = 2 ** (1 / 7.5)
RULES = [AlertRule("frobenius_norm", growth=2.0, within=8)]
LAST = 24


def _grow(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(C)


def _run(model, log_dir, first: int, last: int, *, save_at: int | None = None):
    """Steps ``first + 1 .. last`` of a plain loop watched from ``first`` (a resume when > 0); returns the
    alerts fired and the model's state at ``save_at`` (a checkpoint)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    fired, saved = [], None
    probe = attn_probe.watch(
        model,
        optimizer=opt,
        every=1,
        log_dir=str(log_dir),
        start_step=first,
        alerts=RULES,
        alert_callback=fired.append,
    )
    for step in range(first + 1, last + 1):
        _grow(model)
        opt.step()  # the probe counts the update: a snapshot at every step
        if step == save_at:
            saved = copy.deepcopy(model.state_dict())
    probe.close()
    return [(a.step, a.layer, a.head, a.metric) for a in fired], saved


def test_uninterrupted_run_fires_once_per_layer_at_step_8(tmp_path):
    fired, _ = _run(tiny_llama(), tmp_path, 0, LAST)
    assert fired == [(8, 0, None, "frobenius_norm"), (8, 1, None, "frobenius_norm")]


@pytest.mark.parametrize("resume_at", [3, 5, 8, 12, 16])
def test_resumed_run_fires_what_the_uninterrupted_run_fires(tmp_path, resume_at):
    """Interrupted 3 steps after its checkpoint at ``resume_at`` (those rows are cut on resume) and
    resumed from it: the alerts before the checkpoint plus the resumed run's equal the uninterrupted
    run's (resumed at 12, after the fire, it fired again at 20; resumed at 5 it fired at 13, not 8)."""
    reference, _ = _run(tiny_llama(), tmp_path / "whole", 0, LAST)
    model = tiny_llama()
    log_dir = tmp_path / "resumed"
    before, checkpoint = _run(model, log_dir, 0, resume_at + 3, save_at=resume_at)
    model = tiny_llama()
    model.load_state_dict(checkpoint)
    after, _ = _run(model, log_dir, resume_at, LAST)
    assert [a for a in before if a[0] < resume_at] + after == reference
    # one run, each step once, as the project's loader reads it back
    df = attn_probe.load_trajectory(str(log_dir))
    assert df["run"].nunique() == 1
    layer0 = df[(df.metric == "frobenius_norm") & (df.layer == 0) & df["head"].isna()]
    assert sorted(layer0.step) == list(range(LAST + 1))
    with open(os.path.join(log_dir, "attn_probe.jsonl")) as f:
        headers = [json.loads(line)["run_header"] for line in f if '"run_header"' in line]
    assert len({h["run_id"] for h in headers}) == 1 and [h["resumed"] for h in headers] == [False, True]
