"""The live probe's ``qk_update``: a score pair that remembers the previous snapshot of each layer.

:class:`QKUpdatePair` reads the same ``W_q``, ``W_k`` as the W_qk pair (nothing more is gathered)
and writes one metric, ``qk_update = ||W_qk(t) - W_qk(t')||_F / ||W_qk(t')||_F`` since the
previous snapshot ``t'`` that scored the layer (the maths: :mod:`attn_probe.core.update`). It is
added by naming the metric: ``watch(model, metrics=[..., "qk_update"])``
(:func:`split_update_metric`, :func:`with_update_pair`).

**What it keeps, and where.** On the host (CPU memory), not on the device: the device's memory
belongs to training, and a snapshot already ends with a host transfer. For each layer, in the
walk's order, while the total stays within ``host_bytes`` (:data:`EXACT_HOST_BYTES`, 2 GiB): a
copy of its ``W_q``, ``W_k`` in the weights' dtype (``(H + H_kv) * head_dim * d * itemsize``
bytes), for the exact value. Layers past the budget keep a sketch instead, ``S = W_qk Omega``
with ``Omega`` ``d x r`` (``r`` = :data:`~attn_probe.core.update.SKETCH_COLUMNS`, 32), float32:
``4 * d * r * (1 + H * per_head)`` bytes, and ``||W_qk||_F^2`` exactly; their value has a relative
standard deviation of at most about ``sqrt(1 / (2 r))`` (13 % at 32); one warning names them.

**No value without a previous snapshot**: the first snapshot of a run, the first after a resume
(the previous factors are not in the checkpoint: the first value after a resume is *absent*, not
restored), and a layer whose shape changed (model surgery) write no ``qk_update`` row (the
assembly drops the NaN, :data:`attn_probe.core.update.ABSENT_WHEN_UNDEFINED`). Only the main process scores, so the value
is the same with any number of ranks. A failure is warned once, counted in :attr:`QKUpdatePair.failures`,
and gives no row; the other metrics go on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from ...core import check_metrics
from ...core.update import (
    SKETCH_COLUMNS,
    UPDATE_METRIC,
    exact_update_sq,
    frobenius_sq,
    sketch,
    sketch_matrix,
    sketch_update_sq,
    update_rate,
)
from ...extraction import AttentionLayer
from ...isolation import safe_warn
from ...scoring.pairs import QKPair

__all__ = ["QKUpdatePair", "EXACT_HOST_BYTES", "split_update_metric", "with_update_pair"]

Tensor = torch.Tensor

#: host bytes the exact copies of the previous factors may take, all layers together
EXACT_HOST_BYTES = 2 << 30


@dataclasses.dataclass
class _Previous:
    """One layer's previous snapshot: rows ``row`` of host stacks (exact: factors; sketch: S, ||M||^2)."""

    signature: tuple
    exact: bool
    row: int
    first: Tensor  # exact: the query stack; sketch: the sketch stack
    second: Tensor  # exact: the key stack; sketch: ||M||_F^2, float64
    nbytes: int


def _host_copy(t: Tensor) -> Tensor:
    return t.detach().to("cpu", copy=True)


def _rows(entries: Sequence[_Previous], attr: str, device: torch.device) -> Tensor:
    """The entries' rows of one host stack as a device stack: the stored stack itself when the
    entries are its rows in order (the usual case: no copy on the host), else stacked."""
    base = getattr(entries[0], attr)
    if base.shape[0] == len(entries) and all(getattr(e, attr) is base and e.row == i for i, e in enumerate(entries)):
        stacked = base
    else:
        stacked = torch.stack([getattr(e, attr)[e.row] for e in entries])
    return stacked.to(device)


