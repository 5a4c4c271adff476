"""The paper's scores of pretrained models, to put beside a scored checkpoint.

Saponati et al., *The underlying structures of self-attention: symmetry, directionality, and
emergent dynamics in Transformer training* (ICML 2025, arXiv 2502.10927) scored pretrained models
from the Hugging Face hub and released the results as two text tables in their repository
(https://github.com/matteosaponati/attention-geometry, ``_results/table-symmetry-scores-language.txt``
and ``_results/table-directionality-scores-language.txt``). ``paper_pretrained_scores.csv``, shipped
with this package, holds their values (read 2026-11-28): per model, the median across layers of the
layer-level score and the interquartile range as offsets below and above the median, in the paper's
conventions (symmetry ``2r - 1``; negative directionality = column dominance).

The released tables have faults. The CSV keeps the 80 rows as released; this module says what
each fault is and treats it so:

* **One model under two names.** 13 pairs name one model twice with identical values
  (``bert-base`` and ``bert-base-uncased``, ``gpt-neo-125m`` and ``EleutherAI/gpt-neo-125m``,
  ``gpt2-xl`` and ``gpt2-xlarge``, ...). :func:`pretrained_rows` ``(distinct=True)`` keeps one row
  per distinct set of values (62 of the 80) and lists the other names in :attr:`PretrainedRow.aliases`;
  every name still finds its row (:func:`pretrained_row`).
* **Rows that disagree for one model.** Six models appear under two names with different values:
  ``llama3-8b`` (directionality -0.65) against ``meta-llama/Meta-Llama-3-8B`` (+0.01),
  ``llama3.2-1b`` (-0.59) against ``meta-llama/Llama-3.2-1B`` (-0.02), ``gpt-neo-2.7b`` against
  ``EleutherAI/gpt-neo-2.7B``, and ``llama2-7b``, ``llama3.1-8b``, ``llama3.2-3b`` against their
  ``meta-llama/`` names. So some rows were measured differently. Both rows are kept, and
  :attr:`PretrainedRow.faults` says which row each one disagrees with.
* **``llama3.2-8b``** is no released model (Llama 3.2 came in 1B and 3B text sizes); its row repeats
  ``llama3.2-1b``'s values exactly. It is kept in the table, flagged, has no layer count or width,
  and is never a nearest row (:func:`nearest_pretrained`).
* **Identical values under two different models.** ``roberta-large`` and ``roberta-large-mnli``,
  ``Llama-2-7b-hf`` and ``Llama-2-7b-chat-hf``, and BEiT's 224- and 384-pixel checkpoints have the same
  six values. Their rows share one distinct value set (each name an alias of the other) and are flagged.
* **Vision rows in a "language" table.** The seven ``microsoft/beit-*`` rows are BEiT image
  encoders: their kind is ``"vision"``, so a language model is never compared with them.
* **The directionality table's caption** calls it a symmetry score; the values are
  directionality (the column the CSV names ``directionality_*``).

Kinds: ``"encoder"``, ``"decoder"``, ``"encoder-decoder part"`` (none in the paper's table) and
``"vision"``. Layer count and width are given only where the name determines them.

Only the standard library is imported here.
"""

from __future__ import annotations

import csv
import difflib
import functools
import math
from typing import NamedTuple

__all__ = ["KINDS", "PretrainedRow", "pretrained_rows", "pretrained_row", "pretrained_family",
           "pretrained_families", "kind_and_family", "nearest_pretrained"]

#: the table, next to this module
DATA_FILE = "paper_pretrained_scores.csv"
#: what a row's :attr:`PretrainedRow.kind` can be
KINDS = ("encoder", "decoder", "encoder-decoder part", "vision")

#: name -> (kind, family), by the name's start (the first match wins)
_FAMILY_BY_PREFIX = (
    ("microsoft/beit-", "vision", "beit"),
    ("answerdotai/modernbert-", "encoder", "modernbert"),
    ("facebookai/roberta-", "encoder", "roberta"), ("facebookai/xlm-roberta-", "encoder", "roberta"),
    ("distilbert/distilroberta-", "encoder", "roberta"),
    ("albert-", "encoder", "albert"),
    ("distilbert/distilgpt2", "decoder", "gpt2"), ("gpt2", "decoder", "gpt2"),
    ("google/bert_", "encoder", "bert"), ("bert-", "encoder", "bert"), ("distilbert-", "encoder", "bert"),
    ("openai-gpt", "decoder", "openai-gpt"), ("gpt1", "decoder", "openai-gpt"),
    ("gpt-neo-", "decoder", "gpt-neo"), ("eleutherai/gpt-neo-", "decoder", "gpt-neo"),
    ("gpt-j-", "decoder", "gpt-j"), ("eleutherai/gpt-j-", "decoder", "gpt-j"),
    ("llama", "decoder", "llama"), ("meta-llama/", "decoder", "llama"),
    ("mistralai/", "decoder", "mistral"),
    ("facebook/mobilellm-", "decoder", "mobilellm"),
    ("microsoft/phi-", "decoder", "phi"),
)

