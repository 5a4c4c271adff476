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
  four ``[q, v, k]`` blocks, ``torch.nn.MultiheadAttention``, timm's ``Attention`` (``qkv``),
  LitGPT's ``CausalSelfAttention`` (``qkv``, GQA) and nanoGPT-style ``c_attn`` with ``n_head``.

A projection may be an ``nn.Linear``, a transformers ``Conv1D`` (weight stored ``in x out``,
transposed here) or a PEFT LoRA wrapper (the effective weight ``W + scale * B @ A`` in the
adapter state of the moment the weights are read). Head counts come from module attributes and
the config, never from weight shapes alone, and every ``split`` reads weights only through its
getter. See
``docs/supported-models.md`` for the tested model types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from .base import ParamGetter, Tensor, UnsupportedModelError

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


# --------------------------------------------------------------------------- projections
@dataclass(frozen=True)
class Projection:
    """How to read the effective ``(out, in)`` weight of one projection module."""

    param_names: tuple[str, ...]
    out_features: int
    in_features: int
    weight: Callable[[ParamGetter], Tensor]


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def is_lora(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT LoRA wrapper (its weight is ``base_layer`` plus the adapter)."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")


def projection(module: nn.Module, path: str) -> Projection | None:
    """A :class:`Projection` for ``module`` at ``path``, or ``None`` if it is not linear."""
    prefix = f"{path}." if path else ""
    if is_lora(module):
        return _lora_projection(module, path, prefix)
    if isinstance(module, nn.Linear):
        weight = getattr(module, "weight", None)
        if weight is not None and not weight.is_floating_point():
            raise UnsupportedModelError(
                f"{path}: weight is quantized ({type(weight).__name__}, {weight.dtype}); "
                "attn_probe reads floating-point projection weights only (dequantize or merge first)"
            )
        name = f"{prefix}weight"
        return Projection((name,), module.out_features, module.in_features, lambda get: get(name))
    if _is_conv1d(module):
        name = f"{prefix}weight"
        return Projection((name,), module.nf, module.nx, lambda get: get(name).T)
    return None


def _lora_projection(module: nn.Module, path: str, prefix: str) -> Projection | None:
    """A PEFT LoRA wrapper: declares the base weight and every attached adapter's A/B (so a sharded
    walk gathers whichever is active); the adapter state is read each time the weight is."""
    base = projection(module.base_layer, f"{prefix}base_layer")
    if base is None:
        return None
    _applied_adapters(module, path)  # DoRA in use: refused now, not at the first snapshot
    declared = [a for a in module.lora_A if a in module.lora_B]
    factors = {a: (f"{prefix}lora_A.{a}.weight", f"{prefix}lora_B.{a}.weight") for a in declared}

    def lora_weight(get: ParamGetter) -> Tensor:
        w = base.weight(get)
        sign, adapters = _applied_adapters(module, path)
        for a in adapters:
            if a not in factors:
                raise UnsupportedModelError(
                    f"{path}: adapter {a!r} was added after its layer was found; find the layers again"
                )
            a_name, b_name = factors[a]
            w = w + sign * float(module.scaling[a]) * (get(b_name).to(w.dtype) @ get(a_name).to(w.dtype))
        return w

    names = base.param_names + tuple(n for pair in factors.values() for n in pair)
    return Projection(names, base.out_features, base.in_features, lora_weight)


def _applied_adapters(module: nn.Module, path: str) -> tuple[float, list[str]]:
    """``(sign, adapters)``: the deltas ``scale * B A`` to add to the base weight now, as PEFT's
    forward computes. Merged: none (the base weight holds them). Disabled: the merged ones are
    taken out (the forward unmerges them first). Otherwise: the active adapters."""
    if getattr(module, "disable_adapters", False):
        sign, adapters = -1.0, list(getattr(module, "merged_adapters", []))
    elif getattr(module, "merged", False):
        sign, adapters = 1.0, []
    else:
        active = getattr(module, "active_adapters", None)
        if active is None:
            active = getattr(module, "active_adapter", [])
        sign, adapters = 1.0, [a for a in ([active] if isinstance(active, str) else active) if a in module.lora_A]
    variants = getattr(module, "lora_variant", {})
    for a in adapters:
        dora = getattr(module, "use_dora", {}).get(a, False)
        if dora or a in variants:
            kind = "DoRA" if dora else type(variants[a]).__name__
            raise UnsupportedModelError(
                f"{path}: {kind} adapters are not supported; merge them first (model.merge_and_unload())"
            )
    return sign, adapters


