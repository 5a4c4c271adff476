"""symmetric_init_: W_k := W_q per head, checked against the explicit matrix and the model's own projections."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

import attn_probe
from attn_probe import find_attention

transformers = pytest.importorskip("transformers")

H, D, NH = 32, 2, 4  # hidden size, layers, heads


def _bert():
    return tiny_model("bert", None, vocab_size=50, hidden_size=H, num_hidden_layers=D, num_attention_heads=NH,
                      intermediate_size=64, max_position_embeddings=32)


def _roberta():
    return transformers.RobertaForMaskedLM(
        transformers.RobertaConfig(
            vocab_size=50,
            hidden_size=H,
            num_hidden_layers=D,
            num_attention_heads=NH,
            intermediate_size=64,
            max_position_embeddings=40,
        )
    )


def _distilbert():
    return transformers.DistilBertForMaskedLM(
        transformers.DistilBertConfig(
            vocab_size=50, dim=H, n_layers=D, n_heads=NH, hidden_dim=64, max_position_embeddings=32
        )
    )


def _gpt2():
    return tiny_model("gpt2", None, vocab_size=50, n_embd=H, n_layer=D, n_head=NH, n_positions=32)


def _gpt_neox():
    return transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            vocab_size=50,
            hidden_size=H,
            num_hidden_layers=D,
            num_attention_heads=NH,
            intermediate_size=64,
            max_position_embeddings=32,
        )
    )


def _t5():
    return transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=50,
            d_model=H,
            d_kv=H // NH,
            d_ff=64,
            num_layers=D,
            num_heads=NH,
            decoder_start_token_id=0,
        )
    )


def _bart():
    return transformers.BartForConditionalGeneration(
        transformers.BartConfig(
            vocab_size=50,
            d_model=H,
            encoder_layers=D,
            decoder_layers=D,
            encoder_attention_heads=NH,
            decoder_attention_heads=NH,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=32,
        )
    )


def _llama(kv: int = NH):
    return tiny_model("llama", None, vocab_size=50, hidden_size=H, num_hidden_layers=D, num_attention_heads=NH,
                      num_key_value_heads=kv, intermediate_size=64, max_position_embeddings=32)


# builder, names of the (query, key) weights written by the model's own modules, number of layers
MODELS = {
    "bert": (_bert, "query", "key", D),
    "roberta": (_roberta, "query", "key", D),
    "distilbert": (_distilbert, "q_lin", "k_lin", D),
    "gpt2-fused-conv1d": (_gpt2, None, None, D),
    "gpt-neox-fused": (_gpt_neox, None, None, D),
    "t5": (_t5, "q", "k", 3 * D),  # encoder self, decoder self, decoder cross
    "bart": (_bart, "q_proj", "k_proj", 3 * D),
    "llama": (_llama, "q_proj", "k_proj", D),
}


def _find_or_skip(model):
    try:
        return find_attention(model)
    except attn_probe.UnsupportedModelError as exc:  # e.g. a fused layout the extraction does not read yet
        pytest.skip(f"extraction does not support this layout yet: {exc}")


def _explicit_symmetry(m: torch.Tensor) -> float:
    """<M, M^T>_F / ||M||_F^2 from the explicit matrix."""
    return float((m * m.T).sum() / (m * m).sum())


def _train_step(model) -> None:
    torch.manual_seed(1)
    ids = torch.randint(3, 50, (2, 8))
    kwargs = {"input_ids": ids, "labels": ids}
    if model.config.is_encoder_decoder:
        kwargs["decoder_input_ids"] = ids
    loss = model(**kwargs).loss
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()


@pytest.mark.parametrize("arch", list(MODELS))
def test_symmetric_init_makes_every_layer_symmetric(arch):
    build, q_name, k_name, n_layers = MODELS[arch]
    torch.manual_seed(0)
    model = build()
    layers = _find_or_skip(model)
    assert len(layers) == n_layers
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for layer in layers:  # random init is far from symmetric
        assert _explicit_symmetry(layer.qk_matrix()) < 0.5

    assert attn_probe.symmetric_init_(model) is model

    for layer in find_attention(model):
        m = layer.qk_matrix()
        assert torch.allclose(m, m.T, atol=1e-6 * m.abs().max())
        assert _explicit_symmetry(m) == pytest.approx(1.0, abs=1e-6)
        for h in range(layer.num_heads):  # per head: M_h = W_q^h^T W_q^h is PSD
            mh = layer.qk_matrix(head=h)
            assert torch.linalg.eigvalsh((mh + mh.T) / 2).min() > -1e-6 * mh.abs().max()
    for row in attn_probe.score_model(model):
        assert row["symmetry"] == pytest.approx(1.0, abs=1e-4)

    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    if q_name is not None:
        # exactly the key weights changed, each to a copy of its sibling query weight
        expected = {n for n in before if n.endswith(f".{k_name}.weight")}
        assert changed == expected
        for n in expected:
            q = n[: -len(f"{k_name}.weight")] + f"{q_name}.weight"
            assert torch.equal(model.get_parameter(n), before[q])
    else:
        # fused q|k|v weight: only that tensor changes, biases and everything else are untouched
        assert changed and all(
            n.endswith("weight") and ("c_attn" in n or "query_key_value" in n) for n in changed
        )

    _train_step(model)
    after = dict(model.named_parameters())
    assert all(torch.isfinite(p).all() for p in after.values())
    for n in changed:  # training is unconstrained: W_k moves away from W_q
        assert not torch.equal(after[n].detach(), before[n])


@pytest.mark.parametrize("arch", ["bert", "distilbert", "llama", "t5"])
def test_model_computes_equal_queries_and_keys(arch):
    """Forward hooks on the model's own q/k projections: after the init, q(x) - b_q == k(x) - b_k."""
    build, q_name, k_name, _ = MODELS[arch]
    torch.manual_seed(0)
    model = attn_probe.symmetric_init_(build()).eval()
    captured: dict[str, list[torch.Tensor]] = {"q": [], "k": []}
    hooks = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if "EncDecAttention" in name:  # cross-attention: q and k see different inputs
            continue
        for tag, wanted in (("q", q_name), ("k", k_name)):
            if leaf == wanted:
                bias = module.bias if module.bias is not None else 0.0

                def hook(mod, inp, out, tag=tag, bias=bias):
                    captured[tag].append(out.detach() - (bias.detach() if torch.is_tensor(bias) else bias))

                hooks.append(module.register_forward_hook(hook))
    ids = torch.randint(3, 50, (2, 8))
    with torch.no_grad():
        kwargs = {"input_ids": ids}
        if model.config.is_encoder_decoder:
            kwargs["decoder_input_ids"] = ids
        model(**kwargs)
    for h in hooks:
        h.remove()
    assert len(captured["q"]) == len(captured["k"]) > 0
    for q, k in zip(captured["q"], captured["k"], strict=True):
        assert torch.allclose(q, k, atol=1e-6)


