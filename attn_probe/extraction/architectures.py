"""Architecture knowledge: the one place that knows module names and weight layouts.

An attention module is recognised, in this order, by

* a user adapter (:data:`USER_ADAPTERS`, filled by :func:`attn_probe.register_adapter`);
* *separate projections*: two child projections named like ``(q_proj, k_proj)``,
  ``(query, key)``, ``(q_lin, k_lin)``, ... (see :data:`SEPARATE_QK_NAMES`);
* a *fused* layout (:data:`FUSED_LAYOUTS`), one function per family, keyed on the attention
  class name: ``[q, k, v]`` row blocks (:func:`contiguous_qkv`: GPT-2, Phi-3, MPT, DBRX,
  ModernBERT, multi-query GPTBigCode/Falcon), per-head ``(H, 3, dh)`` interleave
  (:func:`interleaved_qkv`: GPT-NeoX, BLOOM, Persimmon, Falcon, GPTBigCode, DeBERTa v1),
  per-KV-group rows (:func:`grouped_qkv`: Falcon ``new_decoder_architecture``), CodeGen's
  four ``[q, v, k]`` blocks, ``torch.nn.MultiheadAttention`` and XLNet here; the layouts of the
  stacks research code trains with (nanoGPT, timm, LitGPT, torchtitan) in
  :mod:`attn_probe.extraction.stacks`.

How one projection's weight is read (``nn.Linear``, ``Conv1D``, PEFT LoRA, torchtune
LoRA/DoRA/QLoRA): :mod:`attn_probe.extraction.projections`; how fused rows split into heads:
:mod:`attn_probe.extraction.rows`. Both are re-exported here, where adapters import them from.
Head counts come from module attributes and the config, never from weight shapes alone, and
every ``split`` reads weights only through its getter. See ``docs/supported-models.md`` for the
tested model types.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from .base import ParamGetter, QKLayout, Tensor
from .heads import check_head_counts, infer_head_dim
from .heads import first_int as _int
from .projections import Projection, attached_adapters, child_projection, is_lora, projection
from .rows import class_is, contiguous_qkv, grouped_qkv, interleaved_qkv
from .stacks import litgpt_layout, nanogpt_layout, tiles_keys, timm_layout, torchtitan_layout

#: Child-module name pairs (query, key) of attention modules with separate projections.
SEPARATE_QK_NAMES: list[tuple[str, str]] = [
    ("q_proj", "k_proj"),
    ("query", "key"),
    ("q_lin", "k_lin"),
    ("query_proj", "key_proj"),
    ("q", "k"),
    ("wq", "wk"),
    ("to_q", "to_k"),
    ("q_attn", "k_attn"),
    ("Wq", "Wk"),
    ("q_head", "k_head"),
    ("linear_q", "linear_k"),
    ("q_linear", "k_linear"),
]

#: Substrings of a module path that mark cross-attention.
CROSS_ATTENTION_MARKERS = ("crossattention", "cross_attn", "encoder_attn", "encdecattention", "cross_attention",
                           "encoder_decoder_attention")


# --------------------------------------------------------------------------- layouts

#: Attention classes whose ``q_proj`` also computes a per-head output gate: its output is viewed
#: ``(..., H, 2*dh)`` and chunked into (query, gate), so its rows are ``(H, 2, dh)`` and only
#: ``[:, 0]`` meets the keys (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Qwen4-Exp).
GATED_QUERY_CLASSES = ("Qwen3NextAttention", "Qwen3_5Attention", "Qwen3_5MoeAttention", "Qwen4ExpTextAttention")


def separate_layout(
    attn: nn.Module, path: str, config: Any, names: list[tuple[str, str]] | None = None
) -> QKLayout | None:
    """Layout of a module with separate q and k projection children, if it has them.

    Where the forward tiles its KV heads (x-transformers, :func:`~attn_probe.extraction.stacks.tiles_keys`:
    query head ``h`` meets KV head ``h % Hkv``), the keys are tiled the same way, one per query head, so the
    layout states ``num_kv_heads == num_heads`` and every consumer pairs head ``h`` with key ``h``.
    """
    children = dict(attn.named_children())
    slots = 2 if class_is(attn, *GATED_QUERY_CLASSES) else 1  # rows per query head: (query[, gate])
    tiled = tiles_keys(attn)
    for q_name, k_name in names if names is not None else SEPARATE_QK_NAMES:
        if q_name not in children or k_name not in children:
            continue
        prefix = f"{path}." if path else ""
        q = projection(children[q_name], prefix + q_name)
        k = projection(children[k_name], prefix + k_name)
        if q is None or k is None or q.in_features != k.in_features or q.out_features % slots:
            continue
        q_rows = q.out_features // slots
        head_dim = infer_head_dim(attn, config, q_rows, k.out_features)
        if head_dim is None:
            continue
        num_heads, num_kv = q_rows // head_dim, k.out_features // head_dim
        if num_heads % num_kv:
            continue
        d = q.in_features
        tile = num_heads // num_kv if tiled else 1  # (a copy of the keys: repeat, as the forward does)

        def split(get: ParamGetter, q=q, k=k, h=num_heads, hk=num_kv, dh=head_dim, d=d, slots=slots, tile=tile):
            key = k.weight(get).reshape(hk, dh, d)
            return q.weight(get).reshape(h, slots, dh, d)[:, 0], key.repeat(tile, 1, 1) if tile > 1 else key

        return QKLayout(q.param_names + k.param_names, num_heads, num_kv * tile, head_dim, d, split)
    return None




def _by_class(attn: nn.Module, table: dict[str, tuple[str, str | None]]) -> str | None:
    """The fused child name for the module's class (or nearest listed base class); table values
    are ``(child, suffix)`` where ``suffix`` must end the defining module's name if not None."""
    for cls in type(attn).__mro__:
        child, suffix = table.get(cls.__name__, ("", None))
        if child and (suffix is None or cls.__module__.endswith(suffix)):
            return child
    return None



