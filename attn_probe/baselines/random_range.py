"""The random-matrix range: what symmetry and directionality a random ``W_qk`` of a layer's shape scores.

A score only means something against what chance gives. For a layer of shape
(``d_model``, ``head_dim``, ``num_heads``, ``num_kv_heads``) this module draws iid Gaussian factors
``Q (H, d_head, d)`` and ``K (H_kv, d_head, d)`` (query head ``h`` reads key head
``h // (H / H_kv)``, as everywhere in :mod:`attn_probe.core`), scores them with the project's own
core (:func:`attn_probe.core.score_factor_stack`: the factored path, no ``d x d`` matrix when the
factors are thin) and returns the mean and the standard deviation over the draws, of the layer
matrix ``M = sum_h Q_h^T K_g(h)`` and of one head's ``M_h`` (pooled over heads and draws: under
iid initialisation every head has the same distribution).

* **Scale.** Both scores are invariant to ``M -> cM``, and ``(aQ)^T (bK) = ab Q^T K``: the
  standard deviation of an iid initialisation does not matter, only its shape (Gaussian here;
  a uniform initialisation gives nearly the same numbers, docs/scores.md).
* **Symmetry.** For ``M = A^T B`` with ``A, B`` iid ``(k, d)``: ``E tr(MM) = k d s^4`` and
  ``E ||M||_F^2 = k d^2 s^4``, so ``E[symmetry] ~= 1/d``, whatever ``k``, the heads or the
  grouping; its standard deviation is about ``sqrt(2)/d`` (measured, docs/scores.md).
* **Directionality.** ``M^T = B^T A`` is as likely as ``M`` (the factors are exchangeable up to a
  scale, also when grouped query heads are summed) and ``d(M^T) = -d(M)``, so its expectation is 0
  exactly; its spread has no simple law and is measured per shape (each draw counted with its
  transpose, :class:`RandomRange`).

Results are cached per process and shape (:func:`random_range`). A call is bounded in the numbers
it draws (``max_entries``: fewer draws, a count that follows from the shape alone), in time
(``budget`` seconds: fewer draws, a count that depends on the machine's speed and load), both
said in :attr:`RandomRange.note`, and in memory (a shape whose one draw holds more than
:data:`MAX_DRAW_ENTRIES` numbers is skipped, with the reason). Only torch and the core are
imported; the generator is a local, seeded ``torch.Generator`` (the global RNG is never
touched), so with ``budget=None`` every rank and every run computes the same numbers: the live
probe computes it that way on every rank (:data:`PROBE_ENTRIES`), so that no rank waits for another.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..core import score_factor_stack

__all__ = ["CHUNK_ENTRIES", "DEFAULT_BUDGET", "DEFAULT_DRAWS", "HEAD_SAMPLES", "MAX_DRAW_ENTRIES", "PROBE_ENTRIES",
           "LayerShape", "RandomRange", "draw_factors", "random_range", "random_range_rows", "clear_cache"]

#: draws per shape (each gives one layer score and ``H`` head scores)
DEFAULT_DRAWS = 32
#: seconds a :func:`random_range` call gives its draws by default (they stop when the next scored
#: call would pass it; at least one). Not the live probe's bound: see :data:`PROBE_ENTRIES`
DEFAULT_BUDGET = 5.0
#: numbers the live probe draws for the range of all its layer shapes together (``max_entries``
#: of :func:`random_range_rows`, no time budget): the number of draws follows from the shapes
#: alone, so every rank computes the same range in about the same time and none waits for another
#: (docs/scores.md: d = 768 gets all 32 draws, d = 2048 with 8 KV heads 9, Llama-3-8B's layers 2)
PROBE_ENTRIES = 3 << 24
#: numbers (query + key factors) of one draw above which a shape is skipped: 2^26 float32 numbers
#: are 256 MiB, and one such draw takes several seconds to score on a CPU
MAX_DRAW_ENTRIES = 1 << 26
#: numbers of factors scored in one stacked call (small shapes: many draws in one call; the time
#: budget is checked between calls)
CHUNK_ENTRIES = 1 << 22
#: head scores pooled per shape: the first ``ceil(HEAD_SAMPLES / H)`` draws are scored per head
HEAD_SAMPLES = 256
_SCORED = ("symmetry", "directionality")


@dataclass(frozen=True)
class LayerShape:
    """The shape of one attention layer's W_qk factors: ``W_q (H, d_head, d)``, ``W_k (H_kv, d_head, d)``."""

    d_model: int
    head_dim: int
    num_heads: int
    num_kv_heads: int

    def __post_init__(self) -> None:
        for name in ("d_model", "head_dim", "num_heads", "num_kv_heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads cannot share {self.num_kv_heads} key heads")

    @property
    def draw_entries(self) -> int:
        """Numbers in one draw's factors."""
        return (self.num_heads + self.num_kv_heads) * self.head_dim * self.d_model

    def describe(self) -> str:
        kv = f", {self.num_kv_heads} KV heads" if self.num_kv_heads != self.num_heads else ""
        return f"d={self.d_model}, {self.num_heads} heads of {self.head_dim}{kv}"


