"""Read one layer's full q/k factors on every rank, whatever the parallelism.

What each setup costs per snapshot (``bytes`` = size of the layer's full ``W_q`` + ``W_k``):

* single process, DDP, DeepSpeed ZeRO-1/2: parameters are whole on every rank; read
  locally, **no collective**;
* FSDP1 (``FullyShardedDataParallel``): one ``summon_full_params(unit, recurse=False,
  writeback=False, rank0_only=True)`` per FSDP unit owning q/k (consecutive layers of one
  unit share one gather); all-gathers the unit's flat parameter (q, k, v, o, ... of it);
* FSDP2 (``fully_shard``) and tensor parallel (DTensor parameters): ``full_tensor()`` of
  exactly ``W_q`` and ``W_k`` of one layer;
* DeepSpeed ZeRO-3: ``deepspeed.zero.GatheredParameters`` on exactly that layer's q/k
  parameters (``modifier_rank=None``).

Every gather is a collective: **every rank must exhaust** :func:`iter_layer_factors` with
the same layers in the same order (sharded setups add one small all-reduce per call that
checks this and skips the snapshot everywhere when ranks disagree). Scoring and writing
happen on rank 0 only; errors in the non-collective part of one layer are logged and
skipped so that no rank ever misses a collective the others enter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from .extraction import AttentionLayer
from .extraction.architectures import unwrap

Tensor = torch.Tensor
Row = dict[str, Any]

logger = logging.getLogger(__name__)

#: Module-path segments inserted by wrappers (FSDP1, activation checkpointing, torch.compile).
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
_WRAPPER_RE = re.compile(r"(^|\.)(?:" + "|".join(WRAPPER_SEGMENTS) + r")(?=\.|$)")


# --------------------------------------------------------------------------- world
class WorldInfo(NamedTuple):
    """Where this process sits: ``rank``/``world_size`` of the default process group."""

    rank: int
    world_size: int
    local_rank: int
    distributed: bool


def world_info() -> WorldInfo:
    """Rank and world size from ``torch.distributed`` (falls back to ``RANK``/``WORLD_SIZE`` env)."""
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        return WorldInfo(torch.distributed.get_rank(), world, local, world > 1)
    rank = int(os.environ.get("RANK", "0") or 0)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return WorldInfo(rank, world, local, False)


def is_main_process() -> bool:
    """``True`` on global rank 0 (and in a single process): the only rank that writes."""
    return world_info().rank == 0


def _collective_device() -> torch.device:
    backend = str(torch.distributed.get_backend()).lower()
    if "nccl" in backend and "cpu:" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if "xccl" in backend and hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def all_ranks_ok(ok: bool) -> bool:
    """All-reduce (MIN) of a flag: ``True`` only if ``ok`` on every rank.

    A collective: call it on every rank or on none. Without a process group it returns ``ok``.
    Lets a rank that failed locally (e.g. while building its layer list) tell the others to
    skip the next gather instead of leaving them waiting in it.
    """
    info = world_info()
    if not info.distributed:
        return bool(ok)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=_collective_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def _agree(ok: bool, signature: int, count: int) -> bool:
    """One all-reduce: every rank is ok and holds the same layer plan."""
    vals = [1 if ok else 0, signature, -signature, count, -count]
    t = torch.tensor(vals, dtype=torch.int64, device=_collective_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    got = t.tolist()
    return got[0] == 1 and -got[2] == got[1] == signature and -got[4] == got[3] == count


# --------------------------------------------------------------------------- detection
def canonical_name(path: str) -> str:
    """``path`` without wrapper segments: ``layer.0._fsdp_wrapped_module.attn`` -> ``layer.0.attn``."""
    return _WRAPPER_RE.sub("", path).lstrip(".")


def _fsdp1_class() -> type | None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except Exception:  # pragma: no cover - torch built without distributed
        return None
    return FullyShardedDataParallel


def _dtensor_class() -> type | None:
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
    fsdp = _fsdp1_class()
    if fsdp is not None and any(isinstance(m, fsdp) for m in model.modules()):
        return "fsdp1"
    dtensor = _dtensor_class()
    for p in model.parameters():
        if dtensor is not None and isinstance(p, dtensor):
            return "dtensor"
        if hasattr(p, "ds_id"):
            return "zero3"
    return "local"


# --------------------------------------------------------------------------- plans
@dataclasses.dataclass
class _Plan:
    layer: AttentionLayer
    refs: dict[str, tuple[nn.Module, str]]  # param name -> (owning module, attribute)
    units: tuple[nn.Module, ...] = ()  # FSDP1 units owning the q/k params, in parameter order


def _fsdp_owners(model: nn.Module) -> dict[int, nn.Module]:
    """``id(module) -> innermost FSDP1 unit`` containing it (empty if there is no FSDP1)."""
    fsdp = _fsdp1_class()
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


def _plan(layer: AttentionLayer, model: nn.Module, owners: dict[int, nn.Module],
          names: tuple[str, ...] | None = None) -> _Plan:
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
    return _Plan(layer, refs, tuple(units))


def _signature(plans: list[_Plan]) -> int:
    text = "|".join(f"{canonical_name(p.layer.name)}:{','.join(p.refs)}" for p in plans)
    return zlib.crc32(text.encode()) & 0x3FFFFFFF


def _canonical_layer(layer: AttentionLayer) -> AttentionLayer:
    name = canonical_name(layer.name)
    return layer if name == layer.name else dataclasses.replace(layer, name=name)


# --------------------------------------------------------------------------- gathering
def _fsdp1_root_ready(model: nn.Module) -> bool:
    """Make sure FSDP1's lazy init ran from the root (as the first forward would).

    Summoning a nested unit first would make that unit believe it is the root. The lazy
    init is local (no collective) and only run when ``model`` itself is the FSDP root; if it
    cannot be run, the snapshot is skipped (with a warning) until the first forward.
    """
    fsdp = _fsdp1_class()
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


def _fsdp1_gather(stack: contextlib.ExitStack, units: tuple[nn.Module, ...], rank0_only: bool) -> bool:
    """Summon the full parameters of ``units`` (collective); ``True`` if this rank holds them."""
    fsdp = _fsdp1_class()
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


def _dtensor_full(value: Tensor) -> Tensor:
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(value, dtensor):
        return value.full_tensor()
    return value


def _zero3_params(values: Iterable[Tensor]) -> list[Tensor]:
    return [v for v in values if hasattr(v, "ds_id")]


ParamGetter = Callable[[str], Tensor]


def iter_layer_params(
    model: nn.Module,
    layers: Iterable[AttentionLayer],
    *,
    param_names: Callable[[AttentionLayer], tuple[str, ...]] | None = None,
    rank0_only: bool = True,
) -> Iterator[tuple[AttentionLayer, ParamGetter]]:
    """Yield ``(layer, get)`` one layer at a time: ``get(name)`` is the full parameter tensor.

    ``param_names(layer)`` says which parameters to gather (default ``layer.param_names``,
    the query/key weights; a score pair declares its own, :mod:`attn_probe.pairs`). The
    tensors are valid until the next iteration (the gathered memory is freed then).
    ``layer.name`` has wrapper segments such as ``_fsdp_wrapped_module.`` removed
    (:func:`canonical_name`).

    Collective contract: on a sharded model (:func:`sharding_kind` not ``"local"``) every
    rank must call this with the same layers and **exhaust the iterator** (do not ``break``;
    catch errors in the loop body per layer). With ``rank0_only`` (default) only global
    rank 0 receives layers, the other ranks take part in the gathers and yield nothing;
    with ``rank0_only=False`` every rank receives them. ``model`` is what was wrapped (the
    FSDP root, the DDP module, the model whose parameters carry DeepSpeed ``ds_*``).
    """
    layers = list(layers)
    info = world_info()
    receive = (not rank0_only) or (not info.distributed) or info.rank == 0
    kind = sharding_kind(model) if info.distributed else "local"
    plans: list[_Plan] = []
    ok = True
    try:
        owners = _fsdp_owners(model) if kind == "fsdp1" else {}
        plans = [_plan(layer, model, owners, param_names(layer) if param_names else None) for layer in layers]
    except Exception as exc:
        ok = False
        logger.warning("attn_probe: could not locate the layers' parameters (%s: %s)", type(exc).__name__, exc)
    if kind != "local":
        if not _agree(ok, _signature(plans) if ok else 0, len(plans) if ok else -1):
            logger.warning(
                "attn_probe: ranks disagree on the layers to gather (or one failed); skipping this snapshot"
            )
            return
        if kind == "fsdp1" and not _fsdp1_root_ready(model):
            return
    elif not ok:
        return
    if kind == "fsdp1":
        yield from _iter_fsdp1(plans, receive, rank0_only)
        return
    with torch.no_grad():
        for plan in plans:
            gathered: dict[str, Tensor] = {}
            with contextlib.ExitStack() as stack:
                try:  # collective part: identical on every rank
                    values = {n: getattr(m, a) for n, (m, a) in plan.refs.items()}
                    if kind == "zero3":
                        import deepspeed

                        ds = _zero3_params(values.values())
                        stack.enter_context(deepspeed.zero.GatheredParameters(ds, modifier_rank=None))
                        gathered = {n: getattr(m, a).data for n, (m, a) in plan.refs.items()}
                    elif kind == "dtensor":
                        gathered = {n: _dtensor_full(v.detach()) for n, v in values.items()}
                    else:
                        gathered = {n: v.detach() for n, v in values.items()}
                except Exception as exc:
                    logger.warning("attn_probe: gathering %s failed: %s", plan.layer.name, exc)
                    continue
                if not receive:
                    continue
                yield _canonical_layer(plan.layer), gathered.__getitem__
                del gathered


def iter_layer_factors(
    model: nn.Module,
    layers: Iterable[AttentionLayer],
    *,
    rank0_only: bool = True,
) -> Iterator[tuple[AttentionLayer, Tensor, Tensor]]:
    """Yield ``(layer, W_q, W_k)`` one layer at a time, full tensors, under ``no_grad``.

    ``W_q``: ``(num_heads, head_dim, d)``, ``W_k``: ``(num_kv_heads, head_dim, d)``; the
    collective contract of :func:`iter_layer_params` applies (exhaust the iterator on every
    rank). A layer whose split into heads fails is skipped with a warning.
    """
    for layer, get in iter_layer_params(model, layers, rank0_only=rank0_only):
        try:
            query, key = layer.factors(get)
        except Exception as exc:
            logger.warning(
                "attn_probe: reading %s failed (%s: %s); layer skipped", layer.name, type(exc).__name__, exc
            )
            continue
        yield layer, query.detach(), key.detach()


def _iter_fsdp1(
    plans: list[_Plan], receive: bool, rank0_only: bool
) -> Iterator[tuple[AttentionLayer, ParamGetter]]:
    """FSDP1: one summon per run of consecutive layers that share their owning units."""
    runs: list[list[_Plan]] = []
    for plan in plans:
        if runs and [id(u) for u in runs[-1][0].units] == [id(u) for u in plan.units]:
            runs[-1].append(plan)
        else:
            runs.append([plan])
    with torch.no_grad():
        for run in runs:
            with contextlib.ExitStack() as stack:
                try:
                    holds = _fsdp1_gather(stack, run[0].units, rank0_only)
                except Exception as exc:
                    logger.warning("attn_probe: FSDP summon for %s failed: %s", run[0].layer.name, exc)
                    continue
                # with rank0_only, ranks != 0 hold no data here: they only entered the collective
                if not (receive and holds):
                    continue
                for plan in run:
                    yield _canonical_layer(plan.layer), (lambda n, plan=plan: getattr(*plan.refs[n]).detach())


def gather_scores(
    model: nn.Module,
    layers: Iterable[AttentionLayer],
    *,
    per_head: bool = False,
    num_std: float = 2.0,
    dtype: torch.dtype = torch.float32,
    metrics: Iterable[str] | None = None,
) -> list[Row] | None:
    """Score every layer of a (possibly sharded) model; rows on rank 0, ``None`` elsewhere.

    Call on every rank. Gathers one layer at a time (:func:`iter_layer_factors`), scores on
    rank 0 with :func:`attn_probe.scoring.score_layer`, and logs-and-skips a layer whose
    scoring fails, so that every rank keeps entering the same collectives.
    """
    from .scoring import score_layer

    main = is_main_process()
    rows: list[Row] = []
    for layer, query, key in iter_layer_factors(model, layers):
        try:
            rows += score_layer(layer, query, key, per_head=per_head, num_std=num_std, dtype=dtype,
                                metrics=metrics)
        except Exception as exc:
            logger.warning(
                "attn_probe: scoring %s failed (%s: %s); layer skipped", layer.name, type(exc).__name__, exc
            )
    return rows if main else None


def gather_bytes(layers: Iterable[AttentionLayer], element_size: int = 4) -> int:
    """Bytes one snapshot gathers with exact q/k gathers (FSDP2/TP/ZeRO-3): sum of ``|W_q| + |W_k|``.

    ``|W_q| = num_heads * head_dim * d``, ``|W_k| = num_kv_heads * head_dim * d`` elements
    (LoRA factors not counted). FSDP1 gathers whole units instead (at least this much).
    """
    total = 0
    for layer in layers:
        total += (layer.num_heads + layer.num_kv_heads) * layer.head_dim * layer.hidden_size
    return total * element_size


__all__ = [
    "WorldInfo",
    "all_ranks_ok",
    "canonical_name",
    "gather_bytes",
    "gather_scores",
    "is_main_process",
    "iter_layer_factors",
    "iter_layer_params",
    "sharding_kind",
    "world_info",
]
