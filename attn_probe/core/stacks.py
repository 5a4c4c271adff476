"""The entry points of the core: factors of one layer (:func:`score_factors`) or of a stack of layers of
one shape (:func:`score_factor_stack`) -> a float64 ``(metrics, 1 + H)`` device table; the host view
:func:`factored_scores`; tables to rows."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .algorithm import gpu_algorithm, gram_out_dtype_supported
from .formulas import METRICS, check_metrics
from .products import Products, check_factors, check_num_std, pow2_scale
from .spectra import Spectra

Tensor = torch.Tensor
Row = dict[str, Any]

def _metric_table(p: Products, metrics: tuple[str, ...], layers: int) -> Tensor:
    """``(layers, len(metrics), columns)`` of the metrics of ``p`` (its ``(n, G)`` split per layer)."""
    return torch.stack([METRICS[m](p).reshape(layers, -1).to(torch.float64) for m in metrics], 1)


def score_factors(
    query: Tensor,
    key: Tensor,
    metrics: Sequence[str] | None = None,
    *,
    per_head: bool = False,
    num_std: float = 2.0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Metrics of ``M = sum_h Q_h^T K_{g(h)}`` (and of every ``M_h``), as a device tensor.

    ``query``: ``(num_heads, head_dim, d)``, ``key``: ``(num_kv_heads, head_dim, d)``.
    Returns float64 ``(len(metrics), 1 + num_heads * per_head)`` on the factors' device:
    column 0 the layer matrix, then one column per head. Grouped query heads are summed
    before the layer product (``M = sum_g (sum_{h in g} Q_h)^T K_g``), so a grouped-query
    layer costs ``num_kv_heads`` heads. Computed in ``dtype`` under ``no_grad``; no host sync.
    One layer of :func:`score_factor_stack`.

    Example:
        >>> q = torch.randn(4, 8, 32)
        >>> score_factors(q, q, ("symmetry",), per_head=True)  # W_q = W_k: all symmetric
        tensor([[1., 1., 1., 1., 1.]], dtype=torch.float64)
    """
    check_factors(query, key)
    return score_factor_stack(query[None], key[None], metrics, per_head=per_head, num_std=num_std,
                              dtype=dtype)[0]


def score_factor_stack(
    queries: Tensor,
    keys: Tensor,
    metrics: Sequence[str] | None = None,
    *,
    per_head: bool = False,
    num_std: float = 2.0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """:func:`score_factors` of ``L`` layers of one shape at once: ``(L, len(metrics), 1 + H * per_head)``.

    ``queries``: ``(L, num_heads, head_dim, d)``, ``keys``: ``(L, num_kv_heads, head_dim, d)``.
    Each layer's values equal its :func:`score_factors` up to rounding (the same operations,
    batched); the batch saves the per-layer launches and Python work of small layers.
    """
    if not isinstance(queries, Tensor) or not isinstance(keys, Tensor) or queries.ndim != 4 or keys.ndim != 4:
        raise ValueError("stacked factors must be shaped (layers, heads, head_dim, d)")
    if queries.shape[0] != keys.shape[0] or queries.shape[0] == 0:
        raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)}: need the same, "
                         "non-zero number of layers")
    num_heads, num_kv, head_dim, d = check_factors(queries[0], keys[0])
    num_std = check_num_std(num_std)
    names = check_metrics(metrics)
    n_layers, group = queries.shape[0], num_heads // num_kv
    with torch.no_grad():
        q, scale_q, low_q = _stack_factor(queries.detach(), dtype)
        k, scale_k, low_k = _stack_factor(keys.detach(), dtype)
        spectra = Spectra(gpu_algorithm(q.device))
        # one power of two per layer and factor, shared by the layer and its heads
        head_scale_q = scale_q[:, None, None].expand(n_layers, num_kv, group).reshape(n_layers * num_kv, group)
        head_scale_k = scale_k[:, None, None].expand(n_layers, num_kv, 1).reshape(n_layers * num_kv, 1)
        heads = _Lazy(lambda: Products(
            q.reshape(n_layers * num_kv, group, head_dim, d), k.reshape(n_layers * num_kv, head_dim, d),
            num_std, dtype, scale_a=head_scale_q, scale_b=head_scale_k, spectra=spectra,
            low=(None if low_q is None else low_q.reshape(n_layers * num_kv, group, head_dim, d),
                 None if low_k is None else low_k.reshape(n_layers * num_kv, head_dim, d))))
        q_grouped = q.reshape(n_layers, num_kv, group, head_dim, d).sum(2) if group > 1 else q
        layer = Products(q_grouped.reshape(n_layers, 1, num_kv * head_dim, d),
                         k.reshape(n_layers, num_kv * head_dim, d), num_std, dtype, parts=heads.get,
                         scale_a=scale_q[:, None], scale_b=scale_k[:, None], spectra=spectra,
                         low=(None if low_q is None or group > 1 else low_q.reshape(n_layers, 1, num_kv * head_dim, d),
                              None if low_k is None else low_k.reshape(n_layers, num_kv * head_dim, d)))
        # every largest-eigenvalue problem the metrics need, registered before any is solved:
        # the GPU algorithm solves them in one chain per size
        if any(m in _NEEDS_SIGMA for m in names):
            layer.request("m")
            if per_head:
                heads.get().request("m")
        if any(m in _NEEDS_FACTOR_SIGMA for m in names):
            heads.get().request("factors")
        columns = [_metric_table(layer, names, n_layers)]
        if per_head:
            columns.append(_metric_table(heads.get(), names, n_layers))
        return torch.cat(columns, 2)


