"""The layout check (:func:`attn_probe.extraction.layout_check.check_layout`) against real forwards.

Each case runs a real model and keeps, per layer, the tokens its attention module received and the q/k
its attention call received (``F.scaled_dot_product_attention``, replaced for the test; transformers'
``sdpa`` implementation calls it); the probe's factors come from :func:`find_attention`, or from a
deliberately wrong adapter (:func:`attn_probe.register_adapter`), which the check must refuse.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from third_party_layouts import XTransformersAttention
from torch import nn

from attn_probe.extraction import QKLayout, find_attention, register_adapter, unregister_adapter
from attn_probe.extraction.layout_check import check_layout

transformers = pytest.importorskip("transformers")


class Seen:
    """The input of each attention module and the q/k of the sdpa call it made, flattened to ``(N, H, dh)``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, attns: list[nn.Module]) -> None:
        self.x: list[torch.Tensor] = []
        self.qk: list[tuple[torch.Tensor, torch.Tensor]] = []
        original = F.scaled_dot_product_attention

        def sdpa(q, k, v, *args, **kwargs):
            self.qk.append(tuple(t.detach().transpose(1, 2).flatten(0, 1) for t in (q, k)))
            return original(q, k, v, *args, **kwargs)

        def keep(module, args, kwargs):
            self.x.append((args[0] if args else kwargs["hidden_states"]).detach().flatten(0, 1))

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
        for attn in attns:
            attn.register_forward_pre_hook(keep, with_kwargs=True)


