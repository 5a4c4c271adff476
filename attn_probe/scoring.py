"""Score every attention layer of a model: extraction + the scoring core, one row per layer/head."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .extraction import AttentionLayer, find_attention
from .metrics import check_metrics, score_factors, table_rows

Row = dict[str, Any]

#: keys of a row that are not metrics
ROW_KEYS = ("group", "layer", "name", "head", "step")


def row_metrics(rows: Iterable[Row]) -> list[str]:
    """The metric keys of ``rows``, in order of first appearance."""
    names: dict[str, None] = {}
    for row in rows:
        names.update((k, None) for k in row if k not in ROW_KEYS)
    return list(names)


def score_layer(
    layer: AttentionLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    per_head: bool = False,
    num_std: float = 2.0,
    dtype: torch.dtype = torch.float32,
    metrics: Iterable[str] | None = None,
) -> list[Row]:
    """Rows for one layer given its per-head factors (layer row first, then one per head).

    Each row has ``group``, ``layer``, ``name``, ``head`` and one key per metric
    (:data:`attn_probe.metrics.DEFAULT_METRICS` unless ``metrics`` narrows them).
    """
    names = check_metrics(tuple(metrics) if metrics is not None else None)
    table = score_factors(query, key, names, per_head=per_head, num_std=num_std, dtype=dtype)
    return table_rows(layer, names, table.cpu().tolist())


def score_model(
    model: nn.Module,
    per_head: bool = False,
    *,
    num_std: float = 2.0,
    layers: Iterable[AttentionLayer] | None = None,
    dtype: torch.dtype = torch.float32,
    metrics: Iterable[str] | None = None,
    **find_kwargs: Any,
) -> list[Row]:
    """The metrics of every attention layer (and head, if ``per_head``).

    Each row has ``group``, ``layer``, ``name``, ``head`` (``None`` for the layer-level
    matrix ``M = sum_h W_q^h W_k^h^T``) and one key per metric, by default ``symmetry`` and
    ``directionality``; ``metrics=`` chooses them (:data:`attn_probe.metrics.METRICS`).

    Example:
        >>> from transformers import BertConfig, BertModel
        >>> model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2,
        ...                              num_attention_heads=4, intermediate_size=64))
        >>> rows = score_model(model)
        >>> [(r["group"], r["layer"]) for r in rows]
        [('self', 0), ('self', 1)]
    """
    names = check_metrics(tuple(metrics) if metrics is not None else None)
    found = list(layers) if layers is not None else find_attention(model, **find_kwargs)
    rows: list[Row] = []
    with torch.no_grad():
        for layer in found:
            query, key = layer.factors()
            rows += score_layer(layer, query, key, per_head=per_head, num_std=num_std, dtype=dtype,
                                metrics=names)
    return rows
