"""The paper's own training trajectories, to put beside a run's.

Saponati et al., *The underlying structures of self-attention: symmetry, directionality, and
emergent dynamics in Transformer training* (ICML 2025, arXiv 2502.10927) trained BERT-style
encoders and decoders (4 layers, d=256; 12 layers, d=768) from scratch for 200,000 steps on
Wikipedia, RedPajama and Jigsaw, and scored a checkpoint every 1,000 steps. Its authors released
those scores in their repository (https://github.com/matteosaponati/attention-geometry,
``_results/custom-models/``). ``paper_trajectories.csv``, shipped with this package, holds values
derived from them (read 2026-11-27): per run and checkpoint, the median and the 25th/75th
percentiles across layers of the layer-level symmetry and directionality, in the paper's
conventions (symmetry ``2r - 1``; negative directionality = column dominance).

Tokenisation matters when comparing: the released code passed Wikipedia and RedPajama text
through ``" ".join(x)``, so those models saw single characters without word boundaries
(``tokens="chars"``); Jigsaw went through WordPiece (``tokens="wordpiece"``).

Only the standard library is imported here; :func:`paper_trajectory` imports pandas.
"""

from __future__ import annotations

import bisect
import csv
import difflib
import functools
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["PaperRun", "PaperPoint", "PAPER_METRICS", "paper_runs", "paper_run", "paper_point",
           "paper_final", "matching_paper_run", "paper_trajectory"]

#: the scores the paper's trajectories hold
PAPER_METRICS = ("symmetry", "directionality")
#: the table, next to this module
DATA_FILE = "paper_trajectories.csv"

_DATASETS = {"wikipedia": "Wikipedia", "red_pajama": "RedPajama", "jigsaw": "Jigsaw"}
#: the table's ``tokens`` column -> :attr:`PaperRun.tokens`
_TOKENS_IN_TABLE = {"characters (join bug)": "chars", "wordpiece": "wordpiece"}
_TOKENS_TEXT = {"chars": "character-level", "wordpiece": "word-level (WordPiece)"}
#: what :func:`matching_paper_run` accepts for ``tokens`` -> the paper's tokenisation it matches
_TOKENS_ALIASES = {
    "chars": "chars", "char": "chars", "characters": "chars", "character": "chars",
    "wordpiece": "wordpiece", "words": "wordpiece", "word": "wordpiece", "subword": "wordpiece",
    "bpe": "wordpiece",
}
#: the dataset each tokenisation is matched with (RedPajama is character-level too: Wikipedia is the paper's first)
_DATASET_FOR_TOKENS = {"chars": "wikipedia", "wordpiece": "jigsaw"}


class PaperRun(NamedTuple):
    """One of the paper's from-scratch training runs."""

    name: str  #: ``f"{layers}-layer-{model}-{dataset}"``, e.g. ``"4-layer-encoder-wikipedia"``
    layers: int  #: 4 or 12
    model: str  #: ``"encoder"`` or ``"decoder"``
    dataset: str  #: ``"wikipedia"``, ``"red_pajama"`` or ``"jigsaw"``
    tokens: str  #: ``"chars"`` (the released code's join bug) or ``"wordpiece"``

    def describe(self) -> str:
        """Words for legends and verdicts: ``"the paper's 4-layer encoder, Wikipedia, character-level"``."""
        return f"the paper's {self.layers}-layer {self.model}, {_DATASETS[self.dataset]}, {_TOKENS_TEXT[self.tokens]}"


class PaperPoint(NamedTuple):
    """One checkpoint of a paper run: the median and interquartile range across its layers."""

    step: int
    median: float
    q25: float
    q75: float


class _Table(NamedTuple):
    runs: dict[str, PaperRun]
    #: (run name, metric) -> points in step order
    points: dict[tuple[str, str], tuple[PaperPoint, ...]]


@functools.lru_cache(maxsize=1)
def _table() -> _Table:
    """The package's CSV, read once (lines starting with ``#`` are its attribution)."""
    from importlib.resources import files

    text = files(__package__).joinpath(DATA_FILE).read_text(encoding="utf-8")
    reader = csv.DictReader(line for line in text.splitlines() if line and not line.startswith("#"))
    runs: dict[str, PaperRun] = {}
    points: dict[tuple[str, str], list[PaperPoint]] = {}
    for row in reader:
        layers = int(row["layers"])
        run = PaperRun(f"{layers}-layer-{row['model']}-{row['dataset']}", layers, row["model"],
                       row["dataset"], _TOKENS_IN_TABLE[row["tokens"]])
        runs.setdefault(run.name, run)
        step = int(row["step"])
        for metric in PAPER_METRICS:
            points.setdefault((run.name, metric), []).append(PaperPoint(
                step, float(row[f"{metric}_median"]), float(row[f"{metric}_q25"]), float(row[f"{metric}_q75"])))
    ordered = dict(sorted(runs.items(), key=lambda kv: (kv[1].layers, kv[1].model != "encoder",
                                                        list(_DATASETS).index(kv[1].dataset))))
    return _Table(ordered, {k: tuple(sorted(v)) for k, v in points.items()})


