"""Cost of a due step with attention statistics on a model that calls ``flex_attention`` (CPU).

Two nanoGPT-shaped blocks (width 256, 8 heads, batch 2) calling ``flex_attention`` with a causal
``BlockMask`` (eager flex, i.e. flex's own compile with the eager backend); the attention is frozen
(CPU flex has no backward in torch 2.13) and the head trains, so the forward runs with gradients
on. Prints, per length, the best of three forward+backward times with and without the capture armed.

    PYTHONPATH=. python benchmarks/bench_flex_stats.py 512 2048
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from attn_probe.activations.statistics import AttentionCapture
from attn_probe.extraction import find_attention

D, H, B = 256, 8, 2


class FlexBlock(nn.Module):
    def __init__(self, mask) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.n_head, self.n_embd, self.mask = H, D, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in self.c_attn(x).split(D, dim=2))
        y = flex_attention(q, k, v, block_mask=self.mask)
        return x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))


def bench(length: int) -> tuple[float, float]:
    mask = create_block_mask(lambda _b, _h, q, k: q >= k, None, None, length, length, device="cpu")
    net = nn.Sequential(FlexBlock(mask), FlexBlock(mask), nn.Linear(D, 1)).requires_grad_(False)
    net[2].requires_grad_(True)
    x = torch.randn(B, length, D)
    capture = AttentionCapture(net, find_attention(net))

    def step(armed: bool) -> float:
        if armed:
            capture.arm()
        start = time.perf_counter()
        net(x).sum().backward()
        elapsed = time.perf_counter() - start
        if armed:
            capture.disarm()
        return elapsed

    for armed in (False, True, False, True):  # compiles both variants
        step(armed)
    plain = min(step(False) for _ in range(3))
    due = min(step(True) for _ in range(3))
    capture.close()
    return plain, due


if __name__ == "__main__":
    torch.set_num_threads(2)
    for arg in sys.argv[1:] or ["512", "2048"]:
        plain, due = bench(int(arg))
        print(f"length {arg}: step {plain * 1e3:.0f} ms, due step {due * 1e3:.0f} ms, x{due / plain:.2f}")
