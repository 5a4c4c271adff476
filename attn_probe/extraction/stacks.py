"""Layouts of the stacks research code trains with, outside Hugging Face: nanoGPT-style, timm,
LitGPT and torchtitan attention, and x-transformers' key-head pairing (:func:`tiles_keys`). Each is a fused layout of :data:`attn_probe.extraction.architectures.FUSED_LAYOUTS`
(listed there, in the order they are tried), keyed on the module's class and attributes, and was
checked against the q/k the module's own forward computes (``tests/extraction/test_research_layouts.py``,
``tests/extraction/test_stack_layouts.py``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import QKLayout
from .heads import first_int as _int
from .projections import child_projection
from .rows import class_is, contiguous_qkv, grouped_qkv, pair_qk


def nanogpt_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
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


def timm_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
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


def litgpt_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
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


def torchtitan_layout(attn: nn.Module, path: str, config: Any) -> QKLayout | None:
    """torchtitan 0.3 ``GQAttention`` (Llama 3, Qwen 3, ...; read from torchtitan 0.3.0): its ``qkv_linear``
    is a ``FusedQKVLinear`` (the default, ``fuse_qkv=True``) whose one ``wqkv`` has rows grouped per KV head,
    ``(n_kv_heads, H/Hkv + 2, dh)``: the group's queries, then its key, then its value; or a ``QKVLinear`` with
    separate ``wq``/``wk``/``wv``. Counts from the module's ``n_heads``, ``n_kv_heads`` and ``head_dim``; query
    head ``h`` meets KV head ``h // (H/Hkv)`` (SDPA's ``enable_gqa``)."""
    if not class_is(attn, "GQAttention"):
        return None
    qkv = getattr(attn, "qkv_linear", None)
    heads, head_dim = _int(getattr(attn, "n_heads", None)), _int(getattr(attn, "head_dim", None))
    num_kv = _int(getattr(attn, "n_kv_heads", None)) or heads
    if not isinstance(qkv, nn.Module) or heads is None or head_dim is None or heads % num_kv:
        return None
    inner = f"{path}.qkv_linear" if path else "qkv_linear"
    if class_is(qkv, "FusedQKVLinear"):
        wqkv = child_projection(qkv, inner, "wqkv")
        if wqkv is None or _int(getattr(qkv, "heads_per_kv", None)) != heads // num_kv:
            return None
        return grouped_qkv(wqkv, heads, num_kv, head_dim)
    if class_is(qkv, "QKVLinear"):
        q, k = child_projection(qkv, inner, "wq"), child_projection(qkv, inner, "wk")
        return None if q is None or k is None else pair_qk(q, k, heads, num_kv, head_dim)
    return None


def tiles_keys(attn: nn.Module) -> bool:
    """Whether ``attn``'s forward *tiles* its KV heads over the query heads, so query head ``h`` meets KV
    head ``h % Hkv`` (not ``h // (H/Hkv)``, the ``repeat_kv``/``repeat_interleave``/``enable_gqa`` pairing
    of every other layout). x-transformers' ``Attention`` (``attn_kv_heads``/``kv_heads``; read from
    x-transformers 2.31.10, ``x_transformers.attend.Attend.forward``) expands its keys with einops
    ``repeat(k, 'b kvh n d -> b (r kvh) n d')``. Its ``to_q``/``to_k`` are otherwise separate projections
    (:func:`attn_probe.extraction.architectures.separate_layout` reads them and tiles the keys)."""
    return any(c.__name__ == "Attention" and c.__module__.startswith("x_transformers.") for c in type(attn).__mro__)


__all__ = ["nanogpt_layout", "timm_layout", "litgpt_layout", "torchtitan_layout", "tiles_keys"]
