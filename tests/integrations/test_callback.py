"""AttnProbeCallback in a real transformers Trainer: directory rule, steps, values, layout."""

import copy
import functools
import glob
import json
import math
import os
import pickle
import warnings

import pytest
import torch
from helpers import RandomTokens, make_args, tiny_bert
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import Trainer, TrainerCallback

import attn_probe
from attn_probe import directionality_score, find_attention, symmetry_score
from attn_probe.core import DEFAULT_METRICS
from attn_probe.formats.tags import scalar_tag, stats_for


class KeepWeights(TrainerCallback):
    """Copies the model's weights at train begin and after every optimizer step (the reference)."""

    def __init__(self):
        self.states = {}

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.states[state.global_step] = copy.deepcopy(model.state_dict())

    def on_step_end(self, args, state, control, model=None, **kw):
        self.states[state.global_step] = copy.deepcopy(model.state_dict())


make_args = functools.partial(make_args, report_to=["tensorboard"])  # the Trainer reports here


def reference(model, state_dict):
    model = copy.deepcopy(model)
    model.load_state_dict(state_dict)
    out = {}
    for a in find_attention(model):
        m = a.qk_matrix()
        out[scalar_tag(a.group, "symmetry", layer=a.layer)] = symmetry_score(m)
        out[scalar_tag(a.group, "directionality", layer=a.layer)] = directionality_score(m)
    return out


def scalars(log_dir):
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea, {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


def test_trainer_run_writes_scores_into_the_trainers_run(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    model, keep = tiny_bert(), KeepWeights()
    trainer = Trainer(model=model, args=make_args(tmp_path, 7), train_dataset=RandomTokens(),
                      callbacks=[keep, attn_probe.AttnProbeCallback(every=3)])
    trainer.train()
    (run,) = glob.glob(str(tmp_path / "runs" / "*"))  # one run directory: the Trainer's and ours
    ea, series = scalars(run)
    assert "train/loss" in series  # the Trainer's own logging sits in the same run
    ours = {t for t in series if t.startswith("attn_probe/")}
    expected_tags = {scalar_tag("self", m, layer=i) for m in DEFAULT_METRICS for i in (0, 1)}
    expected_tags |= {scalar_tag("self", m, stat=s) for m in DEFAULT_METRICS for s in stats_for(m)}
    assert ours == expected_tags
    for tag in ours:
        assert [s for s, _ in series[tag]] == [0, 3, 6, 7]  # start, schedule, last step
    for step in (0, 3, 6, 7):
        ref = reference(model, keep.states[step])
        for tag, want in ref.items():
            got = dict(series[tag])[step]
            assert got == pytest.approx(want, abs=2e-4), (tag, step)
    # the trajectory file beside the event files holds the same numbers
    rows = [json.loads(line) for line in open(os.path.join(run, "attn_probe.jsonl")) if '"run_header"' not in line]
    assert sorted({r["step"] for r in rows}) == [0, 3, 6, 7]
    final = {scalar_tag(r["group"], r["metric"], layer=r["layer"]): r["value"] for r in rows if r["step"] == 7}
    assert final == pytest.approx(dict((t, dict(series[t])[7]) for t in final), abs=1e-6)
    # layout and configuration text were written once
    tensors = ea.Tags()["tensors"]
    assert "custom_scalars__config__" in tensors and "attn_probe/config/text_summary" in tensors


def test_log_dir_rules(tmp_path, monkeypatch):
    env_dir = tmp_path / "from_env"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(env_dir))
    Trainer(model=tiny_bert(), args=make_args(tmp_path / "a", 2), train_dataset=RandomTokens(),
            callbacks=[attn_probe.AttnProbeCallback(every=1)]).train()
    _, series = scalars(env_dir)
    assert "train/loss" in series and [s for s, _ in series["attn_probe/self/symmetry/median"]] == [0, 1, 2]

    own = tmp_path / "own"  # log_dir= overrides; no TensorBoard reporting needed
    Trainer(model=tiny_bert(), args=make_args(tmp_path / "b", 2, report_to="none"), train_dataset=RandomTokens(),
            callbacks=[attn_probe.AttnProbeCallback(every=2, log_dir=str(own), per_head=True)]).train()
    _, series = scalars(own)
    assert "train/loss" not in series
    assert [s for s, _ in series["attn_probe/self/symmetry/layer_01/head_03"]] == [0, 2]


def test_unsupported_model_fails_when_the_trainer_is_built(tmp_path):
    class NoAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, labels=None):
            return {"loss": self.lin(x).sum()}

    with pytest.raises(attn_probe.UnsupportedModelError):
        Trainer(model=NoAttention(), args=make_args(tmp_path, 2, report_to="none"),
                callbacks=[attn_probe.AttnProbeCallback(every=1)])


def test_gradient_accumulation_counts_optimizer_updates(tmp_path):
    Trainer(model=tiny_bert(), args=make_args(tmp_path, 4, gradient_accumulation_steps=3, report_to="none"),
            train_dataset=RandomTokens(),
            callbacks=[attn_probe.AttnProbeCallback(every=2, log_dir=str(tmp_path / "tb"))]).train()
    rows = [json.loads(line) for line in open(tmp_path / "tb" / "attn_probe.jsonl") if '"run_header"' not in line]
    assert sorted({r["step"] for r in rows}) == [0, 2, 4]
    assert not any(r["value"] is None or math.isnan(r["value"]) for r in rows)


def test_attach_after_train_warns_and_attach_before_does_not(tmp_path):
    from transformers import Trainer

    trainer = Trainer(model=tiny_bert(), args=make_args(tmp_path / "a", 1, report_to="none"), train_dataset=RandomTokens())
    with warnings.catch_warnings(record=True) as before:
        warnings.simplefilter("always")
        attn_probe.attach(trainer, every=1, log_dir=str(tmp_path / "a" / "tb"))
    assert not [w for w in before if "already trained" in str(w.message)]
    trainer.train()
    later = Trainer(model=trainer.model, args=make_args(tmp_path / "b", 1, report_to="none"), train_dataset=RandomTokens())
    later.train()
    with pytest.warns(RuntimeWarning, match=r"already trained \(1 steps\).*trainer.train\(\) runs again"):
        attn_probe.attach(later, every=1, log_dir=str(tmp_path / "b" / "tb"))


def test_the_callback_pickles_and_copies_after_train(tmp_path):
    """Issue 44, finding 7: the callback of ``attach(trainer)`` pickles after ``train()`` (it held the
    Trainer's callback handler, whose scheduler holds weak references: ``TypeError: cannot pickle
    'weakref.ReferenceType'``); the copy keeps the options and the run's identity, not the Trainer."""
    trainer = Trainer(model=tiny_bert(), args=make_args(tmp_path / "out", 2), train_dataset=RandomTokens())
    cb = attn_probe.attach(trainer, every=1, attention_stats=True, random_range=False, announce=False)
    trainer.train()
    assert cb.handler is trainer.callback_handler and cb.run_id is not None
    for back in (pickle.loads(pickle.dumps(cb)), copy.deepcopy(cb)):
        assert type(back) is type(cb) and back is not cb
        assert back.state() == cb.state() and back.run_id == cb.run_id and back.config == cb.config
        assert back.handler is None and back.probe is None
    assert cb.handler is trainer.callback_handler  # the original keeps its Trainer
