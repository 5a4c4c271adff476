r"""Find and diagnose demo configurations: does the encoder take off, and what does W_qk do?

Three modes.

**Diagnose one model** (the default): a plain PyTorch loop over the demo's own pieces
(``prepare_data``, ``build_model``, ``make_collator``, ``init_output_bias_to_unigram_``) with
the Trainer's optimiser settings (AdamW, no decay on biases and LayerNorm, linear warm-up and
decay, gradient clipping at 1.0). Every ``--every`` steps it prints one JSON line:

* ``loss`` -- mean training loss since the last line (compare with ``unigram_entropy``);
* ``symmetry`` -- per-layer symmetry score of the layer-level W_qk, sorted; ``median``;
* ``directionality_median``;
* ``attention_entropy`` -- mean entropy (nats) of each layer's attention rows on 8 fixed blocks
  (``log(seq_len)`` for uniform attention; lower means the model attends selectively);
* ``hidden_cosine`` -- mean cosine similarity between the positions of the last layer's hidden
  states (near 1: every position carries the same vector -- rank collapse);
* ``qk_grad_norm`` -- mean norm of the W_q/W_k gradients over the interval;
* ``seconds`` -- wall time so far; ``cpu_seconds`` -- this process's CPU time so far.

**One model through the demo's own training** (``--trainer OUT.json``): ``demo.train_model``
(the Hugging Face Trainer, the one-line probe callback, TensorBoard) with this script's
overrides, then one JSON file with the probe's trajectory (median and IQR across layers per
probe step), the logged losses, where the encoder left the unigram plateau and where its
symmetry first crossed ``--takeoff``, and the process's CPU time (``resource.getrusage``: what
one model costs on a CPU of its own, start-up included). On a GPU the Trainer trains there
(``--precision bf16`` as the ``paper-small`` preset does); ``--deadline S`` stops training
gracefully once the process has run S seconds (imports included) (the JSON records the step it stopped at), so
that a run on a lent GPU ends, scored, inside its time (``benchmarks/gpu_emergence.sh``).

**The sweep** (``--sweep NAME [NAME ...]`` or ``--sweep all``): for each named configuration
of :data:`SWEEP` the encoder and the decoder train at the same time, one ``--trainer`` process
each, under ``nice -n 19`` with one torch thread (as the demo does on a 2-core machine); one
row per configuration goes to ``--csv`` and the two models' JSON files to ``--out``. On an idle
2-core machine the demo's wall time is about the larger of the two processes' CPU times.

Tokenisation (``--tokens``, the demo's own tokenizers, ``demo.TOKENS``): ``wordpiece``,
``chars`` (one token per character, whitespace included) or ``chars-nospace`` (one token per
non-whitespace character: what the paper's released code fed its Wikipedia and RedPajama models,
whose ``" ".join(text)`` spaced out the characters before a whitespace-splitting tokenizer).

The defaults are :data:`BASE`, the word-level ``cpu`` preset before this sweep (the demo's ``cpu``
preset is now the sweep's ``ch128-s32-b32-lr2e-3``: pre-LN, 4 layers x d 128, 4 heads, one token
per character, 32 x 32 tokens per step, lr 2e-3, warm-up 100, 1,500 steps).

    python benchmarks/demo_dynamics_sweep.py --kind encoder --seed 1                  # the earlier cpu preset
    python benchmarks/demo_dynamics_sweep.py --kind decoder --arch bert --lr 1e-3 --warmup 30 --no-unigram-bias
    python benchmarks/demo_dynamics_sweep.py --kind decoder --decoder-objective paper-mlm   # the released code's decoder
    python benchmarks/demo_dynamics_sweep.py --tokens chars --hidden 128 --ffn 512 --steps 100   # character level
    python benchmarks/demo_dynamics_sweep.py --sweep all --csv benchmarks/results/cpu_preset_sweep.csv \
        --out runs/sweep                                          # the CPU preset sweep (docs/reproducing-the-paper.md)
    python benchmarks/demo_dynamics_sweep.py --sweep ch128-s32-b32-lr2e-3             # today's cpu preset alone
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: when this process started, before the heavy imports: ``--deadline`` counts from here
_START = time.perf_counter()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attn_probe import demo, score_model  # noqa: E402
from attn_probe.formats.tags import layer_stats  # noqa: E402

TOKENS = demo.TOKENS

#: This script's defaults, which the :data:`SWEEP` configurations override: the ``cpu`` preset as it
#: was before the sweep (word level, d 256, 8 x 128 tokens, lr 5e-4, 700 steps). The demo's ``cpu``
#: preset is now the sweep's ``ch128-s32-b32-lr2e-3``; these stay so that the sweep re-runs as recorded.
BASE: dict[str, Any] = {"size": "mini", "tokens": "wordpiece", "steps": 700, "batch_size": 8, "seq_len": 128,
                        "lr": 5e-4, "warmup": 50}

#: The configurations of the CPU preset sweep: overrides of this script's options (their
#: argparse ``dest`` names). Every configuration trains the encoder and the decoder with the
#: same settings; ``steps`` was budgeted from pilot runs to <= ~9 CPU minutes per model.
SWEEP: dict[str, dict[str, Any]] = {
    # the earlier cpu preset, for reference (word-level, d 256, 8 x 128 tokens, lr 5e-4, 700 steps)
    "wp256-s128-b8-lr5e-4": {},
    # character level, 4 layers x d 128 (a BERT miniature, L=4/H=128), 4 heads, FFN 512
    "ch128-s128-b16-lr1e-3": {"tokens": "chars", "hidden": 128, "ffn": 512, "seq_len": 128, "batch_size": 16,
                              "lr": 1e-3, "warmup": 100, "steps": 1200},
    "ch128-s64-b16-lr2e-3": {"tokens": "chars", "hidden": 128, "ffn": 512, "seq_len": 64, "batch_size": 16,
                             "lr": 2e-3, "warmup": 100, "steps": 1500},
    # adopted: today's cpu preset (attn_probe/demo/presets.py)
    "ch128-s32-b32-lr2e-3": {"tokens": "chars", "hidden": 128, "ffn": 512, "seq_len": 32, "batch_size": 32,
                             "lr": 2e-3, "warmup": 100, "steps": 1500},
    "ch128-s32-b32-lr2e-3-seed1": {"tokens": "chars", "hidden": 128, "ffn": 512, "seq_len": 32, "batch_size": 32,
                                   "lr": 2e-3, "warmup": 100, "steps": 1500, "seed": 1},
    # the paper's released-code tokenisation: characters without whitespace (word boundaries lost)
    "chns128-s32-b32-lr2e-3": {"tokens": "chars-nospace", "hidden": 128, "ffn": 512, "seq_len": 32, "batch_size": 32,
                               "lr": 2e-3, "warmup": 100, "steps": 1500},
    # the control: the same shape and schedule, word level (the demo's 4,096-entry WordPiece)
    "wp128-s32-b32-lr2e-3": {"hidden": 128, "ffn": 512, "seq_len": 32, "batch_size": 32, "lr": 2e-3, "warmup": 100,
                             "steps": 1500},
}


def cpu_seconds() -> float:
    """User + system CPU time of this process so far (all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def prepare(a: argparse.Namespace) -> tuple[demo.DemoConfig, Any, torch.Tensor, str]:
    """The DemoConfig of these options (a ``custom`` size if the dimensions are overridden), tokenizer, blocks."""
    size = a.size
    if any(v is not None for v in (a.layers, a.hidden, a.heads, a.ffn)):
        base = demo.SIZES[a.size]
        demo.SIZES["custom"] = tuple(
            v if v is not None else b for v, b in zip((a.layers, a.hidden, a.heads, a.ffn), base, strict=True)
        )
        size = "custom"
    cfg = demo.DemoConfig(
        size=size, arch=a.arch, steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr,
        warmup=a.warmup, weight_decay=a.weight_decay, decoder_objective=a.decoder_objective,
        vocab_size=a.vocab_size, tokens=a.tokens, seed=a.seed, every=a.every, unigram_bias=a.unigram_bias, figure=False,
        progress=True, models=(a.kind,), threads=a.threads, precision=a.precision, max_chars=a.max_chars,
    )
    tokenizer, blocks = demo.prepare_data(cfg)
    return cfg, tokenizer, blocks, size


# --------------------------------------------------------------------------- explicit check
def explicit_symmetry(model: Any) -> list[float]:
    """Per-layer ``<M, M^T>_F / ||M||_F^2`` with ``M = sum_h W_q^h W_k^h^T``, from the raw weights.

    In a BERT-style ``nn.Linear`` the query of token x is ``Q x`` (``Q = query.weight``, heads
    stacked along the rows), so the score between x and y is ``sum_h x^T Q_h^T K_h y`` and the
    layer-level matrix is ``sum_h Q_h^T K_h = Q^T K``. Independent of attn_probe's extraction.
    """
    out = []
    for name, mod in model.named_modules():
        if name.endswith("attention.self"):
            q = mod.query.weight.detach().double()
            k = mod.key.weight.detach().double()
            m = q.T @ k
            out.append(float((m * m.T).sum() / (m * m).sum()))
    return out


# --------------------------------------------------------------------------- one model, the demo's loop
def first_crossing(points: list[tuple[int, float]], level: float) -> int | None:
    """The first step whose value is >= ``level`` and stays so at the next probe (None if never)."""
    for i, (step, v) in enumerate(points):
        if v >= level and (i + 1 == len(points) or points[i + 1][1] >= level):
            return step
    return None


def deadline_callback(start: float, seconds: float, stopped: dict[str, int]) -> Any:
    """A Trainer callback that stops training once ``seconds`` have passed since ``start``
    (``time.perf_counter()``), recording the last step in ``stopped["step"]``."""
    from transformers import TrainerCallback

    class Deadline(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if time.perf_counter() - start >= seconds and state.global_step < state.max_steps:
                control.should_training_stop = True
                stopped["step"] = state.global_step
            return control

    return Deadline()


def run_trainer(a: argparse.Namespace) -> int:
    """Train one model with ``demo.train_model``; write the JSON summary to ``a.trainer``."""
    from attn_probe.analysis.summary import layer_quantiles

    torch.set_num_threads(a.threads)
    cpu0 = cpu_seconds()
    wall0 = time.perf_counter()
    cfg, tokenizer, blocks, size = prepare(a)
    entropy = demo.unigram_entropy(blocks)
    run_dir = Path(a.trainer).with_suffix("")
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    stopped: dict[str, int] = {}
    callbacks = [] if a.deadline is None else [deadline_callback(_START, a.deadline, stopped)]
    cpu_train0 = cpu_seconds()
    captured: dict[str, Any] = {}  # the model train_model builds, for the explicit check at the end
    result = demo.train_model(a.kind, tokenizer, blocks, cfg, run_dir, save_final=False, callbacks=callbacks,
                              model_hook=lambda m: captured.setdefault("model", m))
    cpu_train = cpu_seconds() - cpu_train0
    q = layer_quantiles(run_dir)
    traj: dict[str, list[list[float]]] = {}
    for metric in ("symmetry", "directionality"):
        rows = q[q["metric"] == metric].sort_values("step")
        traj[metric] = [[int(r.step), round(r.median, 4), round(r.q25, 4), round(r.q75, 4)] for r in rows.itertuples()]
    sym = [(s, m) for s, m, _, _ in traj["symmetry"]]
    final_rows = [r for r in result.rows if r["head"] is None]
    final_sym = layer_stats(r["symmetry"] for r in final_rows)
    final_dir = layer_stats(r["directionality"] for r in final_rows)
    model = captured.get("model")
    explicit = None if model is None else [round(v, 6) for v in explicit_symmetry(model)]
    out = {
        "name": a.name,
        "kind": a.kind,
        "tokens": a.tokens,
        "dims": list(demo.SIZES[size]),
        "arch": a.arch,
        "steps": a.steps,
        "steps_done": stopped.get("step", a.steps),
        "deadline_s": a.deadline,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "precision": a.precision,
        "train_s": round(result.seconds, 1),
        "batch_size": a.batch_size,
        "seq_len": a.seq_len,
        "lr": a.lr,
        "warmup": a.warmup,
        "seed": a.seed,
        "every": a.every,
        "vocab": len(tokenizer),
        "blocks": int(blocks.shape[0]),
        "unigram_entropy": round(entropy, 4),
        "cpu_total_s": round(cpu_seconds() - cpu0, 1),
        "cpu_train_s": round(cpu_train, 1),
        "cpu_startup_s": round(cpu_train0 - cpu0, 1),
        "wall_s": round(time.perf_counter() - wall0, 1),
        "final_loss": round(result.final_loss, 4),
        "final_symmetry": [round(final_sym[k], 4) for k in ("median", "q25", "q75")],
        "final_directionality": [round(final_dir[k], 4) for k in ("median", "q25", "q75")],
        "per_layer_symmetry": [round(r["symmetry"], 6) for r in final_rows],
        "explicit_symmetry": explicit,
        "plateau_exit": demo.plateau_exit(result.losses, entropy),
        "takeoff_0.15": first_crossing(sym, 0.15),
        "takeoff_0.30": first_crossing(sym, 0.30),
        "losses": [[s, round(v, 4)] for s, v in result.losses],
        "trajectory": traj,
    }
    Path(a.trainer).write_text(json.dumps(out) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k not in ("losses", "trajectory")}), flush=True)
    return 0


