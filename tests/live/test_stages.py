"""The live probe's stages (attn_probe/live/stages/) on their own: plain values in, plain values out.

Each stage is checked against an independent reference: the schedules themselves (decision),
``score_model``'s per-layer rows and explicit matrices (measurement), ``numpy.quantile`` over
the layer values (assembly), and the files and the lock (outputs).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import tiny_llama

import attn_probe
from attn_probe.definitions import symmetry_score
from attn_probe.formats.logdir import LogDirInUseError
from attn_probe.live.config import ProbeConfig
from attn_probe.live.quantities import WeightMetrics
from attn_probe.live.stages.decision import StepDecision
from attn_probe.live.stages.measurement import Measured, Measurement
from attn_probe.live.stages.outputs import Outputs, announce_line, run_info
from attn_probe.scoring.pairs import QKPair
from attn_probe.sinks import Record, RunInfo
from attn_probe.sinks.assembly import Assembler, layer_statistics, snapshot_from_rows

# --------------------------------------------------------------------------- decision


def test_decision_asks_both_schedules_and_keeps_steps_increasing():
    calls = []

    def images(step):
        calls.append(step)
        return step == 4

    decision = StepDecision(attn_probe.every(3), images, agreement=None)
    assert [tuple(decision.due(s)) for s in (0, 3, 4, 5)] == [(True, False), (True, False), (False, True),
                                                                (False, False)]
    assert calls == [0, 3, 4, 5]
    assert decision.fresh(0)
    decision.taken(3)
    assert not decision.fresh(3) and not decision.fresh(2) and decision.fresh(4)
    # a "no" of a deterministic schedule needs no agreement; a callable's answer or an error does
    assert not decision.deterministic
    assert StepDecision(attn_probe.every(3), None, None).deterministic
    det = StepDecision(attn_probe.every(3), None, None)
    assert not det.needs_vote(det.due(4), None) and det.needs_vote(det.due(3), None)
    assert det.needs_vote(None, RuntimeError("schedule failed"))


def test_a_raising_schedule_raises_from_due():
    def broken(step):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        StepDecision(broken, None, None).due(1)


# --------------------------------------------------------------------------- measurement


def _measurement(model, **options):
    cfg = ProbeConfig(every=None, **options)
    layers = attn_probe.find_attention(model)
    return Measurement(model, cfg, cfg.score_pairs(), layers, agreement=None, is_main_process=True), cfg


@pytest.mark.parametrize("per_head", [False, True], ids=["layer", "per-head"])
def test_measurement_equals_score_model_row_by_row(per_head):
    model = tiny_llama(0, layers=3)
    measurement, cfg = _measurement(model, per_head=per_head)
    measured = measurement.measure(7, None, asynchronous=False, finish=lambda m: m)
    assert measured.step == 7 and measured.images == {}
    rows = attn_probe.score_model(model, per_head=per_head)
    metrics = cfg.score_pairs()[0].metrics
    got = {}
    for layer, (table,) in measured.tables:
        assert table.shape == (len(metrics), 1 + (layer.num_heads if per_head else 0))
        for i, metric in enumerate(metrics):
            for col in range(table.shape[1]):
                got[(layer.layer, None if col == 0 else col - 1, metric)] = float(table[i, col])
    want = {(r["layer"], r["head"], m): r[m] for r in rows for m in metrics}
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # and against the explicit matrix of one layer
    layer = attn_probe.find_attention(model)[1]
    assert got[(1, None, "symmetry")] == pytest.approx(symmetry_score(layer.qk_matrix()), abs=1e-5)


def test_measurement_gathers_what_the_pairs_declare():
    model = tiny_llama(0)
    measurement, _ = _measurement(model, pairs=("qk", "ov"))
    layer = measurement.layers[0]
    names = measurement.param_names(layer)
    assert any("q_proj" in n for n in names) and any("v_proj" in n for n in names)
    assert any("o_proj" in n for n in names) and len(set(names)) == len(names)


# --------------------------------------------------------------------------- assembly


def test_assembly_records_and_statistics_against_numpy():
    layers = attn_probe.find_attention(tiny_llama(0, layers=4))
    gen = np.random.default_rng(0)
    tables = [(layer, [gen.normal(size=(2, 1 + layer.num_heads))]) for layer in layers]
    tables[2][1][0][0, 0] = math.nan  # a NaN layer value is left out of the statistics
    with pytest.warns(RuntimeWarning, match="non-finite"):
        snap = Assembler().assemble(5, [WeightMetrics([("symmetry", "spectral_norm")], None).rows(
            Measured(5, tables, {}), None)])
    assert snap.step == 5 and len(snap.records) == len(layers) * 2 * (1 + layers[0].num_heads)
    sym = [t[0][0, 0] for _, t in tables]
    finite = [v for v in sym if math.isfinite(v)]
    for stat, q in (("median", 0.5), ("q25", 0.25), ("q75", 0.75)):
        assert snap.stats[("self", "symmetry", stat)] == pytest.approx(float(np.quantile(finite, q)))
    norms = [t[0][1, 0] for _, t in tables]
    assert snap.stats[("self", "spectral_norm", "max")] == pytest.approx(max(norms))
    assert snap.records[0] == Record("self", 0, None, "symmetry", tables[0][1][0][0, 0])


def test_checkpoint_snapshots_assemble_like_live_ones():
    model = tiny_llama(0, layers=3)
    rows = attn_probe.score_model(model, metrics=("symmetry", "directionality"))
    snap = snapshot_from_rows(9, rows, ("symmetry", "directionality"))
    assert snap.step == 9
    assert snap.stats == layer_statistics(snap.records)
    want = float(np.quantile([r["symmetry"] for r in rows], 0.5))
    assert snap.stats[("self", "symmetry", "median")] == pytest.approx(want)


# --------------------------------------------------------------------------- outputs


class ListSink:
    def __init__(self):
        self.started, self.steps, self.finished = None, [], False

    def start(self, run):
        self.started = run

    def log(self, snapshot):
        self.steps.append(snapshot.step)

    def finish(self):
        self.finished = True


def _run(model, cfg) -> RunInfo:
    layers = attn_probe.find_attention(model)
    return run_info(cfg, model, layers, list(QKPair().metrics), resume_step=None)


def test_outputs_with_given_sinks_only_open_no_directory():
    model = tiny_llama(0)
    sink = ListSink()
    cfg = ProbeConfig(every=None, sinks=[sink], background=False)
    outputs = Outputs(cfg, _run(model, cfg))
    assert outputs.log_dir is None and outputs.sinks == [sink]
    assert sink.started.config["layers"] == [0, 1] and sink.started.model["attention_layers"][0]["num_kv_heads"] == 2
    snap = snapshot_from_rows(3, attn_probe.score_model(model), QKPair().metrics)
    outputs.write(snap)
    assert outputs.flush(10) and sink.steps == [3]
    outputs.close()
    assert sink.finished and outputs.stats() == [] and outputs.flush(1)


def test_outputs_lock_their_directory_until_closed(tmp_path):
    model = tiny_llama(0)
    cfg = ProbeConfig(every=None, log_dir=str(tmp_path / "run"))
    first = Outputs(cfg, _run(model, cfg))
    assert (tmp_path / "run" / "attn_probe.jsonl").exists()
    with pytest.raises(LogDirInUseError):
        Outputs(cfg, _run(model, cfg))
    first.close()
    Outputs(cfg, _run(model, cfg)).close()  # released: a later writer may open it


def test_announce_line_names_the_schedule_and_the_live_view(tmp_path):
    model = tiny_llama(0)
    line = announce_line(model, 2, str(tmp_path), every=1, unit="optimizer steps")
    assert "watching 2 attention layers of LlamaForCausalLM every optimizer step" in line
    assert "tensorboard --logdir" in line
    assert announce_line(model, 1, None, every=None, unit="x").endswith("on demand -> the given sinks")


def test_the_stages_leave_torch_state_alone():
    # measuring must not change the model (no writeback, no grad) - compared to a copy
    model = tiny_llama(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    measurement, _ = _measurement(model)
    measurement.measure(1, None, asynchronous=False, finish=lambda m: m)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