#: metrics that read ``sigma_max(M)`` / the factors' ``sigma_max`` (their problems are batched)
_NEEDS_SIGMA = frozenset({"spectral_norm", "stable_rank"})
_NEEDS_FACTOR_SIGMA = frozenset({"qk_bound"})


def _stack_factor(t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    """A stack ``(L, heads, head_dim, d)`` divided by one power of two per layer, in ``dtype``.

    Returns the scaled stack in ``dtype``, the scales (float64 ``(L,)``) and, for bf16/fp16
    input on a device with float32-output matrix products (:func:`gram_out_dtype_supported`),
    the scaled stack in its own dtype (exact: a power of two) for the Gram products.
    """
    scale = pow2_scale(t, 3)  # (L,), float32 or t's dtype
    shaped = scale[:, None, None, None]
    if torch.promote_types(t.dtype, dtype) == dtype:  # one division, promoting to dtype
        scaled = t / shaped.to(dtype)
    else:
        scaled = t.to(dtype) / shaped.to(dtype)
    low = None
    if (t.dtype in (torch.bfloat16, torch.float16) and dtype == torch.float32
            and gram_out_dtype_supported(t.device)):
        low = t / shaped.to(t.dtype)
    return scaled, scale.to(torch.float64), low


# ------------------------------------------------------------------ host view of one layer
@dataclass
class FactoredScores:
    """Scores of one layer: the layer-level matrix and, optionally, every head."""

    symmetry: float
    directionality: float
    head_symmetry: list[float] | None = None
    head_directionality: list[float] | None = None


def factored_scores(
    query: Tensor,
    key: Tensor,
    *,
    per_head: bool = False,
    layer: bool = True,
    num_std: float = 2.0,
    dtype: torch.dtype = torch.float32,
) -> FactoredScores:
    """Symmetry and directionality of ``M = sum_h Q_h^T K_{g(h)}`` from per-head factors, on the host.

    ``query`` is ``(num_heads, head_dim, d)`` and ``key`` is ``(num_kv_heads, head_dim, d)``
    (``nn.Linear`` weight rows split per head); query head ``h`` pairs with key head
    ``g(h) = h // (num_heads / num_kv_heads)``. A host-side view of :func:`score_factors`
    (one device-to-host transfer); ``layer=False`` leaves the layer scores ``nan``.

    Example:
        >>> q = torch.randn(4, 8, 32)
        >>> s = factored_scores(q, q, per_head=True)  # W_q = W_k: every M_h is symmetric
        >>> round(s.symmetry, 4), [round(x, 4) for x in s.head_symmetry]
        (1.0, [1.0, 1.0, 1.0, 1.0])
    """
    table = score_factors(query, key, ("symmetry", "directionality"), per_head=per_head,
                          num_std=num_std, dtype=dtype).cpu().tolist()
    nan = float("nan")
    out = FactoredScores(table[0][0] if layer else nan, table[1][0] if layer else nan)
    if per_head:
        out.head_symmetry, out.head_directionality = table[0][1:], table[1][1:]
    return out


class _Lazy:
    """A value built once, on first use (shared by the layer's ``parts`` and the head columns)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make, self._value = make, None

    def get(self) -> Any:
        if self._value is None:
            self._value = self._make()
        return self._value


# ------------------------------------------------------------------------------------ tables
def table_entries(metrics: Sequence[str], table: Any) -> Iterator[tuple[int | None, str, float]]:
    """``(head, metric, value)`` of a host table ``(len(metrics), 1 + H)``; ``head`` ``None`` = layer."""
    for i, metric in enumerate(metrics):
        for col in range(len(table[i])):
            yield (None if col == 0 else col - 1), metric, float(table[i][col])


def table_rows(layer: Any, metrics: Sequence[str], table: Any) -> list[Row]:
    """Rows ``{group, layer, name, head, <metric>: value, ...}``: the layer row, then one per head."""
    base = {"group": layer.group, "layer": layer.layer, "name": layer.name}
    rows: dict[int | None, Row] = {}
    for head, metric, value in table_entries(metrics, table):
        rows.setdefault(head, {**base, "head": head})[metric] = value
    return list(rows.values())
