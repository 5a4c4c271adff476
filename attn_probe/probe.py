"""The live probe: schedule -> snapshot -> sinks, isolated so that it never stops training.

A :class:`Probe` holds the attention layers found at attach time, a step counter, a schedule
and its sinks. At a snapshot it reads every layer's factors through
:func:`attn_probe.distributed.iter_layer_factors` (on every rank, same order, exhausted),
computes the scores on the weights' own device under ``no_grad``
(:func:`attn_probe.scores.factored_scores_tensor`: no ``d x d`` product for thin factors, the
results stay on the device) and moves every layer's scores to the host in one transfer per
snapshot; the sinks get plain numbers, on the main process only.

Counting (:func:`watch`):

* ``optimizer=``: a step post-hook counts optimizer updates;
* ``accelerator=``: real updates only (see :mod:`attn_probe.integrations.accelerate`);
* neither: a forward pre-hook on the root module counts *training-mode forward passes*
  (micro-batches under gradient accumulation).

This module imports neither transformers nor accelerate.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from torch import nn

from .distributed import is_main_process, iter_layer_factors
from .extraction import AttentionLayer, find_attention, unwrap
from .schedules import Schedule, ScheduleLike, as_schedule
from .scores import factored_scores_tensor
from .sinks import Record, RunInfo, Sink, Snapshot
from .sinks.tensorboard import writer_log_dir
from .tags import layer_stats

__all__ = [
    "Probe",
    "watch",
    "LogDirError",
    "ScorePair",
    "QKPair",
    "render_heatmap",
    "default_log_dir",
]

Tensor = torch.Tensor
F = TypeVar("F", bound=Callable[..., Any])

#: trajectory files written by open probes of this process (two probes must not share one)
_OPEN_PATHS: set[str] = set()


class LogDirError(OSError):
    """The log directory cannot be created or written (raised at attach time)."""


def default_log_dir() -> str:
    """``runs/<Mon DD_HH-MM-SS>_<host>``, SummaryWriter's own default."""
    return os.path.join("runs", datetime.now().strftime("%b%d_%H-%M-%S") + "_" + socket.gethostname())


def default_is_main_process() -> bool:
    """Global rank 0 (``torch.distributed``, else the ``RANK`` variable), or True alone."""
    return is_main_process()


# --------------------------------------------------------------------------------------------
# Scored weight pairs
# --------------------------------------------------------------------------------------------


class ScorePair(Protocol):
    """A scored weight pair: the extension point for e.g. ``W_v W_o`` next to ``W_qk``.

    ``metrics`` are the metric names it writes (``tags.scalar_tag`` metric field; prefix new
    pairs, e.g. ``vo_symmetry``); ``score`` returns a ``(len(metrics), 1 + H*per_head)``
    tensor for one layer, column 0 the layer-level value. It may stay on the weights'
    device: the probe moves all pairs' and layers' results to the host together, one
    transfer per device and snapshot.
    """

    metrics: tuple[str, ...]

    def score(self, layer: AttentionLayer, query: Tensor, key: Tensor, *,
              per_head: bool, num_std: float) -> Tensor: ...


class QKPair:
    """Symmetry and directionality of ``W_qk = W_q W_k^T``."""

    metrics: tuple[str, ...] = ("symmetry", "directionality")

    def score(self, layer: AttentionLayer, query: Tensor, key: Tensor, *,
              per_head: bool, num_std: float) -> Tensor:
        # stays on the weights' device: the probe moves every layer's values in one transfer
        return factored_scores_tensor(query, key, per_head=per_head, num_std=num_std)


# --------------------------------------------------------------------------------------------
# Heatmaps (numpy only)
# --------------------------------------------------------------------------------------------


def render_heatmap(matrix: np.ndarray) -> np.ndarray:
    """``HxWx3`` uint8 image of a matrix with a symmetric colour scale: blue < 0 < red, white at 0."""
    m = np.asarray(matrix, dtype=np.float64)
    m = np.where(np.isfinite(m), m, 0.0)
    vmax = float(np.abs(m).max()) if m.size else 0.0
    x = m / vmax if vmax > 0 else np.zeros_like(m)
    pos, neg = np.clip(x, 0, 1), np.clip(-x, 0, 1)
    rgb = np.stack([1 - neg, 1 - pos - neg, 1 - pos], axis=-1)
    return np.round(rgb * 255).astype(np.uint8)


