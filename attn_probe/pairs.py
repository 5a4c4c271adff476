"""Scored weight pairs: which parameters a layer's measurement needs, and how it is scored.

A pair names the parameters it reads (:meth:`ScorePair.param_names`), so that the
distributed walk (:func:`attn_probe.distributed.iter_layer_params`) gathers exactly those on
every rank; it turns them into per-head factors ``(A, B)`` with ``M_h = A_h^T B_{g(h)}``
(:meth:`ScorePair.factors`), and scores them through the one core,
:func:`attn_probe.metrics.score_factors` (:meth:`ScorePair.score`). Its metric names are
the core's, with a prefix for pairs other than ``W_qk`` (e.g. ``ov_symmetry``).

**Adding a pair** touches this module only: subclass :class:`QKPair` (or implement the
protocol) with other ``param_names``/``factors`` and a ``prefix``; the architecture knowledge
it needs (where its weights live) goes in :mod:`attn_probe.extraction`. :class:`OVPair` is
one: the value-output circuit ``W_o^h W_v^h``, opt-in::

    attn_probe.watch(model, ..., pairs=[QKPair(), OVPair()])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from .extraction import AttentionLayer
from .metrics import DEFAULT_METRICS, check_metrics, score_factors

__all__ = ["ScorePair", "QKPair", "OVPair", "pair_metric_names", "check_pairs"]

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


class OVPair(QKPair):
    """The value-output circuit ``W_ov^h = W_o^h W_v^h`` (``d x d``, rows = output), per head and summed.

    Factors ``A_h = (W_o^h)^T`` (the head's block of output-projection columns) and
    ``B_g = W_v^g`` (grouped-query heads share value heads as they share key heads), so the
    core scores ``A_h^T B_{g(h)} = W_o^h W_v^h``. Metric names carry the prefix ``ov_``
    (``ov_symmetry``, ``ov_spectral_norm``, ...; ``ov_qk_bound`` is
    ``sigma_max(W_o^h) sigma_max(W_v^h)``). Where W_v/W_o live is
    :func:`attn_probe.extraction.ov.ov_layout`'s knowledge; an architecture it does not know
    raises :class:`~attn_probe.extraction.UnsupportedModelError` (:meth:`check`).
    """

    metrics: tuple[str, ...] = tuple("ov_" + m for m in DEFAULT_METRICS)
    prefix = "ov_"

    def __init__(self, metrics: Sequence[str] | None = None, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(metrics, dtype=dtype)
        self._layouts: dict[tuple[str, int], object] = {}

    def layout(self, layer: AttentionLayer):  # -> extraction.ov.OVLayout
        key = (layer.name, id(layer.module))
        if key not in self._layouts:
            from .extraction.ov import ov_layout

            self._layouts[key] = ov_layout(layer)
        return self._layouts[key]

    def check(self, layers: Sequence[AttentionLayer]) -> None:
        """Raise :class:`~attn_probe.extraction.UnsupportedModelError` unless every layer is readable."""
        for layer in layers:
            self.layout(layer)

    def param_names(self, layer: AttentionLayer) -> tuple[str, ...]:
        return self.layout(layer).param_names

    def factors(self, layer: AttentionLayer, get: ParamGetter) -> tuple[Tensor, Tensor]:
        return self.layout(layer).factors(get)


def check_pairs(pairs: Sequence[ScorePair], layers: Sequence[AttentionLayer]) -> None:
    """Let every pair that can (``check(layers)``) reject layers it cannot read, before training."""
    for pair in pairs:
        check = getattr(pair, "check", None)
        if callable(check):
            check(layers)


def pair_metric_names(pairs: Sequence[ScorePair]) -> list[str]:
    """Every metric the pairs write, in order; ``ValueError`` if two pairs write the same name."""
    names = [m for p in pairs for m in p.metrics]
    if len(set(names)) != len(names):
        raise ValueError(f"two score pairs write the same metric name: {names}")
    return names
