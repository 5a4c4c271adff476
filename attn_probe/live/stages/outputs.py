"""Stage 4: where snapshots go: the log directory (locked), the sinks, and their dispatcher.

Every use of :mod:`attn_probe.sinks` by the live probe is here: :class:`Outputs` chooses and
locks the log directory, builds the TensorBoard and trajectory sinks beside the given ones,
starts them behind a :class:`~attn_probe.sinks.dispatch.SinkDispatcher` (its interface is
stated at the top of ``sinks/dispatch.py``), and hands it snapshots, flushes and the close.
:func:`run_info` describes the run for the sinks' headers; :func:`announce_line` is the
status line :func:`attn_probe.watch` prints.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ...extraction import AttentionLayer, unwrap
from ...formats.logdir import (
    LogDirError,
    LogDirLock,
    acquire_default,
    check_log_dir,
    default_log_dir,
    printable,
)
from ...sinks import RunInfo, Sink, Snapshot
from ...sinks.dispatch import SinkDispatcher, SinkStats, before_exit_flush
from ...sinks.live_view import run_command
from ..config import ProbeConfig

__all__ = ["Outputs", "SinkStats", "run_info", "announce_line", "at_interpreter_exit"]


def at_interpreter_exit(hook: Callable[[float], None]) -> None:
    """Run ``hook(seconds)`` at interpreter exit, before unclosed dispatchers are flushed."""
    before_exit_flush(hook)


def run_info(config: ProbeConfig, model: nn.Module, layers: Sequence[AttentionLayer],
             metrics: Sequence[str], resume_step: int | None) -> RunInfo:
    """The run's header: the recorded options, the model and its attention layers, the metrics."""
    groups = sorted({a.group for a in layers}, key=[a.group for a in layers].index)
    root = unwrap(model)
    return RunInfo(
        config={**config.record(), "groups": sorted(groups), "layers": sorted({a.layer for a in layers}),
                **(config.extra_config or {})},
        model={
            "class": f"{type(root).__module__}.{type(root).__qualname__}",
            "parameters": sum(p.numel() for p in root.parameters()),
            "attention_layers": [
                {"name": a.name, "group": a.group, "layer": a.layer, "num_heads": a.num_heads,
                 "num_kv_heads": a.num_kv_heads, "head_dim": a.head_dim, "hidden_size": a.hidden_size}
                for a in layers
            ],
        },
        groups=groups,
        metrics=list(metrics),
        per_head=config.per_head,
        resume_step=resume_step,
    )


