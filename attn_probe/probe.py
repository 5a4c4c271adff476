"""The live probe: schedule -> snapshot -> sinks, isolated so that it never stops training.

A :class:`Probe` holds a validated :class:`~attn_probe.config.ProbeConfig`, the attention
layers found at attach time, a step counter and its sinks. At a snapshot it walks every
layer through :func:`attn_probe.distributed.iter_layer_params` (on every rank, same order,
exhausted), gathering the parameters its score pairs and scheduled quantities declare. The
pairs score through the one core on the weights' own device, with no host sync: unsharded
layers after the walk, layers of one shape as stacks (:func:`attn_probe.pairs.stack_layers`,
:func:`attn_probe.metrics.score_factor_stack`), gathered layers one at a time as they come;
with ``async_scoring`` the stacks are copied and scored on a worker thread
(:mod:`attn_probe.asynchronous`). The tables move to the host in one transfer per device and
snapshot, and the sinks get plain numbers, on the main process only.

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
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from .asynchronous import DEFAULT_ASYNC_BYTES, AsyncScorer
from .config import ProbeConfig, config_from_options
from .counting import ForwardPasses, OptimizerUpdates
from .distributed import (
    Agreement,
    AgreementError,
    WalkOutcome,
    is_main_process,
    iter_layer_params,
    sharding_kind,
    world_info,
)
from .extraction import AttentionLayer, find_attention, unwrap
from .images import HeatmapImages, render_heatmap
from .logdir import LogDirError, LogDirInUseError, LogDirLock, acquire_default, check_log_dir, default_log_dir
from .metrics import table_entries
from .pairs import (
    QKPair,
    ScorePair,
    Stack,
    check_pairs,
    pair_metric_names,
    score_stacks,
    stack_layers,
)
from .schedules import is_deterministic
from .sinks import Record, RunInfo, Sink, Snapshot
from .sinks.dispatch import (
    DEFAULT_QUEUE_SIZE,
    DEFAULT_TIMEOUT,
    SinkDispatcher,
    SinkStats,
    before_exit_flush,
    safe_warn,
)
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
WIRING = ("log_dir", "writer", "sinks", "is_main_process", "extra_config", "purge_stale", "restart",
          "background", "sink_queue", "sink_timeout", "async_scoring", "async_max_bytes")

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


def _warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warn without ever raising (:func:`attn_probe.sinks.dispatch.safe_warn`): the probe's
    isolation must not depend on the warnings filter (``python -W error``)."""
    safe_warn(message, category, stacklevel=3)


def check_probe_options(*, sink_timeout: Any = DEFAULT_TIMEOUT, sink_queue: Any = DEFAULT_QUEUE_SIZE,
                        async_max_bytes: Any = DEFAULT_ASYNC_BYTES, **flags: Any) -> None:
    """Reject bad values of the probe's writing and scoring options before anything is opened.

    ``flags`` (``background``, ``async_scoring``, ...) must be bools (``TypeError``); the
    numbers must be in range (``ValueError``); every message names the option.
    """
    if isinstance(sink_queue, bool) or not isinstance(sink_queue, int) or sink_queue < 1:
        raise ValueError(f"sink_queue must be an int >= 1, got {sink_queue!r}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if (isinstance(sink_timeout, bool) or not isinstance(sink_timeout, (int, float))
            or not math.isfinite(sink_timeout) or sink_timeout <= 0):
        raise ValueError(f"sink_timeout must be a finite number of seconds > 0, got {sink_timeout!r}")
    if isinstance(async_max_bytes, bool) or not isinstance(async_max_bytes, int) or async_max_bytes < 0:
        raise ValueError(f"async_max_bytes must be an int >= 0, got {async_max_bytes!r}")


#: open probes in the asynchronous mode (their snapshot in flight is written at interpreter exit)
_SCORING: weakref.WeakSet[Probe] = weakref.WeakSet()


def _deliver_at_exit(seconds: float) -> None:
    """Exit hook (before the sinks are flushed): write each unclosed probe's snapshot in flight.

    Waits for it within ``seconds``; the worker thread then no longer runs while the interpreter
    shuts down (a thread still inside torch then can abort the process).
    """
    deadline = time.monotonic() + seconds
    for probe in list(_SCORING):
        if not probe._closed:
            probe._deliver(wait=True, timeout=max(0.0, deadline - time.monotonic()), closing=True,
                           moment="interpreter exit (the probe was never closed)")


before_exit_flush(_deliver_at_exit)