# --------------------------------------------------------------------------- the sweep driver
CSV_FIELDS = [
    "name", "tokens", "layers", "hidden", "heads", "ffn", "seq_len", "batch_size", "lr", "warmup", "steps", "seed",
    "vocab", "unigram_entropy", "enc_cpu_s", "dec_cpu_s", "est_wall_s", "enc_final_loss", "dec_final_loss",
    "enc_sym", "enc_sym_q25", "enc_sym_q75", "dec_sym", "dec_sym_q25", "dec_sym_q75", "gap", "enc_dir", "dec_dir",
    "enc_plateau_exit", "enc_takeoff_015", "enc_takeoff_030", "meets_target", "max_explicit_diff",
]


def option_args(overrides: dict[str, Any]) -> list[str]:
    """Command-line options for a configuration's overrides."""
    args: list[str] = []
    for k, v in overrides.items():
        flag = "--" + k.replace("_", "-")
        if v is False:
            args.append("--no-unigram-bias" if k == "unigram_bias" else flag)
        elif v is True:
            continue
        else:
            args += [flag, str(v)]
    return args


def csv_row(name: str, enc: dict[str, Any], dec: dict[str, Any]) -> dict[str, Any]:
    """One CSV row from the two models' JSON summaries."""
    layers, hidden, heads, ffn = enc["dims"]
    gap = enc["final_symmetry"][0] - dec["final_symmetry"][0]
    diffs = []
    for r in (enc, dec):
        if r.get("explicit_symmetry"):
            diffs += [abs(x - y) for x, y in zip(r["explicit_symmetry"], r["per_layer_symmetry"], strict=True)]
    return {
        "name": name, "tokens": enc["tokens"], "layers": layers, "hidden": hidden, "heads": heads, "ffn": ffn,
        "seq_len": enc["seq_len"], "batch_size": enc["batch_size"], "lr": enc["lr"], "warmup": enc["warmup"],
        "steps": enc["steps"], "seed": enc["seed"], "vocab": enc["vocab"], "unigram_entropy": enc["unigram_entropy"],
        "enc_cpu_s": enc["cpu_total_s"], "dec_cpu_s": dec["cpu_total_s"],
        "est_wall_s": max(enc["cpu_total_s"], dec["cpu_total_s"]),
        "enc_final_loss": enc["final_loss"], "dec_final_loss": dec["final_loss"],
        "enc_sym": enc["final_symmetry"][0], "enc_sym_q25": enc["final_symmetry"][1],
        "enc_sym_q75": enc["final_symmetry"][2],
        "dec_sym": dec["final_symmetry"][0], "dec_sym_q25": dec["final_symmetry"][1],
        "dec_sym_q75": dec["final_symmetry"][2], "gap": round(gap, 4),
        "enc_dir": enc["final_directionality"][0], "dec_dir": dec["final_directionality"][0],
        "enc_plateau_exit": enc["plateau_exit"], "enc_takeoff_015": enc["takeoff_0.15"],
        "enc_takeoff_030": enc["takeoff_0.30"],
        "meets_target": enc["final_symmetry"][0] >= 0.30 and gap >= 0.25 and enc["plateau_exit"] is not None
        and max(enc["cpu_total_s"], dec["cpu_total_s"]) <= 600,
        "max_explicit_diff": f"{max(diffs):.1e}" if diffs else "",
    }


