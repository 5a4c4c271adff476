"""Attention statistics of modules that call torch's own attention, ``F.scaled_dot_product_attention``.

nanoGPT, timm, LitGPT, torchtitan (0.2) and torchtune compute attention with
``torch.nn.functional.scaled_dot_product_attention`` themselves, not through transformers'
attention interface. :class:`~attn_probe.activations.statistics.AttentionCapture` measures those
calls too: a watched layer whose module does not call the interface
(:func:`measured_by_sdpa`) is an *sdpa layer*. While the capture is armed, a forward pre-hook
and an always-called forward hook on each sdpa layer's module (registered for the capture's life,
doing nothing unarmed) keep a stack of the sdpa layers running, and :class:`SdpaMode` (a :class:`torch.overrides.TorchFunctionMode`) sees every call
of ``scaled_dot_product_attention`` made while the watched model's counted forward runs,
however the function was imported (``F.``, ``torch.nn.functional.``, a local name): a call
made while an sdpa layer is running (directly or in a child module, as torchtitan's
``self.sdpa``) is that layer's, other calls (unwatched modules, transformers' own sdpa
function) pass straight through. :func:`sdpa_call` reads the call as torch does:

- ``query (B, H, Lq, E)``, ``key (B, H_kv, Lk, E)`` (``H_kv = H`` or, with ``enable_gqa``,
  a divisor of ``H``: query head ``h`` meets key head ``h // (H / H_kv)``, torch's
  ``repeat_interleave``); ``scale`` or ``E ** -0.5``;
- ``attn_mask``: boolean (``True`` = takes part) or additive float, broadcast to
  ``(B, H, Lq, Lk)``; ``is_causal``: upper-left causal (:func:`attn_probe.activations.masks.sdpa_row_mask`).

``dropout_p`` is not applied: the statistics describe the attention distribution before dropout.

**Where the mode is pushed.** Only inside a counted forward of the watched model, and only when
some watched layer is an sdpa layer (the capture's forward pre-hook on the model pushes it, its
always-called forward hook pops it: well nested within the forward, on the thread that runs it);
never during backward, the optimizer step, evaluation under ``no_grad`` or steps that are not due.

**torch.compile.** The mode stack is part of what the compiler guards on at the entry of a
compiled frame (module hooks are not): a due step does not reuse code compiled without the
probe, also code compiled before the probe attached (a model of the same class compiled earlier
in the process); it compiles one more variant with the mode, the hooks and the statistics, once:
the traced hooks are guarded by their ids (``hook_id in module._forward_hooks_always_called``),
which stay the same from attach to close. Steps that are not due run the code compiled without
the probe. Models measured through
transformers' interface alone do not get the mode: with it, Llama under ``torch.compile``
failed in torch 2.13 (the root hooks are traced there, and a graph break inside the interface
wrapper under the mode left a corrupted state: ``Tensor.device`` read a ``Size``); for them code
compiled before attach stays a warned and counted cause of missing rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import registry as registry
from .flex import FLEX
from .masks import RowMask, sdpa_row_mask

if TYPE_CHECKING:
    from ..extraction.base import AttentionLayer

Tensor = torch.Tensor

#: the function intercepted (``torch.nn.functional.scaled_dot_product_attention`` is the builtin itself)
SDPA = torch.nn.functional.scaled_dot_product_attention

#: its parameters in order (positional arguments are read by position)
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def measured_by_sdpa(layer: AttentionLayer) -> bool:
    """Whether ``layer`` is measured from its module's ``scaled_dot_product_attention`` calls
    (its module does not call transformers' attention interface)."""
    return layer.module is not None and not registry.calls_interface(layer.module)


def unavailable_reason(layers: Sequence[AttentionLayer]) -> str | None:
    """``None`` if every layer can be measured (through transformers' interface, or from its
    ``scaled_dot_product_attention`` calls); else one line saying why not."""
    interface = [layer for layer in layers if not measured_by_sdpa(layer)]
    if not layers or interface:
        return registry.unavailable_reason(interface if layers else layers)
    return None


def sdpa_call(args: tuple, kwargs: dict, heads: int) -> tuple[Tensor, Tensor, float, RowMask]:
    """``(query, key, scale, rows)`` of one ``scaled_dot_product_attention(*args, **kwargs)`` call
    of a layer with ``heads`` query heads; ``ValueError`` for a call it cannot read."""
    bound: dict[str, Any] = dict(zip(_PARAMS, args, strict=False))
    bound.update(kwargs)
    query, key = bound.get("query"), bound.get("key")
    if not isinstance(query, Tensor) or not isinstance(key, Tensor) or query.dim() != 4 or key.dim() != 4:
        raise ValueError("scaled_dot_product_attention was called without 4D (batch, heads, length, dim) "
                         "query and key")
    if query.shape[1] != heads:
        raise ValueError(f"scaled_dot_product_attention received {query.shape[1]} query heads, the layer "
                         f"has {heads} (heads sharded by tensor parallelism are not measured)")
    if heads % key.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {key.shape[1]} key heads")
    scale = bound.get("scale")
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    mask = bound.get("attn_mask")
    rows = sdpa_row_mask(mask if isinstance(mask, Tensor) else None, bool(bound.get("is_causal", False)),
                         query.shape[2], key.shape[2], query.device)
    return query, key, scale, rows


class SdpaMode(TorchFunctionMode):
    """Hands every ``scaled_dot_product_attention`` call to ``observe(args, kwargs)`` and every
    run of flex's operator to ``observe_flex(args, kwargs, traced)`` (neither raises), then makes
    the call; every other function passes straight through. Nothing else is stored, so a copy of
    the model or a pickle never meets it (it lives on the mode stack only)."""

    def __init__(self, observe: Any, observe_flex: Any = None) -> None:
        super().__init__()
        self.observe = observe
        self.observe_flex = observe_flex

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is SDPA:
            self.observe(args, kwargs)
        elif func is FLEX and FLEX is not None and self.observe_flex is not None:
            # flex's operator: while a compiler traces it (flex's own compile, a library's, the
            # user's) and when a graph from flex's own compile runs it (attn_probe.activations.flex)
            self.observe_flex(args, kwargs, torch.compiler.is_compiling())
        return func(*args, **kwargs)


def running_hooks(running: list[int], i: int, layer: Any = None) -> tuple[Any, Any]:
    """``(pre, post)`` forward hooks of sdpa layer ``i``'s module: push ``i`` on ``running``, pop it.
    ``layer()``: a 0-d integer tensor (or ``None``) that holds the innermost running layer as data,
    for code a compiler traced once for every layer (flex, :mod:`attn_probe.activations.flex`)."""

    def enter(module: nn.Module, args: tuple) -> None:
        running.append(i)
        current = layer() if layer is not None else None
        if current is not None:
            current.fill_(i)

    def leave(module: nn.Module, args: tuple, output: object) -> None:
        if running and running[-1] == i:
            running.pop()
            current = layer() if layer is not None else None
            if current is not None and running:
                current.fill_(running[-1])

    return enter, leave


__all__ = ["SDPA", "SdpaMode", "measured_by_sdpa", "running_hooks", "sdpa_call", "unavailable_reason"]