#: (layers, width) of the names that determine them (model cards and configs of the releases)
_SHAPES = {
    "bert-tiny": (2, 128), "bert-mini": (4, 256), "bert-small": (4, 512), "bert-medium": (8, 512),
    "google/bert_uncased_L-2_H-128_A-2": (2, 128), "google/bert_uncased_L-4_H-256_A-4": (4, 256),
    "google/bert_uncased_L-4_H-512_A-8": (4, 512), "google/bert_uncased_L-8_H-512_A-8": (8, 512),
    "bert-base": (12, 768), "bert-base-uncased": (12, 768), "bert-large": (24, 1024),
    "bert-large-uncased": (24, 1024), "bert-distill": (6, 768), "distilbert-base-uncased": (6, 768),
    "albert-base-v2": (12, 768), "albert-large-v2": (24, 1024), "albert-xlarge-v2": (24, 2048),
    "albert-xxlarge-v2": (12, 4096),
    "FacebookAI/roberta-base": (12, 768), "FacebookAI/roberta-large": (24, 1024),
    "FacebookAI/roberta-large-mnli": (24, 1024), "FacebookAI/xlm-roberta-base": (12, 768),
    "FacebookAI/xlm-roberta-large": (24, 1024), "distilbert/distilroberta-base": (6, 768),
    "answerdotai/ModernBERT-base": (22, 768), "answerdotai/ModernBERT-large": (28, 1024),
    "openai-gpt": (12, 768), "gpt1": (12, 768),
    "gpt2": (12, 768), "gpt2-medium": (24, 1024), "gpt2-large": (36, 1280), "gpt2-xl": (48, 1600),
    "gpt2-xlarge": (48, 1600), "gpt2-distill": (6, 768), "distilbert/distilgpt2": (6, 768),
    "gpt-neo-125m": (12, 768), "EleutherAI/gpt-neo-125m": (12, 768), "gpt-neo-1.3b": (24, 2048),
    "EleutherAI/gpt-neo-1.3B": (24, 2048), "gpt-neo-2.7b": (32, 2560), "EleutherAI/gpt-neo-2.7B": (32, 2560),
    "gpt-j-6b": (28, 4096), "EleutherAI/gpt-j-6B": (28, 4096),
    "llama2-7b": (32, 4096), "meta-llama/Llama-2-7b-hf": (32, 4096), "meta-llama/Llama-2-7b-chat-hf": (32, 4096),
    "llama2-13b": (40, 5120), "meta-llama/Llama-2-13b-chat-hf": (40, 5120), "meta-llama/Llama-2-70b-hf": (80, 8192),
    "llama3-8b": (32, 4096), "meta-llama/Meta-Llama-3-8B": (32, 4096), "meta-llama/Meta-Llama-3-70B": (80, 8192),
    "llama3.1-8b": (32, 4096), "meta-llama/Llama-3.1-8B": (32, 4096), "meta-llama/Llama-3.1-70B": (80, 8192),
    "meta-llama/Llama-3.1-405B": (126, 16384),
    "llama3.2-1b": (16, 2048), "meta-llama/Llama-3.2-1B": (16, 2048),
    "llama3.2-3b": (28, 3072), "meta-llama/Llama-3.2-3B": (28, 3072),
    "mistralai/Mistral-7B-v0.1": (32, 4096), "mistralai/Mixtral-8x22B-v0.1": (56, 6144),
    "microsoft/phi-1": (24, 2048), "microsoft/phi-1_5": (24, 2048), "microsoft/phi-2": (32, 2560),
    "microsoft/Phi-3-mini-4k-instruct": (32, 3072), "microsoft/Phi-3-mini-128k-instruct": (32, 3072),
    "microsoft/beit-base-patch16-224-pt22k": (12, 768), "microsoft/beit-base-patch16-224": (12, 768),
    "microsoft/beit-base-patch16-384": (12, 768), "microsoft/beit-large-patch16-224-pt22k": (24, 1024),
    "microsoft/beit-large-patch16-224": (24, 1024), "microsoft/beit-large-patch16-384": (24, 1024),
    "microsoft/beit-large-patch16-512": (24, 1024),
}