def append_row(csv_path: Path, row: dict[str, Any]) -> None:
    """Append one row to the sweep's CSV (with the header if the file is new)."""
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    new = not csv_path.exists()
    with open(csv_path, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        if new:
            w.writeheader()
        w.writerow(row)


def run_sweep(names: list[str], out: Path, csv_path: Path, extra: list[str], kinds: list[str]) -> int:
    """Train each configuration's models at the same time, niced, one thread each; a CSV row per pair."""
    chosen = list(SWEEP) if names == ["all"] else names
    unknown = [n for n in chosen if n not in SWEEP]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {', '.join(SWEEP)}")
    out.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        procs = {}
        for kind in kinds:
            cmd = ["nice", "-n", "19", sys.executable, __file__, "--kind", kind, "--name", name,
                   "--trainer", str(out / f"{name}.{kind}.json"), *option_args(SWEEP[name]), *extra]
            log = open(out / f"{name}.{kind}.log", "w")  # noqa: SIM115  (closed below)
            procs[kind] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)
        failed = False
        for kind, (p, log) in procs.items():
            rc = p.wait()
            log.close()
            if rc:
                print(f"{name} {kind}: exit {rc}, see {out / f'{name}.{kind}.log'}", flush=True)
                failed = True
        if failed or set(kinds) != set(demo.MODEL_KINDS):
            continue
        enc, dec = (json.loads((out / f"{name}.{k}.json").read_text()) for k in demo.MODEL_KINDS)
        row = csv_row(name, enc, dec)
        append_row(csv_path, row)
        print(json.dumps(row), flush=True)
    return 0


