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
    parser.add_argument("--sds", type=float, default=3.0, metavar="K",
                        help="the emergence lines (text) and columns (csv): a departure is K sd of the random "
                             "range (default 3)")


def run(args: argparse.Namespace) -> int:
    from ..analysis import cli_errors
    from ..analysis.summary import format_summary, summarize
    from ..analysis.trajectory import load_trajectory

    with cli_errors("summary"):
        df = load_trajectory(args.runs, heads=False)  # the layer-level rows: all that the summary reads
        table = summarize(df)
        events = _emergence(df, args)
    if args.format == "csv":
        from ..analysis.trajectory import escape_formulas

        table = _with_events(table, events)
        for column in ("run", "group", "metric"):  # text cells only: values may start with '-'
            table[column] = escape_formulas(table[column])
        print(table.to_csv(index=False, lineterminator="\r\n"), end="")  # RFC 4180: a name's \r is quoted
    else:
        print(format_summary(table, digits=args.digits))
        if events is not None and not events.empty:
            from ..analysis.emergence import format_emergence

            text = format_emergence(events)
            if text:
                print()
                print(text)
    return 0


def _emergence(df, args: argparse.Namespace):  # noqa: ANN001, ANN202 - pandas is imported lazily
    """Departure and takeoff per run, group and score (:mod:`attn_probe.analysis.emergence`); a run
    without a logged random range gets it from its run header's layer shapes."""
    from ..analysis.emergence import emergence, lazy_shapes

    return emergence(df, k=args.sds, shapes=lazy_shapes(args.runs))


#: the CSV's emergence columns: the median layer's events of each run, group and score
EVENT_COLUMNS = {"emergence": "status", "departure_step": "departure", "departure_at_start": "departure_at_start",
                 "takeoff_step": "takeoff", "takeoff_at_start": "takeoff_at_start"}


def _with_events(table, events):  # noqa: ANN001, ANN202 - pandas is imported lazily
    """``table`` with the median layer's events as columns (:data:`EVENT_COLUMNS`), one row per run,
    group and score; empty cells for scores without a random range (the norms) or not emerged."""
    from ..analysis.emergence import median_events

    med = median_events(events)[["run", "group", "metric", *EVENT_COLUMNS.values()]]
    med = med.rename(columns={v: k for k, v in EVENT_COLUMNS.items()})
    for column in ("departure_at_start", "takeoff_at_start"):  # only meaningful with a step
        step = column.replace("_at_start", "_step")
        med[column] = med[column].astype("boolean").mask(med[step].isna())
    return table.merge(med, on=["run", "group", "metric"], how="left")
