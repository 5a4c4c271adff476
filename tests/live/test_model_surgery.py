"""Model surgery after attach: the probe must never log a module that is no longer in the model.

At each snapshot the probe compares the module at every attached path, and the parameters it
scores, with attach time (identity only); on a change it finds the attention layers again and
warns. The logged values must be those of the live model (:func:`attn_probe.score_model`).
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from transformers import BertConfig, BertModel
from transformers.models.bert.modeling_bert import BertSelfAttention

from attn_probe import score_model
from attn_probe.live.probe import Probe

TOL = 1e-6


def config() -> BertConfig:
    return BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=32)


def bert(seed: int = 0) -> BertModel:
    torch.manual_seed(seed)
    return BertModel(config(), add_pooling_layer=False)


def logged(snapshot) -> dict:
    return {(r.layer, r.metric): r.value for r in snapshot.records if r.head is None}


def live(model) -> dict:
    return {(row["layer"], m): row[m] for row in score_model(model) for m in ("symmetry", "directionality")}


def assert_live(snapshot, model) -> None:
    got, want = logged(snapshot), live(model)
    assert set(got) >= set(want) and {k[0] for k in got} == {k[0] for k in want}
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=TOL), key


def surgery_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "model changed after attach" in str(w.message)]


@pytest.fixture
def probe(tmp_path):
    model = bert()
    p = Probe(model, log_dir=str(tmp_path), every=None)
    yield p
    p.close(final_snapshot=False)


def test_replaced_attention_module_is_found_again(probe) -> None:
    model = probe.model
    first = probe.snapshot(0)
    assert_live(first, model)
    fresh = BertSelfAttention(config())
    with torch.no_grad():  # make W_qk of the new module exactly symmetric: symmetry +1
        fresh.key.weight.copy_(fresh.query.weight)
    model.encoder.layer[0].attention.self = fresh
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        second = probe.snapshot(1)
    assert len(surgery_warnings(record)) == 1
    assert "encoder.layer.0.attention.self" in surgery_warnings(record)[0]
    assert_live(second, model)
    assert logged(second)[(0, "symmetry")] == pytest.approx(1.0, abs=1e-6)
    assert logged(first)[(0, "symmetry")] < 0.5  # the old module's value would have been stale
    with warnings.catch_warnings(record=True) as record:  # found again once, not at every snapshot
        warnings.simplefilter("always")
        assert_live(probe.snapshot(2), model)
    assert surgery_warnings(record) == []


def test_deleted_layer_is_reported_gone(probe) -> None:
    model = probe.model
    probe.snapshot(0)
    del model.encoder.layer[1]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        snap = probe.snapshot(1)
    (message,) = surgery_warnings(record)
    assert "gone: encoder.layer.1.attention.self" in message
    assert {r.layer for r in snap.records} == {0}
    assert_live(snap, model)


def test_replaced_query_weight_parameter_is_noticed(probe) -> None:
    model = probe.model
    probe.snapshot(0)
    attn = model.encoder.layer[1].attention.self
    attn.query.weight = torch.nn.Parameter(attn.key.weight.detach().clone())  # e.g. a weight-tying hack
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        snap = probe.snapshot(1)
    assert len(surgery_warnings(record)) == 1
    assert_live(snap, model)
    assert logged(snap)[(1, "symmetry")] == pytest.approx(1.0, abs=1e-6)


def test_lora_injected_after_attach_is_scored(probe) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    model = probe.model
    base = logged(probe.snapshot(0))
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["query", "key"]), model)
    torch.manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero: give the adapters a visible effect
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        snap = probe.snapshot(1)
    assert len(surgery_warnings(record)) == 1
    assert any("lora" in n for layer in probe.layers for n in layer.param_names)
    assert_live(snap, model)
    assert max(abs(logged(snap)[k] - base[k]) for k in base) > 1e-2  # the base weights alone differ


def test_unchanged_model_training_gives_no_warning_and_a_cheap_check(tmp_path) -> None:
    model = bert()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        probe = Probe(model, log_dir=str(tmp_path), every=1)
        probe.attach_optimizer(opt)
        for _ in range(3):
            model(input_ids=torch.randint(0, 64, (2, 8))).last_hidden_state.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        probe.close()
    assert surgery_warnings(record) == []
    assert probe.last_snapshot_step == 3
    # the check is identity comparisons only (~5 us per layer): best of 5 batches, under 50 us
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(100):
            assert probe.measurement.surgery.changed_layers() == []
        best = min(best, (time.perf_counter() - start) / 100 / len(probe.layers))
    assert best < 50e-6, best
