"""The quantity protocol (issue 36): the probe loops over quantities, and a new one is a class and a line.

The new quantity here measures, in :meth:`take` (every rank, before the walk), the Frobenius norm
of each layer's query projection, read from the model's own ``q_proj`` module; its rows must reach
the snapshot, the JSONL and the alert rules' every-rank check, beside the weight metrics.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import tiny_llama

import attn_probe
from attn_probe.live.quantities import AttentionStatistics, Heatmaps, Quantity, Rows, WeightMetrics


class QueryNorm(Quantity):
    name = "query norm"

    def __init__(self, model):
        self.model = model
        self.calls: list[tuple[str, int]] = []

    def take(self, step):
        self.calls.append(("take", step))
        return [float(layer.self_attn.q_proj.weight.detach().double().norm()) for layer in self.model.model.layers]

    def alert_rows(self, taken):
        return [{"group": "self", "layer": i, "head": None, "q_norm": v} for i, v in enumerate(taken)]

    def rows(self, measured, taken):
        self.calls.append(("rows", measured.step))
        return Rows([(layer, ("q_norm",), np.array([[taken[layer.layer]]])) for layer, _ in measured.tables], {})


def test_the_probe_takes_its_quantities_in_order_weights_heatmaps_attention():
    model = tiny_llama(0)
    probe = attn_probe.Probe(model, every=1, log_dir=None, attention_stats=True, random_range=False)
    try:
        kinds = [type(q) for q in probe.quantities]
        assert kinds == [WeightMetrics, Heatmaps, AttentionStatistics]
    finally:
        probe.close(final_snapshot=False)


def test_a_new_quantity_is_one_class_and_one_line(tmp_path):
    model = tiny_llama(0, layers=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with attn_probe.watch(model, optimizer=opt, log_dir=str(tmp_path), every=1, random_range=False) as probe:
        extra = QueryNorm(model)
        probe.quantities.append(extra)  # the one line
        expected = {}
        for step in range(1, 4):
            ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            # the reference: the model's own projection weights after this update, read independently
            expected[step] = [torch.linalg.matrix_norm(layer.self_attn.q_proj.weight.detach().double()).item()
                              for layer in model.model.layers]
    assert [c for c in extra.calls if c[0] == "take"][:3] == [("take", 1), ("take", 2), ("take", 3)]
    got: dict[int, dict[int, float]] = {}
    for line in (tmp_path / "attn_probe.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("metric") == "q_norm":
            got.setdefault(rec["step"], {})[rec["layer"]] = rec["value"]
    for step, norms in expected.items():
        assert got[step] == {i: pytest.approx(v, rel=1e-12) for i, v in enumerate(norms)}
    # beside the weight metrics of the same snapshot
    steps_with_symmetry = {json.loads(line)["step"] for line in (tmp_path / "attn_probe.jsonl").read_text().splitlines()
                           if json.loads(line).get("metric") == "symmetry"}
    assert set(expected) <= steps_with_symmetry


def test_a_quantitys_rows_reach_the_every_rank_alert_rules(tmp_path):
    model = tiny_llama(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fired = []
    with attn_probe.watch(model, optimizer=opt, log_dir=str(tmp_path), every=1, random_range=False,
                          attention_stats=True, alert_callback=fired.append,
                          alerts=[attn_probe.AlertRule("max_logit", above=1e9)]) as probe:
        probe.quantities.append(QueryNorm(model))
        rows = []
        real = probe.alerting.check_attention
        probe.alerting.check_attention = lambda step, r: rows.append((step, list(r))) or real(step, r)
        ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    assert any(any("q_norm" in r for r in rs) for _, rs in rows)
