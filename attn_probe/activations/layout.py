"""One attention call of a watched layer checked against the layer's reading (the live half of the layout check).

:func:`layout_result` turns what the capture holds at a layer's first counted eager call (the module's
input, the q/k its attention call received) into :func:`~attn_probe.extraction.layout_check.check_layout`'s
inputs. :class:`~attn_probe.activations.statistics.AttentionCapture` (``layout_check=True``, the probe's
stage) keeps each layer's input from its pre-hook to its first counted eager attention call, calls
:func:`layout_result` there, drops the input and holds the result in ``layout_results``; the layer is
not checked again. Inside a compiled graph nothing is kept or checked (the layer waits for an eager call).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..extraction.base import AttentionLayer
from ..extraction.layout_check import LayoutCheck, check_layout

Tensor = torch.Tensor

__all__ = ["QK_NORMS", "LayoutWatch", "layout_result"]

#: names of a module's own transform of q/k after the projection (QK-norm), outside W_qk by definition
QK_NORMS = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"), ("query_layernorm", "key_layernorm"))


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)

#: tokens the check reads at most (evenly strided): its float64 work stays near ``H x 1024 x (2 dh + 2)``
MAX_TOKENS = 1024


def _stochastic(module: nn.Module | None, result: LayoutCheck) -> LayoutCheck:
    """A ``mismatch`` where dropout is active inside the attention module (a PEFT LoRA's
    ``lora_dropout`` on the projection's input, say) is not evidence against the reading: the forward's
    q/k are not a function of ``x`` and the weights alone. Recorded ``unverified``, never refused."""
    if result.verdict != "mismatch" or module is None:
        return result
    if any(isinstance(m, _DROPOUTS) and m.training and m.p > 0 for m in module.modules()):
        return LayoutCheck("unverified", (), None, f"dropout is active in the projections: {result.line}",
                           result.residuals)
    return result


def _sharded(wq: Tensor, wk: Tensor, query: Tensor, key: Tensor, layer: AttentionLayer) -> bool:
    """True where this process sees part of the layer: its factors are DTensors, or the attention call
    received other head counts than the layer has while several processes run (tensor parallel).
    A head-count difference in one process is a wrong reading and stays the check's ``mismatch``."""
    try:
        from torch.distributed.tensor import DTensor  # public since torch 2.4
    except ImportError:
        DTensor = ()  # noqa: N806 - no DTensor in this torch: nothing is one
    if any(isinstance(t, DTensor) for t in (wq, wk, query, key)):
        return True
    several = (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and (torch.distributed.get_world_size() > 1)
    )
    return several and (
        query.shape[1] != layer.num_heads or key.shape[1] not in (layer.num_kv_heads, layer.num_heads)
    )


def layout_result(layer: AttentionLayer, x: Tensor, query: Tensor, key: Tensor) -> LayoutCheck:
    """:func:`~attn_probe.extraction.layout_check.check_layout` of ``layer``'s factors against one
    self-attention call: ``x (B, L, d)`` its module's input, ``query (B, H, L, dh)``, ``key (B, Hs, L, dh)``
    what the attention call received. ``unverified`` where the call does not read ``x`` position by
    position (cross-attention, a key length other than ``L``) or where the module normalises q/k after
    the projection (QK-norm) and the check does not reproduce it with the module's own norms."""

    def unverified(line: str) -> LayoutCheck:
        return LayoutCheck("unverified", (), None, line, {})

    if layer.group == "cross":
        return unverified("cross-attention: the keys do not come from the layer's input")
    if x.dim() != 3 or query.dim() != 4 or key.dim() != 4:
        return unverified(
            f"input {tuple(x.shape)} or q/k {tuple(query.shape)}/{tuple(key.shape)} not read "
            "as (batch, length, width) and (batch, heads, length, head_dim)"
        )
    batch, length = x.shape[:2]
    if query.shape[0] != batch or key.shape[0] != batch or query.shape[2] != length or key.shape[2] != length:
        return unverified(
            f"the attention call's q/k lengths {query.shape[2]}/{key.shape[2]} are not the "
            f"input's {length} (a cache or other keys)"
        )
    wq, wk = layer.factors()
    if _sharded(wq, wk, query, key, layer):
        return unverified(
            "several processes with sharded weights or heads (FSDP, tensor parallel): the check runs "
            "where a process holds whole projections and whole heads"
        )
    q_seen = query.detach().transpose(1, 2).reshape(batch * length, query.shape[1], query.shape[3])
    k_seen = key.detach().transpose(1, 2).reshape(batch * length, key.shape[1], key.shape[3])
    module = layer.module
    norms = (
        next(
            (
                (getattr(module, a), getattr(module, b))
                for a, b in QK_NORMS
                if isinstance(getattr(module, a, None), nn.Module)
            ),
            None,
        )
        if module is not None
        else None
    )
    tokens = max(MAX_TOKENS, 8 * wq.shape[1] + 8)  # well above the fits' 2 dh + 2 unknowns, bounded memory
    if norms is None:
        return _stochastic(module, check_layout(x.reshape(batch * length, -1), wq, wk, q_seen, k_seen,
                                                max_tokens=tokens))

    def post(norm: nn.Module) -> Callable[[Tensor], Tensor]:
        return lambda t: norm(t.to(x.dtype))  # the module's own norm, per head (as Qwen3, OLMo's per-head)

    try:
        result = check_layout(
            x.reshape(batch * length, -1),
            wq,
            wk,
            q_seen,
            k_seen,
            q_post=post(norms[0]),
            k_post=post(norms[1]),
            max_tokens=tokens,
        )
    except Exception as exc:  # noqa: BLE001 - a norm over all heads cannot be applied per head
        return unverified(
            f"the module normalises q/k after the projection (QK-norm, outside W_qk by "
            f"definition) in a way the check cannot apply ({type(exc).__name__})"
        )
    if result.verdict == "ok":
        return result
    return unverified(
        "the module normalises q/k after the projection (QK-norm, outside W_qk by definition) "
        f"and the check did not reproduce it: {result.line}"
    )


class LayoutWatch:
    """Which layers of a capture are still to be checked, the input each keeps from its module's
    pre-hook to its attention call, and the results. ``check`` never raises and never runs inside
    a compiled graph (the callers test ``torch.compiler.is_compiling()`` before touching the set, so
    the compiler never guards on it)."""

    def __init__(self, layers: list[AttentionLayer] | tuple[AttentionLayer, ...], enabled: bool) -> None:
        self.layers = layers
        self.pending: set[int] = set(range(len(layers))) if enabled else set()
        self.inputs: dict[int, Tensor] = {}  # kept from the pre-hook to the layer's attention call only
        self.results: dict[int, LayoutCheck] = {}  #: per layer index, the check of its reading

    def keep(self, i: int, x: Tensor) -> None:
        if not torch.compiler.is_compiling() and i in self.pending:
            self.inputs[i] = x.detach()

    def check(self, i: int, query: Tensor, key: Tensor, off: Callable[[str], object]) -> None:
        """Layer ``i``'s reading checked once (:func:`layout_result`) under ``off(device_type)``
        (autocast off); a check that cannot run is recorded ``unverified``."""
        if torch.compiler.is_compiling() or i not in self.pending:
            return
        x = self.inputs.pop(i, None)
        if x is None:
            return
        self.pending.discard(i)
        try:
            with torch.no_grad(), off(query.device.type):
                result = layout_result(self.layers[i], x, query, key)
        except Exception as exc:  # noqa: BLE001 - recorded as such, never raised into training
            result = LayoutCheck("unverified", (), None, f"the check could not run ({type(exc).__name__}: {exc})", {})
        self.results[i] = result
