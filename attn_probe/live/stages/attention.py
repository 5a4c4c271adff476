"""A stage beside the measurement: ``max_logit`` and ``entropy`` measured in the attention path.

:class:`AttentionStage` owns one :class:`~attn_probe.activations.statistics.AttentionCapture` (the
``get_interface`` wrapper, a flag check on steps that are not due; only forwards entered
with gradients enabled count, ``docs/scores.md``) and the arming policy: it arms
for a step that ``due(step)`` says will be measured (plain loops right after the previous
update, :meth:`AttentionStage.after_update`; the Trainer at ``on_step_begin``,
:meth:`AttentionStage.arm_if_due`), never under forward counting
(:meth:`AttentionStage.count_forwards`) or after :meth:`AttentionStage.close`, stops before the
optimizer step when the loop knows that moment (:meth:`AttentionStage.stop`), and at the
snapshot of that step :meth:`AttentionStage.take` collects the values and combines them over
ranks (max for logits and input norms, sum for entropy sums and token counts: one process on
the global batch), on every rank, two all-reduces per snapshot on the probe's gloo group. Values of a step that was not armed are
not logged (the snapshot at attach, the final one at close).

:func:`bound_ratio_table` puts the measured logit beside its weight-only bound:
``logit_bound_ratio = max_logit / (qk_bound * ||x||_max^2 * s)`` (``docs/scores.md``).
:func:`metric_names` and :func:`build_stage` are the probe's set-up: the metric names it
logs and alerts on, then the stage (built last: it wraps transformers' get_interface).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from ...activations.logits import DEFAULT_ENTROPY_ROWS
from ...activations.sdpa import measured_by_sdpa
from ...activations.statistics import AttentionCapture, StepStats, combine, unavailable_reason
from ...distributed import Agreement
from ...extraction import AttentionLayer
from ...extraction.layout_check import LayoutCheck
from ...isolation import Failures, safe_warn
from ...scoring.pairs import QKPair, ScorePair, pair_metric_names
from ..config import ProbeConfig
from .qk_clip import CLIP_METRICS, DEFAULT_TAU, clip_tables, signed_columns

__all__ = ["AttentionStage", "AttentionTables", "RATIO_METRIC", "attention_metrics", "metric_names",
           "bound_ratio_table", "build_stage", "qk_bound_index"]

#: ``armed_for`` of a batch whose step is not known yet (manual optimisation, :meth:`AttentionStage.arm_for_batch`)
BATCH = -1

#: the checks (:mod:`attn_probe.extraction.layout_check`) whose layer is refused
REFUSED_VERDICTS = ("tiled", "mismatch")

#: what fixes a reading the forward contradicts
LAYOUT_FIX = ("Fix: teach attn_probe this layer's layout with attn_probe.extraction.register_adapter, reading "
              "q/k and their head pairing as the forward does (docs/supported-models.md).")

#: the ratio of the measured max logit to its weight-only bound (with ``qk_bound`` among the metrics)
RATIO_METRIC = "logit_bound_ratio"


class AttentionTables:
    """One step's host values: per layer a ``(2, 1 + H)`` table (rows :data:`ATTENTION_METRICS`),
    the largest input norm, the scaling the attention received and (``signed``, per layer
    ``(1 + H,)``) the signed max logit of the QK-clip dry run (:mod:`attn_probe.live.stages.qk_clip`)."""

    def __init__(self, stats: StepStats) -> None:
        self.tables = [t.cpu().numpy() for t in stats.tables()]
        self.signed = None if stats.signed_max is None else signed_columns(stats.signed_max.cpu().numpy(), stats.heads)
        self.counted = [c.cpu().numpy() for c in stats.counted()]  # False: not measured (NaN, no alert)
        self.norms = stats.input_norms().cpu().numpy()
        self.scaling = stats.scaling


def bound_ratio_table(attention: np.ndarray, qk_bound: np.ndarray, norm: float, scaling: float | None) -> np.ndarray:
    """``(1, n)`` ratio ``max_logit / (qk_bound * norm**2 * scaling)`` column by column (layer, heads).

    ``attention`` the layer's attention table, ``qk_bound`` the ``qk_bound`` row of its weight
    table (the same columns); NaN where the bound is 0 or a value is missing.
    """
    n = min(attention.shape[1], qk_bound.shape[0])
    if scaling is None or not math.isfinite(norm):
        return np.full((1, n), math.nan)
    bound = qk_bound[:n].astype(np.float64) * float(norm) ** 2 * float(scaling)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(bound > 0, attention[0, :n] / np.where(bound > 0, bound, 1.0), math.nan)
    return ratio[None]


class AttentionStage:
    """The attention-path quantity of a probe: the arming policy, arm, stop, take (see the module docstring).

    ``reason`` is the one line saying why the model cannot be measured (``capture`` is then
    ``None`` and nothing is registered). ``group`` is the gloo group the ranks combine on
    (``None``: a single process); a failed combination (a timeout) warns once and ends the
    measurement on that rank (the other ranks time out in theirs and end it too). ``due(step)``
    says whether ``step``'s forwards are measured; ``pairs`` and ``per_head`` shape the tables
    (:meth:`extra_tables`); ``failures`` counts a failure to close.
    """

    def __init__(self, model: nn.Module, layers: Sequence[AttentionLayer], group: object | None = None, *,
                 due: Callable[[int], bool] = lambda step: True, pairs: Sequence[ScorePair] = (),
                 per_head: bool = True, failures: Failures | None = None, tau: float = DEFAULT_TAU,
                 entropy_rows: int | None = DEFAULT_ENTROPY_ROWS, flex_compiled: bool = False) -> None:
        self.layers = list(layers)
        self.tau = float(tau)  # the QK-clip dry run's threshold
        self.group = group
        self.due = due
        self.pairs = list(pairs)
        self.per_head = per_head
        self.failures = failures if failures is not None else Failures()
        self.reason = unavailable_reason(self.layers)
        #: the capture records its failures and this stage warns, once, with the step's count
        self.capture = AttentionCapture(model, self.layers, failures=self.failures, entropy_rows=entropy_rows,
                                        flex_compiled=flex_compiled, layout_check=True,
                                        warn_failures=False) if self.reason is None else None
        #: per layer name, the check of its reading against its first counted eager forward (:meth:`layout_news`)
        self.layout: dict[str, LayoutCheck] = {}
        #: ``(group, layer)`` -> the line of a check that contradicts the probe's reading: the layer's
        #: weight scores and attention statistics are no longer written (warned once per layer)
        self.refused: dict[tuple[str, int], str] = {}
        #: snapshots that left out refused layers' rows
        self.refused_snapshots = 0
        self.failures_warned = False
        self.armed_for: int | None = None
        self.stopped = False
        #: plain loops arm right after the update before a due step; the Trainer callback turns
        #: this off and arms at ``on_step_begin`` (evaluation runs between the steps)
        self.arm_after_update = True
        self.forward_counted = False
        self.closed = False
        #: armed (due) steps whose snapshot found no counted token for some measurable layer:
        #: warned once (:func:`missing_reason`), counted, summed up at :meth:`close`
        self.missed_steps: list[int] = []

    @property
    def available(self) -> bool:
        return self.capture is not None

    def after_update(self, step: int) -> None:
        """Plain loops, after the update that made ``step``: arm if the next step ``step + 1`` is due.

        Never raises: a failure (a schedule is user code) is counted in ``failures``."""
        try:
            if self.arm_after_update and not self.forward_counted and not self.closed:
                self.arm_if_due(step + 1)
        except Exception as exc:  # noqa: BLE001 - called on the training thread
            self.failures.report("arming the attention capture", exc)

    def arm_if_due(self, step: int) -> None:
        """Measure the forward passes from now on if ``step`` is due (the Trainer: the step it is about to take)."""
        if self.due(step):
            self.arm(step)

    def arm(self, step: int) -> None:
        """Measure the forward passes from now until :meth:`stop` or the snapshot of ``step``."""
        if self.capture is None or self.armed_for == step:
            return
        self.capture.disarm()
        self.capture.arm()
        self.armed_for, self.stopped = step, False

    def arm_for_batch(self, steps: Sequence[int]) -> None:
        """Manual optimisation: measure this batch's forwards if one of the optimizer ``steps`` it may
        take is due; the step they belong to is known at the batch's end (:meth:`end_batch`)."""
        if any(self.due(step) for step in steps):
            self.arm(BATCH)

    def end_batch(self, step: int) -> None:
        """Manual optimisation, after the batch that led to optimizer ``step``: its forwards are that
        step's if it is due (its snapshot takes them), else they are dropped."""
        if self.armed_for != BATCH:
            return
        if self.due(step):
            self.stop()
            self.armed_for = step
        else:
            self.cancel()

    def stop(self) -> None:
        """No more forwards of the armed step (the Trainer's ``on_pre_optimizer_step``); values kept."""
        if self.capture is not None and self.capture.armed:
            self.capture.disarm()
            self.stopped = True

    def cancel(self) -> None:
        """Nothing armed any more (local: no collective)."""
        if self.capture is not None:
            self.capture.disarm()
        self.armed_for = None

    def count_forwards(self) -> None:
        """The loop counts forward passes: it is not measured (``docs/scores.md``); cancels what is armed."""
        self.forward_counted = True
        self.cancel()

    def layout_news(self, warn: bool = True) -> list[tuple[AttentionLayer, LayoutCheck]]:
        """The layout checks finished since the last call (local, off the forward: at a snapshot), each
        layer once. A check that contradicts the reading (``tiled``, ``mismatch``) refuses the layer from
        now on, warned once with the line and the fix. Never raises."""
        news = []
        try:
            capture = self.capture
            results = dict(capture.layout.results) if capture is not None else {}
            for i, result in sorted(results.items()):
                layer = self.layers[i]
                if layer.name in self.layout:
                    continue
                self.layout[layer.name] = result
                news.append((layer, result))
                if result.verdict in REFUSED_VERDICTS:
                    self.refused[(layer.group, layer.layer)] = result.line
                    if warn:  # the main process's line: only its writes use the refusal
                        safe_warn(f"attn_probe: {layer.name}: the probe's W_q/W_k reading does not reproduce the q/k "
                                  f"its forward hands to attention ({result.verdict}: {result.line}). Its weight "
                                  "scores and attention statistics are no longer written (the trajectory's "
                                  f"layout_check row says why). {LAYOUT_FIX}")
        except Exception as exc:  # noqa: BLE001 - bookkeeping never stops the snapshot
            self.failures.report("recording the layout check", exc)
        return news

    def _reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if self.group is None:
            return tensor
        dist = torch.distributed
        out = tensor.detach().to("cpu", torch.float64).clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        return out

    def take(self, step: int) -> AttentionTables | None:
        """The values of ``step`` combined over ranks, or ``None`` when it was not measured
        (identical on every rank). Collective when ``group`` is set: call on every rank."""
        if self.capture is None:
            return None
        measured = self.armed_for == step
        stats = self.capture.collect()
        if self.armed_for is not None and self.armed_for <= step:  # this step's, or a stale one
            self.capture.disarm()
            self.armed_for = None
        if not measured:  # not this step's: every rank still takes part in the reduction
            stats = StepStats(stats.names, stats.heads, torch.full_like(stats.max_logit, -math.inf),
                              torch.zeros_like(stats.entropy_sum), torch.zeros_like(stats.tokens),
                              torch.full_like(stats.input_norm, -math.inf), stats.scaling,
                              None if stats.signed_max is None else torch.full_like(stats.signed_max, -math.inf))
        if self.group is not None:
            try:
                stats = combine(stats, self._reduce)
            except Exception as exc:  # noqa: BLE001 - a timeout or a broken group: stop measuring here
                self.capture.close()
                self.capture = None
                safe_warn(f"attn_probe: combining the attention statistics over ranks failed at step {step} "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                          "max_logit and entropy are no longer measured on this rank, the weight metrics go on.")
                return None
        if measured:
            self._warn_failures(step, stats)
            self._check_measured(step, stats)
        if not bool(torch.isfinite(stats.max_logit).any()) and not bool((stats.tokens > 0).any()):
            return None
        return AttentionTables(stats)

    def _warn_failures(self, step: int, stats: StepStats) -> None:
        """The first measured step in which measuring failed on this rank: one warning, carrying that
        step's count of failed calls and the layers they cost (a layer whose value is missing for
        that reason is not warned about again as "not measured"). Later failures are counted in
        ``failures``; failures of steps never measured are summed up at :meth:`close`."""
        capture = self.capture
        try:
            if capture is None or not capture.failed_calls or self.failures_warned:
                return
            self.failures_warned = True
            failed, calls = capture.failed_layers, capture.failed_calls
            off, tokens = stats.offsets, stats.tokens.detach().cpu()
            empty = [name for i, name in enumerate(stats.names)
                     if name in failed and not bool((tokens[off[i]:off[i + 1]] > 0).any())]
            if failed:
                where = (f" in {len(failed)} of {len(stats.names)} layers ({', '.join(failed[:3])}"
                         f"{', ...' if len(failed) > 3 else ''})")
                lost = (f"max_logit and entropy of {len(empty)} of them are not logged at this step"
                        f"{', those of the others are partial' if len(empty) < len(failed) else ''}")
            else:
                where, lost = "", "the step's values may be incomplete"
            safe_warn(f"attn_probe: attention statistics skipped at step {step}: {calls} failed "
                      f"call{'s' if calls != 1 else ''}{where}, first: {capture.first_failure}; {lost}. Training "
                      "is unaffected; later failures are counted in probe.failures, not reported.")
        except Exception as exc:  # noqa: BLE001 - bookkeeping never stops the snapshot
            self.failures.report("warning about a failed attention measurement", exc)

    def _check_measured(self, step: int, stats: StepStats) -> None:
        """An armed step that counted nothing for some layer: never silent (warned once, counted).
        Layers whose measurement failed this step are left out (:meth:`_warn_failures` warned).
        Local (no collective): ``stats`` are already combined, so every rank sees the same."""
        try:
            off = stats.offsets
            tokens = stats.tokens.detach().cpu()
            failed = set(self.capture.failed_layers) if self.capture is not None else set()
            missing = [name for i, name in enumerate(stats.names)
                       if name not in failed and not bool((tokens[off[i]:off[i + 1]] > 0).any())]
            if not missing:
                return
            self.missed_steps.append(step)
            if len(self.missed_steps) == 1:
                capture = self.capture
                unreached = set(capture.missing()) if capture is not None else set(missing)
                if capture is not None and capture.failed_this_step or not unreached & set(missing):
                    reason = ("their attention calls reached the probe but counted no token (a failed "
                              "measurement, warned about separately, or only padding).")
                else:
                    reason = missing_reason(self.layers, len(missing) == len(stats.names),
                                            flex_in_graphs=self._flex_in_graphs())
                safe_warn(f"attn_probe: max_logit and entropy were not measured at step {step} for "
                          f"{len(missing)} of {len(stats.names)} layers ({', '.join(missing[:3])}"
                          f"{', ...' if len(missing) > 3 else ''}): {reason} "
                          "Later such steps are counted and summed up at close.")
        except Exception as exc:  # noqa: BLE001 - bookkeeping never stops the snapshot
            self.failures.report("checking the attention statistics", exc)

    def _flex_in_graphs(self) -> bool:
        """Whether flex calls ran inside compiled code during the step (a CPU counter, no wait)."""
        capture = self.capture
        return capture is not None and not capture.flex_compiled and bool(capture.flex_in_graphs)

    def extra_tables(self, measured: Sequence[tuple[AttentionLayer, Sequence[np.ndarray]]],
                     attention: AttentionTables | None) -> list:
        """The attention tables of :meth:`take` (and the bound ratio) as ``(layer, metrics, table)``
        for the assembly, beside the ``measured`` weight tables; none when nothing was measured."""
        if attention is None:
            return []
        index = {(layer.group, layer.layer): i for i, layer in enumerate(self.layers)}
        qk = qk_bound_index(self.pairs)
        names = attention_metrics(self.pairs)
        extra = []
        for layer, tables in measured:
            i = index.get((layer.group, layer.layer))
            if i is None or (layer.group, layer.layer) in self.refused:
                continue
            table = attention.tables[i]
            if qk is not None:
                ratio = bound_ratio_table(table, tables[qk[0]][qk[1]], float(attention.norms[i]), attention.scaling[i])
                table = np.concatenate([table[:, :ratio.shape[1]], ratio])
            extra.append((layer, names, table if self.per_head else table[:, :1]))
            if attention.signed is not None:  # the QK-clip dry run beside max_logit
                extra.extend((layer, clip_names, clip) for clip_names, clip in
                             clip_tables(attention.signed[i], self.tau, self.per_head))
        return extra

    def close(self) -> None:
        """Restore the registry's previous entries; nothing is armed after update from now on.

        Never raises: a failure is counted in ``failures``."""
        self.closed = True
        try:
            if self.capture is not None:
                self.capture.close()
        except Exception as exc:  # noqa: BLE001
            self.failures.report("closing the attention capture", exc)
        capture = self.capture
        if capture is not None and capture.failed_calls_total and not self.failures_warned:
            self.failures_warned = True  # failures only in steps never measured (cancelled, or stale)
            safe_warn(f"attn_probe: attention statistics skipped: measuring failed {capture.failed_calls_total} "
                      f"time{'s' if capture.failed_calls_total != 1 else ''} in steps that were not logged, "
                      f"first: {capture.failures[0] if capture.failures else '?'}; training was unaffected.")
        missed, self.missed_steps = self.missed_steps, []
        if len(missed) > 1:
            safe_warn(f"attn_probe: max_logit and entropy were missing for some layers at {len(missed)} due steps "
                      f"(steps {', '.join(map(str, missed[:5]))}{', ...' if len(missed) > 5 else ''}; the first "
                      "was warned about with its likely cause).")


