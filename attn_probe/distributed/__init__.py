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


The package, by job: :mod:`~attn_probe.distributed.world` (world info, agreement),
:mod:`~attn_probe.distributed.backends` (sharding kinds, plans, gathers, memory reservation),
:mod:`~attn_probe.distributed.walk` (the walk and ``gather_scores``).
"""

from __future__ import annotations

from .backends import canonical_name, reserve_gather_memory, sharding_kind
from .walk import WalkOutcome, gather_bytes, gather_scores, iter_layer_factors, iter_layer_params
from .world import (
    Agreement,
    AgreementError,
    WorldInfo,
    all_ranks_ok,
    default_agreement,
    is_main_process,
    training_group_timeout,
    world_info,
)

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
