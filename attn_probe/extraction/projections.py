"""How to read one projection's effective ``(out, in)`` weight, the adapter state in force included.

A projection may be an ``nn.Linear`` (its weight dequantized when it is a quantized tensor with a
public ``get_original_weight()``, as torchao's ``NF4Tensor``: torchtune's QLoRA), a transformers
``Conv1D`` (weight stored ``in x out``, transposed here), a PEFT LoRA wrapper (``W + scale * B @ A``
in the adapter state of the moment the weights are read) or a torchtune ``LoRALinear``/``DoRALinear``
(:mod:`attn_probe.extraction.torchtune_adapters`). Part of the architecture knowledge
(:mod:`attn_probe.extraction.architectures`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .base import ParamGetter, Tensor, UnsupportedModelError
from .torchtune_adapters import dense, is_torchtune_adapter, torchtune_weight


# --------------------------------------------------------------------------- projections
@dataclass(frozen=True)
class Projection:
    """How to read the effective ``(out, in)`` weight of one projection module."""

    param_names: tuple[str, ...]
    out_features: int
    in_features: int
    weight: Callable[[ParamGetter], Tensor]


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def is_lora(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT LoRA wrapper (its weight is ``base_layer`` plus the adapter)."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")


def projection(module: nn.Module, path: str) -> Projection | None:
    """A :class:`Projection` for ``module`` at ``path``, or ``None`` if it is not linear."""
    prefix = f"{path}." if path else ""
    if is_lora(module):
        return _lora_projection(module, path, prefix)
    if is_torchtune_adapter(module):
        names, out_features, in_features, weight = torchtune_weight(module, path, prefix)
        return Projection(names, out_features, in_features, weight)
    if isinstance(module, nn.Linear):
        weight = getattr(module, "weight", None)
        if weight is not None and not weight.is_floating_point() and not hasattr(weight, "get_original_weight"):
            raise UnsupportedModelError(
                f"{path}: weight is quantized ({type(weight).__name__}, {weight.dtype}); "
                "attn_probe reads floating-point projection weights only (dequantize or merge first)"
            )
        name = f"{prefix}weight"
        return Projection((name,), module.out_features, module.in_features,
                          lambda get: dense(get(name), path))
    if _is_conv1d(module):
        name = f"{prefix}weight"
        return Projection((name,), module.nf, module.nx, lambda get: get(name).T)
    return None


def _lora_projection(module: nn.Module, path: str, prefix: str) -> Projection | None:
    """A PEFT LoRA wrapper: declares the base weight and every attached adapter's A/B (so a sharded
    walk gathers whichever is active); the adapter state is read each time the weight is."""
    base = projection(module.base_layer, f"{prefix}base_layer")
    if base is None:
        return None
    _applied_adapters(module, path)  # DoRA in use: refused now, not at the first snapshot
    declared = [a for a in module.lora_A if a in module.lora_B]
    factors = {a: (f"{prefix}lora_A.{a}.weight", f"{prefix}lora_B.{a}.weight") for a in declared}

    def lora_weight(get: ParamGetter) -> Tensor:
        w = base.weight(get)
        sign, adapters = _applied_adapters(module, path)
        for a in adapters:
            if a not in factors:
                raise UnsupportedModelError(
                    f"{path}: adapter {a!r} was added after its layer was found; find the layers again"
                )
            a_name, b_name = factors[a]
            w = w + sign * float(module.scaling[a]) * (get(b_name).to(w.dtype) @ get(a_name).to(w.dtype))
        return w

    names = base.param_names + tuple(n for pair in factors.values() for n in pair)
    return Projection(names, base.out_features, base.in_features, lora_weight)


def _applied_adapters(module: nn.Module, path: str) -> tuple[float, list[str]]:
    """``(sign, adapters)``: the deltas ``scale * B A`` to add to the base weight now, as PEFT's
    forward computes. Merged: none (the base weight holds them). Disabled: the merged ones are
    taken out (the forward unmerges them first). Otherwise: the active adapters."""
    if getattr(module, "disable_adapters", False):
        sign, adapters = -1.0, list(getattr(module, "merged_adapters", []))
    elif getattr(module, "merged", False):
        sign, adapters = 1.0, []
    else:
        active = getattr(module, "active_adapters", None)
        if active is None:
            active = getattr(module, "active_adapter", [])
        sign, adapters = 1.0, [a for a in ([active] if isinstance(active, str) else active) if a in module.lora_A]
    variants = getattr(module, "lora_variant", {})
    for a in adapters:
        dora = getattr(module, "use_dora", {}).get(a, False)
        if dora or a in variants:
            kind = "DoRA" if dora else type(variants[a]).__name__
            raise UnsupportedModelError(
                f"{path}: {kind} adapters are not supported; merge them first (model.merge_and_unload())"
            )
    return sign, adapters


def attached_adapters(attn: nn.Module) -> Callable[[], tuple[tuple[str, ...], ...]]:
    """A cheap callable naming the adapters attached to each LoRA projection under ``attn`` (the
    projections are found once, here): when its value changes, the layer's ``param_names`` are stale."""
    loras = [m for m in attn.modules() if is_lora(m)]
    return lambda: tuple(tuple(m.lora_A) for m in loras)


def child_projection(attn: nn.Module, path: str, name: str) -> Projection | None:
    """The :func:`projection` of ``attn``'s child module ``name`` (``None`` if it has none or it is not linear)."""
    child = getattr(attn, name, None)
    if not isinstance(child, nn.Module):
        return None
    return projection(child, f"{path}.{name}" if path else name)


__all__ = ["Projection", "projection", "is_lora", "attached_adapters", "child_projection"]
