"""The world the probe runs in and the ranks' agreements: rank and world size, :class:`Agreement`
(MIN all-reduces on a gloo group of the probe's own) and the lower-level API's default one."""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from datetime import timedelta
from typing import Any, NamedTuple

import torch

Tensor = torch.Tensor
Row = dict[str, Any]

logger = logging.getLogger("attn_probe.distributed")

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


def collective_device() -> torch.device:
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
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=collective_device())
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


#: default process group -> its agreement; weakly keyed, so that a destroyed group's agreement goes
#: with it and a new group (which may reuse the old one's ``id``) gets a fresh one
_DEFAULT_AGREEMENTS: weakref.WeakKeyDictionary[Any, Agreement] = weakref.WeakKeyDictionary()


def default_agreement() -> Agreement:
    """The agreement group of the lower-level API (made on first use, on every rank: collective)."""
    group = torch.distributed.group.WORLD
    agreement = _DEFAULT_AGREEMENTS.get(group)
    if agreement is None:
        agreement = _DEFAULT_AGREEMENTS[group] = Agreement()
    return agreement