#: pairs of names of ONE model (short name, hub name); their values agree unless flagged as disagreeing
_SAME_MODEL = (
    ("bert-tiny", "google/bert_uncased_L-2_H-128_A-2"), ("bert-mini", "google/bert_uncased_L-4_H-256_A-4"),
    ("bert-small", "google/bert_uncased_L-4_H-512_A-8"), ("bert-medium", "google/bert_uncased_L-8_H-512_A-8"),
    ("bert-base", "bert-base-uncased"), ("bert-large", "bert-large-uncased"),
    ("bert-distill", "distilbert-base-uncased"), ("openai-gpt", "gpt1"), ("gpt2-xl", "gpt2-xlarge"),
    ("gpt2-distill", "distilbert/distilgpt2"), ("gpt-neo-125m", "EleutherAI/gpt-neo-125m"),
    ("gpt-neo-1.3b", "EleutherAI/gpt-neo-1.3B"), ("gpt-neo-2.7b", "EleutherAI/gpt-neo-2.7B"),
    ("gpt-j-6b", "EleutherAI/gpt-j-6B"), ("llama2-7b", "meta-llama/Llama-2-7b-hf"),
    ("llama3-8b", "meta-llama/Meta-Llama-3-8B"), ("llama3.1-8b", "meta-llama/Llama-3.1-8B"),
    ("llama3.2-1b", "meta-llama/Llama-3.2-1B"), ("llama3.2-3b", "meta-llama/Llama-3.2-3B"),
)

#: names of no released model
_NOT_RELEASED = {"llama3.2-8b": "not a released model (Llama 3.2 has 1B and 3B text models); "
                                "its values repeat llama3.2-1b's"}

#: Hugging Face ``model_type`` -> (kind, family) of the paper's table
_MODEL_TYPES = {
    "bert": ("encoder", "bert"), "distilbert": ("encoder", "bert"), "roberta": ("encoder", "roberta"),
    "xlm-roberta": ("encoder", "roberta"), "roberta-prelayernorm": ("encoder", "roberta"),
    "albert": ("encoder", "albert"),
    "modernbert": ("encoder", "modernbert"), "gpt2": ("decoder", "gpt2"),
    "openai-gpt": ("decoder", "openai-gpt"), "gpt_neo": ("decoder", "gpt-neo"), "gptj": ("decoder", "gpt-j"),
    "llama": ("decoder", "llama"), "mistral": ("decoder", "mistral"), "mixtral": ("decoder", "mistral"),
    "phi": ("decoder", "phi"), "phi3": ("decoder", "phi"), "beit": ("vision", "beit"),
}

_SCORES = ("symmetry", "directionality")


class PretrainedRow(NamedTuple):
    """One row of the paper's pretrained table: median and IQR offsets of each score."""

    name: str  #: as the paper's table spells it
    kind: str  #: one of :data:`KINDS`
    family: str  #: ``"bert"``, ``"gpt2"``, ``"llama"``, ... (:func:`pretrained_families`)
    layers: int | None  #: where the name determines it
    width: int | None  #: ``d_model``, where the name determines it
    symmetry: float  #: median across layers
    symmetry_below: float  #: the 25th percentile is ``symmetry - symmetry_below``
    symmetry_above: float  #: the 75th percentile is ``symmetry + symmetry_above``
    directionality: float
    directionality_below: float
    directionality_above: float
    aliases: tuple[str, ...]  #: the other names whose six values are identical to this row's
    faults: tuple[str, ...]  #: what is wrong with this row (empty for most)

    def values(self) -> tuple[float, ...]:
        """The six numbers, in the CSV's order."""
        return tuple(getattr(self, f"{s}{p}") for s in _SCORES for p in ("", "_below", "_above"))

    def shape_text(self) -> str:
        """``"12 x 768"`` (layers x width), or ``"?"``."""
        return f"{self.layers} x {self.width}" if self.layers else "?"


def _kind_and_family(name: str) -> tuple[str, str]:
    low = name.lower()
    for prefix, kind, family in _FAMILY_BY_PREFIX:
        if low.startswith(prefix):
            return kind, family
    raise ValueError(f"the pretrained table's row {name!r} has no known family")  # a new CSV row


@functools.lru_cache(maxsize=1)
def _table() -> tuple[PretrainedRow, ...]:
    """The 80 rows in the CSV's order (lines starting with ``#`` are its attribution)."""
    from importlib.resources import files

    text = files(__package__).joinpath(DATA_FILE).read_text(encoding="utf-8")
    raw = list(csv.DictReader(line for line in text.splitlines() if line and not line.startswith("#")))
    values = {r["model"]: tuple(float(r[f"{s}{p}"]) for s in _SCORES for p in ("_median", "_iqr_below", "_iqr_above"))
              for r in raw}
    same = {}
    for a, b in _SAME_MODEL:
        same[a], same[b] = b, a
    rows = []
    for r in raw:
        name = r["model"]
        mine = values[name]
        aliases = tuple(n for n in values if n != name and values[n] == mine)
        faults = []
        other = same.get(name)
        if other is not None and values[other] != mine:
            faults.append(f"disagrees with {other}, the same model under another name")
        if name in _NOT_RELEASED:
            faults.append(_NOT_RELEASED[name])
        for alias in aliases:
            if same.get(alias) != name and name not in _NOT_RELEASED and alias not in _NOT_RELEASED:
                faults.append(f"identical values to {alias}, a different model")
        kind, family = _kind_and_family(name)
        layers, width = _SHAPES.get(name, (None, None))
        rows.append(PretrainedRow(name, kind, family, layers, width, *mine, aliases=aliases, faults=tuple(faults)))
    return tuple(rows)


