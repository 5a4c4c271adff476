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

``--compile BACKEND`` (``aot_eager``, ``inductor``): a compiled model (``--shape``), the wall
time of each of 5 steps (due every second step, the first due step compiles the armed variant)
and dynamo's graph count after each, without and with the capture.

``--lengths 512 1024 2048 4096`` (issue 37's cost target): the same small Llama, sdpa, ``--batch``
(use 2), default capture options, at each length: the median ratio of the due-step time to the
not-due step time over ``--repeats`` interleaved pairs (wall time, and the process's CPU time,
which a machine shared with other jobs disturbs less), and the extra peak RSS of a due step
(the peak RSS of a first step, armed or not, above the RSS before it, each in a fresh process; Linux). ``--entropy-rows N|none`` overrides the
capture's ``entropy_rows`` (``none``: every row, the exact entropy).

On a GPU (``--device cuda``; ``benchmarks/gpu_session.sh attention``): ``--shape llama-1b``
(Llama-3.2-1B: d 2048, 16 layers, 32 query / 8 key-value heads, vocab 128256), ``--dtype
bfloat16``, ``--seq 2048`` or ``8192``, ``--batch 1``, ``--impl`` ``sdpa``, ``eager`` or
``flash_attention_2``: the due and not-due step times (CUDA-synchronised)
and the peak allocated memory of each; ``--trainer STEPS --every 10`` times the Trainer runs
on that device.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

SHAPES = {
    "small": dict(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=512),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, tie_word_embeddings=True),
}


def _model(shape: str, seq: int, device: str, dtype: str, impl: str = "sdpa"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], max_position_embeddings=max(seq, 128)))
    model.set_attn_implementation(impl)
    return model.to(device=device, dtype=getattr(torch, dtype))


