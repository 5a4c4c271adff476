"""Read one layer's full q/k factors on every rank, whatever the parallelism.

What each setup costs per snapshot (``bytes`` = size of the layer's full ``W_q`` + ``W_k``):

* single process, DDP, DeepSpeed ZeRO-1/2: parameters are whole on every rank; read
  locally, **no collective**;
* FSDP1 (``FullyShardedDataParallel``): one ``summon_full_params(unit, recurse=False,
  writeback=False, rank0_only=True)`` per FSDP unit owning q/k (consecutive layers of one
  unit share one gather); all-gathers the unit's flat parameter (q, k, v, o, ... of it);
* FSDP2 (``fully_shard``) and tensor parallel (DTensor parameters): an all-gather of
  exactly ``W_q`` and ``W_k`` of one layer (``redistribute`` to ``Replicate``); on the
  receiving rank the next layer's gather is issued before the current layer is scored, so
  the communication overlaps the scoring, holding at most two layers' ``W_q`` + ``W_k``;
* DeepSpeed ZeRO-3: ``deepspeed.zero.GatheredParameters`` on exactly that layer's q/k
  parameters (``modifier_rank=None``).

Every gather is a collective: **every rank must exhaust** :func:`iter_layer_factors` with
the same layers in the same order. Sharded setups agree before every gather, on a gloo
group of their own (:class:`Agreement`): first on the plan (same layers, names and
layouts on every rank), then, per gather, that every rank prepared it (memory reserved,
extraction dry-run); a gather is entered by all ranks or by none. Scoring and writing
happen on rank 0 only. The protocol is stated in ``docs/distributed.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any, NamedTuple

import torch
from torch import nn

from .extraction import AttentionLayer
from .extraction.architectures import unwrap
from .scoring import (
    PairsLike,
    check_model_pairs,
    layer_factors,
    pairs_param_names,
    resolve_pairs,
    score_layer_pairs,
)

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


# --------------------------------------------------------------------------- agreement
class AgreementError(RuntimeError):
    """An agreement between ranks timed out or failed: this rank must issue no further collective."""


def training_group_timeout() -> timedelta:
    """The timeout of the default (training) process group, or torch's default for its backend."""
    from torch.distributed import distributed_c10d as c10d

    try:
        group = c10d._get_default_group()
        with warnings.catch_warnings():  # "multiple backends registered" (FSDP2 on gloo): not the user's concern
            warnings.simplefilter("ignore")
            device = c10d._get_pg_default_device(group)
        timeout = group._get_backend(device).options._timeout
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout
    except Exception:  # noqa: BLE001 - private API; fall back to torch's documented default
        pass
    try:
        return c10d._get_default_timeout(torch.distributed.get_backend())
    except Exception:  # noqa: BLE001
        return c10d.default_pg_timeout


class Agreement:
    """The ranks' agreements: MIN all-reduces of a few integers, on a gloo group of their own.

    Made at attach on every rank (``new_group`` is itself collective). CPU tensors on gloo:
    no CUDA synchronisation, and a timeout raises an exception that can be caught (an NCCL
    timeout would abort the process). ``timeout`` (seconds) defaults to the training group's
    (:func:`training_group_timeout`). After a timeout or any other error, :meth:`min` raises
    :class:`AgreementError` and this object stays ``broken``: its owner must stop issuing
    collectives (the other ranks then time out in their next agreement and stop too).
    """

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timedelta(seconds=timeout) if timeout is not None else training_group_timeout()
        self.group = torch.distributed.new_group(backend="gloo", timeout=self.timeout)
        self.rank = torch.distributed.get_rank()
        self.broken: str | None = None
        self.count = 0  # agreements run (for tests and cost measurements)

    def min(self, values: list[int]) -> list[int]:
        """Element-wise MIN of ``values`` over all ranks (a collective on the agreement group)."""
        if self.broken is not None:
            raise AgreementError(self.broken)
        tensor = torch.tensor(values, dtype=torch.int64)
        try:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=self.group)
        except Exception as exc:  # noqa: BLE001 - gloo timeout, closed pair, ...
            self.broken = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            raise AgreementError(self.broken) from exc
        self.count += 1
        return tensor.tolist()

    def close(self) -> None:
        """Destroy the group (local, no collective); a later :meth:`min` raises :class:`AgreementError`."""
        group, self.group = self.group, None
        self.broken = self.broken or "the agreement group was closed"
        if group is not None:
            try:
                torch.distributed.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - e.g. the default group is already gone
                pass