def attached_adapters(attn: nn.Module) -> Callable[[], tuple[tuple[str, ...], ...]]:
    """A cheap callable naming the adapters attached to each LoRA projection under ``attn`` (the
    projections are found once, here): when its value changes, the layer's ``param_names`` are stale."""
    loras = [m for m in attn.modules() if is_lora(m)]
    return lambda: tuple(tuple(m.lora_A) for m in loras)


# --------------------------------------------------------------------------- head counts
_HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "d_kv", "key_value_proj_dim", "dim_per_head",
                   "dim_head")
_NUM_HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "n_heads_q", "heads", "nheads")
_CONFIG_HEAD_ATTRS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads")


def _int_attr(obj: Any, names: tuple[str, ...]) -> int | None:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def infer_head_dim(attn: nn.Module, config: Any, q_out: int, k_out: int) -> int | None:
    """Head size from the attention module, then the model config, then ``q_out / num_heads``."""
    head_dim = _int_attr(attn, _HEAD_DIM_ATTRS)
    if head_dim is None:
        num_heads = _int_attr(attn, _NUM_HEADS_ATTRS)
        if num_heads:
            head_dim = q_out // num_heads
    if head_dim is None and config is not None:
        head_dim = _int_attr(config, ("head_dim", "d_kv", "attention_head_size"))
        if head_dim is None:
            n = _int_attr(config, _CONFIG_HEAD_ATTRS)
            if n:
                head_dim = q_out // n
    if head_dim and q_out % head_dim == 0 and k_out % head_dim == 0:
        return head_dim
    return None


_KV_HEADS_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads")


def _config_count(config: Any, name: str) -> int | None:
    """``config.<name>`` when it is the config's own field (not an alias such as BART's
    ``num_attention_heads -> encoder_attention_heads``, which may not describe this module)."""
    if config is None or name in (getattr(type(config), "attribute_map", None) or {}):
        return None
    try:
        return _int(getattr(config, name, None))
    except Exception:  # noqa: BLE001 - per-layer heterogeneous configs refuse global reads
        return None


def stated_head_counts(attn: nn.Module) -> tuple[int | None, int | None]:
    """``(query heads, KV heads)`` the attention module states (its attributes, then its own
    ``config``), ``None`` where it states nothing."""
    config = getattr(attn, "config", None)
    heads = _int_attr(attn, _NUM_HEADS_ATTRS) or _config_count(config, "num_attention_heads")
    kv = _int_attr(attn, _KV_HEADS_ATTRS)
    groups = _int(getattr(attn, "num_key_value_groups", None))
    if kv is None and groups and heads and heads % groups == 0:
        kv = heads // groups
    if kv is None:
        kv = _config_count(config, "num_key_value_heads")
    return heads, kv


def check_head_counts(attn: nn.Module, path: str, layout: QKLayout) -> QKLayout:
    """``layout`` if its head counts agree with those ``attn`` states, else
    :class:`UnsupportedModelError`: a wrong count pairs queries with the wrong keys silently."""
    heads, kv = stated_head_counts(attn)
    if (heads is None or heads == layout.num_heads) and (kv is None or kv == layout.num_kv_heads):
        return layout
    raise UnsupportedModelError(
        f"{path} ({type(attn).__name__}): attn_probe read {layout.num_heads} query heads and "
        f"{layout.num_kv_heads} KV heads of size {layout.head_dim} from its projections, but the module "
        f"states num_attention_heads={heads}, num_key_value_heads={kv}; the projections hold something "
        "else besides the per-head queries/keys (e.g. a gate) in a layout attn_probe does not know. "
        "Describe it with attn_probe.register_adapter(fn) (`attn-probe models` prints the recipe)."
    )


# --------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class QKLayout:
    """Result of recognising one attention module: ``split(get) -> (A (H, dh, d), B (H_kv, dh, d))``.

    The one layout type of both pairs: W_q/W_k here, W_o^T/W_v for the OV pair
    (:func:`attn_probe.extraction.ov.ov_layout`, ``labels=("W_o", "W_v")``).
    """

    param_names: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    split: Callable[[ParamGetter], tuple[Tensor, Tensor]]
    #: the factors' names, for errors
    labels: tuple[str, str] = ("W_q", "W_k")

    def factors(self, get: ParamGetter) -> tuple[Tensor, Tensor]:
        """:attr:`split`, checked against the stated shapes (``ValueError`` otherwise)."""
        a, b = self.split(get)
        expected = ((self.num_heads, self.head_dim, self.hidden_size),
                    (self.num_kv_heads, self.head_dim, self.hidden_size))
        if (tuple(a.shape), tuple(b.shape)) != expected:
            raise ValueError(f"extracted {self.labels[0]} {tuple(a.shape)} / {self.labels[1]} {tuple(b.shape)}, "
                             f"expected {expected}")
        return a, b


