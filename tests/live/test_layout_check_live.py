"""The live probe checks each layer's reading once against its first counted training forward (issue 44).

Real forwards of a tiny Llama (GQA, rotary) built from its config, watched with ``attention_stats=True``:
the right reading is verified for every layer and recorded in the trajectory file (``layout_check``
rows, read back from the file); a deliberately wrong adapter (:func:`attn_probe.extraction.register_adapter`:
key heads flipped) is warned about once per layer, and that layer's values are not written afterwards;
a ``no_grad`` evaluation forward does not run the check.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attn_probe  # noqa: E402
from attn_probe.extraction import QKLayout, register_adapter, unregister_adapter  # noqa: E402
from tests.activations.test_attention_health_live import Records  # noqa: E402

B, T = 2, 24


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg).double()


def _flipped_keys(attn, path, config):
    """A deliberately wrong reading of Llama attention: the key heads in reverse order."""
    if type(attn).__name__ != "LlamaAttention":
        return None
    names = (f"{path}.q_proj.weight", f"{path}.k_proj.weight")

    def split(get):
        return get(names[0]).reshape(8, 8, 64), get(names[1]).reshape(2, 8, 64).flip(0)

    return QKLayout(names, 8, 2, 8, 64, split)


def _train(model, tmp_path, steps: int = 3, adapter=None):
    """SGD steps; an evaluation forward under no_grad first (not counted). Returns the probe, the sink,
    the probe's warnings and the layout results seen right after the evaluation forward."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sink = Records()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if adapter is not None:
            register_adapter(adapter)
        try:
            probe = attn_probe.watch(
                model,
                optimizer=opt,
                every=1,
                attention_stats=True,
                per_head=True,
                sinks=[sink],
                metrics=("symmetry",),
                log_dir=str(tmp_path / "tb"),
            )
        finally:
            if adapter is not None:
                unregister_adapter(adapter)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            model(torch.randint(0, 100, (B, T), generator=g))
        after_eval = dict(probe.attention.capture.layout.results)
        for _ in range(steps):
            ids = torch.randint(0, 100, (B, T), generator=g)
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        held = dict(probe.attention.capture.layout.inputs)  # the inputs kept for the check: none after it
        probe.close()
    messages = [str(w.message) for w in caught if "attn_probe" in str(w.message)]
    return probe, sink, messages, after_eval, held


def _layout_rows(tmp_path) -> list[dict]:
    rows = []
    for path in tmp_path.rglob("attn_probe.jsonl"):
        with open(path) as fh:
            rows += [rec for rec in map(json.loads, fh) if rec.get("metric") == "layout_check"]
    return rows


def test_the_right_reading_is_verified_once_and_recorded(tmp_path):
    model = _llama()
    probe, sink, messages, after_eval, held = _train(model, tmp_path)
    assert after_eval == {}  # the no_grad evaluation forward ran no check
    assert held == {}
    assert {name: check.verdict for name, check in probe.attention.layout.items()} == {
        "model.layers.0.self_attn": "ok",
        "model.layers.1.self_attn": "ok",
    }
    assert probe.attention.refused == {} and probe.attention.refused_snapshots == 0
    assert not [m for m in messages if "does not reproduce" in m]
    rows = _layout_rows(tmp_path)  # read back from the file: one row per layer, once
    assert sorted((r["layer"], r["value"]) for r in rows) == [(0, 1.0), (1, 1.0)]
    assert all(r["note"].startswith("ok: reading verified") for r in rows)
    steps = {snap.step for snap in sink.snapshots for r in snap.records if r.metric == "max_logit"}
    assert steps == {1, 2, 3}
    df = attn_probe.load_trajectory(str(tmp_path / "tb"))  # the extra key is tolerated by the loader
    assert set(df[df["metric"] == "layout_check"]["value"]) == {1.0}


def test_a_wrong_adapter_is_refused_warned_once_and_not_written(tmp_path):
    model = _llama()
    probe, sink, messages, _, _ = _train(model, tmp_path, adapter=_flipped_keys)
    refusals = [m for m in messages if "does not reproduce" in m]
    assert len(refusals) == 2  # once per layer, not once per step
    assert all("register_adapter" in m and "mismatch" in m for m in refusals)
    assert set(probe.attention.refused) == {("self", 0), ("self", 1)}
    assert probe.attention.refused_snapshots == 3
    written = {(snap.step, r.metric) for snap in sink.snapshots for r in snap.records}
    assert {step for step, _ in written} == {0}  # only the weights at attach, before any forward
    rows = _layout_rows(tmp_path)
    assert sorted((r["layer"], r["value"]) for r in rows) == [(0, 0.0), (1, 0.0)]
    assert all(r["note"].startswith("mismatch: the probe's x.W_q/x.W_k do not reproduce") for r in rows)


def test_a_compiled_forward_is_not_checked_inside_its_graph(tmp_path):
    """torch.compile (aot_eager): the capture runs inside the graph, so the check waits for an eager call
    (none here): nothing is recorded or refused, the statistics are still written, nothing fails."""
    torch._dynamo.reset()
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sink = Records()
    probe = attn_probe.watch(
        model,
        optimizer=opt,
        every=1,
        attention_stats=True,
        sinks=[sink],
        metrics=("symmetry",),
        log_dir=str(tmp_path / "tb"),
    )
    compiled = torch.compile(model, backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, 100, (B, T), generator=g)
        compiled(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    held = dict(probe.attention.capture.layout.inputs)
    probe.close()
    torch._dynamo.reset()
    assert probe.failures == 0 and held == {}
    assert all(check.verdict == "ok" for check in probe.attention.layout.values())
    assert probe.attention.refused == {}
    assert {snap.step for snap in sink.snapshots for r in snap.records if r.metric == "max_logit"} == {1, 2}


def test_peft_lora_dropout_is_not_read_as_a_wrong_reading(tmp_path):
    """A PEFT LoRA whose ``lora_dropout`` is active (and ``B != 0``): the forward's q/k are not a function
    of ``x`` and the merged weights alone, so the check cannot contradict the (right) reading. The layers
    are recorded ``unverified`` (the note names the dropout), not refused, and their values are written.
    Without the dropout guard the check's verdict is ``mismatch`` and both layers are refused."""
    peft = pytest.importorskip("peft")
    model = _llama()
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj", "k_proj"],
                             init_lora_weights=False)  # B random: the adapter changes q and k
    model = peft.get_peft_model(model, config)
    probe, sink, messages, _, _ = _train(model, tmp_path)
    assert not [m for m in messages if "does not reproduce" in m]
    assert probe.attention.refused == {}
    verdicts = {check.verdict for check in probe.attention.layout.values()}
    assert verdicts == {"unverified"}, probe.attention.layout
    assert all("dropout is active" in check.line for check in probe.attention.layout.values())
    steps = {snap.step for snap in sink.snapshots for r in snap.records if r.metric == "max_logit"}
    assert steps == {1, 2, 3}
