"""The live probe: schedule -> snapshot -> sinks, isolated so that it never stops training.

A :class:`Probe` holds a validated :class:`~attn_probe.config.ProbeConfig`, the attention
layers found at attach time, a step counter and its sinks. At a snapshot it walks every
layer through :func:`attn_probe.distributed.iter_layer_params` (on every rank, same order,
exhausted), gathering the parameters its score pairs and scheduled quantities declare; each
pair scores the layer through the one core (:func:`attn_probe.metrics.score_factors`, on the
weights' own device, no host sync); every layer's table moves to the host in one transfer
per snapshot, and the sinks get plain numbers, on the main process only.

What counts steps lives in :mod:`attn_probe.counting`; :func:`attn_probe.watch` (in
:mod:`attn_probe.watching`) attaches a probe to a loop. This module imports neither
transformers nor accelerate.
"""

from __future__ import annotations

import functools
import math
import os
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from .config import ProbeConfig, config_from_options
from .counting import ForwardPasses, OptimizerUpdates
from .distributed import is_main_process, iter_layer_params
from .extraction import AttentionLayer, find_attention, unwrap
from .images import HeatmapImages, render_heatmap
from .logdir import LogDirError, LogDirInUseError, LogDirLock, acquire_default, check_log_dir, default_log_dir
from .metrics import table_entries
from .pairs import QKPair, ScorePair, pair_metric_names
from .sinks import Record, RunInfo, Sink, Snapshot
from .sinks.dispatch import DEFAULT_QUEUE_SIZE, DEFAULT_TIMEOUT, SinkDispatcher, SinkStats
from .sinks.tensorboard import writer_log_dir
from .tags import layer_stats

__all__ = [
    "Probe",
    "ProbeConfig",
    "LogDirError",
    "LogDirInUseError",
    "ScorePair",
    "QKPair",
    "render_heatmap",
    "default_log_dir",
]

Tensor = torch.Tensor
F = TypeVar("F", bound=Callable[..., Any])

#: keyword arguments of :class:`Probe` that wire it up rather than configure the measurement
WIRING = ("log_dir", "writer", "sinks", "is_main_process", "extra_config", "purge_stale",
          "background", "sink_queue", "sink_timeout")

# LogDirError, LogDirInUseError, default_log_dir: attn_probe.logdir, re-exported here
# (``attn_probe.probe.LogDirError`` is the documented name).


def default_is_main_process() -> bool:
    """Global rank 0 (``torch.distributed``, else the ``RANK`` variable), or True alone."""
    return is_main_process()


def __getattr__(name: str) -> Any:
    # ``from attn_probe.probe import watch`` keeps working; watch lives above the probe
    if name == "watch":
        from .watching import watch

        return watch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------
# Isolation
# --------------------------------------------------------------------------------------------