def _report_failure(probe: Probe, what: str, exc: BaseException) -> None:
    """Count a failure of the probe; warn about the first one with its traceback. Never raises."""
    try:
        probe.failures += 1
        if probe.failures == 1:
            _warn(
                f"attn_probe: {what} failed ({type(exc).__name__}: {exc}); that snapshot "
                "is skipped and training continues. Later failures are counted, not reported.\n"
                + "".join(traceback.format_exception(exc))
            )
    except Exception:  # noqa: BLE001
        pass


def _submodule(module: nn.Module, path: str) -> nn.Module:
    """``module.get_submodule(path)`` by dictionary lookups (a few hundred ns per segment)."""
    for item in path.split(".") if path else ():
        child = module._modules.get(item)
        module = child if child is not None else getattr(module, item)  # AttributeError: gone
    return module


def never_raise(method: F) -> F:
    """Catch every exception of ``method``: warn once per probe with the traceback, return ``None``.

    The warning itself cannot raise (:func:`_warn`), so this holds under ``python -W error``.
    """

    @functools.wraps(method)
    def wrapper(self: Probe, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the probe must never stop training
            _report_failure(self, method.__name__, exc)
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
    ``is_main_process``, ``extra_config`` and ``purge_stale`` say where it goes; ``restart``
    says the run starts over at ``start_step`` even when that is 0 (a Trainer re-entering its
    training loop): the trajectory rows at steps from there on are dropped, as on a resume.
    An unknown option raises ``TypeError`` naming the valid ones.

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
        restart: bool = False,
        background: bool = True,
        sink_queue: int = DEFAULT_QUEUE_SIZE,
        sink_timeout: float = DEFAULT_TIMEOUT,
        async_scoring: bool = False,
        async_max_bytes: int = DEFAULT_ASYNC_BYTES,
        **options: Any,
    ) -> None:
        check_probe_options(background=background, sink_timeout=sink_timeout, sink_queue=sink_queue,
                            async_max_bytes=async_max_bytes, restart=restart, purge_stale=purge_stale)
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
        check_pairs(self.pairs, self.layers)  # e.g. the OV pair on an architecture it cannot read
        self.is_main_process = default_is_main_process() if is_main_process is None else bool(is_main_process)
        self.step = cfg.start_step
        self.last_snapshot_step: int | None = None
        self.failures = 0
        self._warned_nonfinite = False
        #: a sharded run's probe stops for good after a failed agreement (docs/distributed.md)
        self.disabled = False
        self._deterministic = is_deterministic(cfg.schedule) and is_deterministic(cfg.image_schedule)
        self._agreement: Agreement | None = self._make_agreement(model)  # collective on a sharded run
        if not isinstance(async_scoring, bool):
            raise TypeError(f"async_scoring must be True or False, got {async_scoring!r}")
        #: the asynchronous mode's worker (unsharded models; docs/live-probe.md)
        self._async: AsyncScorer | None = AsyncScorer(async_max_bytes) if async_scoring else None
        self._async_timeout = sink_timeout
        self._final = False  # close()'s final snapshot: never asynchronous
        self._warned_async_size = False
        if self._async is not None and self._agreement is not None:
            self._async = None
            _warn("attn_probe: async_scoring applies to unsharded models; this sharded run is scored on the "
                  "training thread, in program order with its gathers.")
        if self._async is not None:
            _SCORING.add(self)  # never closed: the exit hook writes the snapshot in flight
        try:
            self._identities = self._record_identities()
        except Exception:  # noqa: BLE001 - unresolvable names: snapshots will say so; no surgery check
            self._identities = []
        self._handles: list[Any] = []
        self._forward_counter: ForwardPasses | None = None
        self._closed = False
        self._warned_closed = False
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
            resume_step=self.step if self.step > 0 or restart else None,
        )
        if self.is_main_process:
            self._open_sinks(log_dir, writer, sinks, purge_stale, background=background,
                             queue_size=sink_queue, timeout=sink_timeout)

    @property
    def schedule(self) -> Callable[[int], bool] | None:
        return self.config.schedule

    @property
    def sharded(self) -> bool:
        """Whether this probe gathers (FSDP/DTensor/ZeRO-3 on several ranks) and so agrees first."""
        return self._agreement is not None

    # -- the collective protocol (docs/distributed.md) ---------------------------------------

    def _make_agreement(self, model: nn.Module) -> Agreement | None:
        """On a sharded run, the gloo group of the probe's agreements (made at attach, every rank)."""
        if not world_info().distributed or sharding_kind(model) == "local":
            return None  # single process, DDP, ZeRO-1/2: no collective, ever
        return Agreement(self.config.agreement_timeout)

    def _disable(self, reason: str) -> None:
        """A failed agreement: issue no further collective from this rank (warned once)."""
        self.disabled = True
        timeout = self._agreement.timeout if self._agreement is not None else None
        _warn(
            f"attn_probe: an agreement between ranks failed on this rank ({reason}); the probe is disabled "
            "here and issues no further collective. The other ranks time out in their next agreement "
            f"(after agreement_timeout, {timeout}) and disable theirs too. Training continues; no "
            "further snapshots are taken in this run."
        )

    def _due_parts(self, step: int) -> tuple[bool, bool]:
        """``(schedule fires, image schedule fires)`` at ``step`` (may raise: user code)."""
        schedule = self.config.schedule
        return schedule is not None and bool(schedule(step)), self._images_due(step)

    def _agreed_snapshot(self, step: int, want: bool, images: bool | None,
                         error: BaseException | None) -> Snapshot | None:
        """Sharded: one agreement decides, identically on every rank, whether to snapshot now.

        Rank 0's ``want`` decides; an ``error`` on any rank (its schedule raised), a stale step on
        any rank, or different steps make every rank skip. Raises only after every collective of
        this call (then caught by :func:`never_raise`).
        """
        assert self._agreement is not None
        try:
            rank0 = self._agreement.rank == 0
            fresh = self.last_snapshot_step is None or step > self.last_snapshot_step
            vote = [(1 if want else 0) if rank0 else 1, 0 if error is not None else 1, 1 if fresh else 0,
                    int(step), -int(step)]
        except Exception as exc:  # noqa: BLE001 - still vote: "no"
            vote, error = [1, 0, 1, 0, 0], exc
        try:
            due, ok, fresh_everywhere, low, minus_high = self._agreement.min(vote)
        except AgreementError as exc:
            self._disable(str(exc))
            return None
        if not ok:
            if error is not None:
                raise error
            raise RuntimeError(f"the schedule failed on another rank at step {step}; every rank skips it")
        if low != -minus_high:
            raise RuntimeError(f"the ranks disagree on the step ({low} to {-minus_high}); every rank skips it")
        if not due or not fresh_everywhere:
            return None
        self.last_snapshot_step = step
        try:
            snap = self._measure(step, images)
        except AgreementError as exc:
            self._disable(str(exc))
            return None
        if snap is not None:
            self._write(snap)
        return snap

    # -- model surgery after attach ----------------------------------------------------------

    def _record_identities(self) -> list[tuple[AttentionLayer, Any, list[tuple[bool, str, Any, str, Any]], Any]]:
        """Per layer: its module, per scored parameter the owning module and the parameter object,
        and the adapters attached to its LoRA projections."""
        root = unwrap(self.model)
        out = []
        for layer in self.layers:
            module = layer.module
            prefix = f"{layer.name}." if layer.name else ""
            refs = []
            for name in self._param_names(layer):
                on_layer = module is not None and name.startswith(prefix)
                rel = name[len(prefix):] if on_layer else name
                path, _, attr = rel.rpartition(".")
                base = module if on_layer else root
                owner = base.get_submodule(path) if path else base
                refs.append((on_layer, path, owner, attr, owner._parameters.get(attr)))
            out.append((layer, module, refs, layer.attached_adapters()))
        return out

    def _changed_layers(self) -> list[str]:
        """Attached layers whose module, or whose q/k parameters, are no longer those of attach time.

        Identity comparisons only (a few ``getattr`` per layer): the module at each attached
        path, the module owning each scored parameter, the parameter registered there; and the
        names of the adapters attached to its LoRA projections (one added after attach has
        parameters the layer does not declare). Which adapter is active, merged or disabled is
        read with the weights, at every snapshot.
        """
        root = unwrap(self.model)
        changed = []
        for layer, module, refs, adapters in self._identities:
            try:
                same = module is None or _submodule(root, layer.name) is module
                same = same and layer.attached_adapters() == adapters
                for on_layer, path, owner, attr, param in refs if same else ():
                    current = _submodule(module if on_layer else root, path)
                    if current is not owner or current._parameters.get(attr) is not param:
                        same = False
                        break
            except AttributeError:  # the path is gone (a deleted layer)
                same = False
            if not same:
                changed.append(layer.name)
        return changed

    def _check_surgery(self) -> None:
        """Re-resolve the layers (with a warning) when the model changed since attach."""
        changed = self._changed_layers()
        if not changed:
            return
        before = [a.name for a in self.layers]
        try:
            layers = find_attention(self.model, groups=self.config.groups, layers=self.config.layers,
                                    **self.config.find_kwargs)
        except Exception:  # noqa: BLE001 - UnsupportedModelError: nothing left to read
            layers = []
        self.layers = layers
        self._identities = self._record_identities()
        now = [a.name for a in layers]
        gone = [n for n in before if n not in now]
        found = [n for n in now if n not in before]
        _warn(
            "attn_probe: the model changed after attach: "
            f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} no longer the module (or q/k "
            "parameters) found at attach. The probe found the attention layers again: "
            f"{len(layers)} layer{'s' if len(layers) != 1 else ''} now"
            + (f"; gone: {', '.join(gone)}" if gone else "")
            + (f"; new: {', '.join(found)}" if found else "")
            + ". Values from this snapshot on are those of the live modules."
            + ("" if layers else " Nothing is logged until attention layers are found again.")
        )

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
        on disk; call this before reading the files while the probe is open. With
        ``async_scoring`` it first waits for the snapshot being scored. ``timeout`` in seconds
        for each wait (default: the probe's ``sink_timeout``). Returns ``False`` if a snapshot
        was still being scored or a sink still busy then; ``True`` at once on other ranks and
        after :meth:`close`. Never raises.
        """
        scored = self._deliver(wait=True, timeout=timeout)
        dispatcher = self._dispatcher
        if dispatcher is None:
            return scored
        return dispatcher.flush(timeout) and scored

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

    def _check_extraction(self, layer: AttentionLayer, get: Any) -> None:
        """Dry run of the pairs' extraction on empty full-shape tensors (before a gather)."""
        for pair in self.pairs:
            pair.factors(layer, get) if hasattr(pair, "factors") else layer.factors(get)

    def _measure(self, step: int, want_images: bool | None = None, asynchronous: bool = False) -> Snapshot | None:
        """Walk all layers (every rank); score and assemble on the main process.

        ``asynchronous`` (unsharded models): copy the factors and score them on the worker of
        :class:`~attn_probe.asynchronous.AsyncScorer`, returning ``None`` at once.

        Local errors (the model-surgery check, the image schedule, extraction, scoring) are
        kept and re-raised after the walk; under sharding they make this rank vote "stop" at
        the next agreement, so that every rank ends the walk at the same gather.
        """
        scored: list[tuple[AttentionLayer, list[Tensor]]] = []
        images: dict[tuple[str, int], np.ndarray] = {}
        error: BaseException | None = None
        outcome = WalkOutcome()
        try:
            self._check_surgery()
        except Exception as exc:  # noqa: BLE001 - re-raised after the walk
            error = exc
        try:  # a user schedule must not make the main process skip the collective walk below
            want_images = self.is_main_process and (self._images_due(step) if want_images is None else want_images)
        except Exception as exc:  # noqa: BLE001 - re-raised after the walk
            want_images, error = False, exc
        layers = list(self.layers)
        # Unsharded weights stay valid after the walk: score layers of one shape as stacks
        # afterwards. Gathered ones are freed at the next layer: score each in the walk.
        deferred: list[tuple[AttentionLayer, list[tuple[Tensor, Tensor]]]] | None = (
            [] if sharding_kind(self.model) == "local" else None)
        walk = iter_layer_params(self.model, layers, param_names=self._param_names, agreement=self._agreement,
                                 check=self._check_extraction, stop=lambda: error is not None, outcome=outcome)
        for layer, get in walk:
            if not self.is_main_process or error is not None:
                continue  # keep exhausting the iterator: other ranks wait in its collectives
            try:
                factors = self._factors(layer, get)
                if deferred is not None:
                    deferred.append((layer, factors))
                else:  # gathered: scored now and released (two gathered layers alive at most)
                    scored.append((layer, self._score_layer(layer, factors)))
                del factors
                if want_images:
                    assert self.images is not None
                    images[(layer.group, layer.layer)] = self.images.measure(layer, get)
            except Exception as exc:  # noqa: BLE001 - re-raised after the walk
                error = exc
        if error is not None:
            raise error
        if not self.is_main_process or not layers:
            return None
        if not outcome.complete or len(deferred if deferred is not None else scored) != len(layers):
            raise RuntimeError(f"incomplete snapshot at step {step} ({'; '.join(outcome.reasons)}); "
                               "not logged")
        if deferred is None:
            return self._assemble(step, scored, images)
        scored_layers = [lay for lay, _ in deferred]
        per_pair = [[f[i] for _, f in deferred] for i in range(len(self.pairs))]
        if asynchronous and self._async_fits(per_pair):
            assert self._async is not None
            devices = {t.device for fs in per_pair for ab in fs for t in ab}
            with self._async.copying(devices):  # copies: the worker never reads the live weights
                stacks = [stack_layers(pair, fs, copy=True) for pair, fs in zip(self.pairs, per_pair, strict=True)]
            self._async.submit(lambda: self._assemble(step, self._score(scored_layers, stacks), images), devices)
            return None
        stacks = [stack_layers(pair, fs) for pair, fs in zip(self.pairs, per_pair, strict=True)]
        return self._assemble(step, self._score(scored_layers, stacks), images)

    def _factors(self, layer: AttentionLayer, get: Callable[[str], Tensor]) -> list[tuple[Tensor, Tensor]]:
        """Every pair's factors ``(A, B)`` of ``layer``."""
        factors = []
        for pair in self.pairs:
            a, b = pair.factors(layer, get) if hasattr(pair, "factors") else layer.factors(get)
            factors.append((a.detach(), b.detach()))
        return factors

    def _score_layer(self, layer: AttentionLayer, factors: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
        """Every pair's values on one layer (device tensors)."""
        return [pair.score(layer, a, b, per_head=self.config.per_head, num_std=self.config.num_std)
                for pair, (a, b) in zip(self.pairs, factors, strict=True)]

    def _score(self, layers: list[AttentionLayer], stacks: list[list[Stack]]) -> list[tuple[AttentionLayer, list[Tensor]]]:
        """Per layer, every pair's values (device tensors), from the pairs' stacks."""
        by_pair = [score_stacks(pair, layers, pair_stacks, per_head=self.config.per_head, num_std=self.config.num_std)
                   for pair, pair_stacks in zip(self.pairs, stacks, strict=True)]
        return [(layer, [values[j] for values in by_pair]) for j, layer in enumerate(layers)]

    def _async_fits(self, per_pair: list[list[tuple[Tensor, Tensor]]]) -> bool:
        """Whether an asynchronous snapshot's copies stay within ``async_max_bytes`` (else: warned once)."""
        assert self._async is not None
        total = 0
        for pair, factors in zip(self.pairs, per_pair, strict=True):
            dtype = getattr(pair, "dtype", None)
            for a, b in factors:
                item = max(a.element_size(), dtype.itemsize if dtype is not None else 0)
                total += (a.numel() + b.numel()) * item
        if total <= self._async.max_bytes:
            return True
        if not self._warned_async_size:
            self._warned_async_size = True
            _warn(f"attn_probe: an asynchronous snapshot would copy {total / 2**20:.0f} MiB of weights, more than "
                  f"async_max_bytes ({self._async.max_bytes / 2**20:.0f} MiB); snapshots are scored on the "
                  "training thread instead. Raise async_max_bytes to copy them. This warning is shown once.")
        return False

    def _deliver(self, wait: bool = False, timeout: float | None = None, closing: bool = False,
                 moment: str = "close()") -> bool:
        """Hand a finished asynchronous snapshot to the sinks (training thread); never raises.

        ``wait`` first waits for a running one, up to ``timeout`` (default ``sink_timeout``).
        Returns ``False`` if one is still being scored then: it stays pending (written when it
        finishes) unless ``closing`` (at ``moment``), where it is abandoned, with a warning.
        """
        scorer = self._async
        if scorer is None or not scorer.pending():
            return True
        limit = self._async_timeout if timeout is None else timeout
        try:
            done, snap, error = scorer.take(wait=wait, timeout=limit)
            if not done:
                if closing:
                    scorer.abandon()
                    _warn(f"attn_probe: an asynchronous snapshot was still being scored after {limit:g} s at "
                          f"{moment}; it is not logged.")
                return False
            if error is not None:
                _report_failure(self, "an asynchronous snapshot", error)
            elif snap is not None:
                self._write(snap)
        except Exception as exc:  # noqa: BLE001 - never raises
            _report_failure(self, "delivering an asynchronous snapshot", exc)
        return True

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
            _warn(
                f"attn_probe: non-finite weights or undefined scores at step {step} "
                f"({', '.join(nonfinite[:6])}{', ...' if len(nonfinite) > 6 else ''}); logged as NaN. "
                "This warning is shown once."
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
        :class:`~attn_probe.sinks.Snapshot` on the main process, ``None`` elsewhere, when
        skipped, and with ``async_scoring`` (the snapshot then reaches the sinks at the next
        probe call, :meth:`flush` or :meth:`close`). On a sharded run every rank must call it
        (the ranks agree first, see ``docs/distributed.md``).
        """
        if self._closed and not self._warned_closed:
            self._warned_closed = True
            _warn("attn_probe: snapshot() on a closed probe measures nothing (it was closed at step "
                  f"{self.step}); attach a new one with attn_probe.watch(...), or score the model now with "
                  "attn_probe.score_model(model)")
        if self._closed or self.disabled:
            return None
        if self._agreement is not None:
            error: BaseException | None = None
            try:
                step = self.step if step is None else int(step)
            except Exception as exc:  # noqa: BLE001 - still take part in the agreement
                step, error = self.step, exc
            return self._agreed_snapshot(step, True, None, error)
        self._deliver()
        step = self.step if step is None else int(step)
        if self.last_snapshot_step is not None and step <= self.last_snapshot_step:
            return None
        asynchronous = self._async is not None and not self._final
        if asynchronous and self._async.pending():  # the previous one is still being scored
            self._async.skipped += 1
            if self._async.skipped == 1:
                _warn(f"attn_probe: snapshot at step {step} skipped: the previous one is still being scored "
                      "(async_scoring). Later skips are counted in probe.skipped_snapshots, not reported.")
            return None
        self.last_snapshot_step = step
        snap = self._measure(step, asynchronous=asynchronous)
        if snap is not None:
            self._write(snap)
        return snap

    @property
    def skipped_snapshots(self) -> int:
        """Snapshots skipped because the previous asynchronous one was still being scored."""
        return self._async.skipped if self._async is not None else 0

    def due(self, step: int) -> bool:
        """Whether the schedule (or the image schedule) fires at ``step``."""
        schedule = self.config.schedule
        return schedule is not None and bool(schedule(step)) or self._images_due(step)

    @never_raise
    def on_update(self, step: int | None = None) -> None:
        """Advance the counter by one update (or set it to ``step``); snapshot if due.

        On a sharded run the ranks agree on every call when the schedule is a user callable,
        and only on due steps with the built-in ``every``/``log_spaced`` (whose answer is the
        same on every rank); a schedule that raises counts as "no" and every rank skips.
        """
        error: BaseException | None = None
        try:
            self.step = self.step + 1 if step is None else int(step)
        except Exception as exc:  # noqa: BLE001
            error = exc
        if self._closed or self.disabled:
            if error is not None:
                raise error
            return
        if self._agreement is None:
            if error is not None:
                raise error
            self._deliver()
            if self.due(self.step):
                self.snapshot(self.step)
            return
        want = images = False
        if error is None:
            try:
                want, images = self._due_parts(self.step)
            except Exception as exc:  # noqa: BLE001 - counts as "no", agreed with the other ranks
                error = exc
        if error is None and not (want or images) and self._deterministic:
            return  # the same "no" on every rank: nothing to agree on
        self._agreed_snapshot(self.step, want or images, images, error)

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
        """Detach hooks, take a last snapshot if the counter moved past the last one, close sinks.

        Never raises (whatever the warnings filter). On a sharded run every rank must call it:
        the final snapshot is agreed like any other.
        """
        if self._closed:
            return
        try:
            for handle in self._handles:
                try:
                    handle.remove()
                except Exception:  # noqa: BLE001
                    pass
            self._handles.clear()
            counter = self._forward_counter
            if counter is not None and counter.final_step is not None:
                self.step = max(self.step, counter.final_step)
            self._deliver(wait=True, closing=True)  # asynchronous mode: the snapshot in flight first
            moved = self.last_snapshot_step is None or self.step > self.last_snapshot_step
            if final_snapshot and not self.disabled and (moved or self._agreement is not None):
                self._final = True  # scored on this thread, even in the asynchronous mode
                self.snapshot(self.step)  # sharded: always, the agreement skips a stale step everywhere
        except Exception as exc:  # noqa: BLE001 - close() must not stop the user's script
            _report_failure(self, "close", exc)
        finally:
            self._closed = True
            _SCORING.discard(self)
            if self._agreement is not None:
                self._agreement.close()  # local: the gloo group's sockets and threads
            try:
                self._finish_sinks()
            except Exception as exc:  # noqa: BLE001
                _report_failure(self, "closing the sinks", exc)

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
