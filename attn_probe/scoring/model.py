"""Score every attention layer of a model: extraction + the scoring core, one row per layer/head.

Which weight pairs are scored is chosen with ``pairs=`` (:func:`resolve_pairs`): by default the
query-key pair alone; ``pairs=("qk", "ov")`` adds the value-output circuit (``ov_`` metrics).
Every pair scores through :meth:`~attn_probe.scoring.pairs.ScorePair.score`, i.e. the one core
:func:`attn_probe.core.score_factors`, as in the live probe.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..core import METRICS, check_metrics, score_factors, table_rows
from ..core.update import UPDATE_METRIC
from ..extraction import AttentionLayer, UnsupportedModelError, entry_point, find_attention
from ..extraction.architectures import unwrap
from ..extraction.base import ParamGetter
from .pairs import OVPair, QKPair, ScorePair, check_pairs, pair_metric_names

Row = dict[str, Any]
PairsLike = str | ScorePair | Sequence["str | ScorePair"]

#: the pairs ``pairs=`` may name (``--pair NAME`` on ``attn-probe score``): W_q W_k^T and W_o^h W_v^h
PAIR_NAMES: dict[str, type[QKPair]] = {"qk": QKPair, "ov": OVPair}

#: keys of a row that are not metrics
ROW_KEYS = ("group", "layer", "name", "head", "step")


def row_metrics(rows: Iterable[Row]) -> list[str]:
    """The metric keys of ``rows``, in order of first appearance."""
    names: dict[str, None] = {}
    for row in rows:
        names.update((k, None) for k in row if k not in ROW_KEYS)
    return list(names)


def resolve_pairs(
    pairs: PairsLike | None = None,
    metrics: Iterable[str] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> list[ScorePair]:
    """The score pairs of a post-hoc call, validated.

    ``pairs`` is ``None`` (the W_qk pair alone, the default everywhere), or names from
    :data:`PAIR_NAMES` (``"qk"``, ``"ov"``, a single string or a sequence) and/or
    :class:`~attn_probe.scoring.pairs.ScorePair` objects, scored in the order given. ``metrics``
    (core names, no prefix) narrows the *named* pairs: ``pairs=("qk", "ov"),
    metrics=["spectral_norm"]`` gives ``spectral_norm`` and ``ov_spectral_norm``; a pair
    object keeps its own ``metrics`` and ``dtype``. Named pairs compute in ``dtype``.
    ``ValueError`` for an unknown or repeated name, a metric name written twice, or
    ``metrics`` given with pair objects only; ``TypeError`` for something that is not a pair.
    """
    metrics = (metrics,) if isinstance(metrics, str) else (tuple(metrics) if metrics is not None else None)
    core = _core_metrics(metrics)
    if pairs is None:
        pairs = ("qk",)
    elif isinstance(pairs, str) or _is_pair(pairs):
        pairs = (pairs,)
    items = list(pairs)
    if not items:
        raise ValueError(f"pairs must name at least one pair (known: {', '.join(PAIR_NAMES)})")
    named = [p for p in items if isinstance(p, str)]
    if len(set(named)) != len(named):
        raise ValueError(f"pairs repeat a name: {named}")
    if metrics is not None and not named:
        raise ValueError("metrics= narrows the pairs named by string; a pair object carries its own metrics")
    out: list[ScorePair] = []
    for item in items:
        if isinstance(item, str):
            cls = PAIR_NAMES.get(item)
            if cls is None:
                raise ValueError(f"unknown pair {item!r}; known: {', '.join(PAIR_NAMES)}")
            out.append(cls(core, dtype=dtype))
        elif _is_pair(item):
            out.append(item)
        else:
            raise TypeError(f"pairs must hold pair names ({', '.join(PAIR_NAMES)}) or score pairs "
                            f"(attn_probe.scoring.pairs.ScorePair), got {item!r}")
    pair_metric_names(out)  # ValueError if two pairs write the same metric name
    return out


def _is_pair(value: Any) -> bool:
    return not isinstance(value, str) and hasattr(value, "metrics") and callable(getattr(value, "score", None))


def _core_metrics(metrics: tuple[str, ...] | None) -> tuple[str, ...]:
    """Validated core metric names; a pair-prefixed name (``ov_symmetry``) is rejected with the right
    spelling, ``qk_update`` (two snapshots of one run) with where it is measured."""
    if UPDATE_METRIC in (metrics or ()):
        raise ValueError(f"metric {UPDATE_METRIC!r} is the change since the previous snapshot of a training run: the "
                         f"live probe logs it (watch(model, metrics=[..., {UPDATE_METRIC!r}])); one set of weights has none")
    for name in metrics or ():
        for pair, cls in PAIR_NAMES.items():
            bare = name[len(cls.prefix):] if cls.prefix and name.startswith(cls.prefix) else None
            bare = {"gain_bound": "qk_bound"}.get(bare, bare) if pair == "ov" else bare  # ov_gain_bound
            if bare in METRICS:
                raise ValueError(f"metric {name!r}: metrics are named without the pair's prefix; ask for "
                                 f"pair {pair!r} and metric {bare!r} (--pair {pair} --metric {bare})")
    return check_metrics(metrics)


def pair_label(pair: ScorePair) -> str:
    """``"qk"``/``"ov"`` for the named pairs, else the pair's class name (run headers)."""
    for name, cls in PAIR_NAMES.items():
        if type(pair) is cls:
            return name
    return type(pair).__name__


def check_model_pairs(pairs: Sequence[ScorePair], layers: Sequence[AttentionLayer],
                      model_type: str | None = None) -> None:
    """Every pair can read every layer, before any weight is read; the error names ``model_type``."""
    try:
        check_pairs(pairs, layers)
    except UnsupportedModelError as exc:
        if not model_type:
            raise
        raise UnsupportedModelError(f"model type {model_type!r}: {exc}") from exc


