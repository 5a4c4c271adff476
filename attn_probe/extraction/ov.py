"""Where an attention layer's value and output projections live: the OV circuit's factors.

For head ``h`` the OV matrix is ``W_ov^h = W_o^h W_v^h`` (``d x d``, rows index the output):
``W_v^h`` is the head's ``(head_dim, d)`` block of value rows and ``W_o^h`` the
``(d, head_dim)`` block of output-projection *columns* that reads that head (the attention
output is ``(..., H, head_dim)`` flattened head-major before the output projection). The layer
matrix sums the heads. As factors of the scoring core (``M_h = A_h^T B_{g(h)}``):

* ``A_h = (W_o^h)^T``, shape ``(head_dim, d)``, one per query head;
* ``B_g = W_v^g``, shape ``(head_dim, d)``, one per KV head; head ``h`` reads value head
  ``g(h) = h // (H / H_kv)``, as it reads its key head.

Only architectures whose value rows and output-projection columns were checked against the
model's own forward pass are listed (:data:`OV_ARCHITECTURES`); anything else raises
:class:`~attn_probe.extraction.UnsupportedModelError` naming what is supported.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .base import AttentionLayer, ParamGetter, QKLayout, Tensor, UnsupportedModelError
from .projections import Projection, child_projection, is_lora, projection
from .rows import class_is

__all__ = ["OVLayout", "ov_layout", "OV_ARCHITECTURES"]

#: what :func:`ov_layout` reads, for the error message and the docs
OV_ARCHITECTURES = (
    "BERT/RoBERTa self-attention (value + the sibling output.dense)",
    "Llama, Mistral, Qwen2 (v_proj + o_proj, grouped-query)",
    "GPT-2 (Conv1D c_attn [q|k|v] + c_proj)",
    "GPT-NeoX/Pythia and BLOOM (query_key_value per-head interleaved + dense)",
    "Falcon (interleaved, multi-query and new_decoder_architecture grouped + dense)",
)

#: separate value/output children in the attention module itself
_SEPARATE_VO = ("LlamaAttention", "MistralAttention", "Qwen2Attention")
#: BERT-style self-attention: ``value`` here, the output projection in the parent's ``output.dense``
_BERT_SELF = ("BertSelfAttention", "RobertaSelfAttention", "RobertaPreLayerNormSelfAttention")


#: the OV pair's layouts are :class:`~attn_probe.extraction.base.QKLayout` s (one type for
#: both pairs' factor layouts); the name stays for code that imported it
OVLayout = QKLayout


def _layout(v_names: tuple[str, ...], o: Projection, layer: AttentionLayer,
            value: Callable[[ParamGetter], Tensor]) -> OVLayout | None:
    """``value(get)`` gives the ``(H_kv * dh, d)`` value rows; ``o`` maps ``H * dh`` to ``d``."""
    h, hkv, dh, d = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.hidden_size
    if o.in_features != h * dh or o.out_features != d:
        return None

    def split(get: ParamGetter) -> tuple[Tensor, Tensor]:
        w_o = o.weight(get)  # (d, H * dh): column block h reads head h
        return w_o.T.reshape(h, dh, d), value(get).reshape(hkv, dh, d)

    names = tuple(dict.fromkeys((*v_names, *o.param_names)))
    return QKLayout(names, h, hkv, dh, d, split, labels=("W_o", "W_v"))


def _separate(attn: nn.Module, layer: AttentionLayer) -> OVLayout | None:
    if not class_is(attn, *_SEPARATE_VO):
        return None
    v, o = child_projection(attn, layer.name, "v_proj"), child_projection(attn, layer.name, "o_proj")
    if v is None or o is None or v.out_features != layer.num_kv_heads * layer.head_dim:
        return None
    return _layout(v.param_names, o, layer, v.weight)


def _bert(attn: nn.Module, layer: AttentionLayer) -> OVLayout | None:
    """BERT-style: W_v from ``value``, W_o from the sibling ``output.dense`` (found in ``layer.root``).

    Sizes come from the modules' attributes, never from the weights: under sharding a weight's
    local shape is not its full shape (a ZeRO-3 placeholder is ``(0,)``, FSDP1 holds flat shards).
    """
    if not class_is(attn, *_BERT_SELF) or not layer.name.endswith(".self"):
        return None
    out_path = layer.name[: -len("self")] + "output"
    dense = getattr(_submodule(layer.root, out_path), "dense", None)
    v = child_projection(attn, layer.name, "value")
    o = projection(dense, f"{out_path}.dense") if isinstance(dense, nn.Module) and not is_lora(dense) else None
    if v is not None and o is not None and v.out_features == layer.num_kv_heads * layer.head_dim:
        found = _layout(v.param_names, o, layer, v.weight)
        if found is not None:
            return found
    missing = "" if layer.root is not None else "; no model root recorded (find the layers with find_attention)"
    raise UnsupportedModelError(
        f"attn_probe: the OV pair cannot read {layer.name} ({type(attn).__name__}): it reads W_v from its "
        f"`value` and W_o from the sibling {out_path}.dense, linear projections (the latter not wrapped by "
        f"PEFT: merge it first) with W_o mapping {layer.num_heads} x {layer.head_dim} to {layer.hidden_size}; "
        f"found value: {_kind(getattr(attn, 'value', None))}, dense: {_kind(dense)}{missing}. "
        "Score W_qk alone (the default pairs) for this model."
    )


def _kind(module: object) -> str:
    return "a PEFT LoRA wrapper" if isinstance(module, nn.Module) and is_lora(module) else type(module).__name__


def _submodule(root: nn.Module | None, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path) if root is not None else None
    except AttributeError:
        return None


def _fused_value(qkv: Projection, layer: AttentionLayer, kind: str) -> Callable[[ParamGetter], Tensor]:
    """The value rows of a fused q/k/v projection, ``(H_kv * dh, d)``."""
    h, hkv, dh, d = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.hidden_size

    def value(get: ParamGetter) -> Tensor:
        w = qkv.weight(get)
        if kind == "contiguous":  # [q (H dh) | k (Hkv dh) | v (Hkv dh)]
            return w[(h + hkv) * dh:]
        if kind == "interleaved":  # (H, 3, dh)
            return w.reshape(h, 3, dh, d)[:, 2]
        return w.reshape(hkv, h // hkv + 2, dh, d)[:, -1]  # grouped: (Hkv, H/Hkv + 2, dh)

    return value


def _fused(attn: nn.Module, layer: AttentionLayer) -> OVLayout | None:
    h, hkv, dh = layer.num_heads, layer.num_kv_heads, layer.head_dim
    if class_is(attn, "GPT2Attention") and not getattr(attn, "is_cross_attention", False):
        qkv_name, o_name, kind = "c_attn", "c_proj", "contiguous"
    elif class_is(attn, "GPTNeoXAttention", "BloomAttention"):
        qkv_name, o_name, kind = "query_key_value", "dense", "interleaved"
    elif class_is(attn, "FalconAttention"):
        qkv_name, o_name = "query_key_value", "dense"
        if getattr(attn, "new_decoder_architecture", False):
            kind = "grouped"
        elif getattr(attn, "multi_query", False):
            kind = "contiguous"
        else:
            kind = "interleaved"
    else:
        return None
    qkv, o = child_projection(attn, layer.name, qkv_name), child_projection(attn, layer.name, o_name)
    if qkv is None or o is None or qkv.out_features != (h + 2 * hkv) * dh:
        return None
    return _layout(qkv.param_names, o, layer, _fused_value(qkv, layer, kind))


def ov_layout(layer: AttentionLayer) -> OVLayout:
    """The OV factors of ``layer`` (found by :func:`~attn_probe.find_attention`).

    Raises :class:`UnsupportedModelError` for an architecture not in :data:`OV_ARCHITECTURES`
    (or a cross-attention module, or a projection wrapped in a way not read here).
    """
    attn = layer.module
    if attn is not None:
        for recognise in (_separate, _bert, _fused):
            found = recognise(attn, layer)
            if found is not None:
                return found
    kind = type(attn).__name__ if attn is not None else "unknown module"
    raise UnsupportedModelError(
        f"attn_probe: the OV pair cannot read {layer.name} ({kind}): where its W_v/W_o live and how "
        f"W_o's input splits per head is known only for {'; '.join(OV_ARCHITECTURES)} "
        "(docs/supported-models.md). Score W_qk alone (the default pairs) for this model."
    )