class QKUpdatePair(QKPair):
    """``qk_update`` of the W_qk pair, per layer and head (see the module docstring).

    ``host_bytes``: the budget of the exact copies; ``sketch_columns``: ``r`` of the sketch.
    A copy (``copy.copy``, a pickle) starts with no previous snapshot; :meth:`fresh` too.
    """

    metrics: tuple[str, ...] = (UPDATE_METRIC,)
    prefix = ""

    def __init__(self, metrics: Sequence[str] | None = None, *, dtype: torch.dtype = torch.float32,
                 host_bytes: int = EXACT_HOST_BYTES, sketch_columns: int = SKETCH_COLUMNS) -> None:
        if metrics is not None and tuple(metrics) not in ((), (UPDATE_METRIC,)):
            raise ValueError(f"QKUpdatePair writes {UPDATE_METRIC!r} only, got metrics={list(metrics)!r}")
        if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < 0:
            raise ValueError(f"host_bytes must be an int >= 0, got {host_bytes!r}")
        if isinstance(sketch_columns, bool) or not isinstance(sketch_columns, int) or sketch_columns < 1:
            raise ValueError(f"sketch_columns must be an int >= 1, got {sketch_columns!r}")
        self.core_metrics = ()
        self.metrics = (UPDATE_METRIC,)
        self.dtype = dtype
        self.host_bytes = host_bytes
        self.sketch_columns = sketch_columns
        self._clear()

    def _clear(self) -> None:
        self._previous: dict[tuple[str, int], _Previous] = {}
        self._omega: dict[tuple[int, torch.device], Tensor] = {}
        self._now: tuple[Tensor, Tensor] | None = None  # this call's sketches and ||M||^2, until kept
        #: bytes of exact copies held now; layers kept as sketches; failures (the first warned)
        self.held_bytes = 0
        self.sketched: set[tuple[str, int]] = set()
        self.failures = 0

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        return {**state, "held_bytes": 0, "sketched": set(), "failures": 0}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._previous, self._omega, self._now = {}, {}, None

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.dtype, self.host_bytes, self.sketch_columns))

    def fresh(self) -> QKUpdatePair:
        """The same settings, no previous snapshot (each probe gets its own)."""
        return QKUpdatePair(dtype=self.dtype, host_bytes=self.host_bytes, sketch_columns=self.sketch_columns)

    # -- scoring ---------------------------------------------------------------------------------
    def score(self, layer: AttentionLayer, query: Tensor, key: Tensor, *, per_head: bool, num_std: float) -> Tensor:
        return self.score_layers([layer], query[None], key[None], per_head=per_head, num_std=num_std)[0]

    def score_layers(self, layers: Sequence[AttentionLayer], queries: Tensor, keys: Tensor, *, per_head: bool,
                     num_std: float) -> Tensor:
        """``(L, 1, 1 + H * per_head)`` float64 on the weights' device: the rate since each layer's previous
        snapshot (NaN: none), and the layers' current snapshot kept for the next call. Never raises."""
        n = queries.shape[0]
        try:
            return self._rates(layers, queries, keys, per_head)[:, None]
        except Exception as exc:  # noqa: BLE001 - the other metrics go on; no row for this one
            self.failures += 1
            self._previous.clear()  # no value measured against a half-updated state
            self.held_bytes = 0
            if self.failures == 1:
                safe_warn(f"attn_probe: {UPDATE_METRIC} could not be measured ({type(exc).__name__}: {exc}); it is "
                          "not logged for this snapshot. The other metrics are not affected. Later failures are "
                          "counted, not reported.")
        return self._nan(n, queries, per_head)[:, None]

    def _rates(self, layers: Sequence[AttentionLayer], queries: Tensor, keys: Tensor, per_head: bool) -> Tensor:
        n = len(layers)
        names = [(layer.group, layer.layer) for layer in layers]
        signature = (tuple(queries.shape[1:]), tuple(keys.shape[1:]), queries.dtype, per_head)
        per_layer = (queries[0].numel() + keys[0].numel()) * queries.element_size()
        previous: list[_Previous | None] = []
        exact: list[bool] = []
        for name in names:
            prev = self._previous.get(name)
            if prev is not None and prev.signature != signature:  # model surgery: start over for this layer
                self.held_bytes -= prev.nbytes
                prev = None
            previous.append(prev)
            if prev is not None:
                exact.append(prev.exact)
            elif self.held_bytes + per_layer <= self.host_bytes:
                exact.append(True)
                self.held_bytes += per_layer  # reserved now, kept below
            else:
                exact.append(False)
        values: Tensor | None = None
        for mode in (True, False):
            idx = [i for i in range(n) if exact[i] == mode]
            if not idx:
                continue
            whole = len(idx) == n
            index = None if whole else torch.tensor(idx, device=queries.device)
            q = queries if whole else queries.index_select(0, index)
            k = keys if whole else keys.index_select(0, index)
            rates = self._exact(q, k, [previous[i] for i in idx], per_head) if mode else \
                self._sketched(q, k, [previous[i] for i in idx], per_head)
            if rates is not None:
                if whole:
                    values = rates
                else:
                    if values is None:
                        values = self._nan(n, queries, per_head)
                    values[index] = rates
            self._keep(mode, [names[i] for i in idx], signature, q, k, per_head, per_layer)
        return values if values is not None else self._nan(n, queries, per_head)

    @staticmethod
    def _nan(n: int, queries: Tensor, per_head: bool) -> Tensor:
        return torch.full((n, 1 + queries.shape[1] * per_head), math.nan, dtype=torch.float64, device=queries.device)

    def _exact(self, q: Tensor, k: Tensor, previous: list[_Previous | None], per_head: bool) -> Tensor | None:
        if any(p is None for p in previous):  # a layer new to this pair: none of this call's have a value
            return None if all(p is None for p in previous) else self._partial(q, k, previous, per_head, True)
        num, den = exact_update_sq(q, k, _rows(previous, "first", q.device), _rows(previous, "second", q.device),
                                   per_head=per_head, dtype=self.dtype)
        return update_rate(num, den)

    def _sketched(self, q: Tensor, k: Tensor, previous: list[_Previous | None], per_head: bool) -> Tensor | None:
        self._now = sketch(q, k, self._sketch_matrix(q.shape[-1], q.device), per_head=per_head, dtype=self.dtype), \
            frobenius_sq(q, k, per_head=per_head, dtype=self.dtype)
        if any(p is None for p in previous):
            return None if all(p is None for p in previous) else self._partial(q, k, previous, per_head, False)
        num = sketch_update_sq(self._now[0], _rows(previous, "first", q.device))
        return update_rate(num, _rows(previous, "second", q.device))

    def _partial(self, q: Tensor, k: Tensor, previous: list[_Previous | None], per_head: bool,
                 exact: bool) -> Tensor:
        """Some layers have a previous snapshot, some not (after model surgery): those alone."""
        have = [i for i, p in enumerate(previous) if p is not None]
        index = torch.tensor(have, device=q.device)
        kept = [previous[i] for i in have]
        out = self._nan(len(previous), q, per_head)
        if exact:
            num, den = exact_update_sq(q.index_select(0, index), k.index_select(0, index), _rows(kept, "first", q.device),
                                       _rows(kept, "second", q.device), per_head=per_head, dtype=self.dtype)
        else:
            num = sketch_update_sq(self._now[0].index_select(0, index), _rows(kept, "first", q.device))
            den = _rows(kept, "second", q.device)
        out[index] = update_rate(num, den)
        return out

    def _keep(self, exact: bool, names: list[tuple[str, int]], signature: tuple, q: Tensor, k: Tensor,
              per_head: bool, per_layer: int) -> None:
        """Keep this snapshot of ``names`` on the host for the next call."""
        if exact:
            first, second, nbytes = _host_copy(q), _host_copy(k), per_layer
        else:
            s, frob = self._now
            first, second, nbytes = _host_copy(s), _host_copy(frob), 0
            self._now = None
            if not set(names) <= self.sketched:
                self.sketched.update(names)
                safe_warn(f"attn_probe: {UPDATE_METRIC}: the previous W_q, W_k of {len(self.sketched)} layer(s) "
                          f"would pass the host budget ({self.host_bytes / 2**20:.0f} MiB); their value comes "
                          f"from a seeded sketch of {self.sketch_columns} columns (relative sd at most about "
                          f"{100 * math.sqrt(1 / (2 * self.sketch_columns)):.0f} %, docs/scores.md).")
        for row, name in enumerate(names):
            self._previous[name] = _Previous(signature, exact, row, first, second, nbytes)

    def _sketch_matrix(self, d: int, device: torch.device) -> Tensor:
        key = (d, device)
        if key not in self._omega:
            self._omega[key] = sketch_matrix(d, self.sketch_columns, device=device, dtype=self.dtype)
        return self._omega[key]


