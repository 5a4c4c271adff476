"""What the attention capture's hooks cost on a step that is not due (eager, CPU).

The capture keeps its hooks on the watched model from attach to close (issue 44: hooks registered
anew at each due step made ``torch.compile`` recompile at every one); unarmed, each returns at its
first check. This times training forwards of a model calling ``scaled_dot_product_attention``
itself (``--layers`` blocks of d 32, batch 2, length 16: a forward small enough for the hooks to
show) without a capture and with an unarmed one, interleaved, and prints the best CPU time per
forward of each and the difference per forward and per layer.

    python benchmarks/bench_unarmed_hooks.py --layers 12 --forwards 2000 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention (its names and its own sdpa call), d 32, 4 heads."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.n_head, self.n_embd = nn.Linear(d, 3 * d), nn.Linear(d, d), heads, d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.c_attn(x).split(self.n_embd, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(32), CausalSelfAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.ln(x))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--forwards", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    from attn_probe.activations.statistics import AttentionCapture
    from attn_probe.extraction import find_attention

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(*(Block() for _ in range(args.layers)))
    x = torch.randn(2, 16, 32)

    def per_forward() -> float:
        start = time.process_time()
        for _ in range(args.forwards):
            net(x)
        return (time.process_time() - start) / args.forwards

    per_forward()  # warm-up
    bare, hooked = [], []
    for _ in range(args.repeats):
        bare.append(per_forward())
        capture = AttentionCapture(net, find_attention(net))  # hooks registered, not armed
        hooked.append(per_forward())
        capture.close()
    b, h = min(bare), min(hooked)
    print(json.dumps({"layers": args.layers, "bare_us": round(b * 1e6, 1), "unarmed_us": round(h * 1e6, 1),
                      "extra_us_per_forward": round((h - b) * 1e6, 1),
                      "extra_us_per_layer": round((h - b) * 1e6 / args.layers, 2), "ratio": round(h / b, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
