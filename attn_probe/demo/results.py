"""What a demo run measured and what it means: results, the unigram plateau, the comparison table and the verdict."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .host import ThreadPlan
from .presets import GPU_SECTION, PRESETS, SIZES, DemoConfig
from .reference import matching_runs, random_range


@dataclass
class ModelResult:
    """One trained model: where its files are and its final scores."""

    kind: str
    run_dir: Path
    final_loss: float
    losses: list[tuple[int, float]]
    rows: list[dict[str, Any]]
    seconds: float
    #: the checkpoint this run continued from (``--resume``), else None
    resumed_from: Path | None = None
    #: the final model (config.json, weights, tokenizer), for ``attn-probe score|heatmap``
    model_dir: Path | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "run_dir": str(self.run_dir), "final_loss": self.final_loss,
                "losses": self.losses, "rows": self.rows, "seconds": self.seconds,
                "resumed_from": None if self.resumed_from is None else str(self.resumed_from),
                "model_dir": None if self.model_dir is None else str(self.model_dir)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelResult:
        return cls(d["kind"], Path(d["run_dir"]), float(d["final_loss"]), [(int(s), float(v)) for s, v in d["losses"]],
                   d["rows"], float(d["seconds"]), None if d["resumed_from"] is None else Path(d["resumed_from"]),
                   None if d["model_dir"] is None else Path(d["model_dir"]))

    def _stats(self, metric: str) -> dict[str, float]:
        from ..formats.tags import layer_stats

        return layer_stats(float(r[metric]) for r in self.rows if r["head"] is None)

    def median(self, metric: str) -> float:
        """Median across layers of the final layer-level score."""
        return self._stats(metric)["median"]

    def showcase_layer(self) -> tuple[int, str, float] | None:
        """``(layer, metric, value)`` of the layer whose heatmap shows this model's kind best: an
        encoder's most symmetric layer, a decoder's most directional one (largest ``|d|``); the
        lowest layer on a tie. None when the final rows lack that score."""
        metric = "symmetry" if self.kind == "encoder" else "directionality"
        rows = [r for r in self.rows if r.get("head") is None and metric in r]
        if not rows:
            return None
        best = max(rows, key=lambda r: float(r[metric]) if metric == "symmetry" else abs(float(r[metric])))
        return int(best["layer"]), metric, float(best[metric])

    def quartiles(self, metric: str) -> tuple[float, float]:
        """``(q25, q75)`` across layers of the final layer-level score."""
        stats = self._stats(metric)
        return stats["q25"], stats["q75"]


@dataclass
class DemoResult:
    root: Path
    models: dict[str, ModelResult]
    figure: Path | None
    config: DemoConfig
    figure_error: str | None = None
    #: entropy (nats) of the corpus's unigram distribution: the loss of a model that ignores context
    unigram_entropy: float = float("nan")
    #: model kind -> the step at which it left the unigram plateau (None: it has not)
    plateau_exits: dict[str, int | None] = field(default_factory=dict)
    #: model kind -> why it did not finish (its process failed); the others' results are kept
    failures: dict[str, str] = field(default_factory=dict)
    #: how the CPUs were used (None: not planned, e.g. a result built by hand)
    plan: ThreadPlan | None = None

    @property
    def gap(self) -> float | None:
        """Encoder minus decoder median layer symmetry at the end (None unless both were trained)."""
        if not {"encoder", "decoder"} <= set(self.models):
            return None
        return self.models["encoder"].median("symmetry") - self.models["decoder"].median("symmetry")


#: the unigram entropy ...
PLATEAU_MARGIN = 0.5
#: ... for this many consecutive logs
PLATEAU_LOGS = 3


def plateau_exit(
    losses: Sequence[tuple[int, float]],
    entropy: float,
    *,
    margin: float = PLATEAU_MARGIN,
    consecutive: int = PLATEAU_LOGS,
) -> int | None:
    """The step at which a model left the unigram plateau, or None if it has not.

    ``losses`` are the logged ``(step, loss)`` pairs in order. The model has left the plateau
    once ``consecutive`` logs in a row are at least ``margin`` nats below ``entropy``; the step
    returned is the first log of the first such run. A run cut short by the end of training
    does not count.
    """
    run_start, run_len = None, 0
    for step, loss in losses:
        if loss <= entropy - margin:
            if run_len == 0:
                run_start = step
            run_len += 1
            if run_len >= consecutive:
                return run_start
        else:
            run_start, run_len = None, 0
    return None

# --------------------------------------------------------------------------- the demo
def final_loss_definition(window: int) -> str:
    """What "final loss" means in the demo's table, summary lines and verdict (said once)."""
    steps = "the last step" if window == 1 else f"the last {window} steps"
    return f"final loss: the training loss averaged over {steps} (the Trainer's last log; train/loss in TensorBoard)"


