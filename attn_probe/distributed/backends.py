"""What a sharded model's layers need to be gathered: the sharding kind, the plan of each layer
(parameters, owning FSDP1 units, layouts, the plan signature the ranks agree on), the FSDP1/DTensor/ZeRO-3
gathers and the memory reserved for them.

Two public seams, looked up on this module at every call, where tests observe or fail the walk:
:func:`plan_layer` (one layer's plan, on every rank, before the plan agreement) and
:func:`dtensor_full` (where a DTensor gather is issued)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..extraction import AttentionLayer
from ..extraction.architectures import unwrap

Tensor = torch.Tensor
Row = dict[str, Any]

logger = logging.getLogger("attn_probe.distributed")

#: Module-path segments inserted by wrappers (FSDP1, activation checkpointing, torch.compile).
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
_WRAPPER_RE = re.compile(r"(^|\.)(?:" + "|".join(WRAPPER_SEGMENTS) + r")(?=\.|$)")


# --------------------------------------------------------------------------- detection
def canonical_name(path: str) -> str:
    """``path`` without wrapper segments: ``layer.0._fsdp_wrapped_module.attn`` -> ``layer.0.attn``."""
    return _WRAPPER_RE.sub("", path).lstrip(".")


def fsdp1_class() -> type | None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except Exception:  # pragma: no cover - torch built without distributed
        return None
    return FullyShardedDataParallel


def dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover
        return None
    return DTensor


def sharding_kind(model: nn.Module) -> str:
    """How ``model``'s parameters are laid out: ``"fsdp1"``, ``"dtensor"``, ``"zero3"`` or ``"local"``.

    ``"local"`` (single process, DDP, ZeRO-1/2) needs no collective. Detection looks at
    module types and parameter attributes (ZeRO-3: ``ds_id``), never at shapes.
    """
    fsdp = fsdp1_class()
    if fsdp is not None and any(isinstance(m, fsdp) for m in model.modules()):
        return "fsdp1"
    dtensor = dtensor_class()
    for p in model.parameters():
        if dtensor is not None and isinstance(p, dtensor):
            return "dtensor"
        if hasattr(p, "ds_id"):
            return "zero3"
    return "local"


# --------------------------------------------------------------------------- plans
@dataclasses.dataclass
class Plan:
    layer: AttentionLayer
    refs: dict[str, tuple[nn.Module, str]]  # param name -> (owning module, attribute)
    units: tuple[nn.Module, ...] = ()  # FSDP1 units owning the q/k params, in parameter order


def fsdp_owners(model: nn.Module) -> dict[int, nn.Module]:
    """``id(module) -> innermost FSDP1 unit`` containing it (empty if there is no FSDP1)."""
    fsdp = fsdp1_class()
    owners: dict[int, nn.Module] = {}
    if fsdp is None:
        return owners

    def visit(module: nn.Module, unit: nn.Module | None) -> None:
        if isinstance(module, fsdp):
            unit = module
        if unit is not None:
            owners[id(module)] = unit
        for child in module.children():
            visit(child, unit)

    visit(model, None)
    return owners


def plan_layer(layer: AttentionLayer, model: nn.Module, owners: dict[int, nn.Module],
          names: tuple[str, ...] | None = None) -> Plan:
    refs: dict[str, tuple[nn.Module, str]] = {}
    units: list[nn.Module] = []
    prefix = f"{layer.name}." if layer.name else ""
    for name in names if names is not None else layer.param_names:
        if layer.module is not None and name.startswith(prefix):
            base, rel = layer.module, name[len(prefix) :]
        else:
            base, rel = unwrap(model), name
        path, _, attr = rel.rpartition(".")
        owner = base.get_submodule(path) if path else base
        refs[name] = (owner, attr)
        unit = owners.get(id(owner))
        if unit is not None and all(unit is not u for u in units):
            units.append(unit)
    return Plan(layer, refs, tuple(units))


def param_layout(value: Any) -> str:
    """How one parameter is laid out: what a gather of it does on this rank."""
    dtensor = dtensor_class()
    if dtensor is not None and isinstance(value, dtensor):
        return f"D{tuple(value.shape)}"
    if hasattr(value, "ds_id"):
        return f"Z{tuple(getattr(value, 'ds_shape', ()))}"
    return "L"  # read locally (FSDP1 views too: the owning units carry FSDP1's layout)


def plan_signature(plans: list[Plan]) -> int:
    """CRC of what the walk will gather: layer and parameter names, layouts, FSDP1 units."""
    text = "|".join(
        f"{canonical_name(p.layer.name)}:{','.join(p.refs)}:"
        f"{','.join(param_layout(getattr(m, a, None)) for m, a in p.refs.values())}:{len(p.units)}"
        for p in plans
    )
    return zlib.crc32(text.encode()) & 0x3FFFFFFF


def canonical_layer(layer: AttentionLayer) -> AttentionLayer:
    name = canonical_name(layer.name)
    return layer if name == layer.name else dataclasses.replace(layer, name=name)


# --------------------------------------------------------------------------- gathering
def fsdp1_root_ready(model: nn.Module) -> bool:
    """Make sure FSDP1's lazy init ran from the root (as the first forward would).

    Summoning a nested unit first would make that unit believe it is the root. The lazy
    init is local (no collective) and only run when ``model`` itself is the FSDP root; if it
    cannot be run, the snapshot is skipped (with a warning) until the first forward.
    """
    fsdp = fsdp1_class()
    units = [m for m in model.modules() if isinstance(m, fsdp)]
    if all(getattr(u, "_is_root", None) is not None for u in units):
        return True
    reason = "the model given is not the FSDP root"
    if isinstance(model, fsdp) and getattr(model, "_is_root", None) is None:
        try:
            from torch.distributed.fsdp._runtime_utils import _lazy_init

            _lazy_init(model, model)
            return True
        except Exception as exc:  # pragma: no cover - depends on torch internals
            reason = f"its lazy init failed ({type(exc).__name__}: {exc})"
    logger.warning(
        "attn_probe: FSDP is not initialised yet (no forward pass ran) and %s; skipping this "
        "snapshot. Snapshots work after the first forward.",
        reason,
    )
    return False


def fsdp1_gather(stack: contextlib.ExitStack, units: tuple[nn.Module, ...], rank0_only: bool) -> bool:
    """Summon the full parameters of ``units`` (collective); ``True`` if this rank holds them."""
    fsdp = fsdp1_class()
    holds = True
    world = torch.distributed.get_world_size()
    for unit in units:
        # with a sub-group, group-rank 0 may not be global rank 0: then every rank gets the data
        only0 = rank0_only and torch.distributed.get_world_size(unit.process_group) == world
        holds = holds and (not only0 or torch.distributed.get_rank() == 0)
        stack.enter_context(
            fsdp.summon_full_params(
                unit, recurse=False, writeback=False, rank0_only=only0, offload_to_cpu=False
            )
        )
    return holds


def dtensor_full(value: Tensor, asynchronous: bool = False) -> Tensor:
    """The full tensor of a DTensor (else ``value``); ``asynchronous``: issued, not waited for.

    The asynchronous result is waited for by its first use (:func:`waited`). Only a CUDA tensor
    is gathered asynchronously: there the transfer runs on the communication stream beside the
    scoring. A CPU gather (gloo) is always blocking: gloo and the scoring share the same cores,
    so there is nothing to overlap, and an in-flight functional all-gather on gloo aborted a
    rank with heap corruption once in CI (torch 2.13, FSDP2 with LoRA, not reproduced in 150
    snapshots since). The walk's order (issue the next layer's gather, then hand out this
    one) is the same on both devices.
    """
    dtensor = dtensor_class()
    if dtensor is None or not isinstance(value, dtensor):
        return value
    if not asynchronous or value.device.type != "cuda":
        return value.full_tensor()
    from torch.distributed.tensor import Replicate

    return value.redistribute(placements=[Replicate()] * value.device_mesh.ndim, async_op=True).to_local()


def waited(value: Tensor) -> Tensor:
    """``value`` as a plain tensor, once an asynchronous collective that produces it is done."""
    wait = getattr(value, "trigger_wait", None)  # AsyncCollectiveTensor (torch functional collectives)
    return wait() if callable(wait) else value


def zero3_params(values: Iterable[Tensor]) -> list[Tensor]:
    return [v for v in values if hasattr(v, "ds_id")]


ParamGetter = Callable[[str], Tensor]


@dataclasses.dataclass
class Gather:
    """One collective step of the walk: one layer, or (FSDP1) the layers of one summon."""

    plans: list[Plan]
    units: tuple[nn.Module, ...] = ()

    @property
    def names(self) -> str:
        return ", ".join(canonical_name(p.layer.name) for p in self.plans)


def plan_gathers(plans: list[Plan], kind: str) -> list[Gather]:
    if kind != "fsdp1":
        return [Gather([plan], plan.units) for plan in plans]
    runs: list[Gather] = []
    for plan in plans:  # FSDP1: consecutive layers that share their owning units share one summon
        if runs and [id(u) for u in runs[-1].units] == [id(u) for u in plan.units]:
            runs[-1].plans.append(plan)
        else:
            runs.append(Gather([plan], plan.units))
    return runs


def fsdp1_shapes(units: tuple[nn.Module, ...]) -> tuple[dict[tuple[int, str], torch.Size], list[Tensor]]:
    """FSDP1: full shapes of the units' original parameters, and their flat parameters."""
    shapes: dict[tuple[int, str], torch.Size] = {}
    flats: list[Tensor] = []
    for unit in units:
        flat = unit._handle.flat_param  # private: the unit's FlatParameter
        flats.append(flat)
        for info, shape in zip(flat._param_infos, flat._shapes, strict=True):
            shapes[(id(info.module), info.param_name)] = shape
    return shapes, flats


