"""Records describing one attention layer's query/key weights, and how to read them.

An :class:`AttentionLayer` holds no copy of the model. It names the parameters it needs
(``param_names``, relative to the unwrapped model) and knows how to turn those tensors into
per-head factors ``W_q: (num_heads, head_dim, d)`` and ``W_k: (num_kv_heads, head_dim, d)``
(``nn.Linear`` convention: ``q_h = W_q[h] @ x``), so that ``M = sum_h W_q[h]^T W_k[g(h)]``
with ``g(h) = h // (num_heads / num_kv_heads)``. The factors are views of the weights, except
that one layer's factors are materialised when they must be computed (LoRA ``W + s B A``) or
the query rows are not evenly strided (Falcon ``new_decoder_architecture``, CodeGen).
Distributed code can gather exactly those parameters and call :meth:`AttentionLayer.factors`
with the full tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

Tensor = torch.Tensor
ParamGetter = Callable[[str], Tensor]
#: (getter) -> (query (H, dh, d), key (Hkv, dh, d))
FactorFn = Callable[[ParamGetter], "tuple[Tensor, Tensor]"]

GROUPS = ("self", "encoder", "decoder", "cross")


class UnsupportedModelError(ValueError):
    """The model has no attention layer that attn_probe knows how to read."""


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer: where its q/k weights live and how to split them per head."""

    name: str
    group: str
    layer: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    param_names: tuple[str, ...]
    split: FactorFn = field(repr=False, compare=False)
    module: nn.Module | None = field(default=None, repr=False, compare=False)
    params: Mapping[str, Tensor] = field(default_factory=dict, repr=False, compare=False)
    #: the model ``name`` and ``param_names`` are relative to (``unwrap(model)``), for layouts that
    #: read a module outside the attention module (BERT's output projection is a sibling)
    root: nn.Module | None = field(default=None, repr=False, compare=False)
    #: the adapters now attached to the layer's LoRA projections; a change makes ``param_names`` stale
    attached_adapters: Callable[[], Hashable] = field(default=tuple, repr=False, compare=False)

    def factors(self, get: ParamGetter | None = None) -> tuple[Tensor, Tensor]:
        """Per-head ``(W_q, W_k)`` views; ``get`` maps a parameter name to its full tensor.

        Without ``get`` the live parameters of the model are used (no copy, no collective).
        """
        getter = get if get is not None else self.params.__getitem__
        query, key = self.split(getter)
        expected_q = (self.num_heads, self.head_dim, self.hidden_size)
        expected_k = (self.num_kv_heads, self.head_dim, self.hidden_size)
        if tuple(query.shape) != expected_q or tuple(key.shape) != expected_k:
            raise ValueError(
                f"{self.name}: extracted W_q {tuple(query.shape)} / W_k {tuple(key.shape)}, "
                f"expected {expected_q} / {expected_k}"
            )
        return query, key

    def qk_matrix(self, get: ParamGetter | None = None, head: int | None = None) -> Tensor:
        """The explicit ``d x d`` matrix ``W_qk`` (float64) of the layer or of one head.

        Slow reference used by tests and heatmaps; scoring uses the factored path.
        """
        query, key = self.factors(get)
        q = query.detach().double()
        k = key.detach().double()
        group = self.num_heads // self.num_kv_heads
        heads = range(self.num_heads) if head is None else [head]
        m = torch.zeros(self.hidden_size, self.hidden_size, dtype=torch.float64, device=q.device)
        for h in heads:
            m += q[h].T @ k[h // group]
        return m


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