def comparison_table(results: dict[str, ModelResult], window: int | None = None) -> str:
    """Plain-text table: median [q25, q75] layer symmetry and directionality, and final loss.

    With ``window`` (the Trainer's logging interval), a last line says what the final loss is.
    """
    header = (
        f"{'model':<9} {'symmetry median [IQR]':>26} {'directionality median [IQR]':>30} {'final loss':>11}"
    )
    lines = [header, "-" * len(header)]
    for kind, r in results.items():
        cells = []
        for metric in ("symmetry", "directionality"):
            q25, q75 = r.quartiles(metric)
            cells.append(f"{r.median(metric):+.3f} [{q25:+.3f}, {q75:+.3f}]")
        lines.append(f"{kind:<9} {cells[0]:>26} {cells[1]:>30} {r.final_loss:>11.3f}")
    if window is not None:
        lines.append(final_loss_definition(window))
    return "\n".join(lines)


#: measured gaps (encoder - decoder median layer symmetry at the end) of the ``cpu`` preset,
#: quoted by :func:`interpret`: the CPU preset sweep's ``ch128-s32-b32-lr2e-3`` (seed 0) and
#: ``...-seed1`` runs (benchmarks/results/cpu_preset_sweep.csv, docs/reproducing-the-paper.md)
MEASURED_CPU_GAP = (0.449, 0.489)
MEASURED_CPU_GAPS = "+0.449 and +0.489 in two runs (seeds 0 and 1)"
#: ... their final encoder and decoder median layer symmetry, and where the encoder left the plateau
MEASURED_CPU = "encoder +0.465 / +0.507, decoder +0.016 / +0.019 in two runs"
MEASURED_CPU_PLATEAU_EXITS = (540, 570)
#: the one measured run of the ``paper-small`` preset (post-LN, 12,000 steps, one H100, seed 0):
#: the encoder's median layer symmetry and its interquartile range across the 4 layers
MEASURED_GPU_ENCODER = 0.490
MEASURED_GPU_ENCODER_IQR = (0.385, 0.563)
#: ... the step at which that encoder left the unigram plateau
MEASURED_GPU_PLATEAU_EXIT = 810
MEASURED_GPU = "on one H100: encoder +0.49 [IQR +0.39, +0.56] at step 12,000, decoder -0.04"
#: the paper's 4-layer encoders at their last checkpoint (200,000; Wikipedia / RedPajama / Jigsaw), the span
#: of the shipped table (attn_probe.baselines.paper; tests/demo/test_demo_interpret.py checks it)
PAPER_4LAYER_ENCODER = (0.35, 0.66)


#: tokens per optimizer step of the paper's runs (32 sequences x 8 accumulation x 512 positions)
PAPER_TOKENS_PER_STEP = 32 * 8 * 512


#: settings of the measured runs beyond the preset's own fields
_MEASURED_COMMON: dict[str, Any] = {
    "decoder_objective": "causal",
    "weight_decay": 0.01,
    "unigram_bias": True,
    "symmetric_init": False,
    "text": None,
    "dataset": None,
    "max_chars": None,
}
#: fields that do not change what is trained
_NOT_TRAINING = {"every", "save_every"}


def _flag(name: str, value: Any) -> str:
    if name == "symmetric_init":
        return "--symmetric-init" if value else "no --symmetric-init"
    if name == "unigram_bias":
        return "--no-unigram-bias" if not value else "the unigram bias"
    if name == "text":
        return "--text" if value else "the default corpus"
    return f"--{name.replace('_', '-')} {value}"


def measured_differences(cfg: DemoConfig) -> list[str]:
    """The settings of ``cfg`` that differ from the measured runs of its preset (as flags).

    Empty when the preset ran as measured, so that its measured numbers apply. The seed, the
    probe interval and the checkpoints do not count (the ``cpu`` range spans seeds 0 and 1).
    """
    measured = {**PRESETS[cfg.preset], **_MEASURED_COMMON}
    if measured.get("tokens") == "wordpiece":
        measured["vocab_size"] = 4096  # only the WordPiece vocabulary has a size to differ in
    if measured.get("precision") == "bf16-if-supported":
        measured["precision"] = "bf16"  # the H100 run
    diffs = []
    for name, value in measured.items():
        got = getattr(cfg, name)
        if name in _NOT_TRAINING:
            continue
        if name == "text":
            got = list(got) if got else None
        if got != value:
            diffs.append(_flag(name, got))
    return diffs