@dataclass(frozen=True)
class RandomRange:
    """Mean and standard deviation (``ddof=1``, of ONE random matrix's score) over the draws.

    Directionality is taken over the draws and their transposes (the same distribution under iid
    initialisation, and ``d(M^T) = -d(M)``): its mean is 0 exactly, as it is in expectation.

    Layer matrix: ``symmetry``, ``symmetry_sd``, ``directionality``, ``directionality_sd``
    (from ``draws`` values). One head's ``M_h``: the ``head_*`` fields, pooled over the heads
    of the first ``ceil(HEAD_SAMPLES / num_heads)`` draws (the later ones score the layer matrix
    alone), NaN when ``per_head`` was off. ``draws == 0``:
    skipped, every value NaN, ``note`` says why; fewer draws than asked: ``note`` says so. A
    standard deviation from one value is NaN. ``layer_samples`` ``(draws, 2)`` and
    ``head_samples`` ``(head draws, H, 2)`` hold the draws' (symmetry, directionality).
    """

    shape: LayerShape
    draws: int
    seed: int
    num_std: float
    symmetry: float
    symmetry_sd: float
    directionality: float
    directionality_sd: float
    head_symmetry: float
    head_symmetry_sd: float
    head_directionality: float
    head_directionality_sd: float
    seconds: float
    note: str | None = None
    layer_samples: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)), repr=False, compare=False)
    head_samples: np.ndarray | None = field(default=None, repr=False, compare=False)

    def values(self, head: bool = False) -> dict[str, float]:
        """``{metric: value}`` with the trajectory's names (``random_symmetry``, ``..._sd``, ...)."""
        p = "head_" if head else ""
        return {f"random_{m}{s}": float(getattr(self, f"{p}{m}{s}")) for m in _SCORED for s in ("", "_sd")}

    def sigmas(self, value: float, metric: str = "symmetry", head: bool = False) -> float:
        """How many standard deviations ``value`` lies above the mean (below: negative)."""
        p = "head_" if head else ""
        return (value - getattr(self, f"{p}{metric}")) / getattr(self, f"{p}{metric}_sd")