def export_trajectories(out_csv: Path, runs: list[str]) -> int:
    """Median/q25/q75 across layers per probe step of ``NAME=RUN_DIR`` runs (finished or stopped) as one CSV."""
    from attn_probe.analysis.summary import layer_quantiles

    out_csv.parent.mkdir(parents=True, exist_ok=True)
    with open(out_csv, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["run", "metric", "step", "median", "q25", "q75"])
        for spec in runs:
            name, _, run_dir = spec.partition("=")
            q = layer_quantiles(run_dir)
            q = q[q["metric"].isin(["symmetry", "directionality"])].sort_values(["metric", "step"])
            for r in q.itertuples():
                w.writerow([name, r.metric, int(r.step), f"{r.median:.4f}", f"{r.q25:.4f}", f"{r.q75:.4f}"])
    return 0


# --------------------------------------------------------------------------- diagnose (plain loop)
def diagnose(a: argparse.Namespace) -> int:
    torch.set_num_threads(a.threads)
    cfg, tokenizer, blocks, size = prepare(a)
    counts = torch.bincount(blocks.reshape(-1)).double()
    freq = counts[counts > 0] / counts.sum()
    print(
        json.dumps(
            {
                "config": vars(a),
                "dims": demo.SIZES[size],
                "vocab": len(tokenizer),
                "blocks": list(blocks.shape),
                "unigram_entropy": round(float(-(freq * freq.log()).sum()), 3),
            }
        ),
        flush=True,
    )

    model = demo.build_model(
        a.kind, size, len(tokenizer), a.seq_len, pad_token_id=tokenizer.pad_token_id, seed=a.seed, arch=a.arch
    )
    if a.dropout is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = a.dropout
    if a.unigram_bias:
        demo.init_output_bias_to_unigram_(model, blocks)
    model.set_attn_implementation("eager")  # attention probabilities for the entropy
    collator = demo.make_collator(a.kind, tokenizer, a.decoder_objective)

    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
    )

    def lr_factor(step: int) -> float:  # transformers' linear schedule with warm-up
        if step < a.warmup:
            return step / max(1, a.warmup)
        return max(0.0, (a.steps - step) / max(1, a.steps - a.warmup))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    qk_params = [p for n, p in model.named_parameters() if n.endswith(("query.weight", "key.weight"))]
    generator = torch.Generator().manual_seed(a.seed)
    torch.manual_seed(a.seed)
    probe_batch = collator([{"input_ids": blocks[i]} for i in range(8)])

    losses: list[float] = []
    qk_grads: list[float] = []
    start = time.perf_counter()
    cpu0 = cpu_seconds()
    for step in range(a.steps + 1):
        if step % a.every == 0:
            rows = [r for r in score_model(model) if r["head"] is None]
            symmetry = sorted(r["symmetry"] for r in rows)
            model.eval()
            with torch.no_grad():
                out = model(**probe_batch, output_attentions=True, output_hidden_states=True)
            model.train()
            entropy = [float(-(att * att.clamp_min(1e-12).log()).sum(-1).mean()) for att in out.attentions]
            h = torch.nn.functional.normalize(out.hidden_states[-1], dim=-1)
            recent = losses[-a.every :] or [math.nan]
            grads = qk_grads[-a.every :] or [math.nan]
            print(
                json.dumps(
                    {
                        "step": step,
                        "loss": round(sum(recent) / len(recent), 4),
                        "symmetry": [round(s, 4) for s in symmetry],
                        "median": round(layer_stats(symmetry)["median"], 4),
                        "directionality_median": round(
                            layer_stats(r["directionality"] for r in rows)["median"], 4
                        ),
                        "attention_entropy": [round(e, 3) for e in entropy],
                        "hidden_cosine": round(float((h @ h.transpose(1, 2)).mean()), 3),
                        "qk_grad_norm": round(sum(grads) / len(grads), 6),
                        "seconds": round(time.perf_counter() - start, 1),
                        "cpu_seconds": round(cpu_seconds() - cpu0, 1),
                    }
                ),
                flush=True,
            )
        if step == a.steps:
            break
        idx = torch.randint(len(blocks), (a.batch_size,), generator=generator).tolist()
        loss = model(**collator([{"input_ids": blocks[i]} for i in idx])).loss
        loss.backward()
        qk_grads.append(math.sqrt(sum(float(p.grad.norm()) ** 2 for p in qk_params)))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return 0


