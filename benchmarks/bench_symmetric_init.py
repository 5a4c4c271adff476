"""Does symmetric initialisation (W_k := W_q) speed up encoder training? Measured on the demo config.

Trains the demo's encoder (BertForMaskedLM, masked LM) twice with identical settings, seed and
data order -- once from the standard initialisation, once after ``attn_probe.symmetric_init_`` --
and evaluates both every ``--eval-every`` steps on the same held-out blocks with the same fixed
masks. Reports, as Saponati et al. (2025) do, the step at which the symmetric run first reaches
the baseline's final held-out loss and the fraction of training that saves (``1 - step / steps``).

    python benchmarks/bench_symmetric_init.py                          # demo defaults
    python benchmarks/bench_symmetric_init.py --steps 1200 --json out.json --figure docs/img/demo_symmetric_init.png

Wall-clock numbers depend on the machine's load; the loss curves do not (same seed, same order).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attn_probe import demo  # noqa: E402


def fixed_eval_batch(tokenizer, blocks: torch.Tensor, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Held-out blocks masked once (15%, 80/10/10) with a fixed generator: identical for both runs."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    batch = demo.make_collator("encoder", tokenizer)([{"input_ids": b} for b in blocks])
    torch.random.set_rng_state(state)
    return batch


def eval_callback(batch: dict[str, torch.Tensor], every: int, curve: list[tuple[int, float]]):
    from transformers import TrainerCallback

    def evaluate(model) -> float:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            dev = next(model.parameters()).device
            loss = model(**{k: v.to(dev) for k, v in batch.items()}).loss.item()
        model.train(was_training)
        return loss

    class Eval(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            curve.append((0, evaluate(model)))

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % every == 0 or state.global_step == args.max_steps:
                curve.append((int(state.global_step), evaluate(model)))

    return Eval()


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    """First evaluated step whose loss is <= target (None if never)."""
    return next((s for s, v in curve if v <= target), None)


def main(argv: list[str] | None = None) -> int:
    d = demo.DemoConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default=d.size, choices=list(demo.SIZES))
    p.add_argument("--arch", default=d.arch, choices=list(demo.ARCHITECTURES))
    p.add_argument("--no-unigram-bias", dest="unigram_bias", action="store_false")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-blocks", type=int, default=64)
    p.add_argument("--max-chars", type=int, default=None)
    p.add_argument("--threads", type=int, help="torch CPU threads (1 is fastest on a busy machine)")
    p.add_argument("--json", help="write curves and results here")
    p.add_argument("--figure", help="write the loss-curve figure here (PNG)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = demo.DemoConfig(
        size=args.size,
        arch=args.arch,
        unigram_bias=args.unigram_bias,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup=args.warmup,
        seed=args.seed,
        max_chars=args.max_chars,
        models=("encoder",),
        progress=False,
    )
    tokenizer, blocks = demo.prepare_data(cfg)
    train_blocks, held_out = blocks[: -args.eval_blocks], blocks[-args.eval_blocks :]
    batch = fixed_eval_batch(tokenizer, held_out)
    results = {}
    for label, symmetric in (("standard", False), ("symmetric", True)):
        cfg.symmetric_init = symmetric
        curve: list[tuple[int, float]] = []
        t0, c0 = time.perf_counter(), time.process_time()
        r = demo.train_model(
            "encoder",
            tokenizer,
            train_blocks,
            cfg,
            f"/tmp/bench_symmetric_init/{label}",
            callbacks=[eval_callback(batch, args.eval_every, curve)],
            probe=False,
        )
        results[label] = {
            "eval_curve": curve,
            "train_curve": r.losses,
            "final_symmetry_median": r.median("symmetry"),
            "final_directionality_median": r.median("directionality"),
            "wall_s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - c0,
        }
        print(
            f"{label:>9}: eval loss {curve[0][1]:.3f} -> {curve[-1][1]:.3f}, "
            f"median symmetry {r.median('symmetry'):+.3f}, {results[label]['wall_s']:.0f} s",
            flush=True,
        )

    target = results["standard"]["eval_curve"][-1][1]
    reached = steps_to_reach(results["symmetric"]["eval_curve"], target)
    saved = None if reached is None else 1.0 - reached / args.steps
    summary = {
        "config": vars(args),
        "baseline_final_eval_loss": target,
        "symmetric_final_eval_loss": results["symmetric"]["eval_curve"][-1][1],
        "symmetric_steps_to_baseline_final": reached,
        "fraction_of_training_saved": saved,
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(summary, indent=1))
    if saved is None:
        print(f"symmetric init never reached the baseline's final held-out loss {target:.3f}")
    else:
        print(
            f"symmetric init reached the baseline's final held-out loss {target:.3f} at step {reached} "
            f"of {args.steps}: {100 * saved:.0f}% of training saved"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "runs": results}, indent=1))
    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        for label, colour in (("standard", "tab:blue"), ("symmetric", "tab:red")):
            s, v = zip(*results[label]["eval_curve"], strict=True)
            ax.plot(s, v, color=colour, label=f"{label} init")
        ax.axhline(target, color="grey", ls="--", lw=0.8, label="baseline final")
        if reached is not None:
            ax.axvline(reached, color="tab:red", ls=":", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out MLM loss")
        ax.set_ylim(top=min(max(v for _, v in results["standard"]["eval_curve"]), math.inf))
        ax.set_title(f"encoder ({args.size}), symmetric vs standard init")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.figure, dpi=120)
        print(f"figure: {args.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
