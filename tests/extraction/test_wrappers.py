"""Wrapped models: DDP, torch.compile, PEFT LoRA (effective weight), DeepSpeed-style ``.module``.

References are the unwrapped model (same parameters, same names) and, for LoRA, the
wrapped model's own q/k projection outputs captured with hooks and the merged model.
"""

from __future__ import annotations

import socket

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from helpers import tiny_model  # noqa: E402
from test_extraction import check_against_hooks, heads  # noqa: E402

from attn_probe.extraction import find_attention, unwrap  # noqa: E402
from attn_probe.scoring.model import score_model  # noqa: E402


def tiny_llama() -> nn.Module:
    return tiny_model("llama", cls=transformers.AutoModelForCausalLM.from_config, vocab_size=99,
                      intermediate_size=37, max_position_embeddings=64).eval()


def tiny_gpt2() -> nn.Module:
    return tiny_model("gpt2").eval()


def _summary(model: nn.Module) -> list[tuple]:
    return [(a.name, a.group, a.layer, a.param_names) for a in find_attention(model)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_ddp_single_process_gloo() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        model = tiny_llama()
        ddp = DistributedDataParallel(model)
        assert unwrap(ddp) is model
        assert _summary(ddp) == _summary(model)
        for a, b in zip(find_attention(ddp), find_attention(model), strict=True):
            qa, ka = a.factors()
            qb, kb = b.factors()
            assert qa.data_ptr() == qb.data_ptr() and ka.data_ptr() == kb.data_ptr()  # same storage, no copy
    finally:
        dist.destroy_process_group()


def test_torch_compile_wrapper() -> None:
    model = tiny_gpt2()
    compiled = torch.compile(model)  # compilation is lazy: nothing is traced here
    assert unwrap(compiled) is model
    assert _summary(compiled) == _summary(model)
    assert score_model(compiled) == score_model(model)


def test_module_attribute_wrappers_nest() -> None:
    """DataParallel around torch.compile: unwrap peels every layer."""
    model = tiny_gpt2()
    wrapped = nn.DataParallel(torch.compile(model))
    assert unwrap(wrapped) is model
    assert _summary(wrapped) == _summary(model)


def _lora(model: nn.Module, targets: list[str]):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, lora_alpha=6, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(model, config).eval()


def test_lora_scores_effective_weight_and_matches_merged() -> None:
    wrapped = _lora(tiny_llama(), ["q_proj", "k_proj"])
    layers = find_attention(wrapped)
    assert len(layers) == 2
    assert any("lora_A.default.weight" in n for n in layers[0].param_names)
    assert any("lora_B.default.weight" in n for n in layers[0].param_names)
    root = unwrap(wrapped)
    for name in layers[0].param_names:
        root.get_parameter(name)  # names are relative to the unwrapped model
    # the wrapped projections' own outputs (W x + scale * B A x) are reproduced per head
    ids = torch.randint(3, 99, (1, 6), generator=torch.Generator().manual_seed(0))
    spec = lambda m: ("q_proj", heads(8), "k_proj", heads(8))  # noqa: E731
    check_against_hooks(wrapped, layers, spec, {"input_ids": ids}, 4, 2, 8)
    before = [a.qk_matrix() for a in layers]
    rows_before = score_model(wrapped)
    # the LoRA delta matters: the base weight alone gives a different matrix
    base_only = layers[0].qk_matrix(
        get=lambda n: torch.zeros_like(root.get_parameter(n)) if "lora_B" in n else root.get_parameter(n)
    )
    assert not torch.allclose(base_only, before[0])

    merged = wrapped.merge_and_unload()
    merged_layers = find_attention(merged)
    assert all("lora" not in n for a in merged_layers for n in a.param_names)
    for a, m in zip(before, merged_layers, strict=True):
        assert torch.allclose(a, m.qk_matrix(), rtol=1e-5, atol=1e-6)
    for r0, r1 in zip(rows_before, score_model(merged), strict=True):
        assert r0["name"] == r1["name"]
        assert r0["symmetry"] == pytest.approx(r1["symmetry"], abs=1e-5)
        assert r0["directionality"] == pytest.approx(r1["directionality"], abs=1e-5)


def test_lora_merge_adapter_in_place_is_not_counted_twice() -> None:
    wrapped = _lora(tiny_llama(), ["q_proj", "k_proj"])
    before = [a.qk_matrix() for a in find_attention(wrapped)]
    wrapped.merge_adapter()  # base weights now hold W + scale * B A; adapters stay attached
    after = [a.qk_matrix() for a in find_attention(wrapped)]
    for a, b in zip(before, after, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_lora_on_gpt2_conv1d_fused() -> None:
    """LoRA on a Conv1D ``c_attn`` (fan_in_fan_out): the delta is in (out, in) convention."""
    wrapped = _lora(tiny_gpt2(), ["c_attn"])
    before = [a.qk_matrix() for a in find_attention(wrapped)]
    merged = wrapped.merge_and_unload()
    for a, m in zip(before, find_attention(merged), strict=True):
        assert torch.allclose(a, m.qk_matrix(), rtol=1e-5, atol=1e-6)
