"""``attn-probe plot RUN_DIR... -o fig.png [--reference NAME]``: the emergent-dynamics figure of one or
more runs, optionally beside the paper's own trajectories (:mod:`attn_probe.baselines.paper`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


class _ReferenceAction(argparse.Action):
    """``--reference NAME`` (repeatable, or a comma list) collects names; ``--reference list``
    prints the paper's runs and exits, as ``--help`` does, before the other arguments are checked."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        names = [n.strip() for n in str(values).split(",") if n.strip()]
        if names == ["list"]:
            from ..baselines.paper import paper_runs

            for run in paper_runs():
                print(f"{run.name:28s} {run.describe()}")
            parser.exit(0)
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), *names])


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
    parser.add_argument("--reference", action=_ReferenceAction, default=None, metavar="NAME",
                        help="overlay one of the paper's runs (dashed median, hatched q25-q75 band), e.g. "
                        "4-layer-encoder-wikipedia; repeatable or a comma list; '--reference list' prints the names")


def run(args: argparse.Namespace) -> int:
    from ..analysis import cli_errors
    from ..analysis.plots import plot_dynamics, resolve_references, use_agg

    with cli_errors("plot"):
        resolve_references(args.reference)  # a bad name: one line, before matplotlib and the runs load
        use_agg()
        fig = plot_dynamics(args.runs, metrics=args.metric, groups=args.group, per_layer=args.per_layer,
                            logx=args.logx, title=args.title, path=args.output, reference=args.reference)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
