"""Scored weight pairs: which parameters a layer's measurement needs, and how it is scored.

A pair names the parameters it reads (:meth:`ScorePair.param_names`), so that the
distributed walk (:func:`attn_probe.distributed.iter_layer_params`) gathers exactly those on
every rank; it turns them into per-head factors ``(A, B)`` with ``M_h = A_h^T B_{g(h)}``
(:meth:`ScorePair.factors`), and scores them through the one core,
:func:`attn_probe.metrics.score_factors` (:meth:`ScorePair.score`). Its metric names are
the core's, with a prefix for pairs other than ``W_qk`` (e.g. ``ov_symmetry``).

**Adding a pair** touches this module only: subclass :class:`QKPair` (or implement the
protocol) with other ``param_names``/``factors`` and a ``prefix``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from .extraction import AttentionLayer
from .metrics import DEFAULT_METRICS, check_metrics, score_factors

__all__ = ["ScorePair", "QKPair", "pair_metric_names"]

Tensor = torch.Tensor
ParamGetter = Callable[[str], Tensor]


class ScorePair(Protocol):
    """A scored weight pair of one attention layer.

    ``metrics`` are the metric names it writes (prefixed for pairs other than ``W_qk``);
    ``score`` returns a ``(len(metrics), 1 + H * per_head)`` tensor for one layer, column 0
    the layer-level value. It may stay on the weights' device: the probe moves all pairs'
    and layers' results to the host together, one transfer per device and snapshot.
    """

    metrics: tuple[str, ...]

    def param_names(self, layer: AttentionLayer) -> tuple[str, ...]: ...

    def factors(self, layer: AttentionLayer, get: ParamGetter) -> tuple[Tensor, Tensor]: ...

    def score(self, layer: AttentionLayer, query: Tensor, key: Tensor, *,
              per_head: bool, num_std: float) -> Tensor: ...


class QKPair:
    """The query-key bilinear form ``W_qk = W_q W_k^T``: factors ``(W_q, W_k)`` per head."""

    #: metric names written (no prefix: the paper's W_qk is the default pair)
    metrics: tuple[str, ...] = DEFAULT_METRICS
    prefix = ""

    def __init__(self, metrics: Sequence[str] | None = None, *, dtype: torch.dtype = torch.float32) -> None:
        self.core_metrics = check_metrics(metrics)
        self.metrics = tuple(self.prefix + m for m in self.core_metrics)
        self.dtype = dtype

    def param_names(self, layer: AttentionLayer) -> tuple[str, ...]:
        return layer.param_names

    def factors(self, layer: AttentionLayer, get: ParamGetter) -> tuple[Tensor, Tensor]:
        return layer.factors(get)

    def score(self, layer: AttentionLayer, query: Tensor, key: Tensor, *,
              per_head: bool, num_std: float) -> Tensor:
        # stays on the weights' device: the probe moves every layer's values in one transfer
        core = getattr(self, "core_metrics", None) or tuple(m[len(self.prefix):] for m in self.metrics)
        return score_factors(query, key, core, per_head=per_head, num_std=num_std,
                             dtype=getattr(self, "dtype", torch.float32))


def pair_metric_names(pairs: Sequence[ScorePair]) -> list[str]:
    """Every metric the pairs write, in order; ``ValueError`` if two pairs write the same name."""
    names = [m for p in pairs for m in p.metrics]
    if len(set(names)) != len(names):
        raise ValueError(f"two score pairs write the same metric name: {names}")
    return names