def pretrained_rows(distinct: bool = False) -> list[PretrainedRow]:
    """The paper's table: all 80 rows in the CSV's order, or (``distinct=True``) one row per
    distinct set of six values (62), named by its first name that is a released model."""
    rows = _table()
    if not distinct:
        return list(rows)
    seen: set[tuple[float, ...]] = set()
    out = []
    for row in rows:
        if row.values() in seen:
            continue
        if row.name in _NOT_RELEASED:
            row = next(r for r in rows if r.values() == row.values() and r.name not in _NOT_RELEASED)
        seen.add(row.values())
        out.append(row)
    return out


def pretrained_row(name: str) -> PretrainedRow:
    """The row called ``name`` (any of its names; case-insensitive). An unknown name is a
    one-line ``ValueError`` with the closest name."""
    if isinstance(name, str):
        for row in _table():
            if row.name.lower() == name.lower():
                return row
    names = [r.name for r in _table()]
    close = difflib.get_close_matches(str(name), names, n=1) if isinstance(name, str) else []
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"no model {name!r} in the paper's pretrained table{hint}; `attn-probe reference` lists them")


def pretrained_families() -> list[str]:
    """The families of the table, in order of first appearance."""
    return list(dict.fromkeys(r.family for r in _table()))


def pretrained_family(family: str, distinct: bool = True) -> list[PretrainedRow]:
    """The rows of ``family`` (distinct value sets by default), smallest first where the shape is known."""
    if family not in pretrained_families():
        raise ValueError(f"no family {family!r} in the paper's pretrained table; "
                         f"its families: {', '.join(pretrained_families())}")
    rows = [r for r in pretrained_rows(distinct) if r.family == family]
    return sorted(rows, key=lambda r: (r.layers is None, (r.layers or 0) * (r.width or 0) ** 2))


def kind_and_family(model_type: str | None, *, is_decoder: bool = False, is_encoder_decoder: bool = False,
                    architectures: list[str] | tuple[str, ...] = ()) -> tuple[str | None, str | None]:
    """The (kind, family) of a Hugging Face config: ``model_type``, its ``is_decoder`` /
    ``is_encoder_decoder`` flags and its ``architectures``. A BERT with ``is_decoder`` is a decoder
    of family ``bert``; a ``model_type`` the table does not hold has family ``None``, and its kind
    from an architecture named ``...ForCausalLM`` / ``...LMHeadModel`` (decoder) or ``...ForMaskedLM``
    (encoder), else ``None``."""
    if is_encoder_decoder:
        return "encoder-decoder part", None
    kind, family = _MODEL_TYPES.get(str(model_type or "").lower(), (None, None))
    names = [str(a) for a in architectures or ()]
    if is_decoder or any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in names):
        kind = "decoder"
    elif kind is None and any(a.endswith("ForMaskedLM") for a in names):
        kind = "encoder"
    return kind, family


def _distance(row: PretrainedRow, layers: int | None, width: int | None) -> float:
    """How far ``row``'s shape is from (layers, width): the sum of the absolute log ratios."""
    if not row.layers or not layers or not width:
        return math.inf
    return abs(math.log(row.layers / layers)) + abs(math.log(row.width / width))


def nearest_pretrained(kind: str | None, family: str | None, layers: int | None = None, width: int | None = None,
                       n: int = 4) -> list[PretrainedRow]:
    """Up to ``n`` distinct rows to compare a model with, smallest first.

    The rows of the same ``kind`` and ``family``; when the family has none of that kind, the rows
    of the same kind. Among those, the ``n`` nearest in shape (sum of ``|log|`` ratios of layers
    and width; rows without a shape last, then in table order). Rows flagged as no released model
    are never chosen. Vision rows are chosen only for ``kind="vision"``.
    """
    if kind not in KINDS:
        return []
    rows = [r for r in pretrained_rows(distinct=True) if r.kind == kind and r.name not in _NOT_RELEASED]
    same_family = [r for r in rows if r.family == family]
    rows = same_family or rows
    order = {r.name: i for i, r in enumerate(rows)}
    chosen = sorted(rows, key=lambda r: (_distance(r, layers, width), order[r.name]))[:n]
    return sorted(chosen, key=lambda r: (r.layers is None, (r.layers or 0) * (r.width or 0) ** 2, order[r.name]))