def paper_runs() -> list[PaperRun]:
    """The paper's twelve runs: 4 then 12 layers, encoder before decoder, Wikipedia, RedPajama, Jigsaw."""
    return list(_table().runs.values())


def paper_run(name: str | PaperRun) -> PaperRun:
    """The run called ``name`` (a :class:`PaperRun` is returned as it is in the table).

    An unknown name is a one-line ``ValueError`` listing the names.
    """
    runs = _table().runs
    key = name.name if isinstance(name, PaperRun) else name
    if isinstance(key, str) and key in runs:
        return runs[key]
    close = difflib.get_close_matches(str(key), list(runs), n=1) if isinstance(key, str) else []
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"unknown paper run {key!r}{hint}; the paper's runs: {', '.join(runs)}")


def _points(name: str | PaperRun, metric: str) -> tuple[PaperPoint, ...]:
    run = paper_run(name)
    if metric not in PAPER_METRICS:
        raise ValueError(f"the paper's trajectories have no metric {metric!r}; they hold {', '.join(PAPER_METRICS)}")
    return _table().points[(run.name, metric)]


def paper_point(name: str | PaperRun, metric: str, step: int) -> PaperPoint:
    """The paper's checkpoint nearest to ``step`` (a tie goes to the lower one).

    Checkpoints are every 1,000 steps from 1,000 to 200,000, so step 1,500 reads 1,000, step 1,501
    reads 2,000, step 0 reads 1,000 and step 300,000 reads 200,000 (:attr:`PaperPoint.step` says
    which). ``metric`` is ``"symmetry"`` or ``"directionality"``.
    """
    points = _points(name, metric)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    steps = [p.step for p in points]
    i = bisect.bisect_left(steps, step)
    if i == 0:
        return points[0]
    if i == len(steps):
        return points[-1]
    below, above = points[i - 1], points[i]
    return below if step - below.step <= above.step - step else above


def paper_final(name: str | PaperRun, metric: str) -> PaperPoint:
    """The run's last checkpoint (step 200,000)."""
    return _points(name, metric)[-1]


def matching_paper_run(model: str, layers: int, tokens: str) -> PaperRun:
    """The paper run to compare a model with: same kind, nearest depth, same tokenisation.

    ``model`` is ``"encoder"`` or ``"decoder"``; ``layers`` picks the nearer of the paper's 4 and
    12 layers (a tie goes to 4); ``tokens`` ``"chars"`` matches the character-level Wikipedia run,
    ``"wordpiece"`` (or another word/sub-word tokenisation: ``"words"``, ``"bpe"``) the Jigsaw run.
    """
    if model not in ("encoder", "decoder"):
        raise ValueError(f"model must be 'encoder' or 'decoder', got {model!r}")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be a positive int, got {layers!r}")
    kind = _TOKENS_ALIASES.get(tokens.lower()) if isinstance(tokens, str) else None
    if kind is None:
        raise ValueError(f"tokens must be 'chars' (character-level) or 'wordpiece' (any word or sub-word "
                         f"tokenisation: 'words', 'bpe'), got {tokens!r}")
    sizes = sorted({r.layers for r in paper_runs()})
    size = min(sizes, key=lambda s: (abs(s - layers), s))
    return paper_run(f"{size}-layer-{model}-{_DATASET_FOR_TOKENS[kind]}")


def paper_trajectory(name: str | PaperRun) -> pd.DataFrame:
    """One run's whole trajectory as a table for plots: columns ``step, metric, median, q25, q75``
    (symmetry's 200 checkpoints, then directionality's). Needs pandas (``attn-probe[pandas]``)."""
    run = paper_run(name)
    try:
        import pandas as pd
    except ImportError as exc:
        raise ImportError("pandas is needed for this: pip install 'attn-probe[pandas]'") from exc
    rows = [(p.step, metric, p.median, p.q25, p.q75) for metric in PAPER_METRICS for p in _points(run, metric)]
    return pd.DataFrame(rows, columns=["step", "metric", "median", "q25", "q75"])