def split_update_metric(metrics: Sequence[str] | str | None) -> tuple[tuple[str, ...], bool]:
    """``(validated metric names, whether qk_update is among them)``: the core's names are checked by
    :func:`attn_probe.core.check_metrics` (one-line ``ValueError``); ``qk_update`` may stand among them."""
    if metrics is None:
        return check_metrics(None), False
    names = (metrics,) if isinstance(metrics, str) else tuple(metrics)
    if names.count(UPDATE_METRIC) > 1:
        raise ValueError(f"metrics repeat a name: {list(names)}")
    asked = UPDATE_METRIC in names
    core = tuple(m for m in names if m != UPDATE_METRIC)
    if core or not asked:
        check_metrics(core)
    return names, asked


def with_update_pair(pairs: list[Any], asked: bool) -> list[Any]:
    """``pairs`` with a fresh :class:`QKUpdatePair` in place of any given one, and appended when
    ``asked`` and none is there (one per probe: each keeps its own previous snapshot)."""
    out = [p.fresh() if isinstance(p, QKUpdatePair) else p for p in pairs]
    if asked and not any(isinstance(p, QKUpdatePair) for p in out):
        out.append(QKUpdatePair(dtype=getattr(out[0], "dtype", torch.float32) if out else torch.float32))
    return out