def _gpt2_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """GPT-2 family ``c_attn`` (Conv1D, weight stored ``in x out``): outputs ``[q | k | v]``.

    Cross-attention modules read q from ``q_attn`` and k from the first half of ``c_attn``.
    """
    if not (
        class_is(attn, "GPT2Attention", "DecisionTransformerGPT2Attention", "ImageGPTAttention")
        or class_is(attn, "Attention", module_suffix="modeling_openai")
    ):
        return None
    c_attn = child_projection(attn, path, "c_attn")
    if c_attn is None:
        return None
    head_dim = _int(getattr(attn, "head_dim", None))
    num_heads = _int(getattr(attn, "num_heads", None), getattr(attn, "n_head", None))
    if head_dim is None and num_heads:
        head_dim = c_attn.in_features // num_heads
    if head_dim is None:
        return None
    if getattr(attn, "is_cross_attention", False):
        q = child_projection(attn, path, "q_attn")
        if q is None or c_attn.out_features != 2 * q.out_features or c_attn.in_features != q.in_features:
            return None  # (an encoder of another width would make W_qk non-square)
        h, d, q_out = q.out_features // head_dim, q.in_features, q.out_features

        def cross_split(get: ParamGetter) -> tuple[Tensor, Tensor]:
            k = c_attn.weight(get)[:q_out]
            return q.weight(get).reshape(h, head_dim, d), k.reshape(h, head_dim, d)

        return QKLayout(q.param_names + c_attn.param_names, h, h, head_dim, d, cross_split)
    h = c_attn.out_features // (3 * head_dim)
    return contiguous_qkv(c_attn, h, h, head_dim)


def _gpt_bigcode_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """GPTBigCode ``c_attn`` (nn.Linear): multi-query ``[q | k | v]`` with one KV head,
    otherwise per-head interleaved ``(H, 3, dh)``. Cross-attention is not supported."""
    if not class_is(attn, "GPTBigCodeAttention") or getattr(attn, "is_cross_attention", False):
        return None
    c_attn = child_projection(attn, path, "c_attn")
    num_heads, head_dim = _int(getattr(attn, "num_heads", None)), _int(getattr(attn, "head_dim", None))
    if c_attn is None or num_heads is None or head_dim is None:
        return None
    if getattr(attn, "multi_query", False):
        return contiguous_qkv(c_attn, num_heads, 1, head_dim)
    return interleaved_qkv(c_attn, num_heads, head_dim)