#: why flex calls inside a compiled graph are not measured by default, and the remedy
FLEX_IN_GRAPHS = ("flex_attention ran inside a torch.compile graph (torchtitan 0.3 compiles it with inductor; or "
                  "your torch.compile of the model), where the probe traces nothing by default. "
                  "attention_flex_compiled=True traces your mask_mod and score_mod into that graph (the "
                  "arithmetic runs in opaque operators; a failure costs that step's values, warned once), "
                  "though a modifier the compiler cannot trace at all would break a fullgraph=True compile; "
                  "flex called eagerly is always measured.")


def missing_reason(layers: Sequence[AttentionLayer], nothing: bool, *, flex_in_graphs: bool = False) -> str:
    """Why an armed step counted no token for some layers, and the remedy (one sentence or two)."""
    if flex_in_graphs:
        return FLEX_IN_GRAPHS
    now = unavailable_reason(layers)
    if now is not None:  # e.g. model.set_attn_implementation(...) after attach
        return (f"the model changed after the probe attached ({now.removeprefix('attention statistics are unavailable: ')}). "
                "Attach after switching the attention implementation, or switch back.")
    sdpa = [measured_by_sdpa(layer) for layer in layers]
    if any(sdpa) and not nothing:
        return ("no training forward reached those layers' torch.nn.functional.scaled_dot_product_attention while "
                "the step was armed (layers skipped, e.g. LayerDrop or an early exit, or attention computed "
                "otherwise: a manual softmax(q k^T), nn.MultiheadAttention are not "
                "measured).")
    if not nothing:
        return ("no training forward reached those layers while the step was armed (layers skipped, e.g. "
                "LayerDrop or an early exit).")
    if all(sdpa):
        return ("no training forward (gradients enabled) of the watched model called "
                "torch.nn.functional.scaled_dot_product_attention inside a watched attention module while the "
                "step was armed. Likely causes: attention computed otherwise (a manual softmax(q k^T), "
                "nn.MultiheadAttention: not measured); "
                "only torch.no_grad forwards ran in the step; "
                "or the loop's forwards run outside the step the probe sees (Lightning manual optimisation).")
    return ("no training forward (gradients enabled) reached transformers' attention interface while the "
            "step was armed. Likely causes: code compiled by torch.compile before the probe attached is reused "
            "without the probe's wrapper (attach before the first compile of this model class in the process, "
            "or call torch.compiler.reset() before attaching); only torch.no_grad forwards ran in the step; "
            "or the loop's forwards run outside the step the probe sees (Lightning manual optimisation).")