def build(shape: str = "small", seq: int = 128, batch: int = 8, device: str = "cpu", dtype: str = "float32",
          impl: str = "sdpa", **options):
    import torch

    from attn_probe.activations.statistics import AttentionCapture
    from attn_probe.extraction import find_attention

    model = _model(shape, seq, device, dtype, impl)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)

    def step(run=model):
        run(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if device != "cpu":
            torch.cuda.synchronize()

    return step, AttentionCapture(model, find_attention(model), **options)


def trainer_runs(steps: int, every: int = 20, shape: str = "small", seq: int = 128, batch: int = 8,
                 device: str = "cpu", dtype: str = "float32", impl: str = "sdpa") -> None:
    import tempfile
    import warnings

    import torch
    from transformers import Trainer, TrainingArguments

    import attn_probe

    warnings.simplefilter("ignore")

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 10 ** 6

        def __getitem__(self, i):
            ids = torch.randint(0, SHAPES[shape]["vocab_size"], (seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    def run(mode: str) -> float:
        model = _model(shape, seq, device, dtype, impl)
        with tempfile.TemporaryDirectory() as out:
            targs = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch,
                                      report_to="none", save_strategy="no", use_cpu=device == "cpu",
                                      disable_tqdm=True, logging_steps=10 ** 6, seed=0)
            trainer = Trainer(model=model, args=targs, train_dataset=Tokens())
            if mode != "none":
                attn_probe.attach(trainer, every=every, attention_stats=(mode == "attention_stats"),
                                  log_dir=out + "/tb")
            t = time.perf_counter()
            trainer.train()
            return time.perf_counter() - t

    times: dict[str, list[float]] = {m: [] for m in ("none", "probe", "attention_stats")}
    for _ in range(2):
        for mode in times:
            times[mode].append(run(mode))
    best = {m: min(v) for m, v in times.items()}
    print(f"Trainer {steps} steps, every={every}:", " ".join(f"{m} {best[m]:.1f} s" for m in best),
          f"(attention_stats x{best['attention_stats'] / best['probe']:.3f} of the probe alone, "
          f"x{best['attention_stats'] / best['none']:.3f} of no probe)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--trainer", type=int, metavar="STEPS")
    parser.add_argument("--compile", metavar="BACKEND", help="time compiled steps (aot_eager, inductor)")
    parser.add_argument("--every", type=int, default=20, help="the Trainer runs' every (default 20)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--impl", default="sdpa", help="attention implementation: sdpa, eager, flash_attention_2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", help="due/not-due ratio and memory at these lengths")
    parser.add_argument("--entropy-error", action="store_true",
                        help="with --lengths: the sampled entropy against every row's, one training forward")
    parser.add_argument("--entropy-rows", default="default", help="the capture's entropy_rows (N or none)")
    parser.add_argument("--one-step", choices=["off", "on"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rows = {"default": {}, "none": {"entropy_rows": None}}.get(args.entropy_rows)
    rows = rows if rows is not None else {"entropy_rows": int(args.entropy_rows)}
    if args.one_step:
        step, capture = build(seq=args.seq, batch=args.batch, **rows)
        if args.lengths:  # the peak RSS of a first step above the RSS before it (Linux: VmHWM reset)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base = _status_kib("VmRSS")
            if args.one_step == "on":
                capture.arm()
            step()
            print(_status_kib("VmHWM") - base)
            return
        step()  # --memory: the growth of a second step, over the first one's peak
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if args.one_step == "on":
            capture.arm()
        step()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
        return
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    shape = dict(shape=args.shape, seq=args.seq, batch=args.batch, device=args.device, dtype=args.dtype, impl=args.impl)
    print(f"# torch {torch.__version__}, {args.threads} threads, {where}, {shape}")
    if args.trainer:
        trainer_runs(args.trainer, args.every, **shape)
        return
    if args.compile:
        compiled_steps(args.compile, shape)
        return
    if args.device != "cpu":
        cuda_step(args.repeats, shape, rows)
        return
    if args.lengths and args.entropy_error:
        entropy_error(args.lengths, args.batch)
        return
    if args.lengths:
        lengths(args, rows)
        return
    if args.memory:
        for mode in ("off", "on"):
            out = subprocess.run([sys.executable, __file__, "--one-step", mode, "--threads", str(args.threads)],
                                 capture_output=True, text=True, check=True).stdout.split()[-1]
            print(f"peak RSS growth of one step, capture {'armed' if mode == 'on' else 'unarmed'}: {int(out) / 1024:.1f} MiB")
        return
    step, capture = build(**shape, **rows)
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
    print(f"step not due {a * 1e3:.1f} ms, due {b * 1e3:.1f} ms ({(b - a) * 1e3:+.1f} ms); "
          f"Trainer wall time at every=20: x{1 + (b - a) / (20 * a):.4f}")


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def entropy_error(seqs: list[int], batch: int) -> None:
    """Per length: the small Llama's entropy with the default entropy_rows against every row's."""
    import torch

    from attn_probe.activations.logits import entropy_error_bound, sample_rows
    from attn_probe.activations.statistics import AttentionCapture
    from attn_probe.extraction import find_attention

    for seq in seqs:
        model = _model("small", seq, "cpu", "float32")
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
        found = []
        for options in ({}, {"entropy_rows": None}):
            capture = AttentionCapture(model, find_attention(model), **options)
            capture.arm()
            model(input_ids=ids, labels=ids).loss.backward()
            capture.disarm()
            found.append(capture.collect().tables())
            capture.close()
        error = max((a[1] - b[1]).abs().max().item() for a, b in zip(*found, strict=True))
        same_max = all(torch.equal(a[0], b[0]) for a, b in zip(*found, strict=True))
        start, stride = sample_rows(0, seq, 256)
        m = len(range(start, seq, stride))
        print(f"L {seq}: entropy (layer rows) {[round(t[1][0].item(), 3) for t in found[1]]}; max |sampled - every row| "
              f"over layers and heads {error:.2e} nats (Hoeffding, m={m}, delta=0.01: "
              f"{entropy_error_bound(seq, m):.2f}); max_logit identical: {same_max}", flush=True)


def lengths(args, rows: dict) -> None:
    """Per length: median due / not-due step time over interleaved pairs, extra peak RSS of a due step."""
    for seq in args.lengths:
        step, capture = build(seq=seq, batch=args.batch, impl=args.impl, **rows)
        step()
        off, on, ratios, cpu_ratios = [], [], [], []
        for _ in range(args.repeats):
            c, t = time.process_time(), time.perf_counter()
            step()
            off.append(time.perf_counter() - t)
            c_off = time.process_time() - c
            capture.arm()
            c, t = time.process_time(), time.perf_counter()
            step()
            capture.disarm()
            capture.collect()
            on.append(time.perf_counter() - t)
            cpu_ratios.append((time.process_time() - c) / c_off)
            ratios.append(on[-1] / off[-1])
        capture.close()
        growth = []
        for mode in ("off", "on"):
            cmd = [sys.executable, __file__, "--one-step", mode, "--threads", str(args.threads), "--seq", str(seq),
                   "--batch", str(args.batch), "--entropy-rows", args.entropy_rows, "--lengths", "0"]
            growth.append(int(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()[-1]))
        print(f"L {seq}: not due {statistics.median(off):.2f} s, due {statistics.median(on):.2f} s, "
              f"due/not due wall x{statistics.median(ratios):.2f} (pairs: {', '.join(f'{r:.2f}' for r in ratios)}), "
              f"CPU time x{statistics.median(cpu_ratios):.2f} (pairs: {', '.join(f'{r:.2f}' for r in cpu_ratios)}); "
              f"peak RSS above the step's start: not due {growth[0] / 1024:.0f} MiB, due {growth[1] / 1024:.0f} MiB "
              f"({(growth[1] - growth[0]) / 1024:+.0f} MiB)", flush=True)


def compiled_steps(backend: str, shape: dict) -> None:
    """Per step: wall time and dynamo's graph count, compiled without and with the capture."""
    import torch
    from torch._dynamo.utils import counters

    for probe in (False, True):
        torch._dynamo.reset()
        counters.clear()
        step, capture = build(**shape)
        if not probe:
            capture.close()
        model = capture.root
        compiled = torch.compile(model, backend=backend)
        times, graphs = [], []
        for i in range(5):
            due = probe and i % 2 == 1
            if due:
                capture.arm()
            t = time.perf_counter()
            step(compiled)
            times.append(time.perf_counter() - t)
            graphs.append(int(counters["stats"]["unique_graphs"]))
            if due:
                capture.disarm()
        if probe:
            capture.close()
        print(f"{backend}, {'with the capture (due: steps 2, 4)' if probe else 'no probe'}: step times "
              + ", ".join(f"{t:.2f}" for t in times) + f" s; graphs after each step {graphs}; "
              f"graph breaks {sum(counters['graph_break'].values())}")


def cuda_step(repeats: int, shape: dict, rows: dict) -> None:
    """Median step times, not due and due, and the peak allocated memory of each (CUDA)."""
    import torch

    step, capture = build(**shape, **rows)
    step()
    off, on, peaks = [], [], {}
    for _ in range(repeats):
        for armed in (False, True):
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            if armed:
                capture.arm()
            t = time.perf_counter()
            step()
            if armed:
                capture.disarm()
                capture.collect()
            (on if armed else off).append(time.perf_counter() - t)
            peaks[armed] = max(peaks.get(armed, 0), torch.cuda.max_memory_allocated() - base)
    a, b = statistics.median(off), statistics.median(on)
    print(f"step not due {a * 1e3:.1f} ms, due {b * 1e3:.1f} ms ({(b - a) * 1e3:+.1f} ms); "
          f"peak memory above the resident state: not due {peaks[False] / 2 ** 20:.0f} MiB, "
          f"due {peaks[True] / 2 ** 20:.0f} MiB (+{(peaks[True] - peaks[False]) / 2 ** 20:.0f} MiB)")


if __name__ == "__main__":
    main()
