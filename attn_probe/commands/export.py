"""``attn-probe export RUN_DIR... -o out.csv|out.parquet|out.jsonl``: one long table of all runs."""

from __future__ import annotations

import argparse
import sys

FORMAT_CHOICES = ("csv", "parquet", "jsonl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..analysis import add_runs_argument

    add_runs_argument(parser)
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="output file; the format follows its suffix (.csv, .parquet, .jsonl)")
    parser.add_argument("--format", choices=FORMAT_CHOICES, default=None,
                        help="output format when the suffix does not say it")


def run(args: argparse.Namespace) -> int:
    from ..analysis import cli_errors
    from ..analysis.trajectory import export_trajectory, load_trajectory, resolve_format
    from ..cli import CommandError

    try:
        fmt = resolve_format(args.output, args.format)  # fail before reading anything
    except ValueError:
        raise CommandError(
            f"cannot tell the format of {args.output!r} from its suffix; name the file .csv, .parquet "
            f"or .jsonl, or pass --format {{{','.join(FORMAT_CHOICES)}}}"
        ) from None
    with cli_errors("export"):
        df = load_trajectory(args.runs)
        path = export_trajectory(df, args.output, format=fmt)
    runs = df["run"].nunique()
    print(f"wrote {len(df)} rows from {runs} run{'s' if runs != 1 else ''} to {path} ({fmt})",
          file=sys.stderr)
    return 0
