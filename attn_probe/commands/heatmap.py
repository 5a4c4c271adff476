"""``attn-probe heatmap CHECKPOINT --layer N -o fig.png``: one layer's W_qk as a heatmap."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="local Hugging Face checkpoint directory (config.json + weights)")
    parser.add_argument("--layer", type=int, required=True, metavar="N", help="layer index")
    parser.add_argument("--group", default=None, metavar="G",
                        help="attention group when several have layer N (encoder, decoder, cross)")
    parser.add_argument("--head", type=int, default=None, metavar="H",
                        help="one head's W_q^h W_k^h^T instead of the layer sum")
    parser.add_argument("--vmax", type=float, default=None,
                        help="colour scale [-vmax, vmax] (default: a percentile of |W_qk|, see --clip-percentile)")
    parser.add_argument("--clip-percentile", type=float, default=99.5, metavar="P",
                        help="default vmax = the P-th percentile of |W_qk|; 100 = max |W_qk| (default: 99.5)")
    parser.add_argument("-o", "--output", required=True, metavar="FIG", help="image file: .png, .pdf or .svg")


def run(args: argparse.Namespace) -> int:
    from ..analysis import cli_errors
    from ..analysis.plots import plot_heatmap, use_agg
    from ..scoring.checkpoint import check_layer_counts

    with cli_errors("heatmap"):  # UnsupportedModelError is a ValueError: one line too
        check_layer_counts(args.checkpoint)  # a hostile config.json: refused before a model is built
        use_agg()
        fig = plot_heatmap(args.checkpoint, args.layer, group=args.group, head=args.head,
                           vmax=args.vmax, clip_percentile=args.clip_percentile, path=args.output)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
