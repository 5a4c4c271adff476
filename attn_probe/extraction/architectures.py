"""Architecture knowledge: the one place that knows module names and weight layouts.

Two kinds of layout are recognised:

* *separate projections*: an attention module with two child projections named like
  ``(q_proj, k_proj)``, ``(query, key)``, ``(q_lin, k_lin)``, ... (see :data:`SEPARATE_QK_NAMES`);
* *fused projections*: a single child holding q, k and v, with a layout function per
  architecture (see :data:`FUSED_LAYOUTS`).

A projection may be an ``nn.Linear``, a transformers ``Conv1D`` (weight stored ``in x out``)
or a PEFT LoRA wrapper (the effective weight ``W + scale * B @ A`` is scored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from .base import ParamGetter, Tensor

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
]

#: Substrings of a module path that mark cross-attention.
CROSS_ATTENTION_MARKERS = ("crossattention", "cross_attn", "encoder_attn", "encdecattention", "cross_attention")


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


def _is_lora(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")


def projection(module: nn.Module, path: str) -> Projection | None:
    """A :class:`Projection` for ``module`` at ``path``, or ``None`` if it is not linear."""
    prefix = f"{path}." if path else ""
    if _is_lora(module):
        base = projection(module.base_layer, f"{prefix}base_layer")
        if base is None:
            return None
        if getattr(module, "merged", False):
            return base
        adapters = [a for a in _active_adapters(module) if a in module.lora_A and a in module.lora_B]
        names = list(base.param_names)
        terms = []
        for a in adapters:
            a_name, b_name = f"{prefix}lora_A.{a}.weight", f"{prefix}lora_B.{a}.weight"
            names += [a_name, b_name]
            terms.append((a_name, b_name, float(module.scaling[a])))

        def lora_weight(get: ParamGetter, base=base, terms=tuple(terms)) -> Tensor:
            w = base.weight(get)
            for a_name, b_name, scale in terms:
                w = w + scale * (get(b_name).to(w.dtype) @ get(a_name).to(w.dtype))
            return w

        return Projection(tuple(names), base.out_features, base.in_features, lora_weight)
    if isinstance(module, nn.Linear):
        name = f"{prefix}weight"
        return Projection((name,), module.out_features, module.in_features, lambda get: get(name))
    if _is_conv1d(module):
        name = f"{prefix}weight"
        return Projection((name,), module.nf, module.nx, lambda get: get(name).T)
    return None


def _active_adapters(module: nn.Module) -> list[str]:
    active = getattr(module, "active_adapters", None)
    if active is None:
        active = getattr(module, "active_adapter", [])
    if isinstance(active, str):
        active = [active]
    disabled = getattr(module, "disable_adapters", False)
    return [] if disabled else list(active)


# --------------------------------------------------------------------------- head counts
_HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "d_kv", "key_value_proj_dim", "dim_per_head")
_NUM_HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "n_heads_q")
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


# --------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class QKLayout:
    """Result of recognising one attention module."""

    param_names: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    split: Callable[[ParamGetter], tuple[Tensor, Tensor]]


def separate_layout(
    attn: nn.Module, path: str, config: Any, names: list[tuple[str, str]] | None = None
) -> QKLayout | None:
    """Layout of a module with separate q and k projection children, if it has them."""
    children = dict(attn.named_children())
    for q_name, k_name in names if names is not None else SEPARATE_QK_NAMES:
        if q_name not in children or k_name not in children:
            continue
        prefix = f"{path}." if path else ""
        q = projection(children[q_name], prefix + q_name)
        k = projection(children[k_name], prefix + k_name)
        if q is None or k is None or q.in_features != k.in_features:
            continue
        head_dim = infer_head_dim(attn, config, q.out_features, k.out_features)
        if head_dim is None:
            continue
        num_heads, num_kv = q.out_features // head_dim, k.out_features // head_dim
        if num_heads % num_kv:
            continue
        d = q.in_features

        def split(get: ParamGetter, q=q, k=k, h=num_heads, hk=num_kv, dh=head_dim, d=d):
            return q.weight(get).reshape(h, dh, d), k.weight(get).reshape(hk, dh, d)

        return QKLayout(q.param_names + k.param_names, num_heads, num_kv, head_dim, d, split)
    return None


def _gpt2_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """GPT-2 ``c_attn``: Conv1D ``(d, 3d)``; output features are ``[q | k | v]``, heads contiguous."""
    child = getattr(attn, "c_attn", None)
    if child is None or getattr(attn, "is_cross_attention", False):
        return None
    prefix = f"{path}." if path else ""
    proj = projection(child, prefix + "c_attn")
    if proj is None:
        return None
    d = proj.in_features
    # GPTBigCode multi-query: out = d + 2 * head_dim
    q_out = d
    kv_out = (proj.out_features - q_out) // 2
    head_dim = infer_head_dim(attn, config, q_out, kv_out)
    if head_dim is None or q_out + 2 * kv_out != proj.out_features:
        return None
    h, hk = q_out // head_dim, kv_out // head_dim

    def split(get: ParamGetter):
        w = proj.weight(get)
        return w[:q_out].reshape(h, head_dim, d), w[q_out : q_out + kv_out].reshape(hk, head_dim, d)

    return QKLayout(proj.param_names, h, hk, head_dim, d, split)


#: Fused layouts, tried in order on every module: ``(module, path, config) -> QKLayout | None``.
FUSED_LAYOUTS: list[Callable[[nn.Module, str, Any], QKLayout | None]] = [_gpt2_layout]


def recognise(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """The q/k layout of ``attn`` if it is an attention module attn_probe understands."""
    layout = separate_layout(attn, path, config)
    if layout is not None:
        return layout
    for fused in FUSED_LAYOUTS:
        layout = fused(attn, path, config)
        if layout is not None:
            return layout
    return None


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


def unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP/DataParallel (``.module``), ``torch.compile`` (``._orig_mod``) and PEFT wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        elif type(model).__name__ in ("DistributedDataParallel", "DataParallel") and hasattr(model, "module"):
            model = model.module
        elif hasattr(model, "peft_config") and hasattr(model, "base_model") and model.base_model is not model:
            model = model.base_model  # PeftModel -> LoraModel
        elif hasattr(model, "peft_config") and isinstance(getattr(model, "model", None), nn.Module):
            model = model.model  # LoraModel -> the transformers model
    return model


__all__ = [
    "SEPARATE_QK_NAMES",
    "FUSED_LAYOUTS",
    "Projection",
    "QKLayout",
    "projection",
    "recognise",
    "separate_layout",
    "group_of",
    "unwrap",
]
