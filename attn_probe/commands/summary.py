"""``attn-probe summary RUN_DIR...``: first and last median [q25, q75] across layers per run."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..analysis import add_runs_argument

    add_runs_argument(parser)
    parser.add_argument("--format", choices=("text", "csv"), default="text",
                        help="plain-text table (default) or CSV on stdout (names a spreadsheet would run "
                             "as formulas get a leading ')")
    parser.add_argument("--digits", type=int, default=2, help="decimals in the text table (default 2)")


def run(args: argparse.Namespace) -> int:
    from ..analysis import cli_errors
    from ..analysis.summary import format_summary, summarize

    with cli_errors("summary"):
        table = summarize(args.runs)
    if args.format == "csv":
        from ..analysis.trajectory import escape_formulas

        for column in ("run", "group", "metric"):  # text cells only: values may start with '-'
            table[column] = escape_formulas(table[column])
        print(table.to_csv(index=False, lineterminator="\r\n"), end="")  # RFC 4180: a name's \r is quoted
    else:
        print(format_summary(table, digits=args.digits))
    return 0
