"""The probe core in plain PyTorch loops: counting, values, files, isolation of writers."""

import json
import math
import os
import warnings

import numpy as np
import pytest
import torch
from helpers import SEQ, VOCAB, tiny_bert, tiny_model

import attn_probe
from attn_probe import directionality_score, find_attention, symmetry_score
from attn_probe.core import DEFAULT_METRICS
from attn_probe.formats.tags import parse_tag
from attn_probe.live.probe import LogDirError, Probe, render_heatmap
from attn_probe.sinks.tensorboard import custom_scalars_layout


def batch(i):
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def reference_rows(model, per_head=False):
    """Explicit d x d matrices, scored with the matrix functions (slow, obviously correct)."""
    out = {}
    for a in find_attention(model):
        heads = [None] + (list(range(a.num_heads)) if per_head else [])
        for h in heads:
            m = a.qk_matrix(head=h)
            out[(a.group, a.layer, h, "symmetry")] = symmetry_score(m)
            out[(a.group, a.layer, h, "directionality")] = directionality_score(m)
            # the norm metrics (default too): float64 singular values of the explicit matrices
            sv = torch.linalg.svdvals(m)
            out[(a.group, a.layer, h, "spectral_norm")] = float(sv[0])
            out[(a.group, a.layer, h, "frobenius_norm")] = float(torch.linalg.norm(m))
            out[(a.group, a.layer, h, "stable_rank")] = float(sv.square().sum() / sv[0] ** 2)
            q, k = (t.detach().double() for t in a.factors())
            group = a.num_heads // a.num_kv_heads
            bounds = [float(torch.linalg.svdvals(q[i])[0] * torch.linalg.svdvals(k[i // group])[0])
                      for i in (range(a.num_heads) if h is None else [h])]
            out[(a.group, a.layer, h, "qk_bound")] = max(bounds)
    return out


def read_jsonl(log_dir):
    with open(os.path.join(log_dir, "attn_probe.jsonl")) as f:
        return [json.loads(line) for line in f if '"run_header"' not in line]


def rows_at(rows, step):
    """The weight metrics at ``step`` (not the random-matrix range: tests/live/test_random_range_rows.py)."""
    return {(r["group"], r["layer"], r["head"], r["metric"]): r["value"] for r in rows
            if r["step"] == step and not r["metric"].startswith("random_")}


def assert_close_rows(got, want, tol=2e-4):
    assert set(got) == set(want)
    for key, value in want.items():
        if math.isnan(value):
            assert got[key] is None or math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(value, abs=tol, rel=1e-4), key


# ------------------------------------------------------------------------------------ maths


def test_render_heatmap_symmetric_colour_scale():
    m = np.array([[2.0, -2.0], [0.0, 1.0]])
    img = render_heatmap(m)
    assert img.shape == (2, 2, 3) and img.dtype == np.uint8
    assert tuple(img[0, 0]) == (255, 0, 0)  # +max: red
    assert tuple(img[0, 1]) == (0, 0, 255)  # -max: blue
    assert tuple(img[1, 0]) == (255, 255, 255)  # zero: white
    assert tuple(img[1, 1]) == (255, 128, 128)  # half: light red


# ------------------------------------------------------------------------------------ loops


def test_optimizer_hook_counts_updates_and_values_match_reference(tmp_path):
    model = tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected, weights = [0, 3, 6, 7], {}
    with attn_probe.watch(model, optimizer=opt, log_dir=str(tmp_path), every=3, per_head=True) as probe:
        weights[0] = reference_rows(model, per_head=True)
        for i in range(7):
            model(**batch(i)).loss.backward()
            opt.step()
            opt.zero_grad()
            if i + 1 in expected:
                weights[i + 1] = reference_rows(model, per_head=True)
        assert probe.step == 7
    rows = read_jsonl(tmp_path)
    assert sorted({r["step"] for r in rows}) == expected  # 7 comes from close()
    for step in expected:
        assert_close_rows(rows_at(rows, step), weights[step])
    assert all(set(r) == {"step", "wall_time", "group", "layer", "head", "metric", "value"} for r in rows)


def test_forward_hook_counts_training_forwards_only(tmp_path):
    model = tiny_bert()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    probe = attn_probe.watch(model, log_dir=str(tmp_path), every=2)
    for i in range(5):  # gradient accumulation over 2 micro-batches: the hook counts micro-batches
        model.train()
        model(**batch(i)).loss.backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            model(**batch(100 + i))  # evaluation forwards are not counted
    probe.close()
    steps = sorted({r["step"] for r in read_jsonl(tmp_path)})
    assert steps == [0, 2, 4, 5]  # 5 training forwards; the final state is step 5
    assert probe.last_snapshot_step == 5


def test_manual_snapshots_never_go_back(tmp_path):
    model = tiny_bert()
    probe = Probe(model, log_dir=str(tmp_path), every=None)
    assert probe.snapshot(10) is not None
    assert probe.snapshot(10) is None and probe.snapshot(5) is None
    snap = probe.snapshot(11)
    assert snap.step == 11 and {(g, m) for g, m, _ in snap.stats} == {("self", m) for m in DEFAULT_METRICS}
    probe.close(final_snapshot=False)
    assert sorted({r["step"] for r in read_jsonl(tmp_path)}) == [10, 11]


def test_stats_are_quantiles_across_layers(tmp_path):
    model = tiny_bert(layers=4)
    probe = Probe(model, log_dir=str(tmp_path), every=None)
    snap = probe.snapshot(0)
    probe.close(final_snapshot=False)
    ref = reference_rows(model)
    sym = [ref[("self", i, None, "symmetry")] for i in range(4)]
    assert snap.stats[("self", "symmetry", "median")] == pytest.approx(float(np.median(sym)), abs=1e-5)
    assert snap.stats[("self", "symmetry", "q25")] == pytest.approx(float(np.quantile(sym, 0.25)), abs=1e-5)
    assert snap.stats[("self", "symmetry", "q75")] == pytest.approx(float(np.quantile(sym, 0.75)), abs=1e-5)


def test_layer_filter_and_non_main_process(tmp_path):
    model = tiny_bert(layers=3)
    probe = Probe(model, log_dir=str(tmp_path / "a"), every=None, layers=[1])
    snap = probe.snapshot(0)
    probe.close(final_snapshot=False)
    assert {r.layer for r in snap.records} == {1}
    other = Probe(model, log_dir=str(tmp_path / "b"), every=None, is_main_process=False)
    assert other.snapshot(0) is None
    other.close()
    assert not (tmp_path / "b").exists()  # only the main process writes


def test_two_probes_in_one_process(tmp_path):
    m1, m2 = tiny_bert(seed=1), tiny_bert(seed=2)
    p1 = Probe(m1, log_dir=str(tmp_path / "one"), every=None)
    p2 = Probe(m2, log_dir=str(tmp_path / "two"), every=None)
    with pytest.raises(LogDirError, match="already in use by another attn_probe"):
        Probe(m2, log_dir=str(tmp_path / "one"), every=None)
    p1.snapshot(0), p2.snapshot(0)
    p1.close(), p2.close()
    assert_close_rows(rows_at(read_jsonl(tmp_path / "one"), 0), reference_rows(m1))
    assert_close_rows(rows_at(read_jsonl(tmp_path / "two"), 0), reference_rows(m2))
    with pytest.warns(RuntimeWarning, match="already holds a trajectory"):  # free again after close
        Probe(m2, log_dir=str(tmp_path / "one"), every=None).close()


def test_layout_names_existing_tags():
    layout = custom_scalars_layout(["self"], ["symmetry", "directionality"])
    charts = layout["attn_probe/self"]
    margin = layout["attn_probe/self: symmetry, the paper's figure"]["symmetry: median across layers (q25-q75)"]
    assert margin[0] == "Margin" and [parse_tag(t).stat for t in margin[1]] == ["median", "q25", "q75"]
    import re

    (regex,) = charts["directionality: per layer"][1]
    assert re.match(regex, "attn_probe/self/directionality/layer_03")
    assert not re.match(regex, "attn_probe/self/directionality/layer_03/head_01")
    assert not re.match(regex, "attn_probe/self/symmetry/layer_03")


def test_images_are_written(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = tiny_bert()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warnings from a healthy run
        probe = Probe(model, log_dir=str(tmp_path), every=None, images_every=1, image_size=16)
        probe.snapshot(0)
        probe.close(final_snapshot=False)
    ea = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    ea.Reload()
    assert sorted(ea.Tags()["images"]) == ["attn_probe_heatmap/self/layer_00", "attn_probe_heatmap/self/layer_01"]
    (img,) = ea.Images("attn_probe_heatmap/self/layer_00")
    assert (img.width, img.height) == (16, 16)


def test_reusing_a_log_dir_from_step_0_warns(tmp_path):
    model = tiny_bert()
    Probe(model, log_dir=str(tmp_path), every=None).close()
    with pytest.warns(RuntimeWarning, match="already holds a trajectory"):
        Probe(model, log_dir=str(tmp_path), every=None).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Probe(model, log_dir=str(tmp_path), every=None, start_step=1).close()  # a resume: no warning
    steps = [r["step"] for r in read_jsonl(tmp_path)]
    assert steps == sorted(steps) and set(steps) == {0, 1}


@pytest.mark.parametrize("option, value, error", [
    ("sink_timeout", 0, ValueError), ("sink_timeout", -1, ValueError), ("sink_timeout", float("nan"), ValueError),
    ("sink_timeout", "10", ValueError), ("background", "no", TypeError), ("async_max_bytes", -1, ValueError),
    ("sink_queue", 0, ValueError), ("pairs", (), ValueError),
])
def test_bad_writing_options_fail_before_anything_is_written(tmp_path, option, value, error):
    from transformers import BertModel

    from attn_probe import AttnProbeCallback

    model = tiny_model("bert", None, cls=BertModel, vocab_size=32, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=16, max_position_embeddings=512)
    with pytest.raises(error, match=option):
        attn_probe.watch(model, log_dir=str(tmp_path / "run"), **{option: value})
    assert not (tmp_path / "run").exists()
    with pytest.raises(error, match=option):  # the Trainer callback: at construction, not at on_train_begin
        AttnProbeCallback(**{option: value})


def test_snapshot_after_close_warns_once_and_writes_nothing(tmp_path):
    probe = attn_probe.watch(tiny_bert(), log_dir=str(tmp_path), every=None)  # step 0 at attach
    probe.close()
    with pytest.warns(RuntimeWarning, match=r"snapshot\(\) was called after probe.close\(\)") as record:
        assert probe.snapshot(5) is None
        assert probe.snapshot(6) is None
    assert sum("after probe.close()" in str(w.message) for w in record) == 1
    with open(os.path.join(tmp_path, "attn_probe.jsonl")) as f:
        assert {json.loads(line)["step"] for line in f if '"metric"' in line} == {0}
