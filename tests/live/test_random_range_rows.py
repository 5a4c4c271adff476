"""The random-matrix range in live runs: written once into the trajectory, at a fresh run's first
snapshot; not in TensorBoard, the trackers, the statistics or the alerts; never twice on resume."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import SEQ, VOCAB, RandomTokens, make_args, tiny_bert, tiny_llama
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import attn_probe
from attn_probe.baselines import random_range as rr
from attn_probe.baselines.random_range import LayerShape, random_range
from attn_probe.live.alerts import AlertRule
from attn_probe.sinks import Sink
from attn_probe.sinks.trackers import tracker_metrics

NAMES = ("random_symmetry", "random_symmetry_sd", "random_directionality", "random_directionality_sd")


def rows_of(log_dir):
    with open(os.path.join(log_dir, "attn_probe.jsonl")) as f:
        return [json.loads(line) for line in f if '"run_header"' not in line]


def random_rows(rows):
    return [r for r in rows if r["metric"].startswith("random_")]


class Kept(Sink):
    """A sink of the user's: keeps every snapshot it is given."""

    def __init__(self):
        self.snapshots = []

    def start(self, run):
        self.metrics = list(run.metrics)

    def log(self, snapshot):
        self.snapshots.append(snapshot)

    def finish(self):
        pass


def train(model, log_dir, steps, *, start=0, **options):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attn_probe.watch(model, optimizer=opt, log_dir=str(log_dir), start_step=start, **options) as probe:
        for i in range(steps):
            ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(start + i))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    return probe


@pytest.mark.parametrize("per_head", [False, True], ids=["layers", "heads"])
def test_a_fresh_run_writes_the_range_once_at_its_first_step(tmp_path, per_head):
    kept = Kept()
    train(tiny_llama(vocab=VOCAB, seq=SEQ), tmp_path, 4, every=2, per_head=per_head, sinks=[kept])
    rows = rows_of(tmp_path)
    found = random_rows(rows)
    assert {r["step"] for r in found} == {0}
    keys = [(r["group"], r["layer"], r["head"], r["metric"]) for r in found]
    heads = [None, 0, 1, 2, 3] if per_head else [None]
    assert sorted(keys, key=str) == sorted([("self", lay, h, m) for lay in (0, 1) for h in heads for m in NAMES],
                                           key=str)
    # the values are the range of the layer's own shape (tiny_llama: d 32, 4 heads of 8, 2 KV heads)
    want = random_range(LayerShape(32, 8, 4, 2), per_head=per_head)
    for r in found:
        name = r["metric"][len("random_"):]
        assert r["value"] == pytest.approx(getattr(want, ("head_" if r["head"] is not None else "") + name))
    # load_trajectory has them, with the step and the layer/head they describe
    df = attn_probe.load_trajectory(str(tmp_path))
    part = df[df["metric"].str.startswith("random_")]
    assert len(part) == len(found) and set(part["step"]) == {0}
    # a sink of the user's gets them beside the records, once; the records, statistics, RunInfo.metrics
    # (TensorBoard's layout) and the tracker keys hold none of them
    assert [len(s.baselines) for s in kept.snapshots] == [len(found), 0, 0]
    assert not any(m.startswith("random_") for m in kept.metrics)
    for s in kept.snapshots:
        assert not any(r.metric.startswith("random_") for r in s.records)
        assert not any(m.startswith("random_") for _, m, _ in s.stats)
        assert not any("random_" in key for key in tracker_metrics(s, per_head=True))
    ea = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    ea.Reload()
    assert ea.Tags()["scalars"] and not any("random_" in tag for tag in ea.Tags()["scalars"])


def test_resuming_keeps_the_rows_and_writes_none_again(tmp_path):
    train(tiny_bert(0), tmp_path, 4, every=1)
    first = random_rows(rows_of(tmp_path))
    assert len(first) == 2 * len(NAMES)
    train(tiny_bert(1), tmp_path, 2, every=1, start=2)  # resume at step 2: the run's steps >= 2 are cut
    rows = rows_of(tmp_path)
    assert random_rows(rows) == first
    keys = [(r["step"], r["group"], r["layer"], r["head"], r["metric"]) for r in rows]
    assert len(keys) == len(set(keys))


def test_the_option_turns_it_off(tmp_path):
    train(tiny_bert(), tmp_path, 2, every=1, random_range=False)
    assert random_rows(rows_of(tmp_path)) == []
    with pytest.raises(TypeError, match="random_range"):
        attn_probe.AttnProbeCallback(random_range="no")


def test_metrics_without_the_scores_write_no_range(tmp_path):
    train(tiny_bert(), tmp_path, 1, every=1, metrics=["spectral_norm"])
    assert random_rows(rows_of(tmp_path)) == []
    train(tiny_bert(), tmp_path / "sym", 1, every=1, metrics=["symmetry"])
    assert {r["metric"] for r in random_rows(rows_of(tmp_path / "sym"))} == {"random_symmetry", "random_symmetry_sd"}


