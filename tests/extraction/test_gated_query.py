"""Gated queries (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Qwen4-Exp) and the head-count check.

A gated ``q_proj`` outputs, per head, the query and an output gate (``2*H*dh`` rows); only the
query meets the keys. The reference is independent of attn_probe's slicing: the model's own
``q_proj``/``k_proj`` applied to the identity give ``W^T``, the query is sliced as the modeling
code does (``view(..., -1, 2*dh).chunk(2, -1)[0]``), heads are paired as transformers'
``repeat_kv`` pairs them, and ``M = sum_h W_q^h^T W_k^{g(h)}`` is formed explicitly in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from test_extraction import CASES, _build  # noqa: E402

from attn_probe.extraction import UnsupportedModelError, find_attention  # noqa: E402
from attn_probe.scoring.model import score_model  # noqa: E402

GATED_CASES = [c for c in CASES if c.id in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen4_exp_text")]


def _explicit_heads(attn: nn.Module) -> list[torch.Tensor]:
    """Per-head ``W_q^h^T W_k^{g(h)}`` (float64) from the module's own projections and slicing."""
    cfg = attn.config
    h, hkv, dh, d = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim, cfg.hidden_size
    eye = torch.eye(d, dtype=torch.float64)
    with torch.no_grad():
        q_out = (attn.q_proj.double()(eye) - attn.q_proj.double()(0 * eye)).float()  # (d, 2*H*dh): row i = W e_i
        k_out = (attn.k_proj.double()(eye) - attn.k_proj.double()(0 * eye)).float()
    attn.float()
    query, _gate = torch.chunk(q_out.view(d, -1, dh * 2), 2, dim=-1)  # as the modeling code slices it
    key = k_out.view(d, -1, dh)
    assert query.shape[1] == h and key.shape[1] == hkv
    group = attn.num_key_value_groups
    return [query[:, i].double() @ key[:, i // group].double().T for i in range(h)]  # x^T M y = q(x) . k(y)


def _metrics(m: torch.Tensor) -> tuple[float, float]:
    symmetry = float((m * m.T).sum() / (m * m).sum())
    return symmetry, float(torch.linalg.matrix_norm(m, 2))


@pytest.mark.parametrize("case", GATED_CASES, ids=[c.id for c in GATED_CASES])
def test_gated_query_scores_match_explicit_reference(case) -> None:
    model = _build(case)
    (layer,) = find_attention(model)
    cfg = layer.module.config
    assert (layer.num_heads, layer.num_kv_heads) == (cfg.num_attention_heads, cfg.num_key_value_heads)
    per_head = _explicit_heads(layer.module)
    rows = score_model(model, per_head=True, dtype=torch.float64, metrics=["symmetry", "spectral_norm"])
    assert [r["head"] for r in rows] == [None, *range(cfg.num_attention_heads)]
    for row, m in zip(rows, [sum(per_head), *per_head], strict=True):
        symmetry, spectral = _metrics(m)
        assert row["symmetry"] == pytest.approx(symmetry, abs=1e-6), row
        assert row["spectral_norm"] == pytest.approx(spectral, rel=1e-6), row


class GatedAttention(nn.Module):
    """A q_proj with twice the rows its stated heads need, in a layout attn_probe does not know."""

    def __init__(self, d: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 8):
        super().__init__()
        self.config = transformers.LlamaConfig(hidden_size=d, num_attention_heads=heads, num_key_value_heads=kv_heads)
        self.head_dim = head_dim
        self.q_proj = nn.Linear(d, 2 * heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * head_dim, bias=False)


def test_head_counts_disagreeing_with_the_config_are_refused() -> None:
    model = nn.Sequential(GatedAttention())
    with pytest.raises(UnsupportedModelError) as info:
        find_attention(model)
    message = str(info.value)
    assert "0 (GatedAttention)" in message
    assert "read 8 query heads and 2 KV heads of size 8" in message
    assert "num_attention_heads=4, num_key_value_heads=2" in message
    with pytest.raises(UnsupportedModelError, match="num_attention_heads=4"):  # the qk_names path too
        find_attention(model, qk_names=[("q_proj", "k_proj")])


def test_module_attributes_take_precedence_over_the_config() -> None:
    """A module that states its own counts (as a decoder with other heads than the config's) is read by them."""
    attn = GatedAttention()  # q_proj: 8 heads of 8 rows; the config says 4
    attn.num_heads, attn.num_key_value_groups = 8, 4
    (layer,) = find_attention(nn.Sequential(attn))
    assert (layer.num_heads, layer.num_kv_heads) == (8, 2)
    attn.num_key_value_groups = 2  # transformers' repeat_kv would pair 8 query heads with 4 KV heads
    with pytest.raises(UnsupportedModelError, match="num_attention_heads=8, num_key_value_heads=4"):
        find_attention(nn.Sequential(attn))


def test_aliased_config_head_count_is_not_used() -> None:
    """RT-DETR's decoder has decoder_attention_heads; its config's num_attention_heads aliases the encoder's."""
    cls = getattr(transformers, "RTDetrConfig", None)
    if cls is None:
        pytest.skip("RTDetrConfig is not in this transformers")
    config = cls(encoder_attention_heads=4, decoder_attention_heads=8, d_model=32, encoder_hidden_dim=32)
    assert config.num_attention_heads == 4 and "num_attention_heads" in cls.attribute_map
    with torch.device("meta"):
        model = transformers.RTDetrModel(config)
    decoder = [a for a in find_attention(model) if a.name.startswith("decoder.") and "self_attn" in a.name]
    assert decoder and all((a.num_heads, a.head_dim) == (8, 4) for a in decoder)


def test_minicpm_v_language_model_reads_the_gated_query() -> None:
    """MiniCPM-V 4.6 embeds a Qwen3.5 text model: its full-attention layer has the config's heads."""
    cls = getattr(transformers, "MiniCPMV4_6Config", None)
    if cls is None:
        pytest.skip("MiniCPMV4_6Config is not in this transformers")
    config = cls()
    text = config.text_config
    for key, value in dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           intermediate_size=37, vocab_size=99, linear_num_value_heads=2, linear_num_key_heads=2,
                           linear_key_head_dim=8, linear_value_head_dim=8).items():
        setattr(text, key, value)
    text.layer_types = ["linear_attention", "full_attention"]
    text.num_hidden_layers = 2
    vision = config.vision_config
    for key, value in dict(hidden_size=32, num_attention_heads=4, intermediate_size=37, num_hidden_layers=1).items():
        setattr(vision, key, value)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config)
    language = [a for a in find_attention(model) if "language_model" in a.name]
    assert [(a.name, a.num_heads, a.num_kv_heads, a.head_dim) for a in language] == [
        ("language_model.layers.1.self_attn", 4, 2, 8)
    ]
