"""The demo's settings: model sizes, architectures, presets and :class:`DemoConfig`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

#: size -> (layers, hidden size, heads, feed-forward size). ``mini`` is the paper's 4-layer model
#: (bert-mini), ``base`` its 12-layer one; ``mini-128`` is the same 4 layers at width 128 (the
#: BERT miniature L=4/H=128, the ``cpu`` preset's); ``tiny`` exists for tests.
SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 32, 4, 64),
    "mini-128": (4, 128, 4, 512),
    "mini": (4, 256, 4, 1024),
    "base": (12, 768, 12, 3072),
}
MODEL_KINDS = ("encoder", "decoder")


class Architecture(NamedTuple):
    """Class names in ``transformers`` for one demo architecture."""

    config: str
    masked_lm: str
    causal_lm: str
    #: RoBERTa-style position ids start at ``pad_token_id + 1``: that many extra position rows.
    positions_after_pad: bool = False


#: ``bert`` is the paper's (post-LayerNorm); ``bert-preln`` puts the LayerNorm before each
#: sub-layer, and is the default because its encoder starts using attention within a CPU budget
#: (docs/reproducing-the-paper.md has the measurements).
ARCHITECTURES: dict[str, Architecture] = {
    "bert-preln": Architecture(
        "RobertaPreLayerNormConfig",
        "RobertaPreLayerNormForMaskedLM",
        "RobertaPreLayerNormForCausalLM",
        positions_after_pad=True,
    ),
    "bert": Architecture("BertConfig", "BertForMaskedLM", "BertLMHeadModel"),
}
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

#: ``causal``: next-token loss on every position of the uncorrupted block (what the paper
#: describes); ``paper-mlm``: what the paper's released code ran -- the masked-LM collator's
#: corrupted inputs and labels, fed unchanged to the causal LM (which shifts the labels).
DECODER_OBJECTIVES = ("causal", "paper-mlm")
#: ``wordpiece``: a WordPiece vocabulary trained on the corpus (``vocab_size`` entries, word level);
#: ``chars``: one token per character, whitespace included (like the paper's character-level
#: Wikipedia and RedPajama runs, but keeping the word boundaries); ``chars-nospace``: one token per
#: non-whitespace character, what the paper's released code fed those runs.
TOKENS = ("wordpiece", "chars", "chars-nospace")
#: ``fp32``, or ``bf16`` mixed precision (the Trainer's ``bf16=True``).
PRECISIONS = ("fp32", "bf16")

#: Where this file's docs live: the measurements behind the presets and the GPU figure.
DOCS = "docs/reproducing-the-paper.md"
GPU_SECTION = f"{DOCS}#the-gpu-preset-the-takeoff"

#: preset -> the :class:`DemoConfig` fields it sets. ``cpu`` is ``DemoConfig()`` itself: the
#: configuration of the CPU preset sweep whose encoder leaves the unigram plateau (``ch128-s32-b32-
#: lr2e-3``: pre-LN, 4 layers x d 128, characters, 32-token blocks, batch 32, 1,500 steps; encoder
#: +0.47 / +0.51, decoder +0.02 in two runs, docs/reproducing-the-paper.md); ``paper-small`` is the configuration measured on one
#: H100 that reaches the paper's 4-layer encoder range fastest: the paper's post-LN BERT for
#: 12,000 steps (its encoder left the unigram plateau at step 810 and ended at +0.49).
#: ``"bf16-if-supported"`` is resolved by :func:`resolve_preset`.
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {
        "size": "mini-128",
        "arch": "bert-preln",
        "tokens": "chars",
        "steps": 1_500,
        "batch_size": 32,
        "seq_len": 32,
        "lr": 2e-3,
        "warmup": 100,
        "every": 25,
        "precision": "fp32",
        "save_every": 0,
    },
    "paper-small": {
        "size": "mini",
        "arch": "bert",
        "tokens": "wordpiece",
        "steps": 12_000,
        "batch_size": 32,
        "seq_len": 128,
        "lr": 5e-4,
        "warmup": 200,
        "every": 100,
        "precision": "bf16-if-supported",
        "save_every": 2_000,
    },
}


class DemoError(ValueError):
    """A user-facing problem with the demo's inputs (missing file, package, empty corpus...)."""


