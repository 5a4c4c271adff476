"""Export of the long table to CSV (formula-escaped, RFC 4180), Parquet or JSONL.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..formats.trajectory import encode_value
from .loading import as_frame
from .table import (
    COLUMNS,
    LINEAGE,
    PathLike,
    escape_formulas,
    is_na,
    require,
    require_pandas,
    resolve_format,
)

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


def _records(df: pd.DataFrame) -> Iterator[dict[str, Any]]:
    pd = require_pandas()
    lineage = [c for c in LINEAGE if c in df.columns]
    for row in df[list(COLUMNS) + lineage].itertuples(index=False):
        run, group, step, layer, head, metric, value = row[:7]
        rec = {
            "run": run,
            "group": group,
            "step": int(step),
            "layer": None if pd.isna(layer) else int(layer),
            "head": None if pd.isna(head) else int(head),
            "metric": metric,
            "value": encode_value(value),
        }
        for c, v in zip(lineage, row[7:], strict=True):
            rec[c] = None if is_na(v) else int(v) if c == "parent_step" else v
        yield rec


def export_trajectory(df_or_runs: Any, path: PathLike, format: str | None = None) -> Path:
    """Write the long table (or the runs it is loaded from) to CSV, Parquet or JSONL.

    The format comes from ``format`` or the suffix (``.csv``, ``.parquet``/``.pq``,
    ``.jsonl``/``.ndjson``). Values are written losslessly (CSV and JSONL use the shortest
    repr that round-trips; NaN and ``<NA>`` become empty cells / ``null``). CSV has RFC 4180
    line ends (``\\r\\n``: a name holding ``\\r`` or ``\\n`` is quoted), and names that a
    spreadsheet would run as a formula get a leading ``'`` (:func:`escape_formulas`), which
    :func:`read_table` removes again. Read the file back with :func:`read_table`. Returns the
    path written. Raises ``OSError`` with a one-line message when the file cannot be written
    (checked before anything is read where possible: a parent that is a file, a directory).
    """
    fmt = resolve_format(path, format)
    if fmt == "parquet":
        require("pyarrow", "pandas")
    out = Path(path)
    check_output_path(out)  # before reading anything
    df = as_frame(df_or_runs)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if fmt == "csv":
            escaped = df.copy()
            for column in ("run", "group", "metric", "run_id", "parent_run"):
                if column in escaped.columns:
                    text = escaped[column]
                    escaped[column] = escape_formulas(text).where(text.notna(), None)
            escaped.to_csv(out, index=False, lineterminator="\r\n")  # RFC 4180: a name's \r is quoted too
        elif fmt == "parquet":
            df.to_parquet(out, index=False, engine="pyarrow")
        else:
            with open(out, "w", encoding="utf-8") as fh:
                for rec in _records(df):
                    fh.write(json.dumps(rec, allow_nan=False) + "\n")
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write {out}: {exc.strerror or exc}") from exc
    return out


def check_output_path(path: PathLike) -> None:
    """Raise ``NotADirectoryError``/``IsADirectoryError`` with a one-line message when ``path``
    cannot be a file: it is a directory, or one of its parents is a file."""
    out = Path(path)
    if out.is_dir():
        raise IsADirectoryError(f"cannot write {out}: it is a directory; name a file")
    for parent in out.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise NotADirectoryError(f"cannot write {out}: {parent} is a file, not a directory")
            return