def test_gpt2_fused_conv1d_queries_equal_keys():
    """GPT-2 stores q|k|v in one Conv1D (in x out); the split of its output gives q == k (minus bias)."""
    torch.manual_seed(0)
    model = attn_probe.symmetric_init_(_gpt2()).eval()
    outs = []
    hooks = [
        blk.attn.c_attn.register_forward_hook(lambda m, i, o: outs.append((o.detach(), m.bias.detach())))
        for blk in model.transformer.h
    ]
    with torch.no_grad():
        model(input_ids=torch.randint(0, 50, (2, 8)))
    for h in hooks:
        h.remove()
    assert len(outs) == D
    for out, bias in outs:
        q, k, _ = (out - bias).split(H, dim=-1)
        assert torch.allclose(q, k, atol=1e-6)


def test_biases_are_left_alone():
    torch.manual_seed(0)
    model = _bert()
    with torch.no_grad():
        for layer in model.bert.encoder.layer:
            layer.attention.self.key.bias.normal_()
    before = [lyr.attention.self.key.bias.clone() for lyr in model.bert.encoder.layer]
    attn_probe.symmetric_init_(model)
    for b, lyr in zip(before, model.bert.encoder.layer, strict=True):
        assert torch.equal(b, lyr.attention.self.key.bias)


def test_grouped_query_attention_is_rejected_and_nothing_is_written():
    torch.manual_seed(0)
    model = _llama(kv=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="grouped-query"):
        attn_probe.symmetric_init_(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_lora_projection_is_rejected_with_advice():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(
        _bert(), peft.LoraConfig(r=2, target_modules=["query", "key"], init_lora_weights=False)
    )
    with pytest.raises(ValueError, match="merge_and_unload"):
        attn_probe.symmetric_init_(model)


def test_a_permuted_fused_projection_is_rejected_naming_it_and_left_unchanged():
    from transformers import CodeGenConfig, CodeGenForCausalLM

    torch.manual_seed(0)
    model = CodeGenForCausalLM(CodeGenConfig(n_embd=64, n_layer=2, n_head=8, vocab_size=100, rotary_dim=4))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="CodeGen's qkv_proj"):
        attn_probe.symmetric_init_(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_lazy_export():
    from attn_probe.intervention import symmetric_init_

    assert attn_probe.symmetric_init_ is symmetric_init_
