"""Live, causal emergence events (attn_probe.sinks.emergence) written as TensorBoard text, read back
with TensorBoard's own EventAccumulator and checked against the causal rule recomputed here from
the rows: a condition held for 3 consecutive snapshots fires once, noise that crosses and returns
does not, a width where nothing can fire says so once, a resume does not write an event twice."""

from __future__ import annotations

import json
import math
import re
import warnings

import numpy as np
import pytest
import torch
from helpers import tiny_bert
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from attn_probe import Probe
from attn_probe.sinks import Record, RunInfo, Snapshot
from attn_probe.sinks.tensorboard import TensorBoardSink

K, W = 3.0, 3
SUFFIX = "/text_summary"
EVENT = re.compile(r"from step (-?\d+), confirmed at step (-?\d+)")


def text_entries(log_dir):
    """``{tag: [(step, text), ...]}`` of the attn_probe_emergence text entries, as TensorBoard reads them."""
    ea = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    ea.Reload()
    out = {}
    for tag in ea.Tags()["tensors"]:
        if tag.startswith("attn_probe_emergence/"):
            out[tag.removesuffix(SUFFIX)] = [
                (e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in ea.Tensors(tag)]
    return out


def causal(steps, values, mean, sd, k=K, window=W):
    """The rule, written again: ``(start, confirm)`` of the first ``window`` consecutive finite
    values beyond ``k`` sd, NaN skipped; ``None`` when it never holds."""
    run = []
    for s, v in zip(steps, values, strict=True):
        if not math.isfinite(v):
            continue
        run = [*run, s] if abs(v - mean) > k * sd else []
        if len(run) == window:
            return run[0], run[-1]
    return None


def fired(entries):
    return {tag: [(step, *map(int, EVENT.search(text).groups())) for step, text in items]
            for tag, items in entries.items() if not tag.endswith("not_measurable")}


# ------------------------------------------------------------------ synthetic snapshots into the sink

STEPS = list(range(0, 200, 10))
MEAN, SD = 0.01, 0.04  # symmetry: 3 sd = 0.12
DMEAN, DSD = 0.0, 0.5  # directionality: 3 sd = 1.5 covers [-1, 1]


def series():
    out = {}
    out[0] = [0.02 if s < 40 else 0.5 for s in STEPS]  # a clean step at 40
    out[0][7] = math.nan  # a missing value inside the run of snapshots: skipped
    spikes = {20: 0.3, 30: 0.3, 70: -0.3, 80: -0.3, 150: 0.3}  # beyond and back, never 3 in a row
    out[1] = [spikes.get(s, 0.0) for s in STEPS]
    out[2] = [0.0 if s < 100 else -0.4 for s in STEPS]  # negative, from 100
    return out


def snapshots(values):
    snaps = []
    for i, step in enumerate(STEPS):
        recs = [Record("self", layer, None, "symmetry", vals[i]) for layer, vals in values.items()]
        recs += [Record("self", layer, None, "directionality", 0.9) for layer in values]
        sym = [vals[i] for vals in values.values() if math.isfinite(vals[i])]
        stats = {("self", "symmetry", "median"): float(np.median(sym)), ("self", "directionality", "median"): 0.9}
        base = []
        if i == 0:
            for layer in values:
                base += [Record("self", layer, None, "random_symmetry", MEAN),
                         Record("self", layer, None, "random_symmetry_sd", SD),
                         Record("self", layer, None, "random_directionality", DMEAN),
                         Record("self", layer, None, "random_directionality_sd", DSD)]
        snaps.append(Snapshot(step, 0.0, recs, stats=stats, baselines=base))
    return snaps


def run_info(resume=None):
    return RunInfo(config={"random_range": True}, model={}, groups=["self"],
                   metrics=["symmetry", "directionality"], per_head=False, resume_step=resume)


def test_one_entry_per_layer_and_score_at_the_steps_the_rule_gives(tmp_path):
    values = series()
    sink = TensorBoardSink(str(tmp_path))
    sink.start(run_info())
    snaps = snapshots(values)
    for snap in snaps:
        sink.log(snap)
    sink.finish()
    entries = text_entries(tmp_path)
    expected = {}
    for layer, vals in values.items():
        got = causal(STEPS, vals, MEAN, SD)
        if got is not None:
            expected[f"attn_probe_emergence/self/symmetry/layer_{layer:02d}"] = [(got[1], *got)]
    medians = [s.stats[("self", "symmetry", "median")] for s in snaps]
    got = causal(STEPS, medians, MEAN, SD)
    if got is not None:
        expected["attn_probe_emergence/self/symmetry/median"] = [(got[1], *got)]
    # by construction: layer 0 from 40 (the NaN at 70 skipped), layer 2 from 100, layer 1 never
    assert expected["attn_probe_emergence/self/symmetry/layer_00"] == [(60, 40, 60)]
    assert expected["attn_probe_emergence/self/symmetry/layer_02"] == [(120, 100, 120)]
    assert fired(entries) == expected
    # directionality: 3 sd = 1.5 covers [-1, 1]: nothing fires, one not-measurable entry names every series
    (step, text), = entries["attn_probe_emergence/self/directionality/not_measurable"]
    assert step == 0 and "not measurable at this width" in text
    assert all(name in text for name in ("layer 0", "layer 1", "layer 2", "the median layer"))
    assert not [t for t in entries if "directionality" in t and not t.endswith("not_measurable")]
    text = entries["attn_probe_emergence/self/symmetry/layer_00"][0][1]
    assert f"mean {MEAN:+.4f}, sd {SD:.4f}" in text and "beyond 3 sd" in text


def test_noise_that_crosses_and_returns_never_fires(tmp_path):
    noise = {0: [0.3 if i % 3 != 2 else 0.0 for i in range(len(STEPS))]}  # two beyond, one back, repeated
    sink = TensorBoardSink(str(tmp_path))
    sink.start(run_info())
    for snap in snapshots(noise):
        sink.log(snap)
    sink.finish()
    assert causal(STEPS, noise[0], MEAN, SD) is None
    assert fired(text_entries(tmp_path)) == {}


def test_a_failing_rule_warns_once_and_keeps_the_scalars(tmp_path, monkeypatch):
    from attn_probe.sinks import emergence

    def boom(self, snapshot):
        raise RuntimeError("broken")

    monkeypatch.setattr(emergence.LiveEmergence, "entries", boom)
    sink = TensorBoardSink(str(tmp_path))
    sink.start(run_info())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for snap in snapshots(series())[:4]:
            sink.log(snap)
    sink.finish()
    assert len([w for w in caught if "live emergence events are off" in str(w.message)]) == 1
    ea = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("attn_probe/self/symmetry/layer_00")] == STEPS[:4]