#: Attention classes whose fused projection is per-head interleaved ``(H, 3, dh)``.
_INTERLEAVED: dict[str, tuple[str, str | None]] = {
    "GPTNeoXAttention": ("query_key_value", None),
    "GPTNeoXJapaneseAttention": ("query_key_value", None),
    "PersimmonAttention": ("query_key_value", None),
    "BloomAttention": ("query_key_value", None),
    "DisentangledSelfAttention": ("in_proj", "deberta.modeling_deberta"),  # DeBERTa v1 only
}


def _interleaved_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """GPT-NeoX/Pythia, GPT-NeoX-Japanese, Persimmon, BLOOM ``query_key_value`` and DeBERTa(v1)
    ``in_proj``: the output is viewed as ``(H, 3*dh)`` and chunked, so rows are ``(H, 3, dh)``."""
    config = getattr(attn, "config", None) or config
    name = _by_class(attn, _INTERLEAVED)
    if name is None:
        return None
    proj = child_projection(attn, path, name)
    if proj is None:
        return None
    head_dim = _int(
        getattr(attn, "head_dim", None), getattr(attn, "head_size", None), getattr(attn, "attention_head_size", None)
    )
    num_heads = _int(
        getattr(attn, "num_heads", None),
        getattr(attn, "num_attention_heads", None),
        getattr(config, "num_attention_heads", None),
        getattr(config, "n_head", None),
    )
    if head_dim is None and num_heads:
        head_dim = proj.out_features // (3 * num_heads)
    if head_dim is None:
        return None
    return interleaved_qkv(proj, proj.out_features // (3 * head_dim), head_dim)


def _falcon_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """Falcon ``query_key_value``: ``new_decoder_architecture`` groups rows per KV head
    ``(Hkv, H/Hkv + 2, dh)``; ``multi_query`` is ``[q | k | v]`` with one KV head; otherwise
    per-head interleaved ``(H, 3, dh)``."""
    if not class_is(attn, "FalconAttention", "FalconFlashAttention2"):
        return None
    proj = child_projection(attn, path, "query_key_value")
    num_heads, head_dim = _int(getattr(attn, "num_heads", None)), _int(getattr(attn, "head_dim", None))
    if proj is None or num_heads is None or head_dim is None:
        return None
    if getattr(attn, "new_decoder_architecture", False):
        num_kv = _int(getattr(attn, "num_kv_heads", None), getattr(config, "num_kv_heads", None))
        return grouped_qkv(proj, num_heads, num_kv, head_dim) if num_kv else None
    if getattr(attn, "multi_query", False):
        return contiguous_qkv(proj, num_heads, 1, head_dim)
    return interleaved_qkv(proj, num_heads, head_dim)


#: Attention classes whose fused projection is ``[q | k | v]`` (GQA sizes allowed):
#: class name -> (child, defining Python module suffix or None).
_CONTIGUOUS: dict[str, tuple[str, str | None]] = {
    "ModernBertAttention": ("Wqkv", None),
    "Phi3Attention": ("qkv_proj", None),
    "Phi4MultimodalAttention": ("qkv_proj", None),
    "MptAttention": ("Wqkv", None),
    "DbrxAttention": ("Wqkv", None),
    # vision towers: qkv(x).reshape(..., 3, H, dh)
    "BlipAttention": ("qkv", None),
    "Blip2Attention": ("qkv", None),
    "InstructBlipAttention": ("qkv", None),
    "InstructBlipVideoAttention": ("qkv", None),
    "VisionAttention": ("qkv", "qwen2_vl.modeling_qwen2_vl"),
    "Qwen2_5_VLVisionAttention": ("qkv", None),
    "Glm4vVisionAttention": ("qkv", None),
    "VitDetAttention": ("qkv", None),
    "TimesformerSelfAttention": ("qkv", None),
    "SamVisionAttention": ("qkv", None),
}


def _contiguous_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """ModernBERT ``Wqkv`` (viewed ``(3, H, dh)``), Phi-3 ``qkv_proj``, MPT/DBRX ``Wqkv`` and
    the ``qkv`` of BLIP/Qwen-VL/SAM/ViTDet/TimeSformer vision blocks: rows ``[q | k | v]``,
    each block head-major."""
    config = getattr(attn, "config", None) or config
    name = _by_class(attn, _CONTIGUOUS)
    proj = child_projection(attn, path, name) if name else None
    if proj is None:
        return None
    head_dim = _int(getattr(attn, "head_dim", None))
    num_heads = _int(
        getattr(attn, "num_heads", None),
        getattr(attn, "n_heads", None),
        getattr(attn, "num_attention_heads", None),
        getattr(config, "num_attention_heads", None),
        getattr(config, "n_heads", None),
    )
    if head_dim is None and num_heads:
        head_dim = proj.in_features // num_heads
    if head_dim is None or num_heads is None:
        return None
    num_kv = _int(getattr(attn, "num_key_value_heads", None), getattr(attn, "kv_n_heads", None))
    if num_kv is None:
        num_kv = (proj.out_features // head_dim - num_heads) // 2
    return contiguous_qkv(proj, num_heads, num_kv, head_dim)


def _codegen_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """CodeGen ``qkv_proj``: rows form ``mp_num = 4`` blocks, each ``[q | v | k]`` of ``H/4`` heads;
    query head ``h`` lives in block ``h // (H/4)``."""
    if not class_is(attn, "CodeGenAttention"):
        return None
    proj = child_projection(attn, path, "qkv_proj")
    num_heads = _int(getattr(attn, "num_attention_heads", None))
    head_dim = _int(getattr(attn, "head_dim", None))
    mp_num = 4  # hard-coded in transformers' CodeGenAttention.forward
    if proj is None or num_heads is None or head_dim is None or num_heads % mp_num:
        return None
    d, local = proj.in_features, num_heads // mp_num
    if proj.out_features != 3 * num_heads * head_dim:
        return None

    def split(get: ParamGetter) -> tuple[Tensor, Tensor]:
        w = proj.weight(get).reshape(mp_num, 3, local, head_dim, d)  # 3 = (q, v, k)
        return w[:, 0].reshape(num_heads, head_dim, d), w[:, 2].reshape(num_heads, head_dim, d)

    return QKLayout(proj.param_names, num_heads, num_heads, head_dim, d, split)


def _torch_mha_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """``torch.nn.MultiheadAttention``: ``in_proj_weight`` rows ``[q | k | v]``, or separate
    ``q_proj_weight``/``k_proj_weight`` when key/value widths differ."""
    if not isinstance(attn, nn.MultiheadAttention):
        return None
    prefix = f"{path}." if path else ""
    h, dh, d = attn.num_heads, attn.head_dim, attn.embed_dim
    if attn.in_proj_weight is not None:
        name = prefix + "in_proj_weight"
        proj = Projection((name,), 3 * d, d, lambda get: get(name))
        return contiguous_qkv(proj, h, h, dh)
    if attn.kdim != d:
        return None  # W_qk would not be square
    q_name, k_name = prefix + "q_proj_weight", prefix + "k_proj_weight"

    def split(get: ParamGetter) -> tuple[Tensor, Tensor]:
        return get(q_name).reshape(h, dh, d), get(k_name).reshape(h, dh, d)

    return QKLayout((q_name, k_name), h, h, dh, d, split)


def _xlnet_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """XLNet: ``q``/``k`` are raw parameters ``(d, H, dh)`` used as ``einsum("ibh,hnd->ibnd")``,
    so ``W_q[n] = q[:, n, :]^T``. Only the content stream's bilinear form is scored (the
    relative-position and segment terms are not part of ``W_qk``)."""
    if not class_is(attn, "XLNetRelativeAttention"):
        return None
    num_heads, head_dim, d = (_int(getattr(attn, a, None)) for a in ("n_head", "d_head", "d_model"))
    if num_heads is None or head_dim is None or d is None:
        return None
    prefix = f"{path}." if path else ""
    q_name, k_name = prefix + "q", prefix + "k"

    def split(get: ParamGetter) -> tuple[Tensor, Tensor]:
        shape = (d, num_heads, head_dim)
        return get(q_name).reshape(shape).permute(1, 2, 0), get(k_name).reshape(shape).permute(1, 2, 0)

    return QKLayout((q_name, k_name), num_heads, num_heads, head_dim, d, split)



#: Fused layouts, tried in order on every module: ``(module, path, config) -> QKLayout | None``.
#: Each one is keyed narrowly (attention class name) so it never misfires on another model.
FUSED_LAYOUTS: list[Callable[[nn.Module, str, Any], QKLayout | None]] = [
    _gpt2_layout,
    _gpt_bigcode_layout,
    _interleaved_layout,
    _falcon_layout,
    _contiguous_layout,
    _codegen_layout,
    _torch_mha_layout,
    _xlnet_layout,
    timm_layout,
    litgpt_layout,
    torchtitan_layout,
    nanogpt_layout,
]


#: class tables behind some fused layouts (listed by :func:`describe_layouts`)
_LAYOUT_CLASSES: dict[str, dict[str, tuple[str, str | None]]] = {
    "_interleaved_layout": _INTERLEAVED,
    "_contiguous_layout": _CONTIGUOUS,
}


def describe_layouts() -> list[tuple[str, str]]:
    """``(name, description)`` of every built-in layout, read from the registry itself
    (:data:`SEPARATE_QK_NAMES`, :data:`FUSED_LAYOUTS` and their docstrings and class tables):
    what ``attn-probe models`` prints, so it never drifts from the code."""
    pairs = ", ".join(f"({q}, {k})" for q, k in SEPARATE_QK_NAMES)
    rows = [("separate projections", f"two child projections named {pairs}; heads from the module or config. "
             "A projection is an nn.Linear, a transformers Conv1D, a PEFT LoRA wrapper or a torchtune "
             "LoRALinear/DoRALinear (QLoRA's NF4 base dequantized), in the adapter state in force "
             "(torchtune Llama-style MultiHeadAttention: q_proj/k_proj). Query head h meets KV head "
             "h // (H/Hkv), except in x-transformers' Attention (to_q/to_k), whose forward tiles its keys "
             "(h % Hkv): they are read tiled, one per query head.")]
    for fn in FUSED_LAYOUTS:
        text = " ".join((fn.__doc__ or "").split("\n\n")[0].split())
        table = _LAYOUT_CLASSES.get(fn.__name__)
        if table:
            text += " Classes: " + ", ".join(f"{c}.{child}" for c, (child, _) in table.items()) + "."
        rows.append((fn.__name__.strip("_").removesuffix("_layout"), text))
    return rows


#: Layouts registered with :func:`attn_probe.register_adapter`; tried before everything else.
USER_ADAPTERS: list[Callable[[nn.Module, str, Any], QKLayout | None]] = []


def recognise(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """The q/k layout of ``attn``: user adapters, then separate projections, then :data:`FUSED_LAYOUTS`;
    the built-in ones are checked against the head counts the module states (:func:`check_head_counts`)."""
    for adapter in USER_ADAPTERS:
        layout = adapter(attn, path, config)
        if layout is not None:
            return layout
    layout = separate_layout(attn, path, config)
    if layout is None:
        layout = next(filter(None, (fused(attn, path, config) for fused in FUSED_LAYOUTS)), None)
    return None if layout is None else check_head_counts(attn, path, layout)


def group_of(path: str, is_encoder_decoder: bool) -> str:
    """``cross`` for cross-attention, ``encoder``/``decoder`` in encoder-decoder models, else ``self``."""
    low = path.lower()
    if any(m in low for m in CROSS_ATTENTION_MARKERS):
        return "cross"
    if is_encoder_decoder:
        parts = low.split(".")
        if any(p.startswith("decoder") for p in parts):
            return "decoder"
        if any(p.startswith("encoder") for p in parts):
            return "encoder"
    return "self"


def _mro_names(obj: object) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


_MODULE_WRAPPERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine")


def unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP/DataParallel (``.module``), ``torch.compile`` (``._orig_mod``) and PEFT wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        elif type(model).__name__ in _MODULE_WRAPPERS and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        elif "PeftModel" in _mro_names(model) and isinstance(getattr(model, "base_model", None), nn.Module):
            model = model.base_model  # PeftModel -> LoraModel (a BaseTuner)
        elif "BaseTuner" in _mro_names(model) and isinstance(getattr(model, "model", None), nn.Module):
            model = model.model  # LoraModel -> the transformers model
    return model


__all__ = [
    "SEPARATE_QK_NAMES",
    "FUSED_LAYOUTS",
    "USER_ADAPTERS",
    "contiguous_qkv",
    "interleaved_qkv",
    "grouped_qkv",
    "Projection",
    "QKLayout",
    "projection",
    "attached_adapters",
    "recognise",
    "separate_layout",
    "check_head_counts",
    "group_of",
    "unwrap",
    "describe_layouts",
    "child_projection",
    "class_is",
    "is_lora",
]