def pairs_param_names(pairs: Sequence[ScorePair], layer: AttentionLayer) -> tuple[str, ...]:
    """The parameters ``pairs`` read from ``layer``, each once, in order (what a walk gathers)."""
    names: dict[str, None] = {}
    for pair in pairs:
        names.update(dict.fromkeys(pair.param_names(layer)))
    return tuple(names)


def layer_factors(pairs: Sequence[ScorePair], layer: AttentionLayer,
                  get: ParamGetter) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every pair's factors ``(A, B)`` of ``layer`` (detached), with ``M_h = A_h^T B_g(h)``."""
    out = []
    for pair in pairs:
        a, b = pair.factors(layer, get)
        out.append((a.detach(), b.detach()))
    return out


def score_layer_factors(pairs: Sequence[ScorePair], layer: AttentionLayer,
                        factors: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                        per_head: bool, num_std: float) -> list[torch.Tensor]:
    """Every pair's ``(len(pair.metrics), 1 + H * per_head)`` table of one layer, on the weights' device."""
    return [pair.score(layer, a, b, per_head=per_head, num_std=num_std)
            for pair, (a, b) in zip(pairs, factors, strict=True)]


def to_host(tables: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """``tables`` as float64 host arrays of the same shapes, in **one transfer per device**.

    Every table is flattened and concatenated with the others of its device, moved once, and
    split again: the only host synchronisation of a snapshot.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tables:
        by_device.setdefault(t.device, []).append(t.reshape(-1).double())
    host = {dev: torch.cat(parts).cpu().numpy() for dev, parts in by_device.items()}
    offsets = dict.fromkeys(host, 0)
    out = []
    for t in tables:
        start = offsets[t.device]
        offsets[t.device] = start + t.numel()
        out.append(host[t.device][start: start + t.numel()].reshape(tuple(t.shape)))
    return out


def score_layer_pairs(
    layer: AttentionLayer,
    get: ParamGetter,
    pairs: Sequence[ScorePair],
    *,
    per_head: bool = False,
    num_std: float = 2.0,
    source: AttentionLayer | None = None,
) -> list[Row]:
    """Rows for one layer scored by every pair (layer row first, then one per head).

    ``get(name)`` returns the full parameter tensors the pairs declare
    (:func:`pairs_param_names`). The one per-layer path of every caller (post-hoc, checkpoint,
    distributed, and the live probe's gathered layers): :func:`layer_factors`, then
    :func:`score_layer_factors` (each pair's ``score``, the one core), then :func:`to_host`;
    the tables are joined, so a row holds every pair's metrics. ``source`` is the layer record
    the pairs read from when it differs from the one that labels the rows (the distributed
    walk renames layers without wrapper segments).
    """
    source = source if source is not None else layer
    tables = to_host(score_layer_factors(pairs, source, layer_factors(pairs, source, get),
                                         per_head=per_head, num_std=num_std))
    joined = np.concatenate([t.reshape(len(p.metrics), -1) for p, t in zip(pairs, tables, strict=True)])
    return table_rows(layer, pair_metric_names(pairs), joined.tolist())


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
    (:data:`attn_probe.core.DEFAULT_METRICS` unless ``metrics`` narrows them).
    """
    names = check_metrics(tuple(metrics) if metrics is not None else None)
    table = score_factors(query, key, names, per_head=per_head, num_std=num_std, dtype=dtype)
    return table_rows(layer, names, table.cpu().tolist())


@entry_point("score_model")
def score_model(
    model: nn.Module,
    per_head: bool = False,
    *,
    num_std: float = 2.0,
    layers: Iterable[AttentionLayer] | None = None,
    dtype: torch.dtype = torch.float32,
    metrics: Iterable[str] | None = None,
    pairs: PairsLike | None = None,
    **find_kwargs: Any,
) -> list[Row]:
    """The metrics of every attention layer (and head, if ``per_head``).

    Each row has ``group``, ``layer``, ``name``, ``head`` (``None`` for the layer-level
    matrix ``M = sum_h W_q^h W_k^h^T``) and one key per metric, by default the six of
    :data:`attn_probe.core.DEFAULT_METRICS`; ``metrics=`` chooses them
    (:data:`attn_probe.core.METRICS`).

    ``pairs`` chooses the weight pairs (:func:`resolve_pairs`): default the W_qk pair alone;
    ``pairs=("qk", "ov")`` adds the value-output circuit ``W_o^h W_v^h``, whose metrics are
    prefixed ``ov_`` (``ov_symmetry``, ``ov_spectral_norm``, ...); ``pairs="ov"`` scores it
    alone. An architecture whose W_v/W_o layout is unknown raises
    :class:`~attn_probe.extraction.UnsupportedModelError` naming the model type before
    anything is scored.

    Example:
        >>> from transformers import BertConfig, BertModel
        >>> model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2,
        ...                              num_attention_heads=4, intermediate_size=64))
        >>> rows = score_model(model)
        >>> [(r["group"], r["layer"]) for r in rows]
        [('self', 0), ('self', 1)]
    """
    chosen = resolve_pairs(pairs, metrics, dtype=dtype)
    found = list(layers) if layers is not None else find_attention(model, **find_kwargs)
    config = getattr(unwrap(model), "config", None)
    check_model_pairs(chosen, found, getattr(config, "model_type", None))
    rows: list[Row] = []
    with torch.no_grad():
        for layer in found:
            rows += score_layer_pairs(layer, layer.params.__getitem__, chosen, per_head=per_head, num_std=num_std)
    return rows
