"""Alerts the user can rely on, in real runs: NaN weights fire, impossible rules are refused at
attach, the alert line as the user sees it, and a Trainer stopped by an alert saves a checkpoint."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")

from transformers import Trainer, TrainerCallback  # noqa: E402

import attn_probe  # noqa: E402
from attn_probe import AttnProbeCallback, Probe  # noqa: E402
from attn_probe.live.alerts import AlertRule  # noqa: E402
from tests.helpers import REPO, RandomTokens, make_args, tiny_llama  # noqa: E402


def test_nan_weights_fire_an_alert_once_per_layer(tmp_path, capfd):
    """One NaN loss at step 3 (a diverging run) makes every weight NaN after that update: a rule
    on spectral_norm fires at step 3 for each layer with the NaN value, and not again at the
    later steps, where the weights stay NaN."""
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    fired = []
    probe = attn_probe.watch(model, optimizer=opt, every=1, log_dir=str(tmp_path / "tb"),
                             alerts=[AlertRule("spectral_norm", above=1e6)], alert_callback=fired.append)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    finite = []
    for step in range(1, 7):
        loss = model(input_ids=ids, labels=ids).loss
        (loss * math.nan if step == 3 else loss).backward()
        opt.step()
        opt.zero_grad()
        finite.append(all(bool(torch.isfinite(layer.self_attn.q_proj.weight).all()) for layer in model.model.layers))
    probe.close()
    assert finite == [True, True, False, False, False, False]  # the weights themselves, independently
    assert [(a.step, a.layer, a.head, a.metric) for a in fired] == [(3, 0, None, "spectral_norm"),
                                                                  (3, 1, None, "spectral_norm")]
    assert all(math.isnan(a.value) for a in fired)
    err = capfd.readouterr().err
    assert "attn_probe alert at step 3: spectral_norm = nan in self layer 1, all heads" in err


def _train_watched(model, tmp_path, steps, *, nan_at=None, **options):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    fired = []
    probe = attn_probe.watch(model, optimizer=opt, every=1, log_dir=str(tmp_path / "tb"), attention_stats=True,
                             metrics=("symmetry", "qk_bound"), alert_callback=fired.append, **options)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    for step in range(1, steps + 1):
        if step == nan_at:
            with torch.no_grad():
                model.model.layers[1].self_attn.q_proj.weight.fill_(math.nan)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    probe.close()
    return probe, fired


def test_a_failed_attention_measurement_fires_no_alert_and_stops_nothing(tmp_path, monkeypatch):
    """A layer whose measurement failed logs NaN max_logit/entropy (nothing measured), which must not
    fire the NaN default nor stop training: only NaN logits that were measured fire. The control:
    the same rules fire on NaN query weights, whose logits are measured and NaN."""
    rules = [AlertRule("max_logit", above=1e6), AlertRule("entropy", above=1e6),
             AlertRule("logit_bound_ratio", above=10.0)]
    real = attn_probe.activations.statistics.logit_stats

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure in the attention statistics")

    monkeypatch.setattr(attn_probe.activations.statistics, "logit_stats", broken)
    probe, fired = _train_watched(tiny_llama(), tmp_path / "a", 4, alerts=rules, stop_on_alert=True)
    assert probe.failures >= 1 and fired == [] and not probe.stop_requested
    monkeypatch.setattr(attn_probe.activations.statistics, "logit_stats", real)
    probe, fired = _train_watched(tiny_llama(), tmp_path / "b", 3, nan_at=3, alerts=rules)
    assert {(a.step, a.layer, a.metric) for a in fired} == {(3, 1, "max_logit"), (3, 1, "entropy")}
    assert all(math.isnan(a.value) for a in fired)


@pytest.mark.parametrize("options, why", [
    (dict(alerts=[AlertRule("symmetry", above=0.5, heads=True)]),
     "heads=True needs per-head values: pass per_head=True"),
    (dict(alerts=[AlertRule("symmetry", above=0.5, layers=(7,))]),
     "layer 7 is not measured (measured layers: 0, 1)"),
    (dict(alerts=[AlertRule("symmetry", above=0.5, layers=(1,))], layers=[0]),
     "layer 1 is not measured (measured layers: 0)"),
    (dict(alerts=[AlertRule("logit_bound_ratio", above=0.5)], attention_stats=True, metrics=["symmetry"]),
     "'logit_bound_ratio' is not logged in this run (logged metrics: entropy, heads_over_tau, max_logit, "
     "max_logit_signed, qk_clip_scale, symmetry)"),
], ids=["heads-without-per-head", "layer-outside-the-model", "layer-not-measured", "metric-not-logged"])
def test_a_rule_that_can_never_fire_is_refused_at_attach(tmp_path, options, why):
    with pytest.raises(ValueError) as info:
        Probe(tiny_llama(), log_dir=str(tmp_path / "tb"), **options)
    assert str(info.value) == f"alert rule {options['alerts'][0].metric} above 0.5 can never fire: {why}"
    assert "\n" not in str(info.value)


def test_the_trainer_refuses_an_impossible_rule_before_step_0(tmp_path):
    cb = AttnProbeCallback(every=1, log_dir=str(tmp_path / "tb"), alerts=[AlertRule("symmetry", above=0.5, layers=(7,))])
    trainer = Trainer(model=tiny_llama(), args=make_args(tmp_path, 4), train_dataset=RandomTokens(vocab=40, seq=16),
                      callbacks=[cb])
    with pytest.raises(ValueError, match="can never fire: layer 7 is not measured"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_the_alert_line_as_a_user_sees_it(tmp_path):
    """A script with default warning settings: the alert is one line on stderr naming step,
    metric, value, layer, head and rule, with no file path and no source line of the library."""
    script = textwrap.dedent(f"""
        import torch, attn_probe
        from attn_probe.live.alerts import AlertRule
        from tests.helpers import tiny_llama
        model = tiny_llama()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        probe = attn_probe.watch(model, optimizer=opt, every=1, per_head=True, log_dir={str(tmp_path / 'tb')!r},
                                 alerts=[AlertRule("frobenius_norm", above=0.0, heads=True, layers=(1,))])
        probe.close()
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240,
                          cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = tiny_llama()  # the reference: head 0's W_q,h W_k,g(h)^T of layer 1, from the model's own projections
    attn = model.model.layers[1].self_attn
    d = attn.head_dim
    m = attn.q_proj.weight.detach()[:d].double().T @ attn.k_proj.weight.detach()[:d].double()
    want = float(torch.linalg.norm(m))
    lines = [line for line in proc.stderr.splitlines() if "attn_probe alert" in line]
    assert len(lines) == 4, proc.stderr  # 4 heads of layer 1 at step 0 (the snapshot at attach), nothing else
    head0 = lines[0]
    prefix = "attn_probe alert at step 0: frobenius_norm = "
    assert head0.startswith(prefix) and head0.endswith(" in self layer 1, head 0 (rule: frobenius_norm above 0)")
    assert float(head0[len(prefix):].split(" ")[0]) == pytest.approx(want, rel=1e-5)
    assert "attn_probe/" not in proc.stderr and "safe_warn" not in proc.stderr  # no library path, no source line


