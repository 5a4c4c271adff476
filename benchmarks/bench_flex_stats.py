"""Cost of a due step with attention statistics on a model that calls ``flex_attention``.

Blocks shaped as nanoGPT's (``--dim``, ``--heads``, ``--layers``; batch ``--batch``) calling
``flex_attention`` with a causal ``BlockMask``. Prints, per length, the best of ``--repeats``
forward+backward times with and without the capture armed, and the peak device memory on CUDA.

- ``--flex eager`` (default): flex called eagerly (its own compile with the eager backend); the
  probe measures the eager call.
- ``--flex compiled``: ``flex_attention`` wrapped in ``torch.compile`` (inductor), as GPU users and
  torchtitan do; add ``--opt-in`` for ``attention_flex_compiled=True`` (the statistics traced into
  the graph). Without it the due step measures nothing there (and costs about a normal step).

On the CPU torch 2.13's flex has no backward, so the attention is frozen there and only a head
trains (the step is nearly a bare forward: a pessimistic ratio); on CUDA everything trains.

    PYTHONPATH=. python benchmarks/bench_flex_stats.py 512 2048
    PYTHONPATH=. python benchmarks/bench_flex_stats.py 2048 8192 --device cuda --dtype bfloat16 \\
        --dim 2048 --heads 32 --layers 2 --batch 1 --flex compiled --opt-in
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from attn_probe.activations.statistics import AttentionCapture
from attn_probe.extraction import find_attention


class FlexBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mask, attend) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.n_head, self.n_embd, self.mask, self.attend = heads, dim, mask, attend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.c_attn(x).split(c, dim=2))
        y = self.attend(q, k, v, block_mask=self.mask)
        return x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))


def bench(length: int, args: argparse.Namespace) -> tuple[float, float, float, float]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    mask = create_block_mask(lambda _b, _h, q, k: q >= k, None, None, length, length, device=args.device)
    attend = torch.compile(flex_attention) if args.flex == "compiled" else flex_attention
    net = nn.Sequential(*[FlexBlock(args.dim, args.heads, mask, attend) for _ in range(args.layers)],
                        nn.Linear(args.dim, 1)).to(device=device, dtype=dtype)
    if device.type == "cpu":  # no flex backward on the CPU: only the head trains
        net.requires_grad_(False)
        net[-1].requires_grad_(True)
    x = torch.randn(args.batch, length, args.dim, device=device, dtype=dtype)
    capture = AttentionCapture(net, find_attention(net), flex_compiled=args.opt_in)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(armed: bool) -> float:
        if armed:
            capture.arm()
        sync()
        start = time.perf_counter()
        net(x).float().sum().backward()
        sync()
        elapsed = time.perf_counter() - start
        if armed:
            capture.disarm()
            capture.collect()
        net.zero_grad(set_to_none=True)
        return elapsed

    for armed in (False, True, False, True):  # compiles every variant
        step(armed)
    plain = min(step(False) for _ in range(args.repeats))
    peak_plain = peak_due = float("nan")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        step(False)
        peak_plain = torch.cuda.max_memory_allocated() / 2 ** 20
    due = min(step(True) for _ in range(args.repeats))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        step(True)
        peak_due = torch.cuda.max_memory_allocated() / 2 ** 20
    capture.close()
    return plain, due, peak_plain, peak_due


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lengths", nargs="*", type=int, default=[512, 2048])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flex", choices=("eager", "compiled"), default="eager")
    parser.add_argument("--opt-in", action="store_true", help="attention_flex_compiled=True")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"flex {args.flex}{' (attention_flex_compiled)' if args.opt_in else ''}, {args.device} {args.dtype}, "
          f"dim {args.dim}, heads {args.heads}, layers {args.layers}, batch {args.batch}")
    for length in args.lengths:
        plain, due, mem_plain, mem_due = bench(length, args)
        memory = "" if mem_plain != mem_plain else f", peak {mem_plain:.0f} -> {mem_due:.0f} MiB"
        print(f"length {length}: step {plain * 1e3:.0f} ms, due step {due * 1e3:.0f} ms, x{due / plain:.2f}{memory}")


if __name__ == "__main__":
    main()
