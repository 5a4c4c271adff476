"""Stage 2: measure the model at one step: surgery check, walk, factors, scoring, host transfer.

:meth:`Measurement.measure` walks every layer through
:func:`attn_probe.distributed.iter_layer_params` (on every rank, same order, exhausted),
gathering what the pairs declare (:meth:`Measurement.param_names`). Unsharded layers are
scored after the walk, layers of one shape as stacks (:func:`attn_probe.scoring.pairs.stack_layers`);
gathered layers one at a time as they come (freed at the next). All of it goes through
:meth:`Measurement.score_stacked` / :func:`attn_probe.scoring.model.score_layer_factors`, the
scoring core on the weights' device, then one host transfer per device
(:func:`attn_probe.scoring.model.to_host`). With ``async_scoring`` the stacks are copied on the
training thread and scored on the worker of :class:`~attn_probe.live.asynchronous.AsyncScorer`;
:meth:`Measurement.deliver` hands the finished result to the façade on the training thread.
:func:`find_layers` finds what is measured at attach.

**Hooks for other work.** :meth:`Measurement.score_stacked` is the one place the live
probe calls the scoring core on unsharded layers: the place to cut per-layer work (the
GPU-first scoring, which selects its algorithm inside :mod:`attn_probe.core`). A test
may patch it on the class (a public method) to hold or fail the scoring. Quantities measured
from the weights during the walk (like the heatmaps, :class:`attn_probe.live.images.HeatmapImages`)
get ``(layer, get)`` in :meth:`Measurement.measure`'s loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
from torch import nn

from ...distributed import Agreement, WalkOutcome, iter_layer_params, sharding_kind
from ...extraction import AttentionLayer, UnsupportedModelError, find_attention
from ...isolation import Failures, safe_warn
from ...scoring.model import layer_factors, pairs_param_names, score_layer_factors, to_host
from ...scoring.pairs import ScorePair, Stack, check_pairs, score_stacks, stack_layers
from ..asynchronous import AsyncScorer
from ..config import ProbeConfig
from ..images import HeatmapImages
from .surgery import SurgeryCheck

__all__ = ["Measured", "Measurement", "find_layers"]

Tensor = torch.Tensor
T = TypeVar("T")
Factors = list[tuple[Tensor, Tensor]]


def find_layers(model: nn.Module, config: ProbeConfig, pairs: list[ScorePair]) -> list[AttentionLayer]:
    """The attention layers ``config`` selects; raises :class:`~attn_probe.UnsupportedModelError`
    when none matches, or a pair's error when it cannot read the architecture (``check_pairs``)."""
    layers = find_attention(model, groups=config.groups, layers=config.layers, **config.find_kwargs)
    if not layers:
        raise UnsupportedModelError(
            f"attn_probe: no attention layer matches groups={config.groups!r}, layers={config.layers!r}")
    check_pairs(pairs, layers)  # e.g. the OV pair on an architecture it cannot read
    return layers


class Measured(NamedTuple):
    """One step's values on the host: per layer, each pair's table; heatmaps by ``(group, layer)``."""

    step: int
    tables: list[tuple[AttentionLayer, list[np.ndarray]]]
    images: dict[tuple[str, int], np.ndarray]