def test_events_that_cannot_start_are_said_off_and_the_scalars_go_on(tmp_path, monkeypatch):
    from attn_probe.sinks import emergence

    def boom(self, run, log_dir):
        raise RuntimeError("unreadable header")

    monkeypatch.setattr(emergence.LiveEmergence, "start", boom)
    sink = TensorBoardSink(str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink.start(run_info())
        for snap in snapshots(series())[:4]:
            sink.log(snap)
    sink.finish()
    assert len([w for w in caught if "live emergence events are off" in str(w.message)]) == 1
    ea = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("attn_probe/self/symmetry/layer_00")] == STEPS[:4]


# --------------------------------------------------------------------------- a live probe, resumed

def symmetric(model, layer):
    """Make layer ``layer``'s W_qk symmetric: W_k = W_q (W_q W_q^T)."""
    att = model.bert.encoder.layer[layer].attention.self
    with torch.no_grad():
        att.key.weight.copy_(att.query.weight)


def rows_of(log_dir):
    rows = []
    with open(log_dir / "attn_probe.jsonl") as fh:
        for line in fh:
            rec = json.loads(line)
            if "run_header" not in rec:
                rows.append(rec)
    return rows


def reference(rows, layers, after=None):
    """Per tag, ``(start, confirm)`` of the causal rule on the trajectory rows (steps > ``after`` only)."""
    steps = sorted({r["step"] for r in rows if r["metric"] == "symmetry"})
    if after is not None:
        steps = [s for s in steps if s >= after]
    value = {(r["step"], r["layer"]): r["value"] for r in rows if r["metric"] == "symmetry" and r["head"] is None}
    mean = {r["layer"]: r["value"] for r in rows if r["metric"] == "random_symmetry"}
    sd = {r["layer"]: r["value"] for r in rows if r["metric"] == "random_symmetry_sd"}
    out = {}
    for layer in layers:
        got = causal(steps, [value[(s, layer)] for s in steps], mean[layer], sd[layer])
        if got:
            out[f"attn_probe_emergence/self/symmetry/layer_{layer:02d}"] = got
    med = [float(np.median([value[(s, la)] for la in layers])) for s in steps]
    got = causal(steps, med, float(np.median([mean[la] for la in layers])), float(np.median([sd[la] for la in layers])))
    if got:
        out["attn_probe_emergence/self/symmetry/median"] = got
    return out


@pytest.mark.timeout(300)
def test_a_live_probe_writes_each_event_once_across_a_resume(tmp_path):
    model = tiny_bert(seed=0, layers=2, hidden=32, heads=4)
    log_dir = tmp_path / "run"
    probe = Probe(model, log_dir=str(log_dir), every=1000, metrics=["symmetry", "directionality"])
    for step in range(1, 8):
        if step == 3:
            symmetric(model, 0)
        probe.snapshot(step)
    probe.close(final_snapshot=False)
    first = rows_of(log_dir)
    ref = reference(first, [0, 1])
    assert ref["attn_probe_emergence/self/symmetry/layer_00"] == (3, 5)  # symmetry 1 is far beyond 3 sd
    got = fired(text_entries(log_dir))
    assert got == {tag: [(confirm, start, confirm)] for tag, (start, confirm) in ref.items()}
    # resume at step 8: layer 0 stays symmetric (already written: not again), layer 1 becomes symmetric
    probe = Probe(model, log_dir=str(log_dir), every=1000, metrics=["symmetry", "directionality"], start_step=8)
    symmetric(model, 1)
    for step in range(8, 12):
        probe.snapshot(step)
    probe.close(final_snapshot=False)
    rows = rows_of(log_dir)
    after = reference(rows, [0, 1], after=8)
    assert after["attn_probe_emergence/self/symmetry/layer_01"] == (8, 10)
    got = fired(text_entries(log_dir))
    expected = {tag: [(confirm, start, confirm)] for tag, (start, confirm) in ref.items()}
    for tag, (start, confirm) in after.items():
        expected.setdefault(tag, [(confirm, start, confirm)])  # written before the resume: not again
    assert got == expected
    assert len(got["attn_probe_emergence/self/symmetry/layer_00"]) == 1
