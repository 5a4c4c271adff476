"""The one scoring core: every path gives the same numbers; validated config; pairs; metrics registry."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import tiny_bert, tiny_llama, tiny_model

import attn_probe
from attn_probe import core as metrics_module
from attn_probe.cli import main
from attn_probe.definitions import directionality_score, symmetry_score
from attn_probe.live.config import ProbeConfig
from attn_probe.scoring.pairs import QKPair


def bert():
    return tiny_bert(None, vocab=40, seq=16, intermediate=48)


def gpt2():
    return tiny_model("gpt2", None, vocab_size=40, n_embd=32, n_layer=2, n_head=4, n_positions=16)


def llama_gqa():
    return tiny_llama(None)


MODELS = {"bert": bert, "gpt2-fused": gpt2, "llama-gqa": llama_gqa}


def train_a_little(model, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, 40, (4, 12), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def jsonl_at(log_dir, step):
    out = {}
    with open(log_dir / "attn_probe.jsonl") as f:
        for line in f:
            if '"run_header"' in line:  # a run header, not a row
                continue
            r = json.loads(line)
            if r["step"] == step:
                out[(r["group"], r["layer"], r["head"], r["metric"])] = r["value"]
    return out


def close(a, b):
    # float32 weights scored along two paths (stacked live, per layer post hoc): the eigensolver
    # and the norms round differently with the stack size and the CPU's vector width, a few
    # ulp, which directionality's thresholds and stable rank's ratio amplify to ~3e-6
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


@pytest.mark.parametrize("name", list(MODELS), ids=list(MODELS))
def test_live_probe_score_model_and_checkpoint_cli_agree(name, tmp_path, capsys):
    torch.manual_seed(0)
    model = MODELS[name]()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    log_dir = tmp_path / "run"
    probe = attn_probe.watch(model, optimizer=opt, log_dir=str(log_dir), every=1, per_head=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 40, (4, 12), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    probe.close()
    live = jsonl_at(log_dir, 3)
    assert live, "the live probe wrote step 3"

    rows = attn_probe.score_model(model, per_head=True)
    model.save_pretrained(tmp_path / "ckpt")
    capsys.readouterr()
    assert main(["score", str(tmp_path / "ckpt"), "--per-head", "--json"]) == 0
    cli_rows = json.loads(capsys.readouterr().out)
    assert len(cli_rows) == len(rows) > 0

    metrics = [k for k in rows[0] if k not in ("group", "layer", "name", "head")]
    assert metrics == list(metrics_module.DEFAULT_METRICS)  # every default metric, in every path
    for row, cli_row in zip(rows, cli_rows, strict=True):
        assert (row["group"], row["layer"], row["head"]) == (cli_row["group"], cli_row["layer"], cli_row["head"])
        for metric in metrics:
            live_value = live[(row["group"], row["layer"], row["head"], metric)]
            assert close(live_value, row[metric]), (metric, live_value, row[metric])
            assert close(cli_row[metric], row[metric]), (metric, cli_row[metric], row[metric])
    # and the core agrees with the explicit float64 definitions on the model's own layers
    for layer in attn_probe.find_attention(model):
        m = layer.qk_matrix()
        row = next(r for r in rows if r["layer"] == layer.layer and r["group"] == layer.group and r["head"] is None)
        assert row["symmetry"] == pytest.approx(symmetry_score(m), abs=1e-5)
        assert row["directionality"] == pytest.approx(directionality_score(m), abs=1e-4)


def test_rows_carry_one_key_per_metric_spelled_like_the_jsonl(tmp_path):
    model = bert()
    rows = attn_probe.score_model(model, metrics=["directionality"])
    assert all(set(r) == {"group", "layer", "name", "head", "directionality"} for r in rows)
    probe = attn_probe.watch(model, log_dir=str(tmp_path), every=1, metrics=["directionality"])
    probe.close()
    with open(tmp_path / "attn_probe.jsonl") as f:
        # with the random-matrix range of the logged score, written once (docs/scores.md)
        assert {json.loads(line)["metric"] for line in f if '"run_header"' not in line} == {
            "directionality", "random_directionality", "random_directionality_sd"}


def test_misspelled_option_raises_type_error_at_construction_with_valid_names(tmp_path):
    with pytest.raises(TypeError, match="evry") as info:
        attn_probe.AttnProbeCallback(evry=2)
    assert "every" in str(info.value) and "per_head" in str(info.value)
    with pytest.raises(TypeError, match="per_haed"):
        attn_probe.watch(bert(), log_dir=str(tmp_path), per_haed=True)
    assert not (tmp_path / "attn_probe.jsonl").exists()  # nothing attached


@pytest.mark.parametrize("options", [
    {"metrics": ["symmetry", "no_such_metric"]},
    {"num_std": float("nan")},
    {"image_mode": "sideways"},
    {"image_size": 0},
    {"every": 0},
    {"start_step": -1},
], ids=["metric", "num_std", "image_mode", "image_size", "every", "start_step"])
def test_invalid_option_values_raise_value_error_at_construction(options):
    with pytest.raises(ValueError):
        attn_probe.AttnProbeCallback(**options)


def test_config_is_frozen_and_recorded():
    cfg = ProbeConfig(every=5, metrics=("directionality", "symmetry"), layers=[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.every = 3  # type: ignore[misc]
    assert cfg.layers == (1,)
    rec = cfg.record()
    assert rec["every"] == 5 and rec["metrics"] == ["directionality", "symmetry"]
    json.dumps(rec)  # JSON-able


class SelfPair(QKPair):
    """A pair that declares its own parameters: the query weight against itself (M = W_q^T W_q)."""

    prefix = "qq_"

    def param_names(self, layer):
        return tuple(n for n in layer.param_names if "query" in n)

    def factors(self, layer, get):
        names = self.param_names(layer)
        assert set(names) <= set(layer.param_names)
        w = get(names[0])  # BERT: (d, d) query weight
        q = w.reshape(layer.num_heads, layer.head_dim, layer.hidden_size)
        return q, q


def test_a_pair_declares_the_parameters_it_needs(tmp_path):
    model = bert()
    probe = attn_probe.watch(model, log_dir=str(tmp_path), every=1, pairs=[QKPair(), SelfPair(("symmetry",))])
    seen = set()
    orig = probe.measurement.param_names  # the documented seam: what the walk gathers per layer

    def spy(layer):
        names = orig(layer)
        seen.update(names)
        return names

    probe.measurement.param_names = spy
    snap = probe.snapshot(1)
    probe.close(final_snapshot=False)
    assert any("query" in n for n in seen) and any("key" in n for n in seen)
    values = {(r.layer, r.metric): r.value for r in snap.records if r.head is None}
    for layer in attn_probe.find_attention(model):
        assert values[(layer.layer, "qq_symmetry")] == pytest.approx(1.0, abs=1e-6)  # W_q^T W_q is symmetric
        assert values[(layer.layer, "symmetry")] == pytest.approx(symmetry_score(layer.qk_matrix()), abs=1e-5)


def test_a_new_metric_is_one_registry_entry_and_reaches_every_output(tmp_path, monkeypatch, capsys):
    """Adding a metric touches attn_probe/core/formulas.py only: the rows, JSONL, tags and CLI follow."""

    def frobenius_sq_ratio(p):  # ||M||_F^2 / (||A||_F^2 ||B||_F^2), a scale-invariant quantity
        a_sq, b_sq = p.factor_sq
        return p.frob_sq / (a_sq * b_sq)

    monkeypatch.setitem(metrics_module.METRICS, "frob_ratio", frobenius_sq_ratio)
    model = bert()
    rows = attn_probe.score_model(model, metrics=["symmetry", "frob_ratio"])
    for layer in attn_probe.find_attention(model):
        q, k = (t.detach().double() for t in layer.factors())
        m = layer.qk_matrix()
        expected = float((m * m).sum() / (q.square().sum() * k.square().sum()))
        row = next(r for r in rows if r["layer"] == layer.layer)
        assert row["frob_ratio"] == pytest.approx(expected, rel=1e-5)
    probe = attn_probe.watch(model, log_dir=str(tmp_path / "run"), every=1, metrics=["frob_ratio"])
    probe.close()
    with open(tmp_path / "run" / "attn_probe.jsonl") as f:
        assert {json.loads(line)["metric"] for line in f if '"run_header"' not in line} == {"frob_ratio"}
    df = attn_probe.load_trajectory(tmp_path / "run")
    assert set(df["metric"]) == {"frob_ratio"}


def test_no_import_circle_between_watch_probe_and_integrations():
    code = (
        "import sys, attn_probe.integrations.accelerate, attn_probe.live.probe;"
        "assert 'attn_probe.watching' not in sys.modules, 'probe/accelerate import watch';"
        "from attn_probe.live.probe import Probe, LogDirError, QKPair;"
        "from attn_probe import watch; import attn_probe.watching as w; assert watch is w.watch"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_score_factors_metrics_against_explicit_matrices():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(6, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(3, 4, 16, generator=gen, dtype=torch.float64)
    table = attn_probe.score_factors(q, k, ("directionality", "symmetry"), per_head=True, dtype=torch.float64)
    heads = [q[h].T @ k[h // 2] for h in range(6)]
    for col, m in enumerate([sum(heads), *heads]):
        assert table[0, col].item() == pytest.approx(directionality_score(m), abs=1e-9)
        assert table[1, col].item() == pytest.approx(symmetry_score(m), abs=1e-9)
    scores = ("symmetry", "directionality")  # undefined for M = 0; the norms of M = 0 are 0
    zero = attn_probe.score_factors(torch.zeros(2, 2, 4), torch.zeros(2, 2, 4), scores)
    assert all(math.isnan(v) for v in zero.flatten().tolist())
