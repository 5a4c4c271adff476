"""``attn-probe plot RUN_DIR... -o fig.png``: the emergent-dynamics figure of one or more runs."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..analysis import add_runs_argument

    add_runs_argument(parser)
    parser.add_argument("-o", "--output", required=True, metavar="FIG",
                        help="image file: .png, .pdf or .svg")
    parser.add_argument("--per-layer", action="store_true",
                        help="one line per layer coloured by depth instead of median and IQR band")
    parser.add_argument("--group", action="append", default=None, metavar="G",
                        help="attention group to draw (self, encoder, decoder, cross); repeatable; default all")
    parser.add_argument("--metric", action="append", default=None, metavar="M",
                        help="metric to draw, one panel each (any in the run: spectral_norm, ov_symmetry, ...; "
                        "norms on a log axis); repeatable; default symmetry and directionality")
    parser.add_argument("--logx", action="store_true", help="logarithmic step axis")
    parser.add_argument("--title", default=None, help="figure title")


def run(args: argparse.Namespace) -> int:
    from ..analysis import cli_errors
    from ..analysis.plots import plot_dynamics, use_agg

    with cli_errors("plot"):
        use_agg()
        fig = plot_dynamics(args.runs, metrics=args.metric, groups=args.group, per_layer=args.per_layer,
                            logx=args.logx, title=args.title, path=args.output)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
