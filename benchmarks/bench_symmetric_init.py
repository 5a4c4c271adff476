"""Does symmetric initialisation (W_k := W_q) speed up encoder training? Measured on the demo's encoder.

Trains the demo's encoder (masked LM) twice with identical settings, seed and data order -- once
from the standard initialisation, once after ``attn_probe.symmetric_init_`` -- and evaluates both
every ``--eval-every`` steps on the same held-out blocks with the same fixed masks, recording the
held-out loss and the median layer symmetry of W_qk. Reports, as Saponati et al. (2025) do, the
fraction of training saved:

    1 - (first step at which the symmetric run's smoothed held-out loss
         <= the standard run's final smoothed held-out loss) / total steps

where "smoothed" is the trailing mean over ``--smooth`` evaluations (one evaluation is noisy).

``--preset`` takes the demo's presets (``attn_probe/demo/presets.py``): ``cpu``, the pre-LN 4-layer
model at d 128 with 4 heads, one token per character, 1,500 steps of 32 blocks x 32 characters, lr
2e-3 with 100 warm-up steps; ``paper-small``, the GPU schedule, the paper's post-LN 4-layer model at
d 256, WordPiece, 12,000 steps of 32 blocks x 128 tokens, lr 5e-4 with 200 warm-up steps, bf16
where supported. Flags you give override the preset's values. ``--vary
FIELD=V1,V2`` repeats the comparison once per value, everything else fixed: a controlled
comparison, e.g. of why the initial symmetry decays (``--vary weight_decay=0,0.01``,
``--vary lr=5e-5,5e-4``). ``--runs symmetric`` trains only the symmetric runs.

    python benchmarks/bench_symmetric_init.py          # cpu preset; not timed: two 1,500-step runs, ~270 CPU s each
    python benchmarks/bench_symmetric_init.py --preset paper-small --out runs/syminit --resume       # on a GPU
    python benchmarks/bench_symmetric_init.py --preset paper-small --arch bert-preln --steps 16000 --out runs/syminit \
        --resume                                        # the earlier GPU run's settings (pre-LN, 16,000 steps)
    python benchmarks/bench_symmetric_init.py --size tiny --steps 300 --runs symmetric --vary weight_decay=0,0.01

Long runs are resumable: with ``--resume`` (and checkpoints every ``--save-every`` steps), a rerun
of the same command skips finished runs and continues unfinished ones from their last checkpoint;
the evaluation curve is kept in ``OUT/<variant>/<run>/eval_curve.jsonl``.

Wall-clock numbers depend on the machine's load; the loss curves do not (same seed, same order).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attn_probe import demo  # noqa: E402

#: fields ``--vary`` may change, and how to parse their values
VARIABLE = {"weight_decay": float, "lr": float, "warmup": int, "arch": str, "seed": int, "unigram_bias": None}
RUNS = ("standard", "symmetric")


def fixed_eval_batch(tokenizer, blocks: torch.Tensor, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Held-out blocks masked once (15%, 80/10/10) with a fixed generator: identical for both runs."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    batch = demo.make_collator("encoder", tokenizer)([{"input_ids": b} for b in blocks])
    torch.random.set_rng_state(state)
    return batch


def median_symmetry(model) -> float:
    """Median across layers of the layer-level W_qk symmetry."""
    import attn_probe
    from attn_probe.formats.tags import layer_stats

    rows = [r for r in attn_probe.score_model(model) if r["head"] is None]
    return layer_stats(float(r["symmetry"]) for r in rows)["median"]


def eval_callback(batch: dict[str, torch.Tensor], every: int, curve: list[dict], path: Path | None = None):
    """Trainer callback: held-out loss and median symmetry at step 0, every ``every`` steps and at the end.

    Each point is appended to ``curve`` and, if ``path`` is given, to that JSONL file.
    """
    from transformers import TrainerCallback

    def evaluate(model, step: int) -> None:
        if curve and curve[-1]["step"] >= step:
            return  # already have it (e.g. the resume step)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            dev = next(model.parameters()).device
            loss = model(**{k: v.to(dev) for k, v in batch.items()}).loss.item()
        model.train(was_training)
        point = {"step": step, "loss": loss, "symmetry": median_symmetry(model)}
        curve.append(point)
        if path is not None:
            with path.open("a") as f:
                f.write(json.dumps(point) + "\n")

    class Eval(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            evaluate(model, int(state.global_step))

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % every == 0 or state.global_step == args.max_steps:
                evaluate(model, int(state.global_step))

    return Eval()


def smooth(curve: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """Trailing mean over ``window`` points: ``(step_i, mean(v_{i-window+1}..v_i))`` (fewer at the start)."""
    out = []
    for i, (step, _) in enumerate(curve):
        vals = [v for _, v in curve[max(0, i - window + 1) : i + 1]]
        out.append((step, sum(vals) / len(vals)))
    return out


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    """First step whose value is <= target (None if never)."""
    return next((s for s, v in curve if v <= target), None)


def fraction_saved(standard: list[tuple[int, float]], symmetric: list[tuple[int, float]], steps: int,
                   window: int) -> tuple[float, int | None, float | None]:
    """``(target, step, fraction)``: the standard run's final smoothed loss, the first step at which the
    symmetric run's smoothed loss reaches it, and ``1 - step / steps`` (None, None if never)."""
    target = smooth(standard, window)[-1][1]
    reached = steps_to_reach(smooth(symmetric, window), target)
    return target, reached, (None if reached is None else 1.0 - reached / steps)