class Measurement:
    """What is measured and how: the pairs, the current layers, the images quantity, the async worker.

    ``layers`` are the attention layers found at attach, found again after model surgery.
    ``failures`` counts the asynchronous snapshots that failed (:meth:`deliver`).
    """

    def __init__(self, model: nn.Module, config: ProbeConfig, pairs: list[ScorePair],
                 layers: list[AttentionLayer], *, agreement: Agreement | None, is_main_process: bool,
                 failures: Failures | None = None) -> None:
        self.model = model
        self.failures = failures if failures is not None else Failures()
        self.config = config
        self.pairs = pairs
        self.layers = layers
        self.agreement = agreement
        self.is_main_process = is_main_process
        self.images = (HeatmapImages(config.image_schedule, config.image_size, config.image_mode)
                       if config.image_schedule is not None else None)
        self.surgery = SurgeryCheck(model, self.param_names)
        self.surgery.record(layers)
        #: the asynchronous mode's worker (unsharded models; docs/live-probe.md)
        self.scorer: AsyncScorer | None = AsyncScorer(config.async_max_bytes) if config.async_scoring else None
        if self.scorer is not None and agreement is not None:
            self.scorer = None
            safe_warn("attn_probe: async_scoring applies to unsharded models; this sharded run is scored on the "
                      "training thread, in program order with its gathers.")
        self._warned_async_size = False

    # -- seams ---------------------------------------------------------------------------------
    def param_names(self, layer: AttentionLayer) -> tuple[str, ...]:
        """What the walk gathers for ``layer``: every pair's declared parameters, each once."""
        return pairs_param_names(self.pairs, layer)

    def score_stacked(self, layers: list[AttentionLayer], stacks: list[list[Stack]]) -> list[tuple[AttentionLayer, list[Tensor]]]:
        """Per layer, every pair's table (device tensors), from the pairs' stacks: the scoring core."""
        cfg = self.config
        by_pair = [score_stacks(pair, layers, pair_stacks, per_head=cfg.per_head, num_std=cfg.num_std)
                   for pair, pair_stacks in zip(self.pairs, stacks, strict=True)]
        return [(layer, [values[j] for values in by_pair]) for j, layer in enumerate(layers)]

    # -- the asynchronous mode -----------------------------------------------------------------
    def pending(self) -> bool:
        """Whether an asynchronous snapshot was submitted and not yet collected."""
        return self.scorer is not None and self.scorer.pending()

    @property
    def skipped(self) -> int:
        """Snapshots skipped because the previous asynchronous one was still being scored."""
        return self.scorer.skipped if self.scorer is not None else 0

    def busy(self, step: int) -> bool:
        """Whether the previous asynchronous snapshot is still being scored: ``step``'s is then
        skipped (counted in :attr:`skipped`, warned the first time)."""
        if self.scorer is None or not self.scorer.pending():
            return False
        self.scorer.skipped += 1
        if self.scorer.skipped == 1:
            safe_warn(f"attn_probe: snapshot at step {step} skipped: the previous one is still being scored "
                      "(async_scoring). Later skips are counted in probe.skipped_snapshots, not reported.")
        return True

    def collect(self, *, wait: bool, timeout: float, closing: bool, moment: str) -> tuple[bool, Any, BaseException | None]:
        """``(settled, result, error)`` of the asynchronous snapshot, if one is pending.

        ``wait`` waits up to ``timeout`` for a running one. ``settled`` is ``False`` while it is
        still being scored: it stays pending unless ``closing`` (at ``moment``), where it is
        abandoned, with a warning. Nothing pending: ``(True, None, None)``.
        """
        scorer = self.scorer
        if scorer is None or not scorer.pending():
            return True, None, None
        done, result, error = scorer.take(wait=wait, timeout=timeout)
        if not done:
            if closing:
                scorer.abandon()
                safe_warn(f"attn_probe: an asynchronous snapshot was still being scored after {timeout:g} s at "
                          f"{moment}; it is not logged.")
            return False, None, None
        return True, result, error

    def deliver(self, handle: Callable[[Any], object], *, wait: bool = False, timeout: float | None = None,
                closing: bool = False, moment: str = "close()") -> bool:
        """Hand a finished asynchronous result to ``handle`` (on the calling, training thread).

        ``wait`` first waits for a running one, up to ``timeout`` (default ``sink_timeout``).
        Returns ``False`` if one is still being scored then (:meth:`collect`). Never raises:
        a failed snapshot, or a failure of ``handle``, is counted in ``failures``.
        """
        try:
            limit = self.config.sink_timeout if timeout is None else timeout
            settled, result, error = self.collect(wait=wait, timeout=limit, closing=closing, moment=moment)
            if error is not None:
                self.failures.report("an asynchronous snapshot", error)
            elif result is not None:
                handle(result)
            return settled
        except Exception as exc:  # noqa: BLE001 - never raises
            self.failures.report("delivering an asynchronous snapshot", exc)
            return True

    def _async_fits(self, per_pair: list[Factors]) -> bool:
        """Whether an asynchronous snapshot's copies stay within ``async_max_bytes`` (else: warned once)."""
        assert self.scorer is not None
        total = 0
        for pair, factors in zip(self.pairs, per_pair, strict=True):
            dtype = getattr(pair, "dtype", None)
            for a, b in factors:
                item = max(a.element_size(), dtype.itemsize if dtype is not None else 0)
                total += (a.numel() + b.numel()) * item
        if total <= self.scorer.max_bytes:
            return True
        if not self._warned_async_size:
            self._warned_async_size = True
            safe_warn(f"attn_probe: an asynchronous snapshot would copy {total / 2**20:.0f} MiB of weights, more "
                      f"than async_max_bytes ({self.scorer.max_bytes / 2**20:.0f} MiB); snapshots are scored on "
                      "the training thread instead. Raise async_max_bytes to copy them. This warning is shown once.")
        return False

    # -- measuring -------------------------------------------------------------------------------
    def _check_surgery(self) -> None:
        changed = self.surgery.changed_layers()
        if changed:
            cfg = self.config
            self.layers = self.surgery.refind(self.layers, changed, groups=cfg.groups, layers=cfg.layers,
                                              find_kwargs=cfg.find_kwargs)

    def _check_extraction(self, layer: AttentionLayer, get: Any) -> None:
        """Dry run of the pairs' extraction on empty full-shape tensors (before a gather)."""
        layer_factors(self.pairs, layer, get)

    @staticmethod
    def _to_host(step: int, scored: list[tuple[AttentionLayer, list[Tensor]]],
                 images: dict[tuple[str, int], np.ndarray]) -> Measured:
        flat = to_host([t for _, values in scored for t in values])
        tables, i = [], 0
        for layer, values in scored:
            tables.append((layer, flat[i: i + len(values)]))
            i += len(values)
        return Measured(step, tables, images)

    def measure(self, step: int, images: bool | None, *, asynchronous: bool,
                finish: Callable[[Measured], T]) -> T | None:
        """Walk all layers (every rank); score and move to the host on the main process.

        ``images``: take the heatmaps (``None``: ask the image schedule). ``finish`` (given by
        the façade: the assembly) turns the :class:`Measured` values into the result, on the
        worker thread when ``asynchronous`` (unsharded models: the factors are copied and
        scored there, and ``None`` is returned at once; collect it with :meth:`collect`).

        Local errors (the surgery check, the image schedule, extraction, scoring) are kept and
        re-raised after the walk; under sharding they make this rank vote "stop" at the next
        agreement, so that every rank ends the walk at the same gather. An
        :class:`~attn_probe.distributed.AgreementError` propagates at once.
        """
        cfg = self.config
        scored: list[tuple[AttentionLayer, list[Tensor]]] = []
        heatmaps: dict[tuple[str, int], np.ndarray] = {}
        error: BaseException | None = None
        outcome = WalkOutcome()
        try:
            self._check_surgery()
        except Exception as exc:  # noqa: BLE001 - re-raised after the walk
            error = exc
        try:  # a user schedule must not make the main process skip the collective walk below
            want_images = self.is_main_process and (
                (self.images is not None and self.images.due(step)) if images is None else images)
        except Exception as exc:  # noqa: BLE001 - re-raised after the walk
            want_images, error = False, exc
        layers = list(self.layers)
        # Unsharded weights stay valid after the walk: score layers of one shape as stacks
        # afterwards. Gathered ones are freed at the next layer: score each in the walk.
        deferred: list[tuple[AttentionLayer, Factors]] | None = [] if sharding_kind(self.model) == "local" else None
        walk = iter_layer_params(self.model, layers, param_names=self.param_names, agreement=self.agreement,
                                 check=self._check_extraction, stop=lambda: error is not None, outcome=outcome)
        for layer, get in walk:
            if not self.is_main_process or error is not None:
                continue  # keep exhausting the iterator: other ranks wait in its collectives
            try:
                factors = layer_factors(self.pairs, layer, get)
                if deferred is not None:
                    deferred.append((layer, factors))
                else:  # gathered: scored now and released (two gathered layers alive at most)
                    scored.append((layer, score_layer_factors(self.pairs, layer, factors, per_head=cfg.per_head,
                                                              num_std=cfg.num_std)))
                del factors
                if want_images:
                    assert self.images is not None
                    heatmaps[(layer.group, layer.layer)] = self.images.measure(layer, get)
            except Exception as exc:  # noqa: BLE001 - re-raised after the walk
                error = exc
        if error is not None:
            raise error
        if not self.is_main_process or not layers:
            return None
        if not outcome.complete or len(deferred if deferred is not None else scored) != len(layers):
            raise RuntimeError(f"incomplete snapshot at step {step} ({'; '.join(outcome.reasons)}); not logged")
        if deferred is None:
            return finish(self._to_host(step, scored, heatmaps))
        scored_layers = [lay for lay, _ in deferred]
        per_pair = [[f[i] for _, f in deferred] for i in range(len(self.pairs))]
        if asynchronous and self.scorer is not None and self._async_fits(per_pair):
            scorer = self.scorer
            devices = {t.device for fs in per_pair for ab in fs for t in ab}
            with scorer.copying(devices):  # copies: the worker never reads the live weights
                stacks = [stack_layers(pair, fs, copy=True) for pair, fs in zip(self.pairs, per_pair, strict=True)]
            scorer.submit(lambda: finish(self._to_host(step, self.score_stacked(scored_layers, stacks), heatmaps)),
                          devices)
            return None
        stacks = [stack_layers(pair, fs) for pair, fs in zip(self.pairs, per_pair, strict=True)]
        return finish(self._to_host(step, self.score_stacked(scored_layers, stacks), heatmaps))
