"""Cost of one attn_probe snapshot on a sharded model (CPU, gloo), against a training step.

Launches itself under ``torchrun``; each rank builds the same BERT-shaped model, shards it
(``--setup``: ddp, fsdp1, fsdp2 or zero3), runs warm-up steps, then alternates timed
training steps (forward, backward, optimizer step) and timed snapshots
(:func:`attn_probe.distributed.gather_scores` on every rank, scores on rank 0). Rank 0
prints the median times, the snapshot/step ratio and the bytes one snapshot gathers::

    python benchmarks/bench_distributed.py --setup fsdp2 --nproc 2 --hidden 256 --layers 4

Bytes per snapshot (float32): FSDP2/TP/ZeRO-3 gather exactly ``W_q`` and ``W_k`` of each
layer, ``sum (H + H_kv) * head_dim * d * 4``; each rank receives the ``(n-1)/n`` part it
does not hold. FSDP1 all-gathers each owning unit's whole flat parameter (here one
``BertLayer``: about ``12 d^2 + 13 d`` elements plus LayerNorms). DDP/ZeRO-1/2 gather nothing.
Timings depend on the machine and its load; record them with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", choices=["ddp", "fsdp1", "fsdp2", "zero3"], default="fsdp2")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def launch(args: argparse.Namespace) -> int:
    repo = Path(__file__).resolve().parents[1]
    # options travel by environment: torchrun would try to parse ``--nproc`` itself
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "BENCH_DISTRIBUTED_ARGS": json.dumps(vars(args)),
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        __file__,
        "--worker",
    ]
    return subprocess.call(cmd, env=env)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import BertConfig, BertForMaskedLM

    from attn_probe import find_attention
    from attn_probe.distributed import gather_bytes, gather_scores, iter_layer_factors

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    if args.setup == "zero3":
        import importlib

        import deepspeed

        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no JIT build
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = BertConfig(
        vocab_size=1000,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.seq,
    )
    torch.manual_seed(0)
    model = BertForMaskedLM(cfg)
    engine = None
    if args.setup == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif args.setup == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.bert.modeling_bert import BertLayer

        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({BertLayer}), device_id=torch.device("cpu"))
    elif args.setup == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.bert.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
    if args.setup == "zero3":
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "steps_per_print": 10**9,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
        }
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        model = engine.module
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 1000, (args.batch, args.seq), generator=g)

    def step() -> None:
        if engine is not None:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()

    layers = find_attention(model)
    for _ in range(2):
        step()
        gather_scores(model, layers)
    step_times, snap_times, gather_times = [], [], []
    for _ in range(args.repeats):
        dist.barrier()
        t = time.perf_counter()
        step()
        dist.barrier()
        step_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        rows = gather_scores(model, layers)
        dist.barrier()
        snap_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in iter_layer_factors(model, layers):  # gathers only, no scoring
            pass
        dist.barrier()
        gather_times.append(time.perf_counter() - t)
    if rank == 0:
        step_s, snap_s = statistics.median(step_times), statistics.median(snap_times)
        print(
            json.dumps(
                {
                    "setup": args.setup,
                    "nproc": args.nproc,
                    "hidden": args.hidden,
                    "layers": args.layers,
                    "heads": args.heads,
                    "batch": args.batch,
                    "seq": args.seq,
                    "repeats": args.repeats,
                    "rows": len(rows or []),
                    "step_ms": round(1e3 * step_s, 2),
                    "snapshot_ms": round(1e3 * snap_s, 2),
                    "gather_only_ms": round(1e3 * statistics.median(gather_times), 2),
                    "snapshot_over_step": round(snap_s / step_s, 4),
                    "qk_bytes_per_snapshot": 0 if args.setup == "ddp" else gather_bytes(layers),
                    "qk_bytes_per_layer": gather_bytes(layers[:1]),
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(argparse.Namespace(**json.loads(os.environ["BENCH_DISTRIBUTED_ARGS"])))
        return 0
    return launch(args)


if __name__ == "__main__":
    raise SystemExit(main())