def _start_error(log_dir: str, exc: OSError) -> LogDirError:
    """A sink of the log directory failed to start: the OSError as a LogDirError saying why."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = f"the disk is full or nearly full ({exc.strerror or exc})"
    else:
        reason = exc.strerror or str(exc) or type(exc).__name__
    err = LogDirError(f"attn_probe cannot write its log directory {log_dir!r}: {reason}. "
                      "Free some space or pass another log_dir=")
    err.errno = exc.errno
    return err


class Outputs:
    """The log directory, its lock, the sinks and their dispatcher (built on the main process only).

    Built from ``config.log_dir``, ``writer``, ``sinks``, ``purge_stale`` and the lanes'
    options. The directory is locked (:class:`~attn_probe.formats.logdir.LogDirLock`) until
    :meth:`close`, and the trajectory file too (:meth:`~attn_probe.sinks.trajectory.TrajectorySink.claim`,
    before any sink starts): a second writer gets :class:`~attn_probe.formats.logdir.LogDirInUseError`
    here, even where the directory's lock file was deleted. A
    directory the user did not name gets a unique name (``..._1``, ...). Anything that fails
    here raises (a log-directory problem as :class:`~attn_probe.formats.logdir.LogDirError`),
    releasing the lock. After that, nothing raises.
    """

    def __init__(self, config: ProbeConfig, run: RunInfo, *, watch: Any = None) -> None:
        from ...sinks.tensorboard import TensorBoardSink, writer_log_dir
        from ...sinks.trajectory import TrajectorySink

        log_dir, writer, sinks = config.log_dir, config.writer, config.sinks
        lock: LogDirLock | None = None
        trajectory: TrajectorySink | None = None
        try:
            if writer is not None and log_dir is None:
                log_dir = writer_log_dir(writer)
            own: list[Sink] = []
            if sinks is None or log_dir is not None or writer is not None:
                if log_dir is None:  # not named by the user: a fresh unique directory, never a clash
                    lock = acquire_default(default_log_dir())
                    log_dir = lock.log_dir
                else:
                    log_dir = os.path.expanduser(log_dir)
                    check_log_dir(log_dir)
                    lock = LogDirLock(log_dir).acquire()
                trajectory = TrajectorySink(log_dir)
                trajectory.claim()  # the file's own lock, before any sink writes into the directory
                tb = (TensorBoardSink(writer=writer, purge_stale=config.purge_stale) if writer is not None
                      else TensorBoardSink(log_dir, purge_stale=config.purge_stale))
                trajectory.watch = watch  # the alert replay reads the resume cut's walk
                own = [tb, trajectory]
            built = own + list(sinks or [])
            dispatcher = SinkDispatcher(built, background=config.background, queue_size=config.sink_queue,
                                        timeout=config.sink_timeout)
            try:
                dispatcher.start(run)
            except OSError as exc:
                if log_dir is None or isinstance(exc, LogDirError) or not any(
                        dispatcher.failed_sink is sink for sink in own):
                    raise
                raise _start_error(log_dir, exc) from exc
        except BaseException:
            if trajectory is not None:
                trajectory.finish()  # lets the file's lock go (a no-op when the dispatcher finished it)
            if lock is not None:
                lock.release()
            raise
        self.log_dir: str | None = log_dir
        self.sinks: list[Sink] = built
        self.dispatcher: SinkDispatcher | None = dispatcher
        self._lock = lock

    def trajectory(self) -> tuple[str, str] | None:
        """``(path, run id)`` of the trajectory file this run writes (``None``: no trajectory sink)."""
        from ...sinks.trajectory import TrajectorySink

        for sink in self.sinks:
            if isinstance(sink, TrajectorySink) and sink.run_id is not None:
                return sink.path, sink.run_id
        return None

    def write(self, snapshot: Snapshot) -> None:
        """Hand the snapshot to the dispatcher (background lanes: returns at once; never raises)."""
        if self.dispatcher is not None:
            self.dispatcher.log(snapshot)

    def flush(self, timeout: float | None) -> bool:
        """Wait until every snapshot written so far reached every sink (``False`` at the timeout)."""
        return self.dispatcher.flush(timeout) if self.dispatcher is not None else True

    def stats(self) -> list[SinkStats]:
        """Per sink: snapshots delivered, lost, dropped, and whether it fails now (empty once closed)."""
        return self.dispatcher.stats() if self.dispatcher is not None else []

    def close(self) -> None:
        """Drain the lanes and finish the sinks (bounded by ``sink_timeout``); release the log dir."""
        dispatcher, lock = self.dispatcher, self._lock
        self.dispatcher, self._lock = None, None
        self.sinks = []
        try:
            if dispatcher is not None:
                dispatcher.close()
        finally:
            if lock is not None:
                try:
                    lock.release()
                except Exception:  # noqa: BLE001 - close() must not raise
                    pass


def _singular(unit: str) -> str:
    """``"optimizer steps"`` -> ``"optimizer step"``, ``"training forward passes"`` -> ``"... pass"``."""
    for plural, one in (("passes", "pass"), ("steps", "step")):
        if unit.endswith(plural):
            return unit[: -len(plural)] + one
    return unit


def _describe_schedule(every: Any, unit: str) -> str:
    if every is None:
        return "on demand"
    if isinstance(every, int):
        return f"every {every} {unit}" if every != 1 else f"every {_singular(unit)}"
    return f"on the schedule {getattr(every, '__qualname__', repr(every))} ({unit})"


def announce_line(model: nn.Module, layers: int, log_dir: str | None, *, every: Any, unit: str) -> str:
    """What is watched, how often, where it goes, and the ``tensorboard`` command of the live view.

    The command is :func:`attn_probe.sinks.live_view.run_command`: ``--logdir`` names the directory
    holding the run (there the run has its name, not ``.``), with an explicit
    ``--samples_per_plugin scalars=N`` (TensorBoard's server keeps only 1,000 points per scalar
    tag without it, and ``N = 0`` keeps none).
    """
    root = type(getattr(model, "module", model)).__name__
    where = log_dir if log_dir is not None else "the given sinks"
    line = (f"attn_probe: watching {layers} attention layer{'s' if layers != 1 else ''} of {root} "
            f"{_describe_schedule(every, unit)} -> {where}")
    if log_dir is not None:
        line += f"  (live view: {run_command(log_dir)})"
    return printable(line)  # control characters in a model or directory name are escaped