#: Attention classes whose ``q_proj`` also computes a per-head output gate: its output is viewed
#: ``(..., H, 2*dh)`` and chunked into (query, gate), so its rows are ``(H, 2, dh)`` and only
#: ``[:, 0]`` meets the keys (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Qwen4-Exp).
GATED_QUERY_CLASSES = ("Qwen3NextAttention", "Qwen3_5Attention", "Qwen3_5MoeAttention", "Qwen4ExpTextAttention")


def separate_layout(
    attn: nn.Module, path: str, config: Any, names: list[tuple[str, str]] | None = None
) -> QKLayout | None:
    """Layout of a module with separate q and k projection children, if it has them."""
    children = dict(attn.named_children())
    slots = 2 if class_is(attn, *GATED_QUERY_CLASSES) else 1  # rows per query head: (query[, gate])
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

        def split(get: ParamGetter, q=q, k=k, h=num_heads, hk=num_kv, dh=head_dim, d=d, slots=slots):
            return q.weight(get).reshape(h, slots, dh, d)[:, 0], k.weight(get).reshape(hk, dh, d)

        return QKLayout(q.param_names + k.param_names, num_heads, num_kv, head_dim, d, split)
    return None


def child_projection(attn: nn.Module, path: str, name: str) -> Projection | None:
    """The :func:`projection` of ``attn``'s child module ``name`` (``None`` if it has none or it is not linear)."""
    child = getattr(attn, name, None)
    if not isinstance(child, nn.Module):
        return None
    return projection(child, f"{path}.{name}" if path else name)


def class_is(attn: nn.Module, *names: str, module_suffix: str | None = None) -> bool:
    """Narrow key: the module's class (or a base class, for user subclasses) has one of
    ``names``, optionally defined in a Python module whose name ends with ``module_suffix``."""
    return any(
        cls.__name__ in names and (module_suffix is None or cls.__module__.endswith(module_suffix))
        for cls in type(attn).__mro__
    )


def _by_class(attn: nn.Module, table: dict[str, tuple[str, str | None]]) -> str | None:
    """The fused child name for the module's class (or nearest listed base class); table values
    are ``(child, suffix)`` where ``suffix`` must end the defining module's name if not None."""
    for cls in type(attn).__mro__:
        child, suffix = table.get(cls.__name__, ("", None))
        if child and (suffix is None or cls.__module__.endswith(suffix)):
            return child
    return None


def _int(*values: Any) -> int | None:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def contiguous_qkv(proj: Projection, num_heads: int, num_kv: int, head_dim: int) -> QKLayout | None:
    """Rows ``[q (H*dh) | k (Hkv*dh) | v (Hkv*dh)]``, each block head-major (GPT-2, Phi-3, MPT, ...)."""
    q_out, kv_out, d = num_heads * head_dim, num_kv * head_dim, proj.in_features
    if proj.out_features != q_out + 2 * kv_out or num_heads % num_kv:
        return None

    def split(get: ParamGetter) -> tuple[Tensor, Tensor]:
        w = proj.weight(get)
        return w[:q_out].reshape(num_heads, head_dim, d), w[q_out : q_out + kv_out].reshape(num_kv, head_dim, d)

    return QKLayout(proj.param_names, num_heads, num_kv, head_dim, d, split)


def interleaved_qkv(proj: Projection, num_heads: int, head_dim: int) -> QKLayout | None:
    """Rows grouped per head, ``(H, 3, dh)``: ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (GPT-NeoX, BLOOM, ...)."""
    d = proj.in_features
    if proj.out_features != 3 * num_heads * head_dim:
        return None

    def split(get: ParamGetter) -> tuple[Tensor, Tensor]:
        w = proj.weight(get).reshape(num_heads, 3, head_dim, d)
        return w[:, 0], w[:, 1]

    return QKLayout(proj.param_names, num_heads, num_heads, head_dim, d, split)