def _where(value: float, low: float, high: float) -> str:
    if value < low:
        return "below"
    return "above" if value > high else "inside"


def interpret(result: DemoResult, *, cuda: bool | None = None) -> list[str]:
    """What the run shows, in a few lines: the gap, the phase each model reached, what to do next.

    The measured numbers of the preset are quoted only when the preset ran as measured
    (:func:`measured_differences`), each with a verdict: inside, below or above.
    """
    if cuda is None:
        cuda = torch.cuda.is_available()
    cfg = result.config
    h = result.unigram_entropy
    threshold = h - PLATEAU_MARGIN
    differences = measured_differences(cfg)
    lines = []
    for kind, why in result.failures.items():
        lines.append(f"{kind}: did not finish ({why}); the other results are kept")
    gap = result.gap
    if gap is not None:
        lines.append(f"encoder - decoder median layer symmetry: {gap:+.3f}")
        if cfg.preset == "cpu" and not differences:
            low, high = MEASURED_CPU_GAP  # quoted to 3 decimals: compared at 3 decimals
            lines.append(f"  {_where(round(gap, 3), low, high)} the range measured for the cpu preset ({MEASURED_CPU_GAPS})")
        elif cfg.preset == "cpu":
            lines.append(f"  no measured range to compare with: the cpu preset's measured runs differ from this one "
                         f"({', '.join(differences)})")
    for kind, r in result.models.items():
        step = result.plateau_exits.get(kind)
        if step is not None:
            lines.append(f"{kind}: left the unigram plateau at step {step:,} (logged loss <= {threshold:.2f} = "
                         f"unigram entropy {h:.2f} - {PLATEAU_MARGIN} for {PLATEAU_LOGS} logs in a row)")
        else:
            lines.append(f"{kind}: still on the unigram plateau (final loss {r.final_loss:.3f}; it leaves "
                         f"once {PLATEAU_LOGS} logs in a row are <= {threshold:.2f} = unigram entropy {h:.2f} "
                         f"- {PLATEAU_MARGIN})")
    from .events import emergence_lines

    lines.extend(emergence_lines(result.models, result.plateau_exits))
    if cfg.decoder_objective == "paper-mlm" and "decoder" in result.models:
        lines.append("decoder objective: paper-mlm (the released code's masked-LM collator fed to the causal LM); "
                     "its loss is not comparable with a next-token loss")
    if "encoder" not in result.models:
        return lines + paper_side_by_side(result) + directionality_reading(result)
    encoder = result.models["encoder"].median("symmetry")
    if cfg.preset == "paper-small":
        low, high = PAPER_4LAYER_ENCODER
        paper = f"{_where(encoder, low, high)} the paper's 4-layer range (+{low:.2f} to +{high:.2f})"
        if differences:
            lines.append(f"encoder median layer symmetry {encoder:+.3f}: {paper}; no measured run to compare with: "
                         f"the paper-small preset's measured run differs from this one ({', '.join(differences)})")
        else:
            q25, q75 = MEASURED_GPU_ENCODER_IQR
            lines.append(f"encoder median layer symmetry {encoder:+.3f}: {_where(encoder, q25, q75)} the range across "
                         f"layers of this preset's measured run (+{MEASURED_GPU_ENCODER:.2f}; layers' IQR +{q25:.2f} "
                         f"to +{q75:.2f}; one seed, one H100), and {paper}")
            lines.append("  the run-to-run spread of this preset is not measured yet (one run): a difference from "
                         f"+{MEASURED_GPU_ENCODER:.2f} alone says little")
    left = result.plateau_exits.get("encoder") is not None
    lines.extend(paper_side_by_side(result))
    lines.extend(directionality_reading(result))
    if cfg.preset == "cpu":
        lines.extend(_cpu_phase(result, encoder, left, differences, cuda))
    elif left:
        lines.append("phase: takeoff -- the encoder predicts from its context, and its symmetry rises from "
                     f"here (--preset paper-small {MEASURED_GPU}).")
    else:
        lines.append("phase: before the takeoff -- the encoder has not left the unigram plateau; the H100 run "
                     f"of --preset paper-small left it at step {MEASURED_GPU_PLATEAU_EXIT:,}: train longer "
                     f"(see {GPU_SECTION}).")
    return lines