def _qk_image(query: Tensor, key: Tensor, size: int, mode: str) -> np.ndarray:
    num_heads, head_dim, d = query.shape
    num_kv = key.shape[0]
    q = query.detach().float().reshape(num_kv, num_heads // num_kv, head_dim, d).sum(1)
    if mode == "block":
        m = q.reshape(-1, d)[:, :size].T @ key.detach().float().reshape(-1, d)[:, :size]
    else:
        m = q.reshape(-1, d).T @ key.detach().float().reshape(-1, d)
        if d > size:
            m = torch.nn.functional.adaptive_avg_pool2d(m[None, None], size)[0, 0]
    return render_heatmap(m.cpu().numpy())


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


@dataclass(frozen=True)
class _Options:
    per_head: bool
    num_std: float
    images_every: Schedule | None
    image_size: int
    image_mode: str


def _check_log_dir(log_dir: str) -> None:
    try:
        os.makedirs(log_dir, exist_ok=True)
        probe_file = os.path.join(log_dir, f".attn_probe_write_test.{os.getpid()}")
        with open(probe_file, "w") as f:
            f.write("ok")
        os.remove(probe_file)
    except OSError as exc:
        raise LogDirError(
            f"attn_probe cannot write its log directory {log_dir!r}: {exc.strerror or exc}. "
            "Pass a writable log_dir=."
        ) from exc


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
    """Snapshots of the attention scores of one model, written to sinks on the main process.

    Build it with :func:`watch` (or the Trainer callback). ``snapshot(step)`` takes one by
    hand; ``close()`` (or leaving the ``with`` block) takes a final snapshot when the counter
    moved past the last one and closes the sinks. Collective-safe: call ``snapshot`` and
    ``close`` on every rank.

    Attach-time problems raise (:class:`~attn_probe.UnsupportedModelError`,
    :class:`LogDirError`); after that, every failure is caught, warned about once, and the
    affected snapshot is skipped.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        log_dir: str | None = None,
        writer: Any = None,
        sinks: Sequence[Sink] | None = None,
        every: ScheduleLike | None = 100,
        per_head: bool = False,
        groups: Iterable[str] | None = None,
        layers: Iterable[int] | None = None,
        num_std: float = 2.0,
        images_every: ScheduleLike | None = None,
        image_size: int = 128,
        image_mode: str = "downsample",
        pairs: Sequence[ScorePair] | None = None,
        is_main_process: bool | None = None,
        start_step: int = 0,
        find_kwargs: dict[str, Any] | None = None,
        extra_config: dict[str, Any] | None = None,
        purge_stale: bool = True,
    ) -> None:
        if image_mode not in ("downsample", "block"):
            raise ValueError(f"image_mode must be 'downsample' or 'block', got {image_mode!r}")
        if not (isinstance(num_std, (int, float)) and math.isfinite(num_std)):
            raise ValueError(f"num_std must be a finite number, got {num_std!r}")
        self.model = model
        self.schedule: Schedule | None = as_schedule(every)
        self.options = _Options(bool(per_head), float(num_std), as_schedule(images_every),
                                int(image_size), image_mode)
        self.pairs: list[ScorePair] = list(pairs) if pairs is not None else [QKPair()]
        self.layers: list[AttentionLayer] = find_attention(
            model, groups=groups, layers=layers, **(find_kwargs or {})
        )
        if not self.layers:
            from .extraction import UnsupportedModelError

            raise UnsupportedModelError(
                f"attn_probe: no attention layer matches groups={groups!r}, layers={layers!r}"
            )
        self.is_main_process = default_is_main_process() if is_main_process is None else bool(is_main_process)
        self.step = int(start_step)
        self.last_snapshot_step: int | None = None
        self.failures = 0
        self._warned_nonfinite = False
        self._handles: list[Any] = []
        self._final_step: int | None = None  # forward counting: steps seen after the last forward
        self._closed = False
        self._sinks: list[Sink] = []
        self._paths: list[str] = []
        self.log_dir: str | None = None
        config = {
            "every": getattr(self.schedule, "__qualname__", repr(self.schedule)),
            "per_head": self.options.per_head,
            "groups": sorted({a.group for a in self.layers}),
            "layers": sorted({a.layer for a in self.layers}),
            "num_std": self.options.num_std,
            "images_every": getattr(self.options.images_every, "__qualname__", None),
            "image_size": self.options.image_size,
            "image_mode": self.options.image_mode,
            "start_step": self.step,
            **(extra_config or {}),
        }
        self._run = RunInfo(
            config=config,
            model=_describe_model(model, self.layers),
            groups=sorted({a.group for a in self.layers}, key=[a.group for a in self.layers].index),
            metrics=[m for p in self.pairs for m in p.metrics],
            per_head=self.options.per_head,
            resume_step=self.step if self.step > 0 else None,
        )
        if self.is_main_process:
            self._open_sinks(log_dir, writer, sinks, purge_stale)

    # -- sinks -------------------------------------------------------------------------------

    def _open_sinks(self, log_dir: str | None, writer: Any, sinks: Sequence[Sink] | None,
                    purge_stale: bool) -> None:
        from .sinks.tensorboard import TensorBoardSink
        from .sinks.trajectory import TrajectorySink

        if writer is not None and log_dir is None:
            log_dir = writer_log_dir(writer)
        if sinks is None or log_dir is not None or writer is not None:
            log_dir = os.path.expanduser(log_dir if log_dir is not None else default_log_dir())
            _check_log_dir(log_dir)
            trajectory = TrajectorySink(log_dir)
            path = os.path.abspath(trajectory.path)
            if path in _OPEN_PATHS:
                raise LogDirError(f"another open attn_probe already writes {path}; give each probe its own log_dir")
            tb = (TensorBoardSink(writer=writer) if writer is not None
                  else TensorBoardSink(log_dir, purge_stale=purge_stale))
            built: list[Sink] = [tb, trajectory]
            self.log_dir = log_dir
            self._paths.append(path)
        else:
            built = []
        built += list(sinks or [])
        for sink in built:
            sink.start(self._run)
            self._sinks.append(sink)
        _OPEN_PATHS.update(self._paths)

    @main_process_only
    def _write(self, snapshot: Snapshot) -> None:
        for sink in self._sinks:
            sink.log(snapshot)

    # -- scoring -----------------------------------------------------------------------------

    def _images_due(self, step: int) -> bool:
        sched = self.options.images_every
        return sched is not None and bool(sched(step))

    def _measure(self, step: int) -> Snapshot | None:
        """Walk all layers (every rank); score and assemble on the main process."""
        scored: list[tuple[AttentionLayer, list[Tensor]]] = []
        images: dict[tuple[str, int], np.ndarray] = {}
        error: BaseException | None = None
        try:  # a user schedule must not make the main process skip the collective walk below
            want_images = self.is_main_process and self._images_due(step)
        except Exception as exc:  # noqa: BLE001 - re-raised after the walk
            want_images, error = False, exc
        for layer, query, key in iter_layer_factors(self.model, self.layers):
            if not self.is_main_process or error is not None:
                continue  # keep exhausting the iterator: other ranks wait in its collectives
            try:
                values = [p.score(layer, query, key, per_head=self.options.per_head,
                                  num_std=self.options.num_std) for p in self.pairs]
                scored.append((layer, values))
                if want_images:
                    images[(layer.group, layer.layer)] = _qk_image(
                        query, key, self.options.image_size, self.options.image_mode)
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
                table = flat.reshape(v.shape)
                for i, metric in enumerate(pair.metrics):
                    for col in range(table.shape[1]):
                        head = None if col == 0 else col - 1
                        value = float(table[i, col])
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
                for stat, value in layer_stats(vals).items()}

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
        """Whether the schedule fires at ``step`` (identical on every rank)."""
        return self.schedule is not None and bool(self.schedule(step)) or self._images_due(step)

    @never_raise
    def on_update(self, step: int | None = None) -> None:
        """Advance the counter by one update (or set it to ``step``); snapshot if due."""
        self.step = self.step + 1 if step is None else int(step)
        if self.due(self.step):
            self.snapshot(self.step)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer.step()`` calls with a step post-hook."""
        if not hasattr(optimizer, "register_step_post_hook"):
            raise TypeError(f"{type(optimizer).__name__} has no register_step_post_hook; pass a torch optimizer")
        self._handles.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: self.on_update()))

    def attach_forward_counter(self, module: nn.Module) -> None:
        """Count training-mode forward passes of ``module`` (micro-batches under accumulation)."""

        base = self.step
        count = [0]

        def pre_hook(mod: nn.Module, args: Any) -> None:
            if mod.training:
                # step = forwards before this one: the weights this forward sees
                self.on_update(base + count[0])
                count[0] += 1
                self._final_step = base + count[0]

        self._handles.append(module.register_forward_pre_hook(pre_hook))

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
        if self._final_step is not None:
            self.step = max(self.step, self._final_step)
        if final_snapshot and (self.last_snapshot_step is None or self.step > self.last_snapshot_step):
            self.snapshot(self.step)
        self._closed = True
        self._finish_sinks()

    @never_raise
    def _finish_sinks(self) -> None:
        try:
            for sink in self._sinks:
                sink.finish()
        finally:
            _OPEN_PATHS.difference_update(self._paths)
            self._sinks.clear()

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Probe({len(self.layers)} layers, step={self.step}, "
                f"last_snapshot={self.last_snapshot_step}, log_dir={self.log_dir!r})")


