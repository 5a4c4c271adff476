"""What ``attention_stats=True`` costs (issue 25): a due step against a step that is not due.

Llama (d 256, 4 layers, 8 query / 2 key-value heads, vocab 1000), sdpa, batch 8, sequence 128,
CPU: one training step (forward, backward, SGD) with the capture unarmed (a step that is not
due: the registered wrappers check one dict) and armed (a due step: logits, entropy, input
norms), median of ``--repeats``; the ratio of Trainer wall time this implies at ``every=20``
is ``1 + extra / (20 * step)``. ``--memory`` instead reports the peak RSS growth of one step,
unarmed then armed, each in a fresh process. ``--trainer STEPS`` times whole Trainer runs
(batch 8 of random tokens) twice each: no probe, ``attach(trainer, every=20)``, and the same
with ``attention_stats=True``.

    python benchmarks/bench_attention_stats.py [--threads 1] [--repeats 7] [--memory | --trainer 60]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time


def build():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from attn_probe.attention_stats import AttentionCapture
    from attn_probe.extraction import find_attention

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                         num_key_value_heads=2, intermediate_size=512, max_position_embeddings=128))
    model.set_attn_implementation("sdpa")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1000, (8, 128))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return step, AttentionCapture(model, find_attention(model))


def trainer_runs(steps: int) -> None:
    import tempfile
    import warnings

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    import attn_probe

    warnings.simplefilter("ignore")

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 10 ** 6

        def __getitem__(self, i):
            ids = torch.randint(0, 1000, (128,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    def run(mode: str) -> float:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4,
                                             num_attention_heads=8, num_key_value_heads=2, intermediate_size=512,
                                             max_position_embeddings=128))
        model.set_attn_implementation("sdpa")
        with tempfile.TemporaryDirectory() as out:
            targs = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=8,
                                      report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
                                      logging_steps=10 ** 6, seed=0)
            trainer = Trainer(model=model, args=targs, train_dataset=Tokens())
            if mode != "none":
                attn_probe.attach(trainer, every=20, attention_stats=(mode == "attention_stats"), log_dir=out + "/tb")
            t = time.perf_counter()
            trainer.train()
            return time.perf_counter() - t

    times: dict[str, list[float]] = {m: [] for m in ("none", "probe", "attention_stats")}
    for _ in range(2):
        for mode in times:
            times[mode].append(run(mode))
    best = {m: min(v) for m, v in times.items()}
    print(" ".join(f"{m} {best[m]:.1f} s" for m in best),
          f"(attention_stats x{best['attention_stats'] / best['probe']:.3f} of the probe alone)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--trainer", type=int, metavar="STEPS")
    parser.add_argument("--one-step", choices=["off", "on"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.one_step:
        step, capture = build()
        step()
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if args.one_step == "on":
            capture.arm()
        step()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
        return
    print(f"# torch {torch.__version__}, {args.threads} threads, CPU")
    if args.trainer:
        trainer_runs(args.trainer)
        return
    if args.memory:
        for mode in ("off", "on"):
            out = subprocess.run([sys.executable, __file__, "--one-step", mode, "--threads", str(args.threads)],
                                 capture_output=True, text=True, check=True).stdout.split()[-1]
            print(f"peak RSS growth of one step, capture {'armed' if mode == 'on' else 'unarmed'}: {int(out) / 1024:.1f} MiB")
        return
    step, capture = build()
    step()
    off, on = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        step()
        off.append(time.perf_counter() - t)
        capture.arm()
        t = time.perf_counter()
        step()
        capture.disarm()
        capture.collect()
        on.append(time.perf_counter() - t)
    a, b = statistics.median(off), statistics.median(on)
    print(f"step not due {a * 1e3:.1f} ms, due {b * 1e3:.1f} ms (+{(b - a) * 1e3:.1f} ms); "
          f"Trainer wall time at every=20: x{1 + (b - a) / (20 * a):.4f}")


if __name__ == "__main__":
    main()