def qk_bound_index(pairs: Sequence[ScorePair]) -> tuple[int, int] | None:
    """``(pair, metric)`` indices of the W_qk pair's ``qk_bound`` in the measured tables, if measured."""
    for p, pair in enumerate(pairs):
        if type(pair) is QKPair and "qk_bound" in pair.metrics:
            return p, list(pair.metrics).index("qk_bound")
    return None


def attention_metrics(pairs: Sequence[ScorePair]) -> list[str]:
    """The activation metrics logged: ``max_logit``, ``entropy`` and, with ``qk_bound`` among the
    W_qk metrics, :data:`RATIO_METRIC`."""
    return ["max_logit", "entropy", *((RATIO_METRIC,) if qk_bound_index(pairs) is not None else ())]


def metric_names(config: ProbeConfig, pairs: Sequence[ScorePair],
                 layers: Sequence[AttentionLayer]) -> tuple[list[str], list[str]]:
    """``(logged, alertable)``: the metrics the run logs (the pairs', then the activation metrics
    with ``attention_stats`` unless the model cannot be measured) and those an alert rule may
    name (with ``attention_stats`` all the activation metrics, even where not measured: also the
    QK-clip dry run's :data:`~attn_probe.live.stages.qk_clip.CLIP_METRICS`)."""
    logged = pair_metric_names(pairs)
    if not config.attention_stats:
        return logged, logged
    logged = [*logged, *((*attention_metrics(pairs), *CLIP_METRICS) if unavailable_reason(layers) is None else ())]
    return logged, list(dict.fromkeys([*logged, "max_logit", "entropy", RATIO_METRIC, *CLIP_METRICS]))