def run(model: nn.Module, attns: list[nn.Module], monkeypatch: pytest.MonkeyPatch, tokens: int = 96) -> Seen:
    seen = Seen(monkeypatch, attns)
    with torch.no_grad():
        model(torch.randint(0, 100, (2, tokens // 2)))
    assert len(seen.x) == len(seen.qk) == len(attns)
    return seen


def verdicts(model: nn.Module, seen: Seen, **kwargs) -> list[str]:
    layers = find_attention(model, **kwargs)
    return [
        check_layout(x, *layer.factors(), q, k).verdict
        for layer, x, (q, k) in zip(layers, seen.x, seen.qk, strict=True)
    ]


def _llama(**extra) -> tuple[nn.Module, list[nn.Module]]:
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
        **extra,
    )
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    return model, [layer.self_attn for layer in model.model.layers]


def test_llama_gqa_rotary_reading_is_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    model, attns = _llama()
    seen = run(model, attns, monkeypatch)
    layers = find_attention(model)
    checks = [
        check_layout(x, *la.factors(), q, k) for la, x, (q, k) in zip(layers, seen.x, seen.qk, strict=True)
    ]
    assert [c.verdict for c in checks] == ["ok", "ok"]
    assert all(c.fits == ("grouped",) and c.scale == pytest.approx(1.0, abs=1e-6) for c in checks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_default_tolerance_tells_right_from_wrong_in_low_precision(
    monkeypatch, dtype: torch.dtype
) -> None:
    """Measured: right readings leave residuals of ~6e-7 (float32) and ~1.2e-2 (bfloat16), a wrong pairing
    0.59 and more; the default tolerance (by dtype) accepts the one and refuses the other."""
    model, attns = _llama()
    model.to(dtype)
    seen = run(model, attns, monkeypatch, tokens=512)
    assert verdicts(model, seen) == ["ok", "ok"]
    adapter = register_adapter(_wrong("pairing"))
    try:
        assert verdicts(model, seen) == ["mismatch", "mismatch"]
    finally:
        unregister_adapter(adapter)


def test_llama_attention_bias_is_no_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k projection biases (outside W_qk) are fitted, not taken for a wrong reading."""
    model, attns = _llama(attention_bias=True)
    with torch.no_grad():
        for a in attns:
            a.q_proj.bias.normal_()
            a.k_proj.bias.normal_()
    assert verdicts(model, run(model, attns, monkeypatch)) == ["ok", "ok"]


def _wrong(kind: str):
    """A deliberately wrong adapter for Llama attention: the key heads paired with the wrong query heads,
    or the queries read from the key projection's rows (a wrong slice)."""

    def adapter(attn, path, config):
        if type(attn).__name__ != "LlamaAttention":
            return None
        h, hk, dh, d = 8, 2, 8, 64
        names = (f"{path}.q_proj.weight", f"{path}.k_proj.weight")

        def split(get):
            q, k = get(names[0]).reshape(h, dh, d), get(names[1]).reshape(hk, dh, d)
            if kind == "pairing":  # the key heads in the wrong order: each query head meets another key
                return q, k.flip(0)
            return k.repeat(h // hk, 1, 1), k  # "slice": the query heads read from k_proj's rows

        return QKLayout(names, h, hk, dh, d, split)

    return adapter


@pytest.mark.parametrize("kind", ["pairing", "slice"])
def test_a_wrong_adapter_is_refused(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    model, attns = _llama()
    seen = run(model, attns, monkeypatch)
    adapter = register_adapter(_wrong(kind))
    try:
        layers = find_attention(model)
    finally:
        unregister_adapter(adapter)
    checks = [
        check_layout(x, *la.factors(), q, k) for la, x, (q, k) in zip(layers, seen.x, seen.qk, strict=True)
    ]
    assert [c.verdict for c in checks] == ["mismatch", "mismatch"]
    for c in checks:  # what differed: the keys each query head meets, or the query rows themselves
        if kind == "pairing":
            assert (
                c.residuals["q"] < 1e-6
                and c.residuals["q.k grouped"] > 1e-2
                and c.residuals["q.k tiled"] > 1e-2
            )
        else:
            assert c.residuals["q"] > 1e-2
    assert all(c.line.startswith("the probe's x.W_q/x.W_k do not reproduce the forward's: ") for c in checks)


def test_qk_norm_is_reported_and_verified_through_the_modules_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3 (QK-norm with trained-like gains, rotary, GQA): a mismatch on the bare projections, verified
    once the module's own q_norm/k_norm are applied to the probe's view, and named in the line."""
    torch.manual_seed(1)
    cfg = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
        attn_implementation="sdpa",
    )
    model = transformers.Qwen3ForCausalLM(cfg).double().eval()
    attns = [layer.self_attn for layer in model.model.layers]
    with torch.no_grad():
        for a in attns:
            a.q_norm.weight.uniform_(0.5, 1.5)
            a.k_norm.weight.uniform_(0.5, 1.5)
    seen = run(model, attns, monkeypatch, tokens=128)
    layers = find_attention(model)
    for layer, attn, x, (q, k) in zip(layers, attns, seen.x, seen.qk, strict=True):
        assert check_layout(x, *layer.factors(), q, k).verdict == "mismatch"
        check = check_layout(x, *layer.factors(), q, k, q_post=attn.q_norm, k_post=attn.k_norm)
        assert check.verdict == "ok" and "transform applied" in check.line


@pytest.mark.parametrize("tiled_reading", [False, True])
def test_xtransformers_tiling_is_found(monkeypatch: pytest.MonkeyPatch, tiled_reading: bool) -> None:
    """The forward tiles its keys: the grouped reading of the same weights is found ``tiled``; the
    reading attn_probe now makes (keys tiled, one per query head) is ``ok``."""
    torch.manual_seed(2)
    attn = XTransformersAttention(32, heads=8, kv_heads=2).double()
    x = torch.randn(1, 64, 32, dtype=torch.float64)
    captured = []
    original = torch.einsum

    def einsum(eq, *ops):
        if eq == "bhid,bhjd->bhij":
            captured.append(tuple(t.detach()[0].transpose(0, 1) for t in ops))
        return original(eq, *ops)

    monkeypatch.setattr(torch, "einsum", einsum)
    attn(x)
    ((q, k),) = captured
    if tiled_reading:
        query, key = find_attention(nn.ModuleList([attn]))[0].factors()
    else:
        query, key = attn.to_q.weight.reshape(8, 8, 32), attn.to_k.weight.reshape(2, 8, 32)
    check = check_layout(x[0], query, key, q, k)
    assert check.verdict == ("ok" if tiled_reading else "tiled")
    assert check.fits == (("grouped", "tiled") if tiled_reading else ("tiled",))


def test_gpt2_fused_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2's fused c_attn (Conv1D, biases, no rotary): verified; reading k from the v block is refused."""
    torch.manual_seed(3)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    attns = [block.attn for block in model.transformer.h]
    seen = run(model, attns, monkeypatch)
    assert verdicts(model, seen) == ["ok", "ok"]

    def v_as_k(attn, path, config):
        if type(attn).__name__ != "GPT2Attention":
            return None
        name = f"{path}.c_attn.weight"

        def split(get):
            w = get(name).T.reshape(3, 4, 16, 64)
            return w[0], w[2]

        return QKLayout((name,), 4, 4, 16, 64, split)

    register_adapter(v_as_k)
    try:
        assert verdicts(model, seen) == ["mismatch", "mismatch"]
    finally:
        unregister_adapter(v_as_k)


def test_real_xtransformers_flash_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real x-transformers (flash: keys tiled to every query head, then sdpa): attn_probe's reading is
    verified; the grouped reading of the same weights is found ``tiled``."""
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(4)
    model = xt.TransformerWrapper(
        num_tokens=100,
        max_seq_len=64,
        attn_layers=xt.Decoder(
            dim=64, depth=2, heads=8, attn_kv_heads=2, attn_dim_head=8, attn_flash=True, rotary_pos_emb=True
        ),
    )
    model = model.double().eval()
    attns = [m for m in model.modules() if type(m).__name__ == "Attention" and hasattr(m, "to_q")]
    seen = run(model, attns, monkeypatch)
    assert verdicts(model, seen) == ["ok", "ok"]
    for attn, x, (q, k) in zip(attns, seen.x, seen.qk, strict=True):
        grouped = attn.to_q.weight.reshape(8, 8, 64), attn.to_k.weight.reshape(2, 8, 64)
        assert check_layout(x, *grouped, q, k).verdict == "tiled"


def _rotated(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (interleaved pairs) of ``t (N, H, dh)`` at ``positions (N,)``."""
    angles = positions[:, None].double() * torch.linspace(0.1, 1.0, t.shape[-1] // 2, dtype=torch.float64)
    cos, sin = angles.cos()[:, None].to(t), angles.sin()[:, None].to(t)
    a, b = t[..., ::2], t[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


@pytest.mark.parametrize("seed", range(5))
def test_few_distinct_tokens_a_shared_prompt_and_padding(seed: int) -> None:
    """A DPO-like batch: 4 sequences of 6 tokens, two pairs alike (chosen and rejected share a prompt), a
    padding position of zeros; 12 distinct tokens against the fits' 2 dh + 2 = 18 unknowns. The right
    reading is verified by the direct comparison (the fits alone were ill-conditioned there and refused
    it: ``q.k`` residual 7.7e-4 on TRL's DPO test); a wrong one is not verified (``unverified``: too few
    distinct tokens to fit a bias or a factor, so no refusal either)."""
    g = torch.Generator().manual_seed(seed)
    n_heads, n_kv, dh, d = 4, 2, 8, 32
    x = torch.randn(2, 6, d, generator=g)
    x = torch.cat([x, x]).reshape(24, d)
    x[5::6] = 0
    wq, wk = torch.randn(n_heads, dh, d, generator=g) * 0.4, torch.randn(n_kv, dh, d, generator=g) * 0.4
    positions = torch.arange(24) % 6
    q = _rotated(torch.einsum("nd,hed->nhe", x, wq), positions)
    k = _rotated(torch.einsum("nd,hed->nhe", x, wk), positions)
    assert check_layout(x, wq, wk, q, k).verdict == "ok"
    wrong = check_layout(x, wq, wk.flip(0), q, k)
    assert wrong.verdict == "unverified" and "distinct tokens" in wrong.line