def _cpu_phase(result: DemoResult, encoder: float, left: bool, differences: list[str], cuda: bool) -> list[str]:
    """The ``cpu`` preset's phase line, and the GPU preset where it would show more."""
    lines = []
    first, last = MEASURED_CPU_PLATEAU_EXITS
    if left:
        lines.append("phase: takeoff -- the encoder left the unigram plateau (it predicts from its context) "
                     f"and its symmetry rose with it ({MEASURED_CPU}, plateau exit at step {first}-{last}).")
    else:
        lines.append("phase: before the takeoff -- the encoder has not left the unigram plateau (in the two "
                     f"measured runs of this preset it left at step {first}-{last}), so its symmetry shows only "
                     "the early jump.")
    if not left or differences:
        gpu = "" if cuda else " on a GPU"
        lines.append(f"the paper's own architecture and schedule: attn-probe demo --preset paper-small{gpu} "
                     f"({MEASURED_GPU}); figure and numbers: {GPU_SECTION}")
    return lines


def _sds(n: float) -> str:
    return f"{abs(n):.1f}" if abs(n) < 10 else f"{abs(n):,.0f}"


def paper_side_by_side(result: DemoResult) -> list[str]:
    """Each model's median layer symmetry beside the paper's matching run at the same step and at its
    end (:mod:`attn_probe.baselines.paper`), and how far it lies from the run's own random range.

    The paper's value at the same step is that of its nearest checkpoint (every 1,000 steps),
    named. Nothing about the random range when the run logged none.
    """
    cfg = result.config
    if not result.models:
        return []
    lines = []
    try:
        runs = matching_runs(result.models, SIZES[cfg.size][0], cfg.tokens)
        if runs:
            lines.extend(_paper_lines(result, runs))
    except Exception as exc:  # noqa: BLE001  (the verdict still says the rest)
        lines.append(f"the paper's trajectories could not be read ({type(exc).__name__}: {exc})")
    for kind, r in result.models.items():
        rr = random_range(r.run_dir, "symmetry")
        if rr is None:
            continue
        value = r.median("symmetry")
        n = rr.distance(value)
        lines.append(f"  {kind} {value:+.3f} is {_sds(n)} sd {'above' if n >= 0 else 'below'} the random range "
                     f"({rr.mean:+.3f} \u00b1 {rr.sd:.3f})")
    return lines


#: a score this many standard deviations of a random layer's from the random mean is told apart from chance
RANDOM_SDS = 2.0


def directionality_reading(result: DemoResult) -> list[str]:
    """What directionality shows at the models' width: each model's median layer directionality
    against its run's own random range (``random_directionality`` rows), in random-layer sd.

    A random W_qk's directionality is 0 on average with a spread that shrinks with ``d``
    (0.40 at d = 128, 0.16 at d = 768: docs/scores.md), so at a small width a decoder's
    column dominance can lie inside what random layers do: then the run does not show it.
    Nothing when no run logged the range (or no directionality).
    """
    width = SIZES[result.config.size][1]
    lines = []
    for kind, r in result.models.items():
        rr = random_range(r.run_dir, "directionality")
        if rr is None or not any("directionality" in row for row in r.rows):
            continue
        value = r.median("directionality")
        n = rr.distance(value)
        if abs(n) < RANDOM_SDS:
            reading = (f"inside the random range: at d = {width} directionality does not tell this model from "
                       "random weights")
        elif value < 0:
            reading = "beyond it, negative: a few keys (columns) dominate, the paper's signature of a decoder"
        else:
            reading = "beyond it, positive: a few queries (rows) dominate"
        lines.append(f"  {kind} directionality {value:+.3f} is {_sds(n)} sd {'above' if n >= 0 else 'below'} the "
                     f"random range ({rr.mean:+.3f} \u00b1 {rr.sd:.3f} at d = {width}): {reading}")
    if lines:
        lines.insert(0, f"directionality (median across layers; a random layer's sd at d = {width}, more than "
                        f"{RANDOM_SDS:.0f} sd away tells it from chance):")
    return lines


def _paper_lines(result: DemoResult, runs: dict[str, Any]) -> list[str]:
    from ..baselines.paper import paper_final, paper_point

    cfg = result.config
    tokens = cfg.seq_len * cfg.batch_size
    lines = [f"the paper side by side (median layer symmetry; a paper step is {PAPER_TOKENS_PER_STEP:,} "
             f"tokens, a step here {tokens:,}):"]
    for kind, r in result.models.items():
        run = runs[kind]
        at, end = paper_point(run.name, "symmetry", cfg.steps), paper_final(run.name, "symmetry")
        lines.append(f"  {kind} {r.median('symmetry'):+.3f} at step {cfg.steps:,}; {run.describe()}: "
                     f"{at.median:+.3f} at step {at.step:,} (its nearest checkpoint), {end.median:+.3f} at "
                     f"step {end.step:,} (its last)")
    return lines