def main(argv: list[str] | None = None) -> int:
    d = demo.DemoConfig(**BASE)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=demo.MODEL_KINDS, default="encoder")
    p.add_argument("--decoder-objective", choices=demo.DECODER_OBJECTIVES, default="causal",
                   help="causal (next token) or paper-mlm (the released code's MLM batches to the causal LM)")
    p.add_argument("--tokens", choices=TOKENS, default=d.tokens)
    p.add_argument("--size", choices=list(demo.SIZES), default=d.size)
    p.add_argument("--arch", choices=list(demo.ARCHITECTURES), default=d.arch)
    p.add_argument("--layers", type=int, help="override the size's layer count")
    p.add_argument("--hidden", type=int, help="override the size's hidden width")
    p.add_argument("--heads", type=int, help="override the size's head count")
    p.add_argument("--ffn", type=int, help="override the size's feed-forward width")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="WordPiece vocabulary size")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--precision", choices=demo.PRECISIONS, default="fp32",
                   help="--trainer: fp32 or bf16 mixed precision (bf16 needs a GPU that supports it)")
    p.add_argument("--max-chars", type=int, help="use only the first N characters of the corpus")
    p.add_argument("--deadline", type=float, metavar="S",
                   help="--trainer: stop training once this process has run S seconds (the JSON says where)")
    p.add_argument("--dropout", type=float, help="override every dropout probability (diagnose mode only)")
    p.add_argument("--no-unigram-bias", dest="unigram_bias", action="store_false")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--every", type=int, default=d.every)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--takeoff", type=float, default=0.15, help="symmetry level that marks the takeoff")
    p.add_argument("--name", default="custom", help="configuration name recorded in --trainer's JSON")
    p.add_argument("--trainer", metavar="OUT.json", help="train one model through demo.train_model")
    p.add_argument("--sweep", nargs="+", metavar="NAME", help=f"run named configurations: all or {', '.join(SWEEP)}")
    p.add_argument("--csv", default="benchmarks/results/cpu_preset_sweep.csv", help="the sweep's CSV (appended)")
    p.add_argument("--out", default="runs/sweep", help="the sweep's per-model JSON files and logs")
    p.add_argument("--models", nargs="+", choices=demo.MODEL_KINDS, default=list(demo.MODEL_KINDS),
                   help="the sweep's models (a screen: encoder only)")
    p.add_argument("--collect", nargs=3, metavar=("NAME", "ENC_JSON", "DEC_JSON"),
                   help="append the CSV row of two --trainer JSON files")
    p.add_argument("--export-trajectories", nargs="+", metavar="OUT.csv NAME=RUN_DIR",
                   help="write the probe trajectories of runs (finished or stopped) to one CSV")
    a, extra = p.parse_known_args(argv)
    if a.export_trajectories:
        out_csv, *runs = a.export_trajectories
        return export_trajectories(Path(out_csv), runs)
    if a.sweep:
        return run_sweep(a.sweep, Path(a.out), Path(a.csv), extra, a.models)
    if a.collect:
        name, enc_path, dec_path = a.collect
        row = csv_row(name, json.loads(Path(enc_path).read_text()), json.loads(Path(dec_path).read_text()))
        append_row(Path(a.csv), row)
        print(json.dumps(row))
        return 0
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if a.trainer:
        return run_trainer(a)
    return diagnose(a)


if __name__ == "__main__":
    raise SystemExit(main())