def build_stage(model: nn.Module, layers: Sequence[AttentionLayer], config: ProbeConfig, pairs: Sequence[ScorePair],
                agreement: Agreement | None, due: Callable[[int], bool], failures: Failures) -> AttentionStage | None:
    """The stage with ``attention_stats`` (else ``None``), combining on the sharded walk's group
    (``agreement``'s); under DDP, where the probe has no group, a gloo group of its own (a
    collective: every rank attaches). Unavailability is one warning; a failure building it is
    one warning and ``None``: the weight metrics go on."""
    if not config.attention_stats:
        return None
    try:
        group = agreement.group if agreement is not None else None
        if group is None and torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            group = Agreement(config.agreement_timeout).group
        stage = AttentionStage(model, layers, group, due=due, pairs=pairs, per_head=config.per_head,
                               failures=failures, tau=config.qk_clip_tau, entropy_rows=config.attention_entropy_rows,
                               flex_compiled=config.attention_flex_compiled)
    except Exception as exc:  # noqa: BLE001 - the weight metrics go on
        safe_warn(f"attn_probe: attention statistics are unavailable ({type(exc).__name__}: {exc}); "
                  "the weight metrics go on.")
        return None
    if stage.reason is not None:
        safe_warn(f"attn_probe: {stage.reason}; max_logit and entropy are not logged, the weight metrics go on.")
    return stage
