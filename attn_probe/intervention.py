"""Interventions on attention weights. :func:`symmetric_init_` sets ``W_k := W_q`` in every head.

With ``W_k^h = W_q^h`` each head's bilinear form is ``M_h = W_q^h{}^T W_q^h`` (symmetric positive
semi-definite), so the layer matrix ``M = sum_h M_h`` has symmetry score exactly 1. Saponati et
al. (2025) report that encoders started this way reach the baseline's final loss sooner.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import torch
from torch import nn

from .extraction import AttentionLayer, find_attention

__all__ = ["symmetric_init_"]

ModelT = TypeVar("ModelT", bound=nn.Module)


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _check_writable(layer: AttentionLayer, key: torch.Tensor) -> None:
    """``key`` must be a view into one of the layer's stored parameters, or writing it is lost."""
    ptrs = {_storage_ptr(layer.params[n]) for n in layer.param_names if n in layer.params}
    if key.numel() == 0 or _storage_ptr(key) not in ptrs:
        raise ValueError(
            f"symmetric_init_: the key weight of {layer.name!r} ({type(layer.module).__name__}) is computed "
            "from the stored weights, not a view of them, so it cannot be overwritten in place: a "
            "PEFT/LoRA projection W + B A (apply symmetric_init_ to the base model before wrapping it, "
            "or merge the adapters first: model.merge_and_unload()), a fused projection whose rows "
            "are permuted (CodeGen's qkv_proj), or a custom adapter that copies."
        )


def symmetric_init_(
    model: ModelT, *, layers: Iterable[AttentionLayer] | None = None, **find_kwargs: Any
) -> ModelT:
    """Set every attention head's key weight equal to its query weight, in place: ``W_k^h := W_q^h``.

    Only the key projection's weight is written (a copy of the query weight, so the model's own
    initialisation distribution is kept); biases, values and every other parameter are untouched.
    Works through the layer records of :func:`attn_probe.find_attention` (``find_kwargs`` are passed
    to it, ``layers`` overrides it), so separate projections (BERT ``query``/``key``, Llama
    ``q_proj``/``k_proj``, T5 ``q``/``k``, ...) and fused ones (GPT-2 ``c_attn`` ``Conv1D``, ...)
    are handled alike, including cross-attention. Afterwards every layer's ``W_qk`` has symmetry 1.

    Raises ``ValueError`` for grouped-query / multi-query layers (``num_kv_heads < num_heads``):
    several query heads share one key head, so ``W_k = W_q`` per head is not defined. Also raises
    ``ValueError`` when a key weight is computed rather than stored (PEFT/LoRA). Nothing is written
    unless every layer passes these checks. Returns ``model``.

    Example:
        >>> from transformers import BertConfig, BertModel
        >>> import attn_probe
        >>> model = attn_probe.symmetric_init_(BertModel(BertConfig(
        ...     hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)))
        >>> [round(r["symmetry"], 4) for r in attn_probe.score_model(model)]
        [1.0, 1.0]
    """
    found = list(layers) if layers is not None else find_attention(model, **find_kwargs)
    plan = []
    with torch.no_grad():
        for layer in found:
            if layer.num_kv_heads != layer.num_heads:
                raise ValueError(
                    f"symmetric_init_: {layer.name!r} uses grouped-query attention "
                    f"({layer.num_heads} query heads share {layer.num_kv_heads} key heads), so "
                    "W_k = W_q per head is not well-defined; symmetric initialisation needs "
                    "num_key_value_heads == num_attention_heads."
                )
            query, key = layer.factors()
            _check_writable(layer, key)
            plan.append((layer, query, key))
        for _layer, query, key in plan:
            key.copy_(query.detach().clone())
        for layer, _, _ in plan:  # the write must be visible through the layer's own reading
            query, key = layer.factors()
            if not torch.equal(query, key):
                raise RuntimeError(f"symmetric_init_: writing W_k of {layer.name!r} did not take effect")
    return model
