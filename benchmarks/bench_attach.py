"""Where attach time and memory go on a Llama-3-8B-shaped model (issue 44, "What to build" 3).

Builds a Llama with the attention of Llama-3-8B (hidden 4096, 32 query heads and 8 KV heads of
128; ``--layers`` of them, 8 by default to fit a shared machine's memory, 32 for the real depth)
and tiny MLPs (``intermediate_size`` 16: the probe reads only q/k) on the meta device,
materialises it with ``to_empty`` and fills every parameter with ``normal_(0, 0.02)`` (and copies
the buffers, rotary ``inv_freq``, from a one-layer model built for real). Then, each phase timed
in wall time, the calling thread's CPU time (``time.thread_time``) and the process's
(``time.process_time``: all threads), with the process's resident memory before and its peak
during the phase (``VmHWM`` of ``/proc/self/status``, reset before each phase by writing ``5`` to
``/proc/self/clear_refs``; Linux):

* ``discovery``: finding the attention layers (what ``Probe`` does first);
* ``random range``: :func:`attn_probe.baselines.random_range.random_range_rows` of those layers as
  the probe asks for it (no time budget, ``PROBE_ENTRIES`` drawn numbers; the cache cleared first);
* ``Probe(...)``: building the probe (discovery, the random range where it is still computed at
  attach, the sinks, the hooks of the stages);
* ``hooks``: ``attach_optimizer`` (the update counter);
* ``first snapshot``: ``probe.snapshot(0)``, scored on the training thread (what ``watch`` does next);
* ``range ready``: on code that computes the range off the training thread, how long after
  ``Probe(...)`` returned its rows were ready and which thread computed them.

Phases are in this order in one process; the model stays resident. Nothing here is a test:
record the output with the command and the machine in docs/performance.md.

    python benchmarks/bench_attach.py                   # 8 layers, the machine's torch threads
    python benchmarks/bench_attach.py --layers 32 --threads 1
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def phase(name: str, fn: Callable[[], Any], table: list[tuple]) -> Any:
    reset_peak()
    before = rss_mib()
    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    out = fn()
    wall, cpu, proc = time.perf_counter() - t0, time.thread_time() - c0, time.process_time() - p0
    table.append((name, wall, cpu, proc, before, rss_mib("VmHWM") - before))
    return out


def build(layers: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    def config(n: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=256,
            hidden_size=4096,
            num_hidden_layers=n,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=16,
            max_position_embeddings=2048,
        )

    with torch.device("meta"):
        model = LlamaForCausalLM(config(layers)).to(dtype)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
        real = dict(LlamaForCausalLM(config(1)).named_buffers())
        for name, buf in model.named_buffers():
            key = name if name in real else None
            if key is None:  # a layer's buffer: take layer 0's
                parts = name.split(".")
                if "layers" in parts:
                    parts[parts.index("layers") + 1] = "0"
                key = ".".join(parts)
            if key in real:
                buf.copy_(real[key])
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import attn_probe
    from attn_probe.baselines import random_range as rr
    from attn_probe.live.config import config_from_options
    from attn_probe.live.stages.attention import metric_names
    from attn_probe.live.stages.measurement import find_layers

    table: list[tuple] = []
    model = phase(
        "build the model (not attach)", lambda: build(args.layers, getattr(torch, args.dtype)), table
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_from_options(every=100, log_dir=os.path.join(tmp, "probe"))
        pairs = cfg.score_pairs()
        layers = phase("discovery (find_layers)", lambda: find_layers(model, cfg, pairs), table)
        metrics, _ = metric_names(cfg, pairs, layers)
        rr.clear_cache()
        rows, notes = phase(
            "random range (random_range_rows)",
            lambda: rr.random_range_rows(
                layers,
                metrics=metrics,
                per_head=cfg.per_head,
                num_std=cfg.num_std,
                budget=None,
                max_entries=rr.PROBE_ENTRIES,
            ),
            table,
        )
        rr.clear_cache()
        caller = threading.get_ident()
        probe = phase("Probe(...) on the training thread", lambda: attn_probe.Probe(model, cfg), table)
        built = time.perf_counter()
        phase("hooks (attach_optimizer)", lambda: probe.attach_optimizer(opt), table)
        phase("first snapshot (snapshot(0))", lambda: probe.snapshot(0), table)
        task = getattr(probe, "random_range", None)
        ready = None
        if task is not None and hasattr(task, "wait"):
            task.wait()
            ready = (task.finished_at - built, task.thread_id != caller)
        probe.close()
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"{args.layers} layers of hidden 4096, 32 heads / 8 KV heads of 128, {args.dtype}; "
        f"load average {os.getloadavg()[0]:.1f} at the end"
    )
    print(
        f"# random range: {len(rows)} rows, {len({(lay.hidden_size, lay.head_dim) for lay in layers})} "
        f"distinct shape(s){'; ' + '; '.join(notes) if notes else ''}"
    )
    print("| phase | wall s | thread CPU s | process CPU s | RSS before MiB | peak over it MiB |")
    print("|---|---|---|---|---|---|")
    for name, wall, cpu, proc, before, peak in table:
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {proc:.2f} | {before:.0f} | +{peak:.0f} |")
    if ready is not None:
        print(
            f"# the probe's range: ready {ready[0]:.2f} s after Probe(...) returned, "
            f"computed on {'another thread' if ready[1] else 'the training thread'}"
        )
    else:
        print("# the probe's range: computed inside Probe(...) on the training thread")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
