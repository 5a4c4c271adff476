"""Score every attention layer of a model: extraction + factored scores, one row per layer/head."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .extraction import AttentionLayer, find_attention
from .scores import factored_scores

Row = dict[str, Any]


def score_layer(
    layer: AttentionLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    per_head: bool = False,
    num_std: float = 2.0,
    dtype: torch.dtype = torch.float32,
) -> list[Row]:
    """Rows for one layer given its per-head factors (layer row first, then one per head)."""
    s = factored_scores(query, key, per_head=per_head, num_std=num_std, dtype=dtype)
    base = {"group": layer.group, "layer": layer.layer, "name": layer.name}
    rows = [{**base, "head": None, "symmetry": s.symmetry, "directionality": s.directionality}]
    if per_head:
        for h, (sym, dirn) in enumerate(zip(s.head_symmetry or [], s.head_directionality or [], strict=True)):
            rows.append({**base, "head": h, "symmetry": sym, "directionality": dirn})
    return rows


def score_model(
    model: nn.Module,
    per_head: bool = False,
    *,
    num_std: float = 2.0,
    layers: Iterable[AttentionLayer] | None = None,
    dtype: torch.dtype = torch.float32,
    **find_kwargs: Any,
) -> list[Row]:
    """Symmetry and directionality of every attention layer (and head, if ``per_head``).

    Each row has ``group``, ``layer``, ``name``, ``head`` (``None`` for the layer-level
    matrix ``M = sum_h W_q^h W_k^h^T``), ``symmetry`` and ``directionality``.

    Example:
        >>> from transformers import BertConfig, BertModel
        >>> model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2,
        ...                              num_attention_heads=4, intermediate_size=64))
        >>> rows = score_model(model)
        >>> [(r["group"], r["layer"]) for r in rows]
        [('self', 0), ('self', 1)]
    """
    found = list(layers) if layers is not None else find_attention(model, **find_kwargs)
    rows: list[Row] = []
    with torch.no_grad():
        for layer in found:
            query, key = layer.factors()
            rows += score_layer(layer, query, key, per_head=per_head, num_std=num_std, dtype=dtype)
    return rows
