"""The demo command's glue: run directories, :func:`run_demo` and the configuration from the command line."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..sinks.live_view import figure_url, tensorboard_command
from .data import prepare_data, unigram_entropy
from .host import CpuBudget, cpu_budget, plan_threads
from .presets import SIZES, DemoConfig, DemoError, default_preset, resolve_preset
from .processes import train_models
from .reference import matching_runs, write_paper_runs
from .results import DemoResult, ModelResult, comparison_table, interpret, plateau_exit
from .training import last_checkpoint, logging_steps

#: what the demo writes into a model's run directory (anything else there: not the demo's)
_DEMO_FILES = re.compile(r"\.?attn_probe.*|trainer|model|events\.out\.tfevents\..*")


def _clear_earlier_run(run_dir: Path) -> bool:
    """Remove the demo's earlier files in ``run_dir``; True if there were any.

    Refuses (:class:`DemoError`) when ``run_dir`` holds files the demo does not write.
    """
    if not run_dir.exists():
        return False
    if not run_dir.is_dir():
        raise DemoError(f"{run_dir} is a file, not a demo run directory; choose another --out-dir or --name")
    entries = list(run_dir.iterdir())
    foreign = sorted(e.name for e in entries if not _DEMO_FILES.fullmatch(e.name))
    if foreign:
        raise DemoError(f"{run_dir} holds files the demo did not write ({', '.join(foreign[:3])}); "
                        "choose another --out-dir or --name")
    if not entries:
        return False
    import shutil

    shutil.rmtree(run_dir)
    return True


def _prepare_run_dirs(cfg: DemoConfig, root: Path, log: Callable[[str], None]) -> None:
    """Each model's run directory starts afresh unless ``--resume`` finds a checkpoint in it.

    A second run written into the same TensorBoard run and trajectory would show both runs as one.
    """
    for kind in cfg.models:
        run_dir = root / kind
        if cfg.resume:
            ckpt = last_checkpoint(run_dir / "trainer")
            if ckpt is not None:
                log(f"{kind}: resuming from {ckpt}")
            elif _clear_earlier_run(run_dir):
                log(f"{kind}: no checkpoint under {run_dir / 'trainer'}: removed the earlier files, starting afresh")
        elif _clear_earlier_run(run_dir):
            log(f"{kind}: {run_dir} held an earlier run: removed it, starting afresh "
                "(--resume continues a run from its last checkpoint; --name NEW keeps the old one)")


def final_model_commands(result: DemoResult) -> list[str]:
    """``attn-probe score`` of each saved final model, then ``attn-probe heatmap`` of the layer that
    shows each model best (:meth:`ModelResult.showcase_layer`: the encoder's most symmetric layer,
    the decoder's most directional one)."""
    import shlex

    saved = [r for r in result.models.values() if r.model_dir is not None]
    commands = [f"attn-probe score {shlex.quote(str(r.model_dir))}" for r in saved]
    for r in saved:
        layer = _heatmap_layer(result, r)[0]
        figure = result.root / f"{r.kind}_layer{layer}.png"
        commands.append(f"attn-probe heatmap {shlex.quote(str(r.model_dir))} --layer {layer} -o {shlex.quote(str(figure))}")
    return commands


def _heatmap_layer(result: DemoResult, r: ModelResult) -> tuple[int, str]:
    """The layer :func:`final_model_commands` draws for ``r`` and why, in words (the last layer when
    the final rows lack the score)."""
    best = r.showcase_layer()
    if best is None:
        return SIZES[result.config.size][0] - 1, f"the {r.kind}'s last layer"
    layer, metric, value = best
    most = "symmetric" if metric == "symmetry" else "directional"
    return layer, f"the {r.kind}'s most {most} layer ({layer}: {metric} {value:+.3f})"


def heatmap_reasons(result: DemoResult) -> str:
    """The heatmaps :func:`final_model_commands` suggests, in words: ``the encoder's most symmetric
    layer (0: symmetry +0.752) and the decoder's ...``."""
    return " and ".join(_heatmap_layer(result, r)[1] for r in result.models.values() if r.model_dir is not None)


@contextlib.contextmanager
def _deepspeed_on_cpu() -> Iterator[None]:
    """Without CUDA, tell DeepSpeed (if installed) that its accelerator is the CPU, until the demo ends.

    The Trainer imports ``deepspeed`` when it is installed (accelerate's ``unwrap_model`` checks
    for a ``DeepSpeedEngine``), and DeepSpeed's accelerator detection then prints a
    "[WARNING] ... Setting accelerator to CPU" line per process. ``DS_ACCELERATOR=cpu`` is
    DeepSpeed's own setting for the same choice, without the warning; a value the user set is
    kept, and the variable is restored afterwards (the spawned training processes inherit it).
    """
    if "DS_ACCELERATOR" in os.environ or torch.cuda.is_available():
        yield
        return
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        os.environ.pop("DS_ACCELERATOR", None)


#: the attention group of the demo's models (BERT encoders and decoders: self-attention only)
DEMO_GROUP = "self"


def _write_reference(cfg: DemoConfig, root: Path, log: Callable[[str], None]) -> None:
    """The paper's matching runs as TensorBoard runs beside the models' (:mod:`.reference`),
    written before training so that the live view shows them from the start."""
    try:
        runs = matching_runs(cfg.models, SIZES[cfg.size][0], cfg.tokens)
        if not runs:
            return
        written = write_paper_runs(root, runs, [DEMO_GROUP], cfg.steps)
    except Exception as exc:  # noqa: BLE001  (the trained runs are kept; the reference is extra)
        log(f"could not write the paper's reference runs for TensorBoard ({type(exc).__name__}: {exc})")
        return
    log("in TensorBoard beside yours: " + "; ".join(f"{d.name} ({r.describe()})"
                                                   for d, r in zip(written, dict.fromkeys(runs.values()),
                                                                   strict=True)))


def run_demo(cfg: DemoConfig, *, log: Callable[[str], None] = print, budget: CpuBudget | None = None) -> DemoResult:
    """Train the requested models, draw the comparison figure, and return paths and scores.

    ``budget`` (default: :func:`cpu_budget` of this machine) decides the threads and whether the
    models train at the same time (:func:`plan_threads`).
    """
    with _deepspeed_on_cpu():
        return _run_demo(cfg, log, budget)


def _run_demo(cfg: DemoConfig, log: Callable[[str], None], budget: CpuBudget | None) -> DemoResult:
    cfg.validate()
    root = Path(cfg.out_dir) / cfg.name
    layers, hidden, heads, _ = SIZES[cfg.size]
    log(f"preset: {cfg.preset}" + (f" ({cfg.preset_reason})" if cfg.preset_reason else ""))
    log(
        f"attn-probe demo: {cfg.size} {cfg.arch} ({layers} layers, d={hidden}, {heads} heads), "
        f"{cfg.steps:,} steps x {cfg.batch_size} x {cfg.seq_len} tokens, lr {cfg.lr:g}, warm-up {cfg.warmup}, "
        f"{cfg.precision}"
        + (", symmetric init" if cfg.symmetric_init else "")
        + ("" if cfg.unigram_bias else ", zero output bias")
        + (", decoder objective paper-mlm" if cfg.decoder_objective == "paper-mlm" else "")
    )
    concurrent = False if cfg.extra_callbacks else cfg.concurrent
    plan = plan_threads(budget or cpu_budget(), models=len(cfg.models), threads=cfg.threads, concurrent=concurrent)
    log(f"threads: {plan.reason}")
    _prepare_run_dirs(cfg, root, log)
    tokenizer_dir = root / "tokenizer"
    if cfg.resume and (tokenizer_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        log(f"tokenizer: {tokenizer_dir}, the one the checkpoints were trained with")
        tokenizer, blocks = prepare_data(cfg, PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir)))
    else:
        tokenizer, blocks = prepare_data(cfg)
        tokenizer.save_pretrained(str(tokenizer_dir))
    entropy = unigram_entropy(blocks)
    log(
        f"corpus: {blocks.numel():,} tokens in {blocks.shape[0]:,} blocks; vocabulary {len(tokenizer):,}; "
        f"unigram entropy {entropy:.2f} nats"
    )
    _write_reference(cfg, root, log)
    log(f"live view of both models and the paper's matching runs: {tensorboard_command(root)}")
    results, failures = train_models(cfg, tokenizer, blocks, root, plan, log=log)
    if results:
        log("")
        log(comparison_table(results, logging_steps(cfg)))
    exits = {kind: plateau_exit(r.losses, entropy) for kind, r in results.items()}
    figure, figure_error = None, None
    if cfg.figure and results:
        import attn_probe

        path = root / "dynamics.png"
        runs = {kind: str(r.run_dir) for kind, r in results.items()}
        try:  # the paper's matching runs, drawn beside the models (clipped to the steps shown)
            reference = [p.name for p in dict.fromkeys(matching_runs(results, SIZES[cfg.size][0], cfg.tokens).values())]
        except Exception:  # noqa: BLE001  (the reference is extra: the figure is drawn without it)
            reference = []
        try:  # the trained runs are on disk already: a plotting problem must not lose them
            attn_probe.plot_dynamics(runs, path=str(path), reference=reference or None)
            figure = path
            log(f"\nfigure: {figure}")
        except Exception as exc:  # noqa: BLE001
            figure_error = f"{type(exc).__name__}: {exc}"
            log(
                f"\ncould not draw the figure ({figure_error}); draw it later with: "
                + " ".join(shlex.quote(str(a)) for a in ["attn-probe", "plot", root, "-o", root / "dynamics.png",
                                                          *(x for name in reference for x in ("--reference", name))])
            )
    result = DemoResult(root, results, figure, cfg, figure_error, entropy, exits, failures, plan)
    log("")
    for line in interpret(result):
        log(line)
    commands = final_model_commands(result)
    if commands:
        log("final models (config.json, weights, tokenizer) in "
            + ", ".join(str(r.model_dir) for r in results.values() if r.model_dir)
            + f"; score them, or draw {heatmap_reasons(result)}:")
        for command in commands:
            log(f"  {command}")
    log(f"both models and the paper's matching runs in TensorBoard: {tensorboard_command(root)}")
    log(f"  the paper's figure is the first chart of Custom Scalars: {figure_url()} "
        "(or the port TensorBoard prints, if 6006 is taken)")
    return result


def config_from_args(args: Any) -> DemoConfig:
    """A :class:`DemoConfig` from an argparse namespace.

    The preset is ``args.preset`` if given, else ``paper-small`` with CUDA and ``cpu`` without
    (:func:`default_preset`). Its values fill every field the user left unset (``None`` in the
    namespace); what the user set wins, even where it equals another preset's value.
    """
    names = {f.name for f in dataclasses.fields(DemoConfig)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    preset = given.pop("preset", None)
    if preset is None:
        preset, reason = default_preset()
    else:
        reason = "chosen with --preset"
        if preset == "paper-small" and not torch.cuda.is_available():
            reason += "; no CUDA device: 12,000 steps per model take many hours on a CPU"
    values = resolve_preset(preset)
    overridden = sorted(k for k in values if k in given and given[k] != values[k])
    if overridden:
        reason += "; overridden: " + ", ".join(f"--{k.replace('_', '-')} {given[k]}" for k in overridden)
    values.update(given)
    return DemoConfig(preset=preset, preset_reason=reason, **values)