_DEFAULT_AGREEMENTS: dict[int, Agreement] = {}


def default_agreement() -> Agreement:
    """The agreement group of the lower-level API (made on first use, on every rank: collective)."""
    key = id(torch.distributed.distributed_c10d._get_default_group())
    if key not in _DEFAULT_AGREEMENTS:
        _DEFAULT_AGREEMENTS[key] = Agreement()
    return _DEFAULT_AGREEMENTS[key]


class WalkOutcome:
    """Filled in by :func:`iter_layer_params`: did every layer reach the consumer's rank?"""

    def __init__(self) -> None:
        self.complete = True
        self.reasons: list[str] = []

    def skip(self, reason: str) -> None:
        self.complete = False
        self.reasons.append(reason)


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


def _layout(value: Any) -> str:
    """How one parameter is laid out: what a gather of it does on this rank."""
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(value, dtensor):
        return f"D{tuple(value.shape)}"
    if hasattr(value, "ds_id"):
        return f"Z{tuple(getattr(value, 'ds_shape', ()))}"
    return "L"  # read locally (FSDP1 views too: the owning units carry FSDP1's layout)


def _signature(plans: list[_Plan]) -> int:
    """CRC of what the walk will gather: layer and parameter names, layouts, FSDP1 units."""
    text = "|".join(
        f"{canonical_name(p.layer.name)}:{','.join(p.refs)}:"
        f"{','.join(_layout(getattr(m, a, None)) for m, a in p.refs.values())}:{len(p.units)}"
        for p in plans
    )
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


def _dtensor_full(value: Tensor, asynchronous: bool = False) -> Tensor:
    """The full tensor of a DTensor (else ``value``); ``asynchronous``: issued, not waited for.

    The asynchronous result is waited for by its first use (:func:`_waited`).
    """
    dtensor = _dtensor_class()
    if dtensor is None or not isinstance(value, dtensor):
        return value
    if not asynchronous:
        return value.full_tensor()
    from torch.distributed.tensor import Replicate

    return value.redistribute(placements=[Replicate()] * value.device_mesh.ndim, async_op=True).to_local()


def _waited(value: Tensor) -> Tensor:
    """``value`` as a plain tensor, once an asynchronous collective that produces it is done."""
    wait = getattr(value, "trigger_wait", None)  # AsyncCollectiveTensor (torch functional collectives)
    return wait() if callable(wait) else value


def _zero3_params(values: Iterable[Tensor]) -> list[Tensor]:
    return [v for v in values if hasattr(v, "ds_id")]


ParamGetter = Callable[[str], Tensor]


@dataclasses.dataclass
class _Gather:
    """One collective step of the walk: one layer, or (FSDP1) the layers of one summon."""

    plans: list[_Plan]
    units: tuple[nn.Module, ...] = ()

    @property
    def names(self) -> str:
        return ", ".join(canonical_name(p.layer.name) for p in self.plans)


def _gathers(plans: list[_Plan], kind: str) -> list[_Gather]:
    if kind != "fsdp1":
        return [_Gather([plan], plan.units) for plan in plans]
    runs: list[_Gather] = []
    for plan in plans:  # FSDP1: consecutive layers that share their owning units share one summon
        if runs and [id(u) for u in runs[-1].units] == [id(u) for u in plan.units]:
            runs[-1].plans.append(plan)
        else:
            runs.append(_Gather([plan], plan.units))
    return runs


def _fsdp1_shapes(units: tuple[nn.Module, ...]) -> tuple[dict[tuple[int, str], torch.Size], list[Tensor]]:
    """FSDP1: full shapes of the units' original parameters, and their flat parameters."""
    shapes: dict[tuple[int, str], torch.Size] = {}
    flats: list[Tensor] = []
    for unit in units:
        flat = unit._handle.flat_param  # private: the unit's FlatParameter
        flats.append(flat)
        for info, shape in zip(flat._param_infos, flat._shapes, strict=True):
            shapes[(id(info.module), info.param_name)] = shape
    return shapes, flats


def reserve_gather_memory(gather: _Gather, kind: str) -> dict[tuple[int, str], Tensor]:
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
            shapes, flats = _fsdp1_shapes(gather.units)
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


