"""The flex half of :class:`~attn_probe.activations.statistics.AttentionCapture`: what one call of flex's
operator adds to the step's accumulators, eagerly or traced into a compiled graph (``flex_compiled``).

A mixin of the capture (its state is the capture's: the running stack, the accumulators, the
failure record); kept apart so the statistics module stays one reading. The rules are
:mod:`attn_probe.activations.flex`'s.
"""

from __future__ import annotations

import torch

from .flex import FlexCall, flex_stats
from .flex import trace_failed as flex_trace_failed
from .logits import autocast_off

Tensor = torch.Tensor

__all__ = ["FlexCalls"]


class FlexCalls:
    """Methods of the capture for flex calls (see the module doc)."""

    def _layer_tensor(self) -> Tensor | None:
        return self._layer if self.flex_compiled and self._buffers is not None else None

    def observe_flex(self, args: tuple, kwargs: dict, traced: bool = False) -> None:
        """One call of flex's operator inside a counted forward (from :class:`SdpaMode`;
        :mod:`attn_probe.activations.flex`): the innermost sdpa layer running, if any, adds its
        statistics; never raises. ``traced``: a compiler is tracing the call: only a counter goes
        into its graph, or, with ``flex_compiled``, the statistics too; else (real tensors) the
        call is measured here, unless a graph that measured it is the one running it."""
        if not self._running or not self._counted():
            return
        if traced:
            self.flex_in_graphs.add_(1)
            if self.flex_compiled:
                self._observe_flex_traced(args, kwargs)
            return
        i = self._running[-1]
        try:
            if self.flex_compiled and bool(self._pending):  # a CPU tensor: no wait on the device
                self._pending.sub_(1)
                return
            call = FlexCall(args, kwargs, self.heads[i], blocks=False)  # flex's eager rule
            self._accumulate(i, self._flex_stats(i, call), call.scale)
        except Exception as exc:  # never take training down
            self._fail(f"{self.names[i]} (flex_attention): {exc!r}", i)
            return
        self._check_layout(i, call.query, call.key)

    def _observe_flex_traced(self, args: tuple, kwargs: dict) -> None:
        """The statistics of one flex call, traced into the compiled graph (``flex_compiled``). With
        equal layers the layer is data (``self._layer``, set by the layers' hooks): one graph
        serves every layer. The arithmetic goes into opaque operators
        (:func:`~attn_probe.activations.flex.compiled_ops`); an exception while tracing leaves the call untraced and is kept for :meth:`collect`
        (the step's values dropped, warned once, counted)."""
        same = len(set(self.heads)) == 1 and len({layer.group for layer in self.layers}) == 1
        i = 0 if same else self._running[-1]
        try:
            call = FlexCall(args, kwargs, self.heads[i])
            stats = self._flex_stats(i, call, owner=self._owner)
            with torch.no_grad():
                if same:
                    self._accumulate_at(stats, call.scale)
                else:
                    self._accumulate(i, stats, call.scale)
                self._pending.add_(1)
        except Exception as exc:  # noqa: BLE001 - not traced: the step's values are dropped, warned once, counted
            flex_trace_failed(self._owner, type(exc).__name__)

    def _flex_stats(self, i: int, call: FlexCall, owner: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:func:`flex_stats` of one call of layer ``i`` (no gradients, autocast off; may raise);
        ``owner``: traced into a compiled graph, the arithmetic in opaque operators."""
        query = call.query
        with torch.no_grad(), autocast_off(query.device.type):
            return flex_stats(call, query_valid=self._query_mask(i, query.shape[0], query.shape[2]),
                              chunk_elements=self.chunk_elements, entropy_rows=self.entropy_rows, entropy_seed=i,
                              owner=owner)

    def _accumulate_at(self, stats: tuple[Tensor, Tensor, Tensor, Tensor], scaling: float) -> None:
        """:meth:`_accumulate` for the layer ``self._layer`` holds (layers of equal head counts)."""
        mx, ent_sum, tokens, _, scale, seen, signed = self._buffers
        layers, at = len(self.layers), self._layer.view(1)  # an index tensor: no read of its value
        for buf, value, keep_max in ((mx, stats[0], True), (ent_sum, stats[1], False),
                                     (tokens, stats[2], False), (signed, stats[3], True)):
            rows = buf.view(layers, -1)
            old = rows.index_select(0, at)  # (1, H)
            rows.index_copy_(0, at, torch.maximum(old, value.to(old)) if keep_max else old + value.to(old))
        scale.index_fill_(0, at, float(scaling))
        seen.index_add_(0, at, torch.ones(1, dtype=seen.dtype, device=seen.device))