def _parse_vary(text: str | None) -> tuple[str | None, list]:
    if not text:
        return None, [None]
    field, _, values = text.partition("=")
    if field not in VARIABLE or not values:
        raise SystemExit(f"--vary: FIELD=V1,V2 with FIELD one of {', '.join(VARIABLE)}")
    cast = VARIABLE[field]
    if cast is None:
        return field, [v.strip().lower() in ("1", "true", "yes", "on") for v in values.split(",")]
    return field, [cast(v) for v in values.split(",")]


def _load_curve(path: Path, upto: int | None) -> list[dict]:
    if not path.is_file() or upto is None:
        return []
    points = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [p for p in points if p["step"] <= upto]


def run_one(label: str, cfg: demo.DemoConfig, tokenizer, train_blocks, batch, eval_every: int,
            run_dir: Path) -> dict:
    """Train one encoder (``label``: standard or symmetric init); resumable through ``cfg.resume``."""
    done = run_dir / "result.json"
    if cfg.resume and done.is_file():
        print(f"{run_dir}: finished earlier, reusing {done}", flush=True)
        return json.loads(done.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    curve_path = run_dir / "eval_curve.jsonl"
    ckpt = demo.training.last_checkpoint(run_dir / "trainer") if cfg.resume else None
    curve = _load_curve(curve_path, demo.training.checkpoint_step(ckpt) if ckpt else None)
    curve_path.write_text("".join(json.dumps(p) + "\n" for p in curve))
    cfg.symmetric_init = label == "symmetric"
    t0 = time.perf_counter()
    r = demo.train_model("encoder", tokenizer, train_blocks, cfg, run_dir,
                         callbacks=[eval_callback(batch, eval_every, curve, curve_path)], probe=False)
    result = {
        "eval_curve": [(p["step"], p["loss"]) for p in curve],
        "symmetry_curve": [(p["step"], p["symmetry"]) for p in curve],
        "train_curve": r.losses,
        "final_symmetry_median": r.median("symmetry"),
        "final_directionality_median": r.median("directionality"),
        "wall_s": time.perf_counter() - t0,
        "resumed_from": str(r.resumed_from) if r.resumed_from else None,
    }
    done.write_text(json.dumps(result))
    print(f"{label:>9}: held-out loss {curve[0]['loss']:.3f} -> {curve[-1]['loss']:.3f}, median symmetry "
          f"{curve[0]['symmetry']:+.3f} -> {curve[-1]['symmetry']:+.3f}, {result['wall_s']:.0f} s", flush=True)
    return result


def symmetry_at(curve: list[tuple[int, float]], fractions=(0.0, 0.1, 0.25, 0.5, 1.0)) -> dict[int, float]:
    """The symmetry curve read at a few fractions of training (the nearest evaluated step at or after)."""
    last = curve[-1][0]
    out = {}
    for f in fractions:
        step, value = next(((s, v) for s, v in curve if s >= f * last), curve[-1])
        out[step] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(demo.PRESETS), default="cpu",
                   help="the demo's schedule (default: %(default)s); flags below override it")
    p.add_argument("--size", choices=list(demo.SIZES))
    p.add_argument("--arch", choices=list(demo.ARCHITECTURES))
    p.add_argument("--no-unigram-bias", dest="unigram_bias", action="store_false", default=None)
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup", type=int)
    p.add_argument("--weight-decay", type=float)
    p.add_argument("--precision", choices=list(demo.PRECISIONS))
    p.add_argument("--seed", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--max-chars", type=int)
    p.add_argument("--eval-every", type=int, help="evaluate every N steps (default: cpu 25, paper-small 100)")
    p.add_argument("--eval-blocks", type=int, default=64, help="held-out blocks (default: %(default)s)")
    p.add_argument("--smooth", type=int, default=5,
                   help="trailing mean over this many evaluations before comparing (default: %(default)s)")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--vary", metavar="FIELD=V1,V2", help=f"one run set per value; FIELD: {', '.join(VARIABLE)}")
    p.add_argument("--save-every", type=int, help="Trainer checkpoint every N steps (paper-small: 2,000)")
    p.add_argument("--resume", action="store_true", help="skip finished runs and continue unfinished ones")
    p.add_argument("--out", default="/tmp/bench_symmetric_init", help="run directories (default: %(default)s)")
    p.add_argument("--threads", type=int, help="torch CPU threads (1 is fastest on a busy machine)")
    p.add_argument("--json", help="write curves and results here")
    p.add_argument("--figure", help="write the held-out loss and symmetry figure here (PNG)")
    return p


def config_from(args: argparse.Namespace) -> demo.DemoConfig:
    values = demo.resolve_preset(args.preset)
    for name in ("size", "arch", "unigram_bias", "steps", "batch_size", "seq_len", "lr", "warmup",
                 "weight_decay", "precision", "seed", "vocab_size", "max_chars", "save_every"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    values.pop("every", None)
    cfg = demo.DemoConfig(preset=args.preset, models=("encoder",), progress=False, resume=args.resume, **values)
    if args.resume and not cfg.save_every:
        cfg.save_every = max(1, cfg.steps // 10)
    cfg.validate()
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = config_from(args)
    eval_every = args.eval_every or (100 if args.preset == "paper-small" else 25)
    field, values = _parse_vary(args.vary)

    tokenizer, blocks = demo.prepare_data(base)
    train_blocks, held_out = blocks[: -args.eval_blocks], blocks[-args.eval_blocks :]
    batch = fixed_eval_batch(tokenizer, held_out)
    print(f"preset {args.preset}: {base.size} {base.arch}, {base.steps:,} steps x {base.batch_size} x "
          f"{base.seq_len}, lr {base.lr:g}, warm-up {base.warmup}, weight decay {base.weight_decay:g}, "
          f"{base.precision}; held-out {args.eval_blocks} blocks every {eval_every} steps, smoothed over "
          f"{args.smooth}", flush=True)

    variants = {}
    for value in values:
        name = "base" if field is None else f"{field}={value}"
        cfg = dataclasses.replace(base)
        if field is not None:
            setattr(cfg, field, value)
            print(f"--- {name}", flush=True)
        runs = {label: run_one(label, cfg, tokenizer, train_blocks, batch, eval_every, Path(args.out) / name / label)
                for label in args.runs}
        summary: dict = {"runs": runs}
        for label, r in runs.items():
            summary[f"{label}_symmetry_at"] = symmetry_at(r["symmetry_curve"])
            summary[f"{label}_final_smoothed_loss"] = smooth(r["eval_curve"], args.smooth)[-1][1]
        if set(RUNS) <= set(runs):
            target, reached, saved = fraction_saved(runs["standard"]["eval_curve"], runs["symmetric"]["eval_curve"],
                                                    cfg.steps, args.smooth)
            summary.update(baseline_final_smoothed_loss=target, symmetric_steps_to_baseline_final=reached,
                           fraction_of_training_saved=saved)
            if saved is None:
                print(f"{name}: symmetric init never reached the standard run's final smoothed held-out loss "
                      f"{target:.4f}", flush=True)
            else:
                print(f"{name}: symmetric init reached the standard run's final smoothed held-out loss {target:.4f} "
                      f"at step {reached:,} of {cfg.steps:,}: {100 * saved:.0f}% of training saved", flush=True)
        for label in runs:
            at = ", ".join(f"{s:,}: {v:+.3f}" for s, v in summary[f"{label}_symmetry_at"].items())
            print(f"{name}: {label} median symmetry at steps {at}", flush=True)
        variants[name] = summary

    config = {**vars(args), "resolved": {k: v for k, v in base.__dict__.items()
                                         if k not in ("extra_callbacks", "text", "preset_reason")},
              "eval_every": eval_every, "torch_threads": torch.get_num_threads()}
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, "variants": variants}, indent=1, default=str))
        print(f"json: {args.json}")
    if args.figure:
        draw(variants, args.figure, args.smooth)
        print(f"figure: {args.figure}")
    return 0


def draw(variants: dict, path: str, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_sym) = plt.subplots(1, 2, figsize=(10, 3.6))
    styles = {"standard": "-", "symmetric": "--"}
    for i, (name, summary) in enumerate(variants.items()):
        colour = f"C{i}"
        for label, r in summary["runs"].items():
            s, v = zip(*smooth(r["eval_curve"], window), strict=True)
            ax_loss.plot(s, v, color=colour, ls=styles[label], label=f"{name}, {label}")
            s, v = zip(*r["symmetry_curve"], strict=True)
            ax_sym.plot(s, v, color=colour, ls=styles[label], label=f"{name}, {label}")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel(f"held-out MLM loss (mean of {window} evaluations)")
    ax_sym.set_xlabel("step")
    ax_sym.set_ylabel("median layer symmetry")
    ax_sym.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
