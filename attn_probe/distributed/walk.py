"""The walk over a model's layers on every rank (:func:`iter_layer_params`, :func:`iter_layer_factors`),
the post-hoc :func:`gather_scores` built on it, and :func:`gather_bytes`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..extraction import AttentionLayer
from ..extraction.architectures import unwrap
from ..scoring.model import (
    PairsLike,
    check_model_pairs,
    layer_factors,
    pairs_param_names,
    resolve_pairs,
    score_layer_pairs,
)
from . import backends
from .backends import (
    Gather,
    ParamGetter,
    Plan,
    canonical_layer,
    canonical_name,
    fsdp1_gather,
    fsdp1_root_ready,
    fsdp_owners,
    plan_gathers,
    plan_signature,
    sharding_kind,
    waited,
    zero3_params,
)
from .world import Agreement, default_agreement, is_main_process, world_info

Tensor = torch.Tensor
Row = dict[str, Any]

logger = logging.getLogger("attn_probe.distributed")


class WalkOutcome:
    """Filled in by :func:`iter_layer_params`: did every layer reach the consumer's rank?"""

    def __init__(self) -> None:
        self.complete = True
        self.reasons: list[str] = []

    def skip(self, reason: str) -> None:
        self.complete = False
        self.reasons.append(reason)



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
    the query/key weights; a score pair declares its own, :mod:`attn_probe.scoring.pairs`). The
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
    plans: list[Plan] = []
    gathers: list[Gather] = []
    ok = True
    try:
        owners = fsdp_owners(model) if kind == "fsdp1" else {}
        plans = [backends.plan_layer(layer, model, owners, param_names(layer) if param_names else None) for layer in layers]
        gathers = plan_gathers(plans, kind)
        signature = plan_signature(plans)
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
            ok = fsdp1_root_ready(model)  # local: FSDP's own lazy init, before any gather
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


def _walk_local(plans: list[Plan], receive: bool, stop: Callable[[], bool] | None,
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
                yield canonical_layer(plan.layer), gathered.__getitem__
            del gathered


def _prepare(gather: Gather, kind: str, receive: bool,
             check: Callable[[AttentionLayer, ParamGetter], Any] | None) -> bool:
    """The local work before a gather that can fail: reserve its memory, dry-run the extraction."""
    try:
        views = backends.reserve_gather_memory(gather, kind)  # looked up at each call: a documented seam
        if check is not None and receive:
            for i, plan in enumerate(gather.plans):
                keyed = {n: views.get((i, n)) for n in plan.refs}
                if all(v is not None for v in keyed.values()):
                    check(canonical_layer(plan.layer), keyed.__getitem__)
        del views
        return True
    except Exception as exc:  # noqa: BLE001 - reported through the agreement
        logger.warning("attn_probe: preparing the gather of %s failed on this rank (%s: %s); "
                       "every rank skips it", gather.names, type(exc).__name__, exc)
        return False


def _walk_sharded(gathers: list[Gather], kind: str, agreement: Agreement, receive: bool, rank0_only: bool,
                  check: Callable[[AttentionLayer, ParamGetter], Any] | None,
                  stop: Callable[[], bool] | None,
                  outcome: WalkOutcome) -> Iterator[tuple[AttentionLayer, ParamGetter]]:
    """FSDP1/2, TP, ZeRO-3: one agreement before every gather; all ranks enter it or none.

    DTensor (FSDP2, TP), on a rank that receives: gathers are issued without waiting, and a
    layer is yielded only once the next layer's gather is issued (after its agreement), so
    the next transfer overlaps the caller's work on this one (on CUDA; a CPU gather blocks,
    :func:`~attn_probe.distributed.backends.dtensor_full`); at most two gathered layers
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


def _gather(stack: contextlib.ExitStack, gather: Gather, kind: str,
            rank0_only: bool, asynchronous: bool = False) -> list[tuple[AttentionLayer, ParamGetter]] | None:
    """Enter the gather's collective(s); the layers and getters if this rank holds the data.

    ``asynchronous`` (DTensor): issue the gathers without waiting; the getter waits.
    """
    if kind == "fsdp1":
        if not fsdp1_gather(stack, gather.units, rank0_only):
            return None
        return [(canonical_layer(plan.layer), (lambda n, plan=plan: getattr(*plan.refs[n]).detach()))
                for plan in gather.plans]
    plan = gather.plans[0]
    values = {n: getattr(m, a) for n, (m, a) in plan.refs.items()}
    if kind == "zero3":
        import deepspeed

        stack.enter_context(deepspeed.zero.GatheredParameters(zero3_params(values.values()), modifier_rank=None))
        gathered = {n: getattr(m, a).data for n, (m, a) in plan.refs.items()}
        return [(canonical_layer(plan.layer), gathered.__getitem__)]
    gathered = {n: backends.dtensor_full(v.detach(), asynchronous) for n, v in values.items()}

    @stack.callback
    def release() -> None:  # a stale getter holds nothing; no transfer is left unwaited
        try:
            for t in gathered.values():
                waited(t)
        except Exception as exc:  # noqa: BLE001 - the walk goes on; the caller saw it in get() if it asked
            logger.warning("attn_probe: waiting for the gather of %s failed (%s: %s)",
                           canonical_name(plan.layer.name), type(exc).__name__, exc)
        finally:
            gathered.clear()

    def get(name: str) -> Tensor:
        gathered[name] = waited(gathered[name])
        return gathered[name]

    return [(canonical_layer(plan.layer), get)]


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
    :func:`attn_probe.scoring.model.score_layer_pairs`, and logs-and-skips a layer whose scoring
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
