"""PEFT LoRA adapter state is read when the weights are read, not when the layers were found.

A real ``LoraConfig`` on a tiny Llama (float64), watched once; then the adapter state changes:
``merge_adapter`` (the delta moves into the base weight), ``unmerge_adapter``, a second adapter
of another rank and alpha added and made active, ``disable_adapter()`` (with and without a merged
adapter). In every state the live snapshot and ``score_model`` must equal the metrics of the
weights the model really computes with: its own ``q_proj``/``k_proj`` applied to the identity.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import attn_probe  # noqa: E402
from attn_probe.extraction import find_attention, unwrap  # noqa: E402
from attn_probe.scoring.model import score_model  # noqa: E402
from attn_probe.scoring.pairs import QKPair  # noqa: E402

H, HKV, DH, D = 4, 2, 8, 32
METRICS = ["symmetry", "spectral_norm"]


def lora_llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=99, hidden_size=D, num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=HKV,
        intermediate_size=37, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    lora = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, lora).double().eval()


def reference_rows(model: nn.Module) -> list[tuple[int, int | None, float, float]]:
    """``(layer, head, symmetry, spectral_norm)`` of ``M = sum_h W_q^h^T W_k^{h // (H/Hkv)}``, the
    weights read off the wrapped projections' outputs on the identity (float64, no bias in Llama).

    Run after the probe read the weights: with adapters disabled while merged, this forward
    unmerges them (PEFT does so on the first forward), as the model's next step would.
    """
    rows = []
    root = unwrap(model)
    for index, block in enumerate(getattr(root, "model", root).layers):
        attn = block.self_attn
        eye = torch.eye(D, dtype=attn.q_proj.base_layer.weight.dtype)
        with torch.no_grad():
            query = attn.q_proj(eye).double().reshape(D, H, DH)  # row i: (W_q e_i) per head
            key = attn.k_proj(eye).double().reshape(D, HKV, DH)
        heads = [query[:, h] @ key[:, h // (H // HKV)].T for h in range(H)]
        for head, m in [(None, sum(heads)), *enumerate(heads)]:
            symmetry = float((m * m.T).sum() / (m * m).sum())
            rows.append((index, head, symmetry, float(torch.linalg.matrix_norm(m, 2))))
    return rows


def _from_snapshot(snapshot) -> list[tuple[int, int | None, float, float]]:
    values = {(r.layer, r.head, r.metric): r.value for r in snapshot.records}
    keys = sorted({(layer, head) for layer, head, _ in values}, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
    return [(layer, head, values[layer, head, "symmetry"], values[layer, head, "spectral_norm"]) for layer, head in keys]


def _from_score_model(model: nn.Module) -> list[tuple[int, int | None, float, float]]:
    rows = score_model(model, per_head=True, dtype=torch.float64, metrics=METRICS)
    return [(r["layer"], r["head"], r["symmetry"], r["spectral_norm"]) for r in rows]


def assert_rows_close(ours, reference, what: str) -> None:
    assert [r[:2] for r in ours] == [r[:2] for r in reference], what
    for got, ref in zip(ours, reference, strict=True):
        assert got[2] == pytest.approx(ref[2], abs=1e-9), f"{what}: symmetry of layer {got[0]} head {got[1]}"
        assert got[3] == pytest.approx(ref[3], rel=1e-9), f"{what}: spectral norm of layer {got[0]} head {got[1]}"


def _add_second_adapter(model: nn.Module) -> None:
    second = peft.LoraConfig(r=2, lora_alpha=64, target_modules=["q_proj", "k_proj"], init_lora_weights=False)
    model.add_adapter("second", second)
    model.double()


STATES = [
    ("plain", lambda model: contextlib.nullcontext()),
    ("merge_adapter", lambda model: model.merge_adapter()),
    ("unmerge_adapter", lambda model: model.unmerge_adapter()),
    ("set_adapter_second", lambda model: (_add_second_adapter(model), model.set_adapter("second"))),
    ("disable_adapter", lambda model: model.disable_adapter()),
    ("disable_adapter_while_merged", lambda model: (model.merge_adapter(), model.disable_adapter())[-1]),
]


def _enter(model: nn.Module, state: str) -> contextlib.AbstractContextManager:
    """Apply the states in order up to ``state``; returns the context to hold while measuring."""
    context: contextlib.AbstractContextManager = contextlib.nullcontext()
    for name, change in STATES:
        if name in ("disable_adapter", "disable_adapter_while_merged") and name != state:
            continue  # the disabled states are contexts, entered only when measured
        if name == "disable_adapter_while_merged":
            model.set_adapter("default")
        out = change(model)
        if isinstance(out, contextlib.AbstractContextManager):
            context = out
        if name == state:
            return context
    raise AssertionError(state)


@pytest.mark.parametrize("state", [name for name, _ in STATES])
def test_live_probe_and_score_model_use_the_adapter_state_in_force(tmp_path, state: str) -> None:
    model = lora_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the model changed after attach" when an adapter is added
        probe = attn_probe.watch(model, log_dir=str(tmp_path), every=None, per_head=True,
                                 pairs=[QKPair(METRICS, dtype=torch.float64)], background=False)
        try:
            with _enter(model, state):
                live = _from_snapshot(probe.snapshot(1))
                posthoc = _from_score_model(model)
                reference = reference_rows(model)
        finally:
            probe.close(final_snapshot=False)
    assert_rows_close(live, reference, f"{state}: live snapshot")
    assert_rows_close(posthoc, reference, f"{state}: score_model")


def test_states_in_sequence_on_one_probe(tmp_path) -> None:
    """The sequence a user runs (s19): one probe, each change followed by a snapshot."""
    model = lora_llama()
    steps = iter(range(1, 100))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = attn_probe.watch(model, log_dir=str(tmp_path), every=None, per_head=True,
                                 pairs=[QKPair(METRICS, dtype=torch.float64)], background=False)
        try:
            for what, change in [
                ("plain", lambda: None),
                ("merge_adapter", model.merge_adapter),
                ("unmerge_adapter", model.unmerge_adapter),
                ("set_adapter('second')", lambda: (_add_second_adapter(model), model.set_adapter("second"))),
                ("set_adapter('default')", lambda: model.set_adapter("default")),
            ]:
                change()
                assert_rows_close(_from_snapshot(probe.snapshot(next(steps))), reference_rows(model), what)
            with model.disable_adapter():
                assert_rows_close(_from_snapshot(probe.snapshot(next(steps))), reference_rows(model), "disabled")
            assert_rows_close(_from_snapshot(probe.snapshot(next(steps))), reference_rows(model), "enabled again")
        finally:
            probe.close(final_snapshot=False)


def test_every_adapter_is_declared_and_the_active_one_read() -> None:
    """The sharded walk gathers ``param_names``: all adapters' A/B are declared, the active one is used."""
    model = lora_llama()
    _add_second_adapter(model)
    (layer, *_) = find_attention(model)
    for adapter in ("default", "second"):
        assert f"{layer.name}.q_proj.lora_A.{adapter}.weight" in layer.param_names
        assert f"{layer.name}.k_proj.lora_B.{adapter}.weight" in layer.param_names
    root = unwrap(model)
    params = dict(root.named_parameters())
    only = {n: params[n] for n in layer.param_names}
    before = layer.qk_matrix(only.__getitem__)
    model.set_adapter("second")
    after = layer.qk_matrix(only.__getitem__)  # the same record, the new active adapter
    assert not torch.allclose(before, after)
    assert torch.allclose(after, find_attention(model)[0].qk_matrix(), rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_fsdp2_sharded_probe_reads_the_active_adapter(tmp_path) -> None:
    """Two gloo ranks, FSDP2: the walk gathers every adapter's A/B; the active one is applied."""
    import sys

    from helpers import WORKERS, launch

    launch("lora_shard_worker.py", [str(tmp_path)], 2, timeout=240)
    result = __import__("json").loads((tmp_path / "snapshots.json").read_text())
    assert result["sharded"]
    sys.path.insert(0, str(WORKERS))
    from lora_shard_worker import STATES, lora_llama

    model = lora_llama()  # the same weights, unsharded
    for state in STATES:
        if state == "second":
            model.set_adapter("second")
        with model.disable_adapter() if state == "disabled" else contextlib.nullcontext():
            reference = reference_rows(model)
        got = {(layer, head, metric): value for layer, head, metric, value in result["snapshots"][state]}
        assert len(got) == 2 * len(reference)
        for layer, head, symmetry, spectral in reference:  # float32 weights
            assert got[layer, head, "symmetry"] == pytest.approx(symmetry, abs=1e-5), (state, layer, head)
            assert got[layer, head, "spectral_norm"] == pytest.approx(spectral, rel=1e-5), (state, layer, head)


def test_dora_in_use_is_refused_and_read_once_merged() -> None:
    config = transformers.LlamaConfig(vocab_size=99, hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                                      num_key_value_heads=HKV, intermediate_size=37)
    torch.manual_seed(0)
    dora = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj"], use_dora=True,
                           init_lora_weights=False)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config), dora).double().eval()
    with pytest.raises(attn_probe.UnsupportedModelError, match="q_proj: DoRA adapters are not supported"):
        find_attention(model)
    model.merge_adapter()  # the base weight holds the DoRA-adapted weight: read alone
    assert_rows_close(_from_score_model(model), reference_rows(model), "merged DoRA")