def reserve_gather_memory(gather: Gather, kind: str) -> dict[tuple[int, str], Tensor]:
    """Allocate, before the ranks agree to a gather, the memory that gather will take.

    Returns empty tensors of the full shapes (views of the reservation), keyed by
    ``(plan index, parameter name)``, for a dry run of the extraction. The caller drops them
    just before the gather, whose own allocations then come out of the memory just freed (the
    CUDA caching allocator keeps it). An out-of-memory error is thus raised here, on the
    rank that lacks the memory, before any rank has entered the gather. FSDP1: the units'
    whole unsharded flat parameters (what ``summon_full_params`` allocates).
    """
    specs: list[tuple[tuple[int, str], torch.Size, torch.dtype, torch.device]] = []
    totals: dict[tuple[torch.dtype, torch.device], int] = {}
    if kind == "fsdp1":
        try:
            shapes, flats = fsdp1_shapes(gather.units)
        except Exception:  # noqa: BLE001 - private attributes: reserve nothing, check nothing
            return {}
        for flat in flats:
            key = (flat.dtype, flat.device)
            totals[key] = totals.get(key, 0) + flat._padded_unsharded_size.numel()
        dtype, device = flats[0].dtype, flats[0].device
        for i, plan in enumerate(gather.plans):
            for name, (owner, attr) in plan.refs.items():
                shape = shapes.get((id(owner), attr))
                if shape is not None:
                    specs.append(((i, name), shape, dtype, device))
    else:
        for i, plan in enumerate(gather.plans):
            for name, (owner, attr) in plan.refs.items():
                value = getattr(owner, attr)
                shape = torch.Size(getattr(value, "ds_shape", value.shape))
                key = (value.dtype, value.device)
                specs.append(((i, name), shape, *key))
                totals[key] = totals.get(key, 0) + shape.numel()
    buffers = {key: torch.empty(n, dtype=key[0], device=key[1]) for key, n in totals.items()}
    offsets = dict.fromkeys(buffers, 0)
    views: dict[tuple[int, str], Tensor] = {}
    for key, shape, dtype, device in specs:
        buf, at = buffers[(dtype, device)], offsets[(dtype, device)]
        if at + shape.numel() <= buf.numel():
            views[key] = buf[at: at + shape.numel()].view(shape)
            offsets[(dtype, device)] = at + shape.numel()
    return views