@dataclass
class DemoConfig:
    """Every knob of the demo. The defaults are the ``cpu`` preset, the measured CPU configuration.

    ``preset`` only records which preset the values came from (see :func:`resolve_preset` and
    :func:`config_from_args`); the other fields are what runs.
    """

    preset: str = "cpu"
    size: str = "mini-128"
    arch: str = "bert-preln"
    #: see :data:`TOKENS`
    tokens: str = "chars"
    steps: int = 1_500
    batch_size: int = 32
    seq_len: int = 32
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    precision: str = "fp32"
    decoder_objective: str = "causal"
    vocab_size: int = 4096
    seed: int = 0
    every: int = 25
    out_dir: str = "runs"
    name: str = "demo"
    text: Sequence[str] | None = None
    dataset: str | None = None
    dataset_split: str = "train"
    dataset_column: str = "text"
    max_chars: int | None = None
    models: Sequence[str] = MODEL_KINDS
    symmetric_init: bool = False
    unigram_bias: bool = True
    figure: bool = True
    progress: bool = True
    #: save a Trainer checkpoint every N steps (0: never); with ``resume``, a rerun continues
    #: from the last one, so that a long run can span several commands
    save_every: int = 0
    resume: bool = False
    #: torch threads per model; None: chosen by :func:`plan_threads` from the CPUs available
    threads: int | None = None
    #: train the models at the same time, one process each (True), one after the other (False),
    #: or decide from the free CPU cores (None, :func:`plan_threads`)
    concurrent: bool | None = None
    extra_callbacks: Sequence[Any] = field(default_factory=tuple, repr=False)
    #: why this preset was chosen (printed by :func:`run_demo`)
    preset_reason: str | None = field(default=None, repr=False)

    def validate(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise DemoError(f"unknown architecture {self.arch!r}; choose one of {', '.join(ARCHITECTURES)}")
        if self.tokens not in TOKENS:
            raise DemoError(f"unknown tokens {self.tokens!r}; choose one of {', '.join(TOKENS)}")
        if self.size not in SIZES:
            raise DemoError(f"unknown size {self.size!r}; choose one of {', '.join(SIZES)}")
        for name in ("steps", "batch_size", "seq_len", "every", "vocab_size"):
            if int(getattr(self, name)) < 1:
                raise DemoError(f"{name.replace('_', '-')} must be a positive integer")
        if self.seq_len < 4:
            raise DemoError("seq-len must be at least 4 tokens")
        if not self.lr > 0:
            raise DemoError("lr must be positive")
        if self.warmup < 0:
            raise DemoError("warmup must be >= 0")
        bad = [m for m in self.models if m not in MODEL_KINDS]
        if bad or not self.models:
            raise DemoError(f"models must be a non-empty subset of {MODEL_KINDS}, got {list(self.models)}")
        if self.text and self.dataset:
            raise DemoError("give either --text or --dataset, not both")
        if self.preset not in PRESETS:
            raise DemoError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if self.precision not in PRECISIONS:
            raise DemoError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.decoder_objective not in DECODER_OBJECTIVES:
            raise DemoError(
                f"unknown decoder objective {self.decoder_objective!r}; choose one of {', '.join(DECODER_OBJECTIVES)}"
            )
        if self.threads is not None and self.threads < 1:
            raise DemoError("threads must be a positive integer")
        if self.save_every < 0:
            raise DemoError("save-every must be >= 0")
        if self.resume and not self.save_every:
            raise DemoError("--resume needs checkpoints: give --save-every N (the paper-small preset saves every 2,000 steps)")
        if self.concurrent and self.extra_callbacks:
            raise DemoError("extra callbacks run in this process: train the models one after the other (concurrent=False)")


def resolve_preset(name: str) -> dict[str, Any]:
    """The :class:`DemoConfig` fields of preset ``name``, with the precision decided for this machine.

    ``paper-small`` trains in bf16 where ``torch.cuda.is_bf16_supported()``, else in fp32.
    """
    if name not in PRESETS:
        raise DemoError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    values = dict(PRESETS[name])
    if values.get("precision") == "bf16-if-supported":
        values["precision"] = "bf16" if _bf16_supported() else "fp32"
    return values


def _bf16_supported() -> bool:
    import torch  # here, not at the top: `attn-probe --help` builds the demo's flags from this module

    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    except Exception:  # noqa: BLE001  (a broken CUDA install: fall back to fp32)
        return False


def default_preset() -> tuple[str, str]:
    """``(preset, reason)`` when the user names none: ``paper-small`` with CUDA, else ``cpu``."""
    import torch

    if torch.cuda.is_available():
        try:
            device = torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001
            device = "a CUDA device"
        return "paper-small", f"CUDA is available ({device}); --preset cpu gives the 1,500-step character-level CPU run"
    return "cpu", "no CUDA device; the paper's own architecture and schedule need --preset paper-small on a GPU"
