"""The trackers' key budget (issue 38 item 5): per layer min/median/max over heads and the top-k
heads with their indices, in the one tag grammar; the documented key count of a 32 x 32-head run.

References: the summaries written out by hand (sorting, :func:`statistics.median`), the keys
built from the grammar's documented forms, and attn_probe.jsonl read back line by line.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest
import torch

from attn_probe.formats.tags import parse_tag, scalar_tag, summary_names
from attn_probe.sinks import Record, Snapshot
from attn_probe.sinks.head_budget import head_summary
from attn_probe.sinks.tracker_record import TrackerRun
from attn_probe.sinks.trackers import KEY_PATTERN, TrackerFanOut, TrackerTarget, tracker_key, tracker_metrics

DOCS = Path(__file__).resolve().parents[2] / "docs" / "tags.md"


def test_summary_tags_parse_back_and_leave_the_old_forms_alone():
    for name in summary_names(12):
        tag = scalar_tag("self", "max_logit", layer=7, summary=name)
        assert tag == f"attn_probe/self/max_logit/layer_07/{name}"
        parts = parse_tag(tag)
        assert (parts.group, parts.metric, parts.layer, parts.head, parts.stat, parts.summary) == \
            ("self", "max_logit", 7, None, None, name)
        assert KEY_PATTERN.match(tracker_key("self", "max_logit", layer=7, summary=name))
    assert tracker_key("cross attn", "entropy", layer=1, summary="top_1") == "attn_probe/cross_attn/entropy/layer_01/top_1"
    assert parse_tag("attn_probe/self/symmetry/layer_03/head_02").summary is None
    assert parse_tag("attn_probe/self/symmetry/median").stat == "median"
    for bad in ("attn_probe/self/x/layer_03/top_0", "attn_probe/self/x/layer_03/heads_q25",
                "attn_probe/self/x/layer_03/head_01/top_1"):
        assert parse_tag(bad) is None
    with pytest.raises(ValueError, match="summary must be one of"):
        scalar_tag("self", "x", layer=1, head=2, summary="top_1")
    with pytest.raises(ValueError, match="summary must be one of"):
        scalar_tag("self", "x", stat="median", summary="heads_min")


def test_head_summary_matches_a_hand_computation():
    rng = random.Random(3)
    for n in (1, 2, 5, 32):
        for k in (0, 1, 3, 40):
            values = {h: round(rng.uniform(-2, 2), 1) for h in range(n)}  # rounding makes ties
            if n > 2:
                values[1] = math.nan
            finite = {h: v for h, v in values.items() if not math.isnan(v)}
            for low_first in (False, True):
                got = head_summary(values, k, low_first)
                assert list(got) == list(summary_names(k))
                vals = list(finite.values())
                assert got["heads_min"] == min(vals) and got["heads_max"] == max(vals)
                assert got["heads_median"] == pytest.approx(statistics.median(vals), abs=1e-12)
                order = sorted(finite, key=lambda h: ((finite[h] if low_first else -finite[h]), h))
                for r in range(k):
                    if r < len(order):
                        assert (got[f"top_{r + 1}"], got[f"top_{r + 1}_head"]) == (finite[order[r]], order[r])
                    else:
                        assert math.isnan(got[f"top_{r + 1}"]) and math.isnan(got[f"top_{r + 1}_head"])
    got = head_summary({0: math.nan, 1: math.nan}, 2)
    assert all(math.isnan(v) for v in got.values())


def test_entropy_and_clip_scale_rank_from_the_low_end():
    records = [Record("self", 0, h, m, v) for m in ("entropy", "qk_clip_scale", "max_logit")
               for h, v in enumerate([0.9, 0.2, 0.5])]
    values = tracker_metrics(Snapshot(1, 0.0, records), top_k=1)
    assert values["attn_probe/self/entropy/layer_00/top_1_head"] == 1
    assert values["attn_probe/self/qk_clip_scale/layer_00/top_1_head"] == 1
    assert values["attn_probe/self/max_logit/layer_00/top_1_head"] == 0


#: the counts docs/tags.md states for a 32-layer x 32-head model with per_head=True and the
#: default metrics, tracker_top_k=3: a step with attention_stats measured, and one without
DOCUMENTED_MEASURED = 3592
DOCUMENTED_WEIGHTS_ONLY = 1942


def test_32_by_32_run_sends_the_documented_keys_and_the_jsonl_holds_every_head(tmp_path):
    """A Llama of 32 layers x 32 heads (head_dim 2, from LlamaConfig), per_head=True,
    attention_stats=True, one update: the tracker gets exactly the documented number of keys, every
    one of the grammar's forms (no head_ key), and attn_probe.jsonl holds every head of every metric."""
    text = DOCS.read_text()
    assert f"{DOCUMENTED_MEASURED:,}" in text and f"{DOCUMENTED_WEIGHTS_ONLY:,}" in text
    from attn_probe import watch
    from tests.helpers import tiny_model

    L = H = 32
    model = tiny_model("llama", hidden_size=64, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=8,
                       intermediate_size=16, vocab_size=40, max_position_embeddings=16, impl="sdpa")
    sent: list[tuple[int, dict]] = []
    target = TrackerTarget("fake", run=lambda: TrackerRun("fake", "r1", "fake run"),
                           send=lambda values, step: sent.append((step, values)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    log_dir = tmp_path / "run"
    probe = watch(model, optimizer=opt, every=1, per_head=True, attention_stats=True, random_range=False,
                  sinks=[TrackerFanOut([target])], log_dir=str(log_dir), background=False)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    opt.step()
    probe.close()

    by_step = dict(sent)
    assert sorted(by_step) == [0, 1]
    assert len(by_step[1]) == DOCUMENTED_MEASURED
    assert len(by_step[0]) == DOCUMENTED_WEIGHTS_ONLY  # the attach snapshot: no attention measured

    weights = ("symmetry", "directionality", "spectral_norm", "frobenius_norm", "stable_rank", "qk_bound")
    magnitudes = ("spectral_norm", "frobenius_norm", "stable_rank", "qk_bound")
    head_metrics = (*weights, "max_logit", "entropy", "logit_bound_ratio", "max_logit_signed", "qk_clip_scale")
    layer_metrics = (*head_metrics, "heads_over_tau")
    want = {scalar_tag("self", m, stat=s) for m in layer_metrics
            for s in ("median", "q25", "q75", *(("max",) if m in magnitudes else ()))}
    want |= {scalar_tag("self", m, layer=i) for m in layer_metrics for i in range(L)}
    want |= {scalar_tag("self", m, layer=i, summary=s) for m in head_metrics for i in range(L)
             for s in summary_names(3)}
    assert set(by_step[1]) == want

    rows = [json.loads(line) for line in (log_dir / "attn_probe.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step") == 1 and r.get("metric") is not None]
    heads: dict[str, set] = {}
    for r in rows:
        if r["head"] is not None:
            heads.setdefault(r["metric"], set()).add((r["layer"], r["head"]))
    assert set(heads) == set(head_metrics)
    every = {(i, h) for i in range(L) for h in range(H)}
    for metric, seen in heads.items():
        assert seen == every, metric
    # one summary against the JSONL values, by hand
    ent = {r["head"]: r["value"] for r in rows if r["metric"] == "entropy" and r["layer"] == 5 and r["head"] is not None}
    low = sorted(ent, key=lambda h: (ent[h], h))
    key = "attn_probe/self/entropy/layer_05/"
    assert by_step[1][key + "heads_min"] == pytest.approx(min(ent.values()), rel=1e-12)
    assert by_step[1][key + "heads_median"] == pytest.approx(statistics.median(ent.values()), rel=1e-12)
    assert [by_step[1][key + f"top_{r}_head"] for r in (1, 2, 3)] == low[:3]