class Grow(TrainerCallback):
    """Doubles layer 0's W_q at the start of every step (learning rate 0: nothing else changes)."""

    def __init__(self, model) -> None:
        self.model = model

    def on_step_begin(self, args, state, control, **kwargs):
        with torch.no_grad():
            self.model.model.layers[0].self_attn.q_proj.weight.mul_(2.0)


@pytest.mark.parametrize("save", ["steps", "no"])
def test_a_trainer_stopped_by_an_alert_saves_the_weights_that_fired(tmp_path, capfd, save):
    """W_q of layer 0 doubles every step, so W_q W_kᵀ's norm grows x4 over two steps: a x3 rule
    fires at step 2 and stops the Trainer there. With a save policy the Trainer saves
    checkpoint-2 at the stop (its W_q is 4x the initial one), and the stop line says so."""
    from safetensors.torch import load_file

    model = tiny_llama()
    initial = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    cb = AttnProbeCallback(every=1, log_dir=str(tmp_path / "tb"), stop_on_alert=True,
                           alerts=[AlertRule("frobenius_norm", growth=3.0, within=2, layers=(0,))])
    args = make_args(tmp_path / "out", 8, learning_rate=0.0, save_strategy=save, save_steps=100, logging_steps=100)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(vocab=40, seq=16), callbacks=[Grow(model), cb])
    trainer.train()
    assert trainer.state.global_step == 2
    err = capfd.readouterr().err
    stop = [line for line in err.splitlines() if "training stopped" in line]
    assert len(stop) == 1
    assert stop[0].startswith("attn_probe: training stopped at step 2 because of the alert on frobenius_norm at "
                              "step 2 (self layer 0) (stop_on_alert=True); ")
    saved = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
    if save == "no":
        assert saved == []
        assert "no checkpoint is saved (save_strategy='no')" in stop[0]
        return
    assert saved == ["checkpoint-2"]
    assert f"the Trainer saves a checkpoint of this step in {tmp_path / 'out' / 'checkpoint-2'}" in stop[0]
    weights = load_file(str(tmp_path / "out" / "checkpoint-2" / "model.safetensors"))
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], initial * 4)
