"""Wall-time overhead of the live probe in a real Trainer run (CPU, BERT-mini MLM).

Runs ``Trainer.train()`` on BertForMaskedLM with the bert-mini shape (4 layers, d=256,
4 heads) on random tokens, alternating: no callback, ``AttnProbeCallback(every=100)``,
``AttnProbeCallback(every=20)``, ``AttnProbeCallback(every=1)`` (``--variants`` picks),
repeated ``--repeats`` times, and reports the median wall time of ``trainer.train()``
against the baseline (goals: <= 1.02 at every=100, <= 1.03 at every=20), and the CPU-time
ratio (steadier than wall time on a shared machine). It also times single snapshots
directly, the part of the overhead that load does not blur, with the default metrics and
with the paper's two scores only (``metrics=("symmetry", "directionality")``).

    python benchmarks/bench_overhead.py --steps 200 --repeats 3

Not a test: timings depend on the machine and its load; record them with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch


def build(args: argparse.Namespace):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=args.vocab, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=1024, max_position_embeddings=args.seq)
    return BertForMaskedLM(cfg)


class RandomMLM(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(5, vocab, (n, seq), generator=g)
        self.mask = torch.rand(n, seq, generator=g) < 0.15

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i].clone()
        labels = torch.where(self.mask[i], ids, torch.full_like(ids, -100))
        ids[self.mask[i]] = 4  # [MASK]-like token
        return {"input_ids": ids, "labels": labels}


def run_once(args: argparse.Namespace, every: int | None, workdir: str, async_scoring: bool = False
             ) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) of ``trainer.train()``."""
    from transformers import Trainer, TrainingArguments

    import attn_probe

    model = build(args)
    targs = TrainingArguments(
        output_dir=workdir, max_steps=args.steps, per_device_train_batch_size=args.batch, learning_rate=5e-5,
        warmup_steps=20, weight_decay=0.01, report_to="none", logging_steps=50, save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    callbacks = [] if every is None else [attn_probe.AttnProbeCallback(
        every=every, log_dir=os.path.join(workdir, "tb"), **({"async_scoring": True} if async_scoring else {}))]
    trainer = Trainer(model=model, args=targs, train_dataset=RandomMLM(args.steps * args.batch, args.seq, args.vocab),
                      callbacks=callbacks)
    start, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    return time.perf_counter() - start, time.process_time() - cpu


def snapshot_cost(args: argparse.Namespace, n: int = 30, **options) -> float:
    """Mean seconds one ``snapshot()`` call takes on the calling (training) thread.

    With ``async_scoring=True`` that is the walk and the copies; the scoring finishes on the
    worker before the next call (``flush()``, outside the timing).
    """
    from attn_probe.live.probe import Probe

    model = build(args)
    with tempfile.TemporaryDirectory() as d:
        probe = Probe(model, log_dir=d, every=None, **options)
        probe.snapshot(0)  # warm-up
        probe.flush()
        elapsed = 0.0
        for step in range(1, n + 1):
            start = time.perf_counter()
            probe.snapshot(step)
            elapsed += time.perf_counter() - start
            probe.flush()
        probe.close(final_snapshot=False)
    return elapsed / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: on a shared machine OpenMP spinning with more "
                   "threads than free cores makes steps 10x slower and the timings meaningless; 0 = torch default)")
    p.add_argument("--variants", default="baseline,every=100,every=20,every=1",
                   help="comma-separated subset of baseline, every=100, every=20, every=1, and every=N+async "
                   "(async_scoring=True); baseline always runs")
    p.add_argument("--json", action="store_true", help="print the raw timings as JSON too")
    args = p.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    p_variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    known = {"baseline": None, "every=100": 100, "every=20": 20, "every=1": 1}
    known.update({f"{k}+async": v for k, v in list(known.items()) if v is not None})
    unknown = [v for v in p_variants if v not in known]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(known)}")
    variants = {"baseline": None, **{v: known[v] for v in p_variants if v != "baseline"}}
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    with tempfile.TemporaryDirectory() as root:
        run_once(args, None, os.path.join(root, "warmup"))  # imports, allocator, caches
        for rep in range(args.repeats):
            for name, every in variants.items():  # alternate so drifting load hits all variants
                t, c = run_once(args, every, os.path.join(root, f"{name}-{rep}"), name.endswith("+async"))
                times[name].append(t)
                cpu[name].append(c)
                print(f"rep {rep} {name:>10}: {t:7.2f} s wall, {c:7.2f} s CPU", flush=True)
    snap = snapshot_cost(args)
    snap_two = snapshot_cost(args, metrics=("symmetry", "directionality"))
    snap_async = snapshot_cost(args, async_scoring=True)
    base = statistics.median(times["baseline"])
    base_cpu = statistics.median(cpu["baseline"])
    print(f"\nBERT-mini MLM, {args.steps} steps, batch {args.batch} x seq {args.seq}, "
          f"{torch.get_num_threads()} threads, {args.repeats} alternating repeats, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("| variant | median wall s | wall ratio | per-rep wall ratios | median CPU s | CPU ratio |")
    print("|---|---|---|---|---|---|")
    for name in variants:
        med, med_cpu = statistics.median(times[name]), statistics.median(cpu[name])
        per_rep = ", ".join(f"{t / b:.3f}" for t, b in zip(times[name], times["baseline"], strict=True))
        print(f"| {name} | {med:.2f} | {med / base:.3f} | {per_rep} | {med_cpu:.2f} | {med_cpu / base_cpu:.3f} |")
    step_time = base / args.steps
    print(f"\none snapshot (4 layers, default metrics + TensorBoard + JSONL): {snap * 1e3:.2f} ms "
          f"= {snap / step_time:.3f} training steps; at every=100 that is {snap / step_time / 100:.4%} extra, "
          f"at every=20 {snap / step_time / 20:.4%}")
    print(f"one snapshot with symmetry and directionality only: {snap_two * 1e3:.2f} ms")
    print(f"one snapshot with async_scoring=True, on the training thread (walk + copies): {snap_async * 1e3:.2f} ms")
    if args.json:
        print(json.dumps({"wall": times, "cpu": cpu, "snapshot_s": snap, "snapshot_two_metrics_s": snap_two,
                          "snapshot_async_training_thread_s": snap_async,
                          "args": vars(args)}))


if __name__ == "__main__":
    main()
