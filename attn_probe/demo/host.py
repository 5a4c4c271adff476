"""The host the demo trains on: the CPUs it may use, the threads per model, and glibc's allocator."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use and the load on the machine.

    ``affinity`` is ``len(os.sched_getaffinity(0))`` (``os.cpu_count()`` where that does not
    exist); ``quota`` the cgroup CPU limit in CPUs, ``quota_us / period_us`` (None: no limit);
    ``load`` the 1-minute load average (None where the OS has none).
    """

    affinity: int
    quota: float | None = None
    load: float | None = None

    @property
    def cpus(self) -> int:
        """``max(1, floor(min(affinity, quota)))``: whole CPUs available to the process."""
        limit = float(self.affinity) if self.quota is None else min(float(self.affinity), self.quota)
        return max(1, int(limit))

    def describe(self) -> str:
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup quota {self.quota:g} CPUs"
        load = "" if self.load is None else f", load average {self.load:.2f}"
        return f"{self.cpus} CPU{'s' if self.cpus != 1 else ''} available (affinity {self.affinity}, {quota}){load}"


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_dirs(root: Path, own: str | None) -> list[Path]:
    """``root/own`` and each of its parents up to ``root`` (a limit anywhere above applies too)."""
    dirs = [root]
    if own and own.strip("/"):
        parts = own.strip("/").split("/")
        dirs = [root.joinpath(*parts[:i]) for i in range(len(parts), 0, -1)] + [root]
    return dirs


def _own_cgroups(proc_cgroup: Path) -> dict[str, str]:
    """Controller -> this process's cgroup path, from ``/proc/self/cgroup`` (``""``: the v2 one)."""
    text = _read_text(proc_cgroup) or ""
    own: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                own[controller] = parts[2]
    return own


def cgroup_cpu_quota(
    root: str | os.PathLike[str] = "/sys/fs/cgroup", proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup"
) -> float | None:
    """The cgroup CPU limit of this process in CPUs, ``quota / period``, or None without one.

    cgroup v2: ``cpu.max`` (``"200000 100000"``, or ``"max 100000"`` for none); cgroup v1:
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` under ``cpu/`` or ``cpu,cpuacct/`` (quota −1
    for none). Checked in the process's own cgroup (``/proc/self/cgroup``) and every parent up
    to ``root``; the smallest limit found applies.
    """
    root = Path(root)
    own = _own_cgroups(Path(proc_cgroup))
    limits: list[float] = []
    for d in _cgroup_dirs(root, own.get("")):
        fields = (_read_text(d / "cpu.max") or "").split()
        if len(fields) == 2 and fields[0] != "max":
            try:
                quota, period = float(fields[0]), float(fields[1])
            except ValueError:
                continue
            if quota > 0 and period > 0:
                limits.append(quota / period)
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for d in _cgroup_dirs(root / mount, own.get("cpu")):
            quota_text, period_text = _read_text(d / "cpu.cfs_quota_us"), _read_text(d / "cpu.cfs_period_us")
            try:
                quota, period = float(quota_text or ""), float(period_text or "")
            except ValueError:
                continue
            if quota > 0 and period > 0:
                limits.append(quota / period)
    return min(limits) if limits else None


def cpu_budget(
    *,
    affinity: Iterable[int] | None = None,
    cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
    proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
    load: float | None = None,
) -> CpuBudget:
    """Count the CPUs available to this process (affinity and cgroup quota) and read the load.

    Every source can be given (tests): ``affinity`` (default ``os.sched_getaffinity(0)``), the
    cgroup files under ``cgroup_root``, and ``load`` (default ``os.getloadavg()[0]``).
    """
    if affinity is None:
        try:
            count = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            count = os.cpu_count() or 1
    else:
        count = len(set(affinity))
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = None
    return CpuBudget(max(1, count), cgroup_cpu_quota(cgroup_root, proc_cgroup), load)


@dataclass(frozen=True)
class ThreadPlan:
    """How the demo uses the CPUs: torch threads per model, and whether the models train at once."""

    threads: int
    concurrent: bool
    #: printed: what was chosen and why
    reason: str


