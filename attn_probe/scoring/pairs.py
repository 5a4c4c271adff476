"""Scored weight pairs: which parameters a layer's measurement needs, and how it is scored.

A pair names the parameters it reads (:meth:`ScorePair.param_names`), so that the
distributed walk (:func:`attn_probe.distributed.iter_layer_params`) gathers exactly those on
every rank; it turns them into per-head factors ``(A, B)`` with ``M_h = A_h^T B_{g(h)}``
(:meth:`ScorePair.factors`), and scores them through the one core,
:func:`attn_probe.core.score_factors` (:meth:`ScorePair.score`). Its metric names are
the core's, with a prefix for pairs other than ``W_qk`` (e.g. ``ov_symmetry``).

**Adding a pair** touches this module only: subclass :class:`QKPair` (or implement the
protocol) with other ``param_names``/``factors`` and a ``prefix``; the architecture knowledge
it needs (where its weights live) goes in :mod:`attn_probe.extraction`. :class:`OVPair` is
one: the value-output circuit ``W_o^h W_v^h``, opt-in::

    attn_probe.watch(model, ..., pairs=[QKPair(), OVPair()])
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..core import (
    DEFAULT_METRICS,
    WRITTEN_NAMES,
    check_metrics,
    gpu_algorithm,
    gram_is_cheaper,
    score_factor_stack,
    score_factors,
)
from ..extraction import AttentionLayer

__all__ = ["ScorePair", "QKPair", "OVPair", "pair_metric_names", "check_pairs", "stack_layers", "score_stacks",
           "Stack", "stack_budget", "stack_layer_bytes"]

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
        self.metrics = tuple(WRITTEN_NAMES.get(self.prefix + m, self.prefix + m) for m in self.core_metrics)
        self.dtype = dtype

    def __eq__(self, other: object) -> bool:  # by value (caches aside): a pickled config comes back equal
        return type(other) is type(self) and self.__getstate__() == other.__getstate__()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.metrics, self._dtype()))

    def param_names(self, layer: AttentionLayer) -> tuple[str, ...]:
        return layer.param_names

    def factors(self, layer: AttentionLayer, get: ParamGetter) -> tuple[Tensor, Tensor]:
        return layer.factors(get)

    def score(self, layer: AttentionLayer, query: Tensor, key: Tensor, *,
              per_head: bool, num_std: float) -> Tensor:
        # stays on the weights' device: the probe moves every layer's values in one transfer
        return score_factors(query, key, self._core_metrics(), per_head=per_head, num_std=num_std,
                             dtype=self._dtype())

    def score_stack(self, queries: Tensor, keys: Tensor, *, per_head: bool, num_std: float) -> Tensor:
        """:meth:`score` of ``L`` stacked layers of one shape: ``(L, len(metrics), 1 + H * per_head)``."""
        return score_factor_stack(queries, keys, self._core_metrics(), per_head=per_head, num_std=num_std,
                                  dtype=self._dtype())

    def _core_metrics(self) -> tuple[str, ...]:
        return getattr(self, "core_metrics", None) or tuple(m[len(self.prefix):] for m in self.metrics)

    def _dtype(self) -> torch.dtype:
        return getattr(self, "dtype", torch.float32)


class OVPair(QKPair):
    """The value-output circuit ``W_ov^h = W_o^h W_v^h`` (``d x d``, rows = output), per head and summed.

    Factors ``A_h = (W_o^h)^T`` (the head's block of output-projection columns) and
    ``B_g = W_v^g`` (grouped-query heads share value heads as they share key heads), so the
    core scores ``A_h^T B_{g(h)} = W_o^h W_v^h``. Metric names carry the prefix ``ov_``
    (``ov_symmetry``, ``ov_spectral_norm``, ...; ``ov_gain_bound`` is
    ``sigma_max(W_o^h) sigma_max(W_v^h)``). Where W_v/W_o live is
    :func:`attn_probe.extraction.ov.ov_layout`'s knowledge; an architecture it does not know
    raises :class:`~attn_probe.extraction.UnsupportedModelError` (:meth:`check`).
    """

    metrics: tuple[str, ...] = tuple("ov_" + m for m in DEFAULT_METRICS)
    prefix = "ov_"

    def __init__(self, metrics: Sequence[str] | None = None, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(metrics, dtype=dtype)
        self._layouts: dict[int, tuple[object, object]] = {}

    def __getstate__(self) -> dict:
        # the layouts are a cache of the watched modules (and closures): a copy or a pickle starts without
        return {**self.__dict__, "_layouts": {}}

    def layout(self, layer: AttentionLayer):  # -> extraction.ov.OVLayout
        # keyed by the module alone: the distributed walk hands out the same layer renamed
        # without wrapper segments, and its parameters were gathered under the first names.
        # The module is kept with its layout, so a recycled id() cannot match another module.
        entry = self._layouts.get(id(layer.module))
        if entry is None or entry[0] is not layer.module:
            from ..extraction.ov import ov_layout

            entry = self._layouts[id(layer.module)] = (layer.module, ov_layout(layer))
        return entry[1]

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


#: the most bytes a stack of layers may take in :func:`stack_layers` on the GPU algorithm
#: (:func:`attn_probe.core.gpu_algorithm`): on CUDA the budget is the smaller of this cap and
#: :data:`FREE_MEMORY_SHARE` of the device's free memory; the GPU algorithm on CPU tensors uses
#: the cap. One stack per shape saves kernel launches (docs/performance.md)
STACK_BYTES = 8 << 30
#: share of the device's free memory (``torch.cuda.mem_get_info``) a stack may take
FREE_MEMORY_SHARE = 0.5
#: the budget on the CPU algorithm: all layers of one shape in one stack up to this size, so that
#: a snapshot's operation count does not grow with the layer count (the core avoids full-size
#: temporaries, which made cache-sized chunks faster before; docs/performance.md)
CPU_STACK_BYTES = 256 << 20


def stack_budget(device: torch.device) -> int:
    """Bytes one stack of layers may take on ``device`` (see :data:`STACK_BYTES`)."""
    if not gpu_algorithm(device):
        return CPU_STACK_BYTES
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(1, min(STACK_BYTES, int(free * FREE_MEMORY_SHARE)))
    return STACK_BYTES


def stack_layer_bytes(q_shape: Sequence[int], k_shape: Sequence[int], dtype: torch.dtype,
                      compute: torch.dtype) -> int:
    """Bytes one layer takes in a stack: its stacked copy, the core's scaled copies in the compute
    dtype and in its own (bf16 Gram products), and any ``d x d`` products the core forms."""
    heads, head_dim, d = q_shape[-3:]
    numel = math.prod(q_shape) + math.prod(k_shape)
    formed = 0
    if not gram_is_cheaper(k_shape[-3] * head_dim, d):
        formed += d * d
    if not gram_is_cheaper(head_dim, d):
        formed += heads * d * d
    return 2 * (dtype.itemsize + compute.itemsize) * numel + compute.itemsize * formed


def _scores_as_stack(pair: ScorePair) -> bool:
    """Whether ``pair`` scores through the core unchanged, so that stacking gives its own numbers.

    True for :class:`QKPair` and its subclasses that keep its ``score``; a subclass that
    defines its own ``score`` is called layer by layer, never bypassed by a stack, unless it
    also scores stacks of named layers (``score_layers``, e.g. the stateful ``qk_update`` pair).
    """
    if not isinstance(pair, QKPair):
        return False
    if callable(getattr(pair, "score_layers", None)):
        return True
    return next(cls for cls in type(pair).__mro__ if "score" in vars(cls)) is QKPair


@dataclasses.dataclass
class Stack:
    """Factors of the layers ``indices`` ready to score: stacked ``(L, ...)``, or one layer's own."""

    indices: list[int]
    queries: Tensor
    keys: Tensor
    stacked: bool

    @property
    def nbytes(self) -> int:
        return self.queries.nbytes + self.keys.nbytes


def stack_layers(pair: ScorePair, factors: Sequence[tuple[Tensor, Tensor]], *, copy: bool = False) -> list[Stack]:
    """Group layers for :func:`score_stacks`: one stack per shape, dtype and device, in chunks.

    For a pair that scores through the core (:class:`QKPair` and subclasses that keep its
    ``score``), layers of one shape are stacked (``torch.stack``, one operation per chunk
    whatever the layer count, in the weights' dtype: the core converts) in chunks within
    :func:`stack_budget`; a chunk of one layer and any other pair's layers stay single.
    ``copy=True`` copies single layers too (``clone``), so that the result no longer reads the
    weights (the asynchronous mode scores it while training goes on).
    """
    def single(i: int) -> Stack:
        a, b = factors[i]
        return Stack([i], a.clone() if copy else a, b.clone() if copy else b, stacked=False)

    if not _scores_as_stack(pair) or len(factors) < 2:
        return [single(i) for i in range(len(factors))]
    assert isinstance(pair, QKPair)
    dtype = pair._dtype()
    groups: dict[tuple, list[int]] = {}
    for i, (a, b) in enumerate(factors):
        groups.setdefault((tuple(a.shape), tuple(b.shape), a.dtype, b.dtype, a.device, b.device), []).append(i)
    stacks: list[Stack] = []
    for (q_shape, k_shape, q_dtype, _, device, _), indices in groups.items():
        per_layer = stack_layer_bytes(q_shape, k_shape, q_dtype, dtype)
        size = max(1, stack_budget(device) // per_layer)
        for start in range(0, len(indices), size):
            chunk = indices[start: start + size]
            if len(chunk) == 1:
                stacks.append(single(chunk[0]))
                continue
            queries = torch.stack([factors[i][0] for i in chunk])
            keys = torch.stack([factors[i][1] for i in chunk])
            stacks.append(Stack(chunk, queries, keys, stacked=True))
    return stacks


def score_stacks(pair: ScorePair, layers: Sequence[AttentionLayer], stacks: Sequence[Stack], *,
                 per_head: bool, num_std: float) -> list[Tensor]:
    """``pair.score`` of each of ``layers`` (in order) from its :func:`stack_layers` stacks."""
    out: list[Tensor | None] = [None] * len(layers)
    for stack in stacks:
        if not stack.stacked:
            i = stack.indices[0]
            out[i] = pair.score(layers[i], stack.queries, stack.keys, per_head=per_head, num_std=num_std)
            continue
        assert isinstance(pair, QKPair)
        score_layers = getattr(pair, "score_layers", None)
        if callable(score_layers):  # a pair that keeps state per layer needs their names
            table = score_layers([layers[i] for i in stack.indices], stack.queries, stack.keys,
                                 per_head=per_head, num_std=num_std)
        else:
            table = pair.score_stack(stack.queries, stack.keys, per_head=per_head, num_std=num_std)
        for j, i in enumerate(stack.indices):
            out[i] = table[j]
    return out  # type: ignore[return-value]