def test_a_failing_range_is_one_warning_and_no_rows(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no memory for the draws")

    monkeypatch.setattr(rr, "random_range", broken)
    with pytest.warns(RuntimeWarning, match="random-matrix range could not be computed") as seen:
        probe = train(tiny_bert(), tmp_path, 3, every=1)
    assert len([w for w in seen if "random-matrix" in str(w.message)]) == 1
    assert probe.failures == 0
    rows = rows_of(tmp_path)
    assert random_rows(rows) == [] and {r["step"] for r in rows} == {0, 1, 2, 3}


def test_a_shape_over_the_limit_is_skipped_with_a_warning(tmp_path, monkeypatch):
    rr.clear_cache()
    monkeypatch.setattr(rr, "MAX_DRAW_ENTRIES", 100)
    try:
        with pytest.warns(RuntimeWarning, match="skipped: one random draw of d=32"):
            train(tiny_bert(), tmp_path, 1, every=1)
    finally:
        rr.clear_cache()
    rows = rows_of(tmp_path)
    assert random_rows(rows) == [] and {r["step"] for r in rows} == {0, 1}


def test_the_drawn_numbers_bound_attach_whatever_the_clock(tmp_path, monkeypatch):
    """The probe's draws follow from the shapes and PROBE_ENTRIES alone (the same on every rank):
    a time budget that has run out changes nothing."""
    rr.clear_cache()
    shape = LayerShape(32, 8, 4, 4)  # tiny_bert's layers: 2048 numbers per draw
    monkeypatch.setattr(rr, "PROBE_ENTRIES", 3 * shape.draw_entries + 5)
    monkeypatch.setattr(rr, "DEFAULT_BUDGET", 1e-6)  # the library's time budget: not the probe's
    try:
        with pytest.warns(RuntimeWarning, match=r"3 of 32 random draws of d=32, 4 heads of 8 within 6,149 drawn numbers"):
            train(tiny_bert(), tmp_path, 1, every=1, per_head=True)
    finally:
        rr.clear_cache()
    want = random_range(shape, draws=3, budget=None, per_head=True, cache=False)
    found = random_rows(rows_of(tmp_path))
    by = {r["metric"]: r["value"] for r in found if r["layer"] == 0 and r["head"] is None}
    assert by["random_symmetry"] == pytest.approx(want.symmetry, rel=1e-6)
    assert by["random_symmetry_sd"] == pytest.approx(want.symmetry_sd, rel=1e-6)


def test_alert_rules_cannot_name_the_range_and_fire_only_on_the_scores(tmp_path):
    with pytest.raises(ValueError, match="random_symmetry"):
        train(tiny_bert(), tmp_path / "refused", 1, every=1, alerts=[AlertRule("random_symmetry", above=0.0)])
    fired = []
    train(tiny_bert(), tmp_path, 1, every=1, alerts=[AlertRule("symmetry", above=-2.0)], alert_callback=fired.append)
    assert sorted((a.step, a.layer) for a in fired) == [(0, 0), (0, 1)]
    assert random_rows(rows_of(tmp_path))


def test_the_global_generator_is_untouched_by_attach(tmp_path):
    rr.clear_cache()
    model = tiny_bert()
    before = torch.get_rng_state()
    probe = attn_probe.watch(model, log_dir=str(tmp_path), every=1)
    after = torch.get_rng_state()
    probe.close()
    assert torch.equal(before, after)
    assert random_rows(rows_of(tmp_path))


def test_a_trainer_run_resumed_from_its_checkpoint_holds_the_range_once(tmp_path):
    out = tmp_path / "out"
    kw = dict(save_strategy="steps", save_steps=4)
    from transformers import Trainer

    first = Trainer(model=tiny_bert(), args=make_args(out, 6, **kw), train_dataset=RandomTokens())
    attn_probe.attach(first, every=2, per_head=True)
    first.train()
    (run_dir,) = list((out / "runs").iterdir())
    once = random_rows(rows_of(run_dir))
    assert {r["step"] for r in once} == {0} and len(once) == 2 * (1 + 4) * len(NAMES)
    second = Trainer(model=tiny_bert(), args=make_args(out, 6, **kw), train_dataset=RandomTokens())
    attn_probe.attach(second, every=2, per_head=True)
    second.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    rows = rows_of(run_dir)
    assert random_rows(rows) == once
    assert sorted({r["step"] for r in rows}) == [0, 2, 4, 6]
    df = attn_probe.load_trajectory(str(run_dir))
    part = df[df["metric"] == "random_symmetry"]
    assert len(part) == 2 * (1 + 4) and set(part["step"]) == {0}