def plan_threads(
    budget: CpuBudget,
    *,
    models: int = 2,
    threads: int | None = None,
    concurrent: bool | None = None,
    default_threads: int | None = None,
) -> ThreadPlan:
    """Torch threads per model and whether to train the models at the same time.

    Threads (``threads`` given: that many): one when at most two CPUs are available, or when the
    load average is above the CPU count (torch's threads then wait for each other: steps were
    up to 10× slower); else ``min(default_threads, cpus)`` (``default_threads``: torch's own
    choice). Concurrency (``concurrent`` None: decided here): the models train at the same time,
    one process each, whenever there are at least as many CPUs as models, busy or not: the
    kernel shares the CPUs among all runnable threads, so on a machine another job keeps busy one
    process per model gets more of them than one model after the other (on 2 CPUs beside a
    2-thread job, about 1 CPU instead of 2/3), and on an idle one each gets its own. Each then
    runs ``min(threads above, cpus // models, free cores // models)`` threads (at least one),
    where the free cores are ``round(cpus - load)``; with fewer CPUs than models, one after the other.
    """
    cpus = budget.cpus
    load = budget.load or 0.0
    if default_threads is None:
        default_threads = torch.get_num_threads()
    where = budget.describe()
    if threads is not None:
        alone, why = threads, f"--threads {threads}"
    elif cpus <= 2:
        alone, why = 1, "one thread: at most two CPUs (more threads wait for each other)"
    elif budget.load is not None and load > cpus:
        alone, why = 1, f"one thread: the load average is above the {cpus} CPUs"
    else:
        alone = max(1, min(default_threads, cpus))
        why = f"{alone} thread{'s' if alone != 1 else ''}"
    free = max(0, int(cpus - load + 0.5))
    if models < 2:
        return ThreadPlan(alone, False, f"{where}: {why}")
    if concurrent is None:
        concurrent = cpus >= models
        how = (f"{free} free core{'s' if free != 1 else ''}: the {models} models train at the same time, one "
               "process each (the CPUs are shared among all running threads: one process per model gets more "
               "of a busy machine than one model after the other)" if concurrent
               else f"{cpus} CPU{'s' if cpus != 1 else ''}, fewer than the {models} models: one after the other")
    else:
        how = ("--concurrent: the models train at the same time, one process each" if concurrent
               else "--sequential: one model after the other")
    if concurrent and threads is None:
        share = max(1, min(alone, cpus // models, free // models))
        if share != alone:
            alone, why = share, f"{share} thread{'s' if share != 1 else ''} each"
    return ThreadPlan(alone, concurrent, f"{where}: {why}; {how}")

class keep_freed_memory:
    """Within: glibc's ``malloc`` keeps freed memory for reuse instead of handing it back to the kernel.

    Every training step frees and allocates the same activations again (the logits alone are
    batch x seq_len x vocab floats, 16 MiB in the cpu preset). With glibc's defaults many come
    back from the kernel as fresh pages, which it must zero: about 14,000-17,000 page faults and
    0.02-0.04 s of system time per step of the cpu preset. ``M_MMAP_THRESHOLD`` = 32 MiB (glibc's
    own dynamic maximum) and ``M_TRIM_THRESHOLD`` = 256 MiB keep them in the heap (about 3,500
    faults per step). Only where memory comes from changes, not what is computed. On exit: glibc's
    default thresholds (128 KiB) and ``malloc_trim(0)``, which returns the freed memory. Nothing
    happens where the C library is not glibc.
    """

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    KEEP = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 256 << 20}
    DEFAULT = 128 << 10

    def __init__(self) -> None:
        self.libc: Any = None

    def __enter__(self) -> None:
        import platform

        if platform.libc_ver()[0] != "glibc":
            return
        try:
            import ctypes

            libc = ctypes.CDLL(None)
            libc.mallopt, libc.malloc_trim  # noqa: B018  (both exist, or nothing is changed)
        except (OSError, AttributeError):
            return
        self.libc = libc
        for param, value in self.KEEP.items():
            libc.mallopt(param, value)

    def __exit__(self, *exc: object) -> None:
        if self.libc is not None:
            for param in self.KEEP:
                self.libc.mallopt(param, self.DEFAULT)
            self.libc.malloc_trim(0)