def watch(
    model: nn.Module,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    accelerator: Any = None,
    log_dir: str | None = None,
    every: ScheduleLike = 100,
    **options: Any,
) -> Probe:
    """Attach a probe to a training loop and take the step-0 snapshot now.

    * ``watch(model, optimizer=opt, log_dir="runs/x", every=100)``: counts ``opt.step()``;
    * ``watch(model, accelerator=accelerator, every=100)``: counts real optimizer updates of
      the prepared optimizers and writes into the accelerator's TensorBoard run if any;
    * ``watch(model, every=100)``: counts training-mode forward passes of ``model``.

    ``every`` is an int or a callable ``step -> bool`` (:mod:`attn_probe.schedules`).
    Other options go to :class:`Probe` (``per_head``, ``groups``, ``layers``, ``num_std``,
    ``images_every``, ``image_size``, ``image_mode``, ``pairs``, ``start_step``, ``sinks``).
    """
    if optimizer is not None and accelerator is not None:
        raise ValueError("give optimizer= or accelerator=, not both (the accelerator knows its optimizers)")
    if accelerator is not None:
        from .integrations.accelerate import watch_accelerated

        return watch_accelerated(model, accelerator, log_dir=log_dir, every=every, **options)
    probe = Probe(model, log_dir=log_dir, every=every, **options)
    if optimizer is not None:
        probe.attach_optimizer(optimizer)
    else:
        probe.attach_forward_counter(model)
    probe.snapshot(probe.step)
    return probe