def iter_layer_params(
    model: nn.Module,
    layers: Iterable[AttentionLayer],
    *,
    param_names: Callable[[AttentionLayer], tuple[str, ...]] | None = None,
    rank0_only: bool = True,
    agreement: Agreement | None = None,
    check: Callable[[AttentionLayer, ParamGetter], Any] | None = None,
    stop: Callable[[], bool] | None = None,
    outcome: WalkOutcome | None = None,
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

    The protocol (sharded models; ``docs/distributed.md``): the ranks first agree on the
    plan (every rank located its parameters, same layers, names and layouts); then, for each
    gather, every rank does the local work that can fail (reserving the gather's memory,
    the dry run ``check(layer, get)`` of the extraction on empty full-shape tensors on the
    ranks that receive) and polls ``stop()``, and the ranks agree: a gather is entered
    only when every rank is ready; a layer that failed anywhere is skipped on every rank;
    when any rank asks to stop, every rank ends the walk. Agreements run on ``agreement``
    (default :func:`default_agreement`), a gloo group; an :class:`AgreementError` (timeout)
    propagates, and the caller must then issue no further collective. ``outcome`` records
    whether every layer was yielded (on a receiving rank). Local setups (single process, DDP,
    ZeRO-1/2) issue no collective at all.
    """
    layers = list(layers)
    outcome = outcome if outcome is not None else WalkOutcome()
    info = world_info()
    receive = (not rank0_only) or (not info.distributed) or info.rank == 0
    kind = sharding_kind(model) if info.distributed else "local"
    plans: list[_Plan] = []
    gathers: list[_Gather] = []
    ok = True
    try:
        owners = _fsdp_owners(model) if kind == "fsdp1" else {}
        plans = [_plan(layer, model, owners, param_names(layer) if param_names else None) for layer in layers]
        gathers = _gathers(plans, kind)
        signature = _signature(plans)
    except Exception as exc:  # noqa: BLE001 - reported through the agreement below
        ok = False
        logger.warning("attn_probe: could not locate the layers' parameters (%s: %s)", type(exc).__name__, exc)
    if kind == "local":
        if not ok:
            outcome.skip("could not locate the layers' parameters")
            return
        yield from _walk_local(plans, receive, stop, outcome)
        return
    if ok and kind == "fsdp1":
        try:
            ok = _fsdp1_root_ready(model)  # local: FSDP's own lazy init, before any gather
        except Exception as exc:  # noqa: BLE001
            ok = False
            logger.warning("attn_probe: FSDP lazy init failed (%s: %s)", type(exc).__name__, exc)
    agreement = agreement if agreement is not None else default_agreement()
    sig, count = (signature, len(plans)) if ok else (0, -1)
    got = agreement.min([1 if ok else 0, sig, -sig, count, -count])
    if not (got[0] == 1 and -got[2] == got[1] == sig and -got[4] == got[3] == count):
        logger.warning("attn_probe: ranks disagree on the layers to gather (or one failed); skipping this snapshot")
        outcome.skip("the ranks disagree on the layers to gather, or one failed to locate them")
        return
    yield from _walk_sharded(gathers, kind, agreement, receive, rank0_only, check, stop, outcome)


def _walk_local(plans: list[_Plan], receive: bool, stop: Callable[[], bool] | None,
                outcome: WalkOutcome) -> Iterator[tuple[AttentionLayer, ParamGetter]]:
    """Single process, DDP, ZeRO-1/2: read each layer's own parameters, no collective."""
    with torch.no_grad():
        for plan in plans:
            if stop is not None and stop():
                outcome.skip("stopped")
                return
            try:
                gathered = {n: getattr(m, a).detach() for n, (m, a) in plan.refs.items()}
            except Exception as exc:  # noqa: BLE001
                logger.warning("attn_probe: reading %s failed: %s", plan.layer.name, exc)
                outcome.skip(f"reading {canonical_name(plan.layer.name)} failed")
                continue
            if receive:
                yield _canonical_layer(plan.layer), gathered.__getitem__
            del gathered


def _prepare(gather: _Gather, kind: str, receive: bool,
             check: Callable[[AttentionLayer, ParamGetter], Any] | None) -> bool:
    """The local work before a gather that can fail: reserve its memory, dry-run the extraction."""
    try:
        views = reserve_gather_memory(gather, kind)
        if check is not None and receive:
            for i, plan in enumerate(gather.plans):
                keyed = {n: views.get((i, n)) for n in plan.refs}
                if all(v is not None for v in keyed.values()):
                    check(_canonical_layer(plan.layer), keyed.__getitem__)
        del views
        return True
    except Exception as exc:  # noqa: BLE001 - reported through the agreement
        logger.warning("attn_probe: preparing the gather of %s failed on this rank (%s: %s); "
                       "every rank skips it", gather.names, type(exc).__name__, exc)
        return False


def _walk_sharded(gathers: list[_Gather], kind: str, agreement: Agreement, receive: bool, rank0_only: bool,
                  check: Callable[[AttentionLayer, ParamGetter], Any] | None,
                  stop: Callable[[], bool] | None,
                  outcome: WalkOutcome) -> Iterator[tuple[AttentionLayer, ParamGetter]]:
    """FSDP1/2, TP, ZeRO-3: one agreement before every gather; all ranks enter it or none.

    DTensor (FSDP2, TP), on a rank that receives: gathers are issued without waiting, and a
    layer is yielded only once the next layer's gather is issued (after its agreement), so
    the next transfer overlaps the caller's work on this one; at most two gathered layers
    are alive. Every rank still agrees on, and enters, the gathers in the same order. FSDP1
    and ZeRO-3 gather synchronously, one at a time.
    """
    prefetch = kind == "dtensor" and receive
    ahead: tuple[contextlib.ExitStack, list[tuple[AttentionLayer, ParamGetter]]] | None = None
    try:
        with torch.no_grad():
            for gather in gathers:
                try:
                    stopping = bool(stop()) if stop is not None else False
                except Exception:  # noqa: BLE001
                    stopping = True
                ready = False if stopping else _prepare(gather, kind, receive, check)
                go, all_ready = agreement.min([0 if stopping else 1, 1 if ready else 0])
                if not go:
                    outcome.skip("a rank stopped the walk")
                    break
                if not all_ready:
                    if ready:
                        logger.warning("attn_probe: another rank could not prepare the gather of %s; "
                                       "every rank skips it", gather.names)
                    outcome.skip(f"{gather.names}: failed on a rank, skipped on every rank")
                    continue
                stack = contextlib.ExitStack()
                try:  # the collective: every rank is here, for the same gather
                    held = _gather(stack, gather, kind, rank0_only, asynchronous=prefetch)
                except Exception as exc:  # noqa: BLE001 - inside the collective: out of scope
                    stack.close()
                    logger.warning("attn_probe: gathering %s failed on this rank (%s: %s)",
                                   gather.names, type(exc).__name__, exc)
                    outcome.skip(f"gathering {gather.names} failed")
                    continue
                if not (receive and held is not None):
                    stack.close()
                    continue  # with rank0_only, ranks != 0 only took part in the collective
                if not prefetch:
                    with stack:
                        yield from held
                    continue
                previous, ahead = ahead, (stack, held)
                if previous is not None:  # the next gather is in flight: hand out the one before it
                    with previous[0]:
                        yield from previous[1]
                    previous = None  # released before the next gather is reserved and issued
            if ahead is not None:
                last, ahead = ahead, None
                with last[0]:
                    yield from last[1]
    finally:
        if ahead is not None:  # the caller stopped early: wait for, then drop, what is in flight
            ahead[0].close()


def _gather(stack: contextlib.ExitStack, gather: _Gather, kind: str,
            rank0_only: bool, asynchronous: bool = False) -> list[tuple[AttentionLayer, ParamGetter]] | None:
    """Enter the gather's collective(s); the layers and getters if this rank holds the data.

    ``asynchronous`` (DTensor): issue the gathers without waiting; the getter waits.
    """
    if kind == "fsdp1":
        if not _fsdp1_gather(stack, gather.units, rank0_only):
            return None
        return [(_canonical_layer(plan.layer), (lambda n, plan=plan: getattr(*plan.refs[n]).detach()))
                for plan in gather.plans]
    plan = gather.plans[0]
    values = {n: getattr(m, a) for n, (m, a) in plan.refs.items()}
    if kind == "zero3":
        import deepspeed

        stack.enter_context(deepspeed.zero.GatheredParameters(_zero3_params(values.values()), modifier_rank=None))
        gathered = {n: getattr(m, a).data for n, (m, a) in plan.refs.items()}
        return [(_canonical_layer(plan.layer), gathered.__getitem__)]
    gathered = {n: _dtensor_full(v.detach(), asynchronous) for n, v in values.items()}

    @stack.callback
    def release() -> None:  # a stale getter holds nothing; no transfer is left unwaited
        try:
            for t in gathered.values():
                _waited(t)
        except Exception as exc:  # noqa: BLE001 - the walk goes on; the caller saw it in get() if it asked
            logger.warning("attn_probe: waiting for the gather of %s failed (%s: %s)",
                           canonical_name(plan.layer.name), type(exc).__name__, exc)
        finally:
            gathered.clear()

    def get(name: str) -> Tensor:
        gathered[name] = _waited(gathered[name])
        return gathered[name]

    return [(_canonical_layer(plan.layer), get)]


def iter_layer_factors(
    model: nn.Module,
    layers: Iterable[AttentionLayer],
    *,
    rank0_only: bool = True,
) -> Iterator[tuple[AttentionLayer, Tensor, Tensor]]:
    """Yield ``(layer, W_q, W_k)`` one layer at a time, full tensors, under ``no_grad``.

    ``W_q``: ``(num_heads, head_dim, d)``, ``W_k``: ``(num_kv_heads, head_dim, d)``; the
    collective contract of :func:`iter_layer_params` applies (exhaust the iterator on every
    rank). The split into heads is dry-run before each gather on the ranks that receive; a
    layer whose split fails is skipped with a warning. Drop a layer's tensors before asking
    for the next: under FSDP2/TP the next layer's gather is then already in flight.
    """
    def check(layer: AttentionLayer, get: ParamGetter) -> None:
        layer.factors(get)

    for layer, get in iter_layer_params(model, layers, rank0_only=rank0_only, check=check):
        try:
            query, key = layer.factors(get)
        except Exception as exc:
            logger.warning(
                "attn_probe: reading %s failed (%s: %s); layer skipped", layer.name, type(exc).__name__, exc
            )
            continue
        yield layer, query.detach(), key.detach()
        del query, key  # held no longer than the caller's own references (prefetch: two layers)


def gather_scores(
    model: nn.Module,
    layers: Iterable[AttentionLayer],
    *,
    per_head: bool = False,
    num_std: float = 2.0,
    dtype: torch.dtype = torch.float32,
    metrics: Iterable[str] | None = None,
    pairs: PairsLike | None = None,
) -> list[Row] | None:
    """Score every layer of a (possibly sharded) model; rows on rank 0, ``None`` elsewhere.

    Call on every rank. ``metrics`` and ``pairs`` as for :func:`attn_probe.score_model`
    (``pairs=("qk", "ov")`` also scores ``W_o^h W_v^h``): the walk gathers, one layer at a
    time (:func:`iter_layer_params`), exactly the parameters the pairs declare, dry-runs
    their extraction before each gather, scores on rank 0 with
    :func:`attn_probe.scoring.score_layer_pairs`, and logs-and-skips a layer whose scoring
    fails, so that every rank keeps entering the same collectives. An architecture a pair
    cannot read raises :class:`~attn_probe.extraction.UnsupportedModelError` on every rank
    before any collective (the check is the same local computation on every rank).
    """
    layers = list(layers)
    chosen = resolve_pairs(pairs, metrics, dtype=dtype)
    check_model_pairs(chosen, layers, getattr(getattr(unwrap(model), "config", None), "model_type", None))

    # the walk yields layers renamed without wrapper segments; the pairs read the parameters under
    # the names they declared for the original layer (a pair may derive them from layer.name)
    originals = {id(layer.module): layer for layer in layers if layer.module is not None}

    def source(layer: AttentionLayer) -> AttentionLayer:
        return originals.get(id(layer.module), layer)

    def check(layer: AttentionLayer, get: ParamGetter) -> None:
        layer_factors(chosen, source(layer), get)

    main = is_main_process()
    rows: list[Row] = []
    walk = iter_layer_params(model, layers, param_names=lambda layer: pairs_param_names(chosen, layer), check=check)
    for layer, get in walk:
        try:
            rows += score_layer_pairs(layer, get, chosen, per_head=per_head, num_std=num_std, source=source(layer))
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
    "Agreement",
    "AgreementError",
    "WalkOutcome",
    "WorldInfo",
    "all_ranks_ok",
    "canonical_name",
    "default_agreement",
    "gather_bytes",
    "gather_scores",
    "is_main_process",
    "iter_layer_factors",
    "iter_layer_params",
    "reserve_gather_memory",
    "sharding_kind",
    "training_group_timeout",
    "world_info",
]