def draw_factors(shape: LayerShape, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw: float32 ``Q (H, d_head, d)`` then ``K (H_kv, d_head, d)``, iid N(0, 1), from ``generator``.

    :func:`random_range` draws ``draws`` of these in order from ``torch.Generator().manual_seed(seed)``.
    """
    q = torch.randn(shape.num_heads, shape.head_dim, shape.d_model, generator=generator)
    k = torch.randn(shape.num_kv_heads, shape.head_dim, shape.d_model, generator=generator)
    return q, k


def _mean_sd(x: np.ndarray) -> tuple[float, float]:
    x = np.asarray(x, dtype=np.float64).ravel()
    if x.size == 0:
        return math.nan, math.nan
    return float(x.mean()), float(x.std(ddof=1)) if x.size > 1 else math.nan


def _with_transposes(directionality: np.ndarray) -> tuple[float, float]:
    """Mean and sd of the draws' directionalities and their transposes' (``d(M^T) = -d(M)``; under
    iid initialisation ``M^T`` is as likely as ``M``): the mean is exactly 0, the sd (``ddof=1``
    over the ``2n`` values) that of one matrix around it."""
    x = np.asarray(directionality, dtype=np.float64).ravel()
    if x.size == 0:
        return math.nan, math.nan
    return 0.0, float(math.sqrt(2.0 * float(np.square(x).sum()) / (2 * x.size - 1)))


_CACHE: dict[tuple, RandomRange] = {}
_LOCK = threading.Lock()


def clear_cache() -> None:
    """Forget the ranges computed in this process."""
    with _LOCK:
        _CACHE.clear()


def random_range(shape: LayerShape, *, draws: int = DEFAULT_DRAWS, seed: int = 0, num_std: float = 2.0,
                 per_head: bool = True, budget: float | None = DEFAULT_BUDGET,
                 dtype: torch.dtype = torch.float32, head_samples: int = HEAD_SAMPLES,
                 cache: bool = True, max_entries: int | None = None) -> RandomRange:
    """The random range of ``shape`` (see the module docstring), cached per process.

    ``budget``: seconds for the draws (``None``: no limit); the draws stop when the next chunk
    would pass it, so a large shape gets fewer draws (at least one, two when the first fits in
    half the budget), stated in ``note``. ``max_entries``: numbers drawn at most, all draws'
    factors together (``None``: no limit): ``draws`` becomes ``max(1, max_entries //
    shape.draw_entries)`` when that is fewer, a count that depends on the shape alone (the same on
    every rank and machine), stated in ``note``. A shape whose one draw exceeds
    :data:`MAX_DRAW_ENTRIES` numbers is skipped (``draws == 0``). ``dtype``: the core's
    computation dtype (the probe's is float32). ``head_samples``: heads pooled for the head range
    (the first draws are scored per head until that many). Raises ``ValueError`` for a bad shape,
    ``draws < 1`` or ``max_entries < 1``.
    """
    if not isinstance(shape, LayerShape):
        raise TypeError(f"shape must be a LayerShape, got {type(shape).__name__}")
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ValueError(f"draws must be an int >= 1, got {draws!r}")
    if budget is not None and not (isinstance(budget, (int, float)) and budget > 0):
        raise ValueError(f"budget must be a number of seconds > 0 or None, got {budget!r}")
    if max_entries is not None and (isinstance(max_entries, bool) or not isinstance(max_entries, int)
                                    or max_entries < 1):
        raise ValueError(f"max_entries must be an int >= 1 or None, got {max_entries!r}")
    key = (shape, draws, int(seed), float(num_std), bool(per_head), dtype, int(head_samples), max_entries)
    if cache:
        with _LOCK:
            hit = _CACHE.get(key)
        if hit is not None:
            return hit
    drawn = draws if max_entries is None else min(draws, max(1, max_entries // shape.draw_entries))
    result = _compute(shape, drawn, int(seed), float(num_std), per_head, budget, dtype, int(head_samples))
    if drawn < draws and result.draws == drawn:
        result = dataclasses.replace(result, note=f"{drawn} of {draws} random draws of {shape.describe()} "
                                                  f"within {max_entries:,} drawn numbers")
    if cache:
        with _LOCK:
            _CACHE.setdefault(key, result)
    return result


def _compute(shape: LayerShape, draws: int, seed: int, num_std: float, per_head: bool,
             budget: float | None, dtype: torch.dtype, head_samples: int) -> RandomRange:
    start = time.perf_counter()
    nan = math.nan
    if shape.draw_entries > MAX_DRAW_ENTRIES:
        note = (f"skipped: one random draw of {shape.describe()} holds {shape.draw_entries:,} numbers "
                f"(more than {MAX_DRAW_ENTRIES:,})")
        return RandomRange(shape, 0, seed, num_std, *([nan] * 8), seconds=0.0, note=note)
    generator = torch.Generator().manual_seed(seed)
    per_call = max(1, CHUNK_ENTRIES // shape.draw_entries)
    # per-head scores only until HEAD_SAMPLES heads are pooled: the later draws score the layer
    # matrix alone (cheaper), so a large layer gets more draws within the budget
    head_draws = max(1, -(-head_samples // shape.num_heads)) if per_head else 0
    layer: list[np.ndarray] = []
    heads: list[np.ndarray] = []
    done = 0
    per_draw = 0.0
    while done < draws:
        scoring_heads = done < head_draws
        n = min(per_call, draws - done, head_draws - done if scoring_heads else draws)
        t0 = time.perf_counter()
        pairs = [draw_factors(shape, generator) for _ in range(n)]
        q = torch.stack([p[0] for p in pairs])
        k = torch.stack([p[1] for p in pairs])
        del pairs
        table = score_factor_stack(q, k, _SCORED, per_head=scoring_heads, num_std=num_std, dtype=dtype)
        table = table.cpu().numpy()  # (n, 2, 1 + H * scoring_heads)
        layer.append(table[:, :, 0])
        if scoring_heads:
            heads.append(np.moveaxis(table[:, :, 1:], 1, 2))  # (n, H, 2)
        done += n
        per_draw = (time.perf_counter() - t0) / n  # the last call's: heads cost more than the layer
        if budget is not None and done < draws:
            spent = time.perf_counter() - start
            next_n = min(per_call, draws - done)
            if spent + per_draw * next_n > budget:  # the next call would pass the budget
                break
    seconds = time.perf_counter() - start
    layer_samples = np.concatenate(layer)
    head_samples = np.concatenate(heads) if heads else None
    sym, sym_sd = _mean_sd(layer_samples[:, 0])
    dirn, dirn_sd = _with_transposes(layer_samples[:, 1])
    if head_samples is not None:
        hsym, hsym_sd = _mean_sd(head_samples[:, :, 0])
        hdir, hdir_sd = _with_transposes(head_samples[:, :, 1])
    else:
        hsym = hsym_sd = hdir = hdir_sd = nan
    note = None
    if done < draws:
        note = (f"{done} of {draws} random draws of {shape.describe()} within the {budget:g} s budget "
                f"({seconds:.1f} s)")
    return RandomRange(shape, done, seed, num_std, sym, sym_sd, dirn, dirn_sd, hsym, hsym_sd, hdir, hdir_sd,
                       seconds=seconds, note=note, layer_samples=layer_samples, head_samples=head_samples)


#: a trajectory row of the range: ``(group, layer, head, metric, value)``
RangeRow = tuple[str, int, "int | None", str, float]


def random_range_rows(layers: Sequence[Any], *, metrics: Sequence[str], per_head: bool, num_std: float = 2.0,
                      budget: float | None = DEFAULT_BUDGET, draws: int = DEFAULT_DRAWS,
                      seed: int = 0, max_entries: int | None = None,
                      only: Collection[tuple[str, int]] | None = None) -> tuple[list[RangeRow], list[str]]:
    """The range as trajectory rows for ``layers`` (objects with ``group``, ``layer``, ``hidden_size``,
    ``head_dim``, ``num_heads``, ``num_kv_heads``: :class:`attn_probe.extraction.AttentionLayer`).

    Per layer, ``random_symmetry`` and ``random_symmetry_sd`` when ``"symmetry"`` is in ``metrics``,
    ``random_directionality`` and ``..._sd`` when ``"directionality"`` is; ``head`` ``None`` for
    the layer matrix, and with ``per_head`` one row set per head ``h`` (the pooled head range: the
    same values for every head of a shape). Each distinct shape is computed once
    (:func:`random_range`), ``budget`` seconds and ``max_entries`` drawn numbers for all of them
    together: the first shape gets the whole of both (at least one draw), the next ones what is
    left, in the order of ``layers`` (with ``budget=None`` the draws depend on the shapes alone).
    Returns the rows and the notes of shapes that got fewer draws or were skipped (no rows).

    ``only``: the ``(group, layer)`` pairs to give rows for (``None``: every layer). Only their
    shapes are drawn; a shape before them that no pair of ``only`` has is accounted for without
    being drawn (the numbers it would draw are taken off ``max_entries``, which follows from the
    shapes alone), so with ``budget=None`` the rows are the very numbers the whole list gives, at
    the cost of ``only``'s shapes (a reader asking for 2 layers of a header naming 8,000 shapes
    draws 2). With a time budget, the shapes left out leave their time to the others.
    """
    wanted = [m for m in _SCORED if m in metrics]
    rows: list[RangeRow] = []
    notes: list[str] = []
    if not wanted:
        return rows, notes
    deadline = None if budget is None else time.perf_counter() + budget
    entries_left = max_entries
    ranges: dict[LayerShape, RandomRange | None] = {}

    def shape_of(lay: Any) -> LayerShape:
        return LayerShape(int(lay.hidden_size), int(lay.head_dim), int(lay.num_heads), int(lay.num_kv_heads))

    asked = None if only is None else {(str(g), int(la)) for g, la in only}
    needed = None if asked is None else {shape_of(lay) for lay in layers if (str(lay.group), int(lay.layer)) in asked}
    for lay in layers:
        shape = shape_of(lay)
        if shape not in ranges and needed is not None and shape not in needed:
            # accounted for as if drawn, not drawn: the later shapes get what it leaves (budget=None: exact)
            if entries_left is not None and not (ranges and entries_left < shape.draw_entries) \
                    and shape.draw_entries <= MAX_DRAW_ENTRIES:
                entries_left = max(0, entries_left - min(draws, max(1, entries_left // shape.draw_entries))
                                   * shape.draw_entries)
            ranges[shape] = None
        if shape not in ranges:
            # the first shape gets the whole budget (at least one draw); the others what is left
            left = None if deadline is None else budget if not ranges else deadline - time.perf_counter()
            if left is not None and left <= 0:
                notes.append(f"skipped: no time left in the {budget:g} s budget for {shape.describe()}")
                ranges[shape] = None
                continue
            if ranges and entries_left is not None and entries_left < shape.draw_entries:
                notes.append(f"skipped: fewer than one draw of {shape.describe()} left in the "
                             f"{max_entries:,} drawn numbers")
                ranges[shape] = None
                continue
            found = random_range(shape, draws=draws, seed=seed, num_std=num_std, per_head=per_head, budget=left,
                                 max_entries=entries_left)
            if entries_left is not None:
                entries_left = max(0, entries_left - found.draws * shape.draw_entries)
            if found.note is not None:
                notes.append(found.note)
            ranges[shape] = found if found.draws > 0 else None
        found = ranges[shape]
        if found is None or (asked is not None and (str(lay.group), int(lay.layer)) not in asked):
            continue
        for head in [None, *(range(shape.num_heads) if per_head else ())]:
            values = found.values(head=head is not None)
            for metric in wanted:
                for suffix in ("", "_sd"):
                    name = f"random_{metric}{suffix}"
                    rows.append((str(lay.group), int(lay.layer), head, name, values[name]))
    return rows, notes


#: the shapes of the table in docs/scores.md: (d_model, head_dim, heads, KV heads)
TABLE_SHAPES = ((128, 32, 4, 4), (256, 64, 4, 4), (768, 64, 12, 12), (2048, 64, 32, 8), (4096, 128, 32, 8))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the range of some shapes as a markdown table (docs/scores.md): ``python -m
    attn_probe.baselines.random_range [--draws N] [d:head_dim:heads:kv_heads ...]``, no time limit."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m attn_probe.baselines.random_range")
    parser.add_argument("shapes", nargs="*", help="d_model:head_dim:heads:kv_heads (default: the docs' table)")
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes] or list(TABLE_SHAPES)
    print("| d | heads (KV) x head_dim | draws | layer symmetry | 1/d, sqrt(2)/d | layer directionality "
          "| head symmetry | head directionality | s per draw |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d, dh, h, kv in shapes:
        r = random_range(LayerShape(d, dh, h, kv), draws=args.draws, seed=args.seed, budget=None,
                         head_samples=args.draws * h, cache=False)  # every head of every draw
        print(f"| {d} | {h} ({kv}) x {dh} | {r.draws} | {r.symmetry:+.5f} ± {r.symmetry_sd:.5f} "
              f"| {1 / d:.5f}, {math.sqrt(2) / d:.5f} | {r.directionality:+.2f} ± {r.directionality_sd:.3f} "
              f"| {r.head_symmetry:+.5f} ± {r.head_symmetry_sd:.5f} "
              f"| {r.head_directionality:+.2f} ± {r.head_directionality_sd:.3f} | {r.seconds / r.draws:.3f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
