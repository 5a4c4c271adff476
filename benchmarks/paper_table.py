"""The paper's from-scratch runs at a few steps, as a markdown table (docs/reproducing-the-paper.md).

Reads the median layer symmetry and directionality of every checkpoint of Saponati et al.'s
(ICML 2025) from-scratch runs -- the values published in the paper's released repository, as
shipped with attn_probe in ``attn_probe/baselines/paper_trajectories.csv`` -- and prints one row
per run (4- and 12-layer, encoder and decoder, Wikipedia, RedPajama and Jigsaw) with the medians
at the chosen steps. Wikipedia and RedPajama were character-level in those runs (the released
code's ``" ".join(text)``), Jigsaw word-level (WordPiece): the table shows what that does to the
decoder's symmetry.

    python benchmarks/paper_table.py                              # steps 5k, 12k, 50k, 200k
    python benchmarks/paper_table.py --steps 1000 8000 --iqr      # other steps, with [q25, q75]
    python benchmarks/paper_table.py --csv ../shared/paper_trajectories.csv

Only the standard library is used (``csv``), so it runs anywhere the repository is checked out.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

#: the package's copy of the paper's trajectories
DEFAULT_CSV = Path(__file__).resolve().parent.parent / "attn_probe" / "baselines" / "paper_trajectories.csv"
DEFAULT_STEPS = (5_000, 12_000, 50_000, 200_000)
METRICS = ("symmetry", "directionality")
#: row order: size, then model, then dataset (the character-level runs first)
_ORDER = {"4-layer": 0, "12-layer": 1, "encoder": 0, "decoder": 1, "wikipedia": 0, "red_pajama": 1, "jigsaw": 2}
_DATASET = {"wikipedia": "Wikipedia", "red_pajama": "RedPajama", "jigsaw": "Jigsaw"}


def read_rows(path: Path) -> list[dict[str, str]]:
    """The CSV's rows as dictionaries; lines starting with ``#`` (an attribution header) are skipped."""
    if not path.is_file():
        raise SystemExit(f"paper_table: no such file: {path} (give --csv PATH to the paper's trajectories)")
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(line for line in fh if not line.startswith("#")))


def tokens_label(tokens: str) -> str:
    """``characters`` for the character-level runs (the CSV says ``characters (join bug)`` or ``chars``),
    ``WordPiece`` for the word-level ones."""
    if tokens.startswith("char"):
        return "characters"
    return "WordPiece" if tokens.lower() == "wordpiece" else tokens


def table(rows: Iterable[dict[str, str]], steps: Sequence[int], iqr: bool = False) -> str:
    """The markdown table: one row per run, the median (and ``[q25, q75]``) of each metric at ``steps``."""
    runs: dict[tuple[str, str, str], dict[int, dict[str, str]]] = {}
    tokens: dict[tuple[str, str, str], str] = {}
    for r in rows:
        key = (r["size"], r["model"], r["dataset"])
        runs.setdefault(key, {})[int(r["step"])] = r
        tokens[key] = r["tokens"]
    if not runs:
        raise SystemExit("paper_table: the CSV has no rows")

    def cell(point: dict[str, str] | None, metric: str) -> str:
        if point is None:
            return "–"
        text = f"{float(point[f'{metric}_median']):+.2f}"
        if iqr:
            text += f" [{float(point[f'{metric}_q25']):+.2f}, {float(point[f'{metric}_q75']):+.2f}]"
        return text.replace("-", "−")

    header = ["run", "tokens"] + [f"{m} {s // 1000}k" for m in METRICS for s in steps]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in sorted(runs, key=lambda k: tuple(_ORDER.get(p, 9) for p in k)):
        size, model, dataset = key
        cells = [cell(runs[key].get(s), m) for m in METRICS for s in steps]
        name = f"{size} {model}, {_DATASET.get(dataset, dataset)}"
        lines.append("| " + " | ".join([name, tokens_label(tokens[key]), *cells]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="the trajectories (default: the package's copy)")
    p.add_argument("--steps", type=int, nargs="+", default=list(DEFAULT_STEPS),
                   help="checkpoint steps, multiples of 1,000 from 1,000 to 200,000 (default: 5k 12k 50k 200k)")
    p.add_argument("--iqr", action="store_true", help="add the interquartile range across layers")
    a = p.parse_args(argv)
    bad = [s for s in a.steps if s % 1000 or not 1000 <= s <= 200_000]
    if bad:
        p.error(f"steps must be multiples of 1,000 from 1,000 to 200,000, got {bad}")
    print(table(read_rows(a.csv), a.steps, a.iqr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