def main_process_only(method: F) -> F:
    """Run ``method`` on the main process only; elsewhere return ``None``."""

    @functools.wraps(method)
    def wrapper(self: Probe, *args: Any, **kwargs: Any) -> Any:
        if not self.is_main_process:
            return None
        return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def never_raise(method: F) -> F:
    """Catch every exception of ``method``: warn once per probe with the traceback, return ``None``."""

    @functools.wraps(method)
    def wrapper(self: Probe, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the probe must never stop training
            self.failures += 1
            if self.failures == 1:
                warnings.warn(
                    f"attn_probe: {method.__name__} failed ({type(exc).__name__}: {exc}); that snapshot "
                    "is skipped and training continues. Later failures are counted, not reported.\n"
                    + "".join(traceback.format_exception(exc)),
                    RuntimeWarning,
                    stacklevel=2,
                )
            return None

    return wrapper  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------


def _check_log_dir(log_dir: str) -> None:
    """Create ``log_dir`` and prove it writable, else :class:`LogDirError` (:func:`attn_probe.logdir.check_log_dir`)."""
    check_log_dir(log_dir)


def _start_error(log_dir: str, exc: OSError) -> LogDirError:
    """A sink of the log directory failed to start: the OSError as a LogDirError saying why."""
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = f"the disk is full or nearly full ({exc.strerror or exc})"
    else:
        reason = exc.strerror or str(exc) or type(exc).__name__
    err = LogDirError(f"attn_probe cannot write its log directory {log_dir!r}: {reason}. "
                      "Free some space or pass another log_dir=")
    err.errno = exc.errno
    return err


def _describe_model(model: nn.Module, layers: Sequence[AttentionLayer]) -> dict[str, Any]:
    root = unwrap(model)
    return {
        "class": f"{type(root).__module__}.{type(root).__qualname__}",
        "parameters": sum(p.numel() for p in root.parameters()),
        "attention_layers": [
            {"name": a.name, "group": a.group, "layer": a.layer, "num_heads": a.num_heads,
             "num_kv_heads": a.num_kv_heads, "head_dim": a.head_dim, "hidden_size": a.hidden_size}
            for a in layers
        ],
    }


class Probe:
    """Snapshots of the attention metrics of one model, written to sinks on the main process.

    Build it with :func:`watch` (or the Trainer callback). ``snapshot(step)`` takes one by
    hand; ``close()`` (or leaving the ``with`` block) takes a final snapshot when the counter
    moved past the last one and closes the sinks. Collective-safe: call ``snapshot`` and
    ``close`` on every rank.

    ``config`` (a :class:`~attn_probe.config.ProbeConfig`) and/or its fields as keyword
    options say what is measured and when; ``log_dir``, ``writer``, ``sinks``,
    ``is_main_process``, ``extra_config`` and ``purge_stale`` say where it goes. An unknown
    option raises ``TypeError`` naming the valid ones.

    Attach-time problems raise (:class:`~attn_probe.UnsupportedModelError`,
    :class:`LogDirError`); after that, every failure is caught, warned about once, and the
    affected snapshot is skipped.
    """

    def __init__(
        self,
        model: nn.Module,
        config: ProbeConfig | None = None,
        *,
        log_dir: str | None = None,
        writer: Any = None,
        sinks: Sequence[Sink] | None = None,
        is_main_process: bool | None = None,
        extra_config: dict[str, Any] | None = None,
        purge_stale: bool = True,
        background: bool = True,
        sink_queue: int = DEFAULT_QUEUE_SIZE,
        sink_timeout: float = DEFAULT_TIMEOUT,
        **options: Any,
    ) -> None:
        self.config = cfg = config_from_options(config, allowed_extra=WIRING, **options)
        self.model = model
        self.pairs: list[ScorePair] = cfg.score_pairs()
        self.metrics = pair_metric_names(self.pairs)
        self.images = (HeatmapImages(cfg.image_schedule, cfg.image_size, cfg.image_mode)
                       if cfg.image_schedule is not None else None)
        self.layers: list[AttentionLayer] = find_attention(
            model, groups=cfg.groups, layers=cfg.layers, **cfg.find_kwargs
        )
        if not self.layers:
            from .extraction import UnsupportedModelError

            raise UnsupportedModelError(
                f"attn_probe: no attention layer matches groups={cfg.groups!r}, layers={cfg.layers!r}"
            )
        self.is_main_process = default_is_main_process() if is_main_process is None else bool(is_main_process)
        self.step = cfg.start_step
        self.last_snapshot_step: int | None = None
        self.failures = 0
        self._warned_nonfinite = False
        self._handles: list[Any] = []
        self._forward_counter: ForwardPasses | None = None
        self._closed = False
        self._sinks: list[Sink] = []
        self._dispatcher: SinkDispatcher | None = None
        self._lock: LogDirLock | None = None
        self.log_dir: str | None = None
        groups = sorted({a.group for a in self.layers}, key=[a.group for a in self.layers].index)
        record = {
            **cfg.record(),
            "groups": sorted(groups),
            "layers": sorted({a.layer for a in self.layers}),
            **(extra_config or {}),
        }
        self._run = RunInfo(
            config=record,
            model=_describe_model(model, self.layers),
            groups=groups,
            metrics=list(self.metrics),
            per_head=cfg.per_head,
            resume_step=self.step if self.step > 0 else None,
        )
        if self.is_main_process:
            self._open_sinks(log_dir, writer, sinks, purge_stale, background=background,
                             queue_size=sink_queue, timeout=sink_timeout)

    @property
    def schedule(self) -> Callable[[int], bool] | None:
        return self.config.schedule

    # -- sinks -------------------------------------------------------------------------------

    def _open_sinks(self, log_dir: str | None, writer: Any, sinks: Sequence[Sink] | None, purge_stale: bool,
                    *, background: bool = True, queue_size: int = DEFAULT_QUEUE_SIZE,
                    timeout: float = DEFAULT_TIMEOUT) -> None:
        """Choose and lock the log directory, build the sinks and start them behind a dispatcher.

        The directory is locked (:class:`~attn_probe.logdir.LogDirLock`) for the probe's
        lifetime: a second writer gets :class:`LogDirInUseError` here. A directory the user did
        not name gets a unique name instead (``..._1``, ...). Anything that fails here raises
        (a log-directory problem as :class:`LogDirError`), releasing the lock.
        """
        from .sinks.tensorboard import TensorBoardSink
        from .sinks.trajectory import TrajectorySink

        lock: LogDirLock | None = None
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
                tb = (TensorBoardSink(writer=writer, purge_stale=purge_stale) if writer is not None
                      else TensorBoardSink(log_dir, purge_stale=purge_stale))
                own = [tb, TrajectorySink(log_dir)]
            built = own + list(sinks or [])
            dispatcher = SinkDispatcher(built, background=background, queue_size=queue_size, timeout=timeout)
            try:
                dispatcher.start(self._run)
            except OSError as exc:
                if log_dir is None or isinstance(exc, LogDirError) or not any(
                        dispatcher.failed_sink is sink for sink in own):
                    raise
                raise _start_error(log_dir, exc) from exc
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        self.log_dir = log_dir
        self._lock = lock
        self._sinks = built
        self._dispatcher = dispatcher

    @main_process_only
    def _write(self, snapshot: Snapshot) -> None:
        """Hand the snapshot to the dispatcher (background lanes: returns at once; never raises)."""
        if self._dispatcher is not None:
            self._dispatcher.log(snapshot)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot taken so far is written by every sink (main process).

        With the default background writing, ``snapshot()`` returns before its values are
        on disk; call this before reading the files while the probe is open. ``timeout`` in
        seconds (default: the probe's ``sink_timeout``). Returns ``False`` if a sink was still
        busy then; ``True`` at once on other ranks and after :meth:`close`. Never raises.
        """
        dispatcher = self._dispatcher
        if dispatcher is None:
            return True
        return dispatcher.flush(timeout)

    def sink_stats(self) -> list[SinkStats]:
        """Per sink: snapshots delivered, lost to failures, dropped (queue full), and whether it fails now."""
        return self._dispatcher.stats() if self._dispatcher is not None else []

    # -- measuring ---------------------------------------------------------------------------

    def _param_names(self, layer: AttentionLayer) -> tuple[str, ...]:
        names: dict[str, None] = {}
        for pair in self.pairs:
            wanted = pair.param_names(layer) if hasattr(pair, "param_names") else layer.param_names
            names.update(dict.fromkeys(wanted))
        return tuple(names)

    def _images_due(self, step: int) -> bool:
        return self.images is not None and self.images.due(step)

    def _measure(self, step: int) -> Snapshot | None:
        """Walk all layers (every rank); score and assemble on the main process."""
        scored: list[tuple[AttentionLayer, list[Tensor]]] = []
        images: dict[tuple[str, int], np.ndarray] = {}
        error: BaseException | None = None
        try:  # a user schedule must not make the main process skip the collective walk below
            want_images = self.is_main_process and self._images_due(step)
        except Exception as exc:  # noqa: BLE001 - re-raised after the walk
            want_images, error = False, exc
        for layer, get in iter_layer_params(self.model, self.layers, param_names=self._param_names):
            if not self.is_main_process or error is not None:
                continue  # keep exhausting the iterator: other ranks wait in its collectives
            try:
                values = []
                for pair in self.pairs:
                    a, b = pair.factors(layer, get) if hasattr(pair, "factors") else layer.factors(get)
                    values.append(pair.score(layer, a.detach(), b.detach(), per_head=self.config.per_head,
                                             num_std=self.config.num_std))
                scored.append((layer, values))
                if want_images:
                    assert self.images is not None
                    images[(layer.group, layer.layer)] = self.images.measure(layer, get)
            except Exception as exc:  # noqa: BLE001 - re-raised after the walk
                error = exc
        if error is not None:
            raise error
        if not self.is_main_process:
            return None
        return self._assemble(step, scored, images)

    def _assemble(self, step: int, scored: list[tuple[AttentionLayer, list[Tensor]]],
                  images: dict[tuple[str, int], np.ndarray]) -> Snapshot:
        # One transfer per device: flatten everything, concatenate, move once.
        by_device: dict[torch.device, list[Tensor]] = {}
        for _, values in scored:
            for v in values:
                by_device.setdefault(v.device, []).append(v.reshape(-1).double())
        host: dict[torch.device, np.ndarray] = {
            dev: torch.cat(parts).cpu().numpy() for dev, parts in by_device.items()
        }
        offsets = dict.fromkeys(host, 0)
        records: list[Record] = []
        nonfinite: list[str] = []
        for layer, values in scored:
            for pair, v in zip(self.pairs, values, strict=True):
                n = v.numel()
                flat = host[v.device][offsets[v.device]: offsets[v.device] + n]
                offsets[v.device] += n
                for head, metric, value in table_entries(pair.metrics, flat.reshape(v.shape)):
                    records.append(Record(layer.group, layer.layer, head, metric, value))
                    if head is None and not math.isfinite(value):
                        nonfinite.append(f"{layer.name} {metric}")
        if nonfinite and not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(
                f"attn_probe: non-finite weights or undefined scores at step {step} "
                f"({', '.join(nonfinite[:6])}{', ...' if len(nonfinite) > 6 else ''}); logged as NaN. "
                "This warning is shown once.",
                RuntimeWarning,
                stacklevel=4,
            )
        return Snapshot(step=step, wall_time=time.time(), records=records,
                        stats=self._stats(records), images=images)

    @staticmethod
    def _stats(records: list[Record]) -> dict[tuple[str, str, str], float]:
        by_key: dict[tuple[str, str], list[float]] = {}
        for r in records:
            if r.head is None:
                by_key.setdefault((r.group, r.metric), []).append(r.value)
        return {(group, metric, stat): value
                for (group, metric), vals in by_key.items()
                for stat, value in layer_stats(vals, metric).items()}

    # -- public ------------------------------------------------------------------------------

    @never_raise
    def snapshot(self, step: int | None = None) -> Snapshot | None:
        """Measure now and write (main process); ``step`` defaults to the probe's counter.

        Steps must increase: a step ``<=`` the last snapshot's is skipped. Returns the
        :class:`~attn_probe.sinks.Snapshot` on the main process, ``None`` elsewhere.
        """
        if self._closed:
            return None
        step = self.step if step is None else int(step)
        if self.last_snapshot_step is not None and step <= self.last_snapshot_step:
            return None
        self.last_snapshot_step = step
        snap = self._measure(step)
        if snap is not None:
            self._write(snap)
        return snap

    def due(self, step: int) -> bool:
        """Whether the schedule (or the image schedule) fires at ``step``."""
        schedule = self.config.schedule
        return schedule is not None and bool(schedule(step)) or self._images_due(step)

    @never_raise
    def on_update(self, step: int | None = None) -> None:
        """Advance the counter by one update (or set it to ``step``); snapshot if due."""
        self.step = self.step + 1 if step is None else int(step)
        if self.due(self.step):
            self.snapshot(self.step)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer.step()`` calls (:class:`attn_probe.counting.OptimizerUpdates`)."""
        self.add_hook_handle(OptimizerUpdates(optimizer, self))

    def attach_forward_counter(self, module: nn.Module) -> None:
        """Count training-mode forward passes of ``module`` (:class:`attn_probe.counting.ForwardPasses`)."""
        self._forward_counter = ForwardPasses(module, self)
        self.add_hook_handle(self._forward_counter)

    def add_hook_handle(self, handle: Any) -> None:
        """Keep a removable handle (``.remove()``) to drop at :meth:`close`."""
        self._handles.append(handle)

    def close(self, final_snapshot: bool = True) -> None:
        """Detach hooks, take a last snapshot if the counter moved past the last one, close sinks."""
        if self._closed:
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        counter = self._forward_counter
        if counter is not None and counter.final_step is not None:
            self.step = max(self.step, counter.final_step)
        if final_snapshot and (self.last_snapshot_step is None or self.step > self.last_snapshot_step):
            self.snapshot(self.step)
        self._closed = True
        self._finish_sinks()

    def _finish_sinks(self) -> None:
        """Drain the sinks' queues and finish them (bounded by ``sink_timeout``); release the log dir.

        Never raises: the dispatcher catches and warns about everything a sink does at close.
        """
        dispatcher, lock = self._dispatcher, self._lock
        self._dispatcher, self._lock = None, None
        self._sinks = []
        try:
            if dispatcher is not None:
                dispatcher.close()
        finally:
            if lock is not None:
                try:
                    lock.release()
                except Exception:  # noqa: BLE001 - close() must not raise
                    pass

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Probe({len(self.layers)} layers, step={self.step}, "
                f"last_snapshot={self.last_snapshot_step}, log_dir={self.log_dir!r})")
