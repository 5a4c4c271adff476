"""Benchmark: factored scores vs. the straightforward explicit ``d x d`` computation (CPU).

Run from the repository root::

    python benchmarks/bench_scores.py                 # all shapes, 5 repeats, median
    python benchmarks/bench_scores.py --repeats 3 --shapes bert-base

Explicit reference, as one would write it by hand:

* layer: ``M = W_q^T repeat_kv(W_k)`` (every query head paired with its KV head, summed by
  the matrix product), then ``<M, M^T>``, ``||M||^2`` and the row/column norms of ``M``;
* per head: ``M_h = Q_h^T K_{g(h)}`` formed one head at a time, same reductions.

``--metrics`` times the scoring core (:func:`attn_probe.core.score_factors`) instead: the
paper's two scores against the default metrics (the two scores plus spectral_norm,
frobenius_norm, stable_rank, qk_bound), and the norms' largest relative difference from
``torch.linalg.svdvals`` of the explicit float64 matrix.

Factored: :func:`attn_probe.core.factored_scores`. Both run in float32 on the same random
weights (std 0.02), alternately (so that both see the same machine load); the script prints
the median wall time of each, the speed-up and the largest absolute difference between
their scores. Timings depend on the machine and its
load; record them together with ``--threads`` and what else was running.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from attn_probe.core import factored_scores
from attn_probe.definitions import (
    directionality_from_norms,
    pair_kv_heads,
    symmetry_from_inner_products,
)

SHAPES = {
    # name: (d, num_heads, num_kv_heads, head_dim)
    "llama3-8b": (4096, 32, 8, 128),
    "bert-base": (768, 12, 12, 64),
}


def explicit_scores(m: torch.Tensor, num_std: float = 2.0) -> tuple[float, float]:
    """Scores of an explicit matrix, the straightforward way."""
    sym = symmetry_from_inner_products(float((m * m.T).sum()), float((m * m).sum()))
    dirn = directionality_from_norms(m.norm(dim=1), m.norm(dim=0), num_std)
    return sym, dirn


def explicit_layer(q: torch.Tensor, k: torch.Tensor) -> list[float]:
    num_heads, head_dim, d = q.shape
    k_rep = k[pair_kv_heads(num_heads, k.shape[0])]  # repeat_kv
    m = q.reshape(-1, d).T @ k_rep.reshape(-1, d)
    return list(explicit_scores(m))


def explicit_per_head(q: torch.Tensor, k: torch.Tensor) -> list[float]:
    pairs = pair_kv_heads(q.shape[0], k.shape[0]).tolist()
    out: list[float] = []
    for h, g in enumerate(pairs):
        out += explicit_scores(q[h].T @ k[g])
    return out


def factored_layer(q: torch.Tensor, k: torch.Tensor) -> list[float]:
    s = factored_scores(q, k)
    return [s.symmetry, s.directionality]


def factored_per_head(q: torch.Tensor, k: torch.Tensor) -> list[float]:
    s = factored_scores(q, k, per_head=True, layer=False)
    return [x for pair in zip(s.head_symmetry, s.head_directionality, strict=True) for x in pair]


def interleaved_medians(
    ref: Callable[[], list[float]], fast: Callable[[], list[float]], repeats: int
) -> tuple[float, float, list[float], list[float]]:
    """Median wall times of ``ref`` and ``fast``, run alternately so both see the same machine load."""
    ref_out, fast_out = ref(), fast()  # warm-up (allocator, MKL thread pool)
    t_ref, t_fast = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ref_out = ref()
        t1 = time.perf_counter()
        fast_out = fast()
        t2 = time.perf_counter()
        t_ref.append(t1 - t0)
        t_fast.append(t2 - t1)
    return statistics.median(t_ref), statistics.median(t_fast), ref_out, fast_out


def _core_table(q: torch.Tensor, k: torch.Tensor, metrics: tuple[str, ...], per_head: bool) -> list:
    from attn_probe.core import score_factors

    return score_factors(q, k, metrics, per_head=per_head).tolist()


def core_metrics(args: argparse.Namespace) -> None:
    """The core's cost with the two scores and with every default metric, per shape and mode."""
    from attn_probe.core import DEFAULT_METRICS

    two = ("symmetry", "directionality")
    print(f"{'shape':<10} {'mode':<9} {'2 scores s':>11} {'6 metrics s':>12} {'ratio':>6} {'norm rel err':>13}")
    for name in args.shapes:
        d, num_heads, num_kv, head_dim = SHAPES[name]
        q = torch.randn(num_heads, head_dim, d) * 0.02
        k = torch.randn(num_kv, head_dim, d) * 0.02
        for mode in args.modes:
            per_head = mode == "per-head"
            t_two, t_all, _, table = interleaved_medians(
                partial(_core_table, q, k, two, per_head), partial(_core_table, q, k, DEFAULT_METRICS, per_head),
                args.repeats)
            group = num_heads // num_kv
            qd, kd = q.double(), k.double()
            m = sum(qd[h].T @ kd[h // group] for h in range(num_heads))
            sv = torch.linalg.svdvals(m)
            err = max(abs(table[2][0] / float(sv[0]) - 1), abs(table[3][0] / float(sv.norm()) - 1))
            row = {"shape": name, "mode": mode, "two_scores_s": t_two, "all_metrics_s": t_all,
                   "ratio": t_all / t_two, "layer_norm_rel_err": err}
            if args.json:
                print(json.dumps(row))
            else:
                print(f"{name:<10} {mode:<9} {t_two:>11.4f} {t_all:>12.4f} {t_all / t_two:>5.2f}x {err:>13.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--modes", nargs="+", choices=["layer", "per-head"], default=["layer", "per-head"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--json", action="store_true", help="print one JSON object per row")
    parser.add_argument("--metrics", action="store_true",
                        help="time the core with 2 scores vs the 6 default metrics instead")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs "
        f"({platform.machine()}), float32, median of {args.repeats}, load average {load:.1f} at start"
    )
    if args.metrics:
        core_metrics(args)
        return
    if not args.json:
        print(f"{'shape':<10} {'mode':<9} {'explicit s':>11} {'factored s':>11} {'speed-up':>9} {'max |diff|':>11}")
    for name in args.shapes:
        d, num_heads, num_kv, head_dim = SHAPES[name]
        q = torch.randn(num_heads, head_dim, d) * 0.02
        k = torch.randn(num_kv, head_dim, d) * 0.02
        for mode in args.modes:
            ref_fn, fast_fn = (explicit_layer, factored_layer) if mode == "layer" else (explicit_per_head, factored_per_head)
            t_ref, t_fast, ref, fast = interleaved_medians(partial(ref_fn, q, k), partial(fast_fn, q, k), args.repeats)
            diff = max(abs(a - b) for a, b in zip(ref, fast, strict=True))
            row = {"shape": name, "mode": mode, "explicit_s": t_ref, "factored_s": t_fast,
                   "speedup": t_ref / t_fast, "max_abs_diff": diff}
            if args.json:
                print(json.dumps(row))
            else:
                print(f"{name:<10} {mode:<9} {t_ref:>11.4f} {t_fast:>11.4f} {t_ref / t_fast:>8.1f}x {diff:>11.2e}")


if __name__ == "__main__":
    main()