def grouped_qkv(proj: Projection, num_heads: int, num_kv: int, head_dim: int) -> QKLayout | None:
    """Rows grouped per KV head, ``(Hkv, H/Hkv + 2, dh)``: the group's queries, then its k, then its v
    (Falcon ``new_decoder_architecture``)."""
    d = proj.in_features
    if num_heads % num_kv or proj.out_features != (num_heads + 2 * num_kv) * head_dim:
        return None
    per = num_heads // num_kv

    def split(get: ParamGetter) -> tuple[Tensor, Tensor]:
        w = proj.weight(get).reshape(num_kv, per + 2, head_dim, d)
        return w[:, :per].reshape(num_heads, head_dim, d), w[:, per]

    return QKLayout(proj.param_names, num_heads, num_kv, head_dim, d, split)


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


def _nanogpt_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """nanoGPT-style ``CausalSelfAttention`` (Karpathy's nanoGPT and the research code built on it):
    a ``c_attn`` ``nn.Linear(n_embd, 3 * n_embd)`` split as ``c_attn(x).split(n_embd, dim=2)`` into
    ``[q | k | v]``, each viewed ``(n_head, n_embd // n_head)``. Keyed on the structure (any class
    name): an ``nn.Linear`` child ``c_attn`` (not GPT-2's Conv1D) and int ``n_head`` and ``n_embd``
    with ``c_attn`` of width ``n_embd -> 3 * n_embd``."""
    c_attn = getattr(attn, "c_attn", None)
    num_heads, d = _int(getattr(attn, "n_head", None)), _int(getattr(attn, "n_embd", None))
    if not isinstance(c_attn, nn.Module) or num_heads is None or d is None or d % num_heads:
        return None
    if not isinstance(getattr(c_attn, "base_layer", c_attn), nn.Linear):  # (a LoRA wrapper reads its base)
        return None
    proj = child_projection(attn, path, "c_attn")
    if proj is None or proj.in_features != d or proj.out_features != 3 * d:
        return None
    return contiguous_qkv(proj, num_heads, num_heads, d // num_heads)


def _timm_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """timm's ``Attention`` (ViT, DeiT and the ViTs built on them: ``timm.layers.attention`` and the older
    ``timm.models.vision_transformer``): ``qkv(x).reshape(B, N, 3, num_heads, head_dim)``, so rows
    ``[q | k | v]``, each head-major; ``head_dim`` from the module (timm >= 1.0) or
    ``qkv.out_features / (3 * num_heads)``."""
    if not any(c.__name__ == "Attention" and c.__module__.startswith("timm.") for c in type(attn).__mro__):
        return None
    proj = child_projection(attn, path, "qkv")
    num_heads = _int(getattr(attn, "num_heads", None))
    if proj is None or num_heads is None or proj.out_features % (3 * num_heads):
        return None
    head_dim = _int(getattr(attn, "head_dim", None)) or proj.out_features // (3 * num_heads)
    return contiguous_qkv(proj, num_heads, num_heads, head_dim)


def _litgpt_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """LitGPT ``CausalSelfAttention`` (``litgpt.model``, read from litgpt 0.5.13): ``qkv`` is
    ``nn.Linear(n_embd, (n_head + 2 * n_query_groups) * head_size)`` split as
    ``(n_head * head_size, n_query_groups * head_size, n_query_groups * head_size)`` into ``[q | k | v]``,
    each head-major; keys are ``repeat_interleave``-d, so query head ``h`` meets KV head
    ``h // (n_head / n_query_groups)``. Counts come from the module's ``config``. (Versions before
    the ``qkv`` rename stored ``attn`` grouped per query group; those are not recognised.)"""
    if not any(c.__name__ == "CausalSelfAttention" and c.__module__.startswith("litgpt.")
               for c in type(attn).__mro__):
        return None
    cfg = getattr(attn, "config", None)
    num_heads, num_kv, head_dim = (_int(getattr(cfg, a, None)) for a in ("n_head", "n_query_groups", "head_size"))
    proj = child_projection(attn, path, "qkv")
    if proj is None or num_heads is None or num_kv is None or head_dim is None:
        return None
    return contiguous_qkv(proj, num_heads, num_kv, head_dim)


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
    _timm_layout,
    _litgpt_layout,
    _nanogpt_layout,
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
    rows = [("separate projections", f"two child projections named {pairs}; heads from the module or config")]
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
]
