"""Loading runs into the long table: :func:`load_trajectory` (run directories, trajectory files,
exported tables) and :func:`read_table` (a table written by
:func:`~attn_probe.analysis.export.export_trajectory`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..formats.events import is_event_file
from ..formats.trajectory import TRAJECTORY_FILENAME
from .reading import FileRuns, lines_of, loads_line, parse_record, read_run
from .runs import find_runs
from .table import (
    COLUMNS,
    FORMATS,
    LINEAGE,
    RENAMED_METRICS,
    ROW_KEY,
    PathLike,
    RunsLike,
    TrajectoryError,
    TrajectoryWarning,
    is_text,
    normalize,
    require,
    require_pandas,
    resolve_format,
    unescape_formulas,
)

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


def _file_frame(names: list[str], found: FileRuns) -> pd.DataFrame:
    """One table of a file's rows (``names[i]`` is run ``i``'s name), with exact dtypes (no float
    round trip for the ints) and the lineage columns; the run columns share one string per run."""
    import numpy as np

    pd = require_pandas()
    run, group, step, layer, head, missing, metric, value = found.columns()
    labels = np.empty(len(found.names), dtype=object)
    labels[:] = list(found.names)

    def objects(values: list) -> Any:
        arr = np.empty(len(values), dtype=object)
        arr[:] = values
        return arr[run]

    parent_steps = np.array([0 if p is None else p for p in found.parent_steps], dtype=np.int64)
    no_parent = np.array([p is None for p in found.parent_steps], dtype=bool)
    return pd.DataFrame({
        "run": objects(names),
        "group": labels[group],
        "step": step,
        "layer": pd.arrays.IntegerArray(layer, np.zeros(len(layer), dtype=bool)),
        "head": pd.arrays.IntegerArray(head, missing),
        "metric": labels[metric],
        "value": value,
        "run_id": objects(found.ids),
        "parent_run": objects(found.parents),
        "parent_step": pd.arrays.IntegerArray(parent_steps[run], no_parent[run]),
    })


#: how many runs a warning names before it only counts the rest
_NAMED_IN_WARNING = 5
#: the longest run name a warning prints (a hostile path can be long)
_NAME_IN_WARNING = 80


def _short(name: str) -> str:
    from ..formats.logdir import printable

    text = printable(name)
    return text if len(text) <= _NAME_IN_WARNING else text[:_NAME_IN_WARNING - 3] + "..."


def load_trajectory(runs: RunsLike, *, heads: bool = True) -> pd.DataFrame:
    """Load one or more runs as a long table ``run, group, step, layer, head, metric, value``
    (and ``run_id, parent_run, parent_step`` when a run carries a run header).

    ``runs`` is a run directory, a parent of run directories (``encoder/`` and ``decoder/``
    give two runs), a table written by :func:`export_trajectory`, a list of those, or
    ``{name: directory}``. Duplicate steps of a resumed run keep the value written last.

    Lineage: a trajectory file written since run headers exist names each run's random
    ``run_id`` and, for a run branched from another run's checkpoint, that run's id and step
    (``parent_run``, ``parent_step``; ``<NA>`` otherwise); these three columns are present when
    any loaded run (or table) has them. A trajectory file that holds several runs (a fresh run
    started in a ``log_dir`` that already held one appends to it) loads as separate runs,
    named ``NAME``, ``NAME#2``, ``NAME#3``... in the order they were written, with one
    :class:`TrajectoryWarning` that counts them and names the first few; runs are told apart
    by their run headers, or, in files written before them, by their steps starting again
    (:class:`~attn_probe.formats.runs.RunSplitter`); a resumed run stays one run. A header that
    cannot be read (damaged, too long) or is missing (the steps go down) ends the run before
    it: the rows after it are a run without a ``run_id``; a header reusing an earlier run's id
    starts a separate run whose ``run_id`` reads ``ID#2`` (the next free number where a run of the
    file carries that id itself); one :class:`TrajectoryWarning` per
    file names those lines (:mod:`attn_probe.formats.runs`). Time and memory are linear in the
    files, whatever the number of runs. Corrupt or truncated trajectory lines are skipped with
    one :class:`TrajectoryWarning` per file; directories without probe data are skipped with a
    warning, and :class:`TrajectoryError` is raised when nothing usable is left.

    ``heads=False`` loads only the layer-level rows (``head`` ``<NA>``), dropped as the files are
    read: memory then grows with those rows alone, not with the per-head ones (``summary`` reads
    this way). Runs are found and named as with every row.

    Example:
        >>> df = load_trajectory("runs/encoder")                      # doctest: +SKIP
        >>> df[df["head"].isna()].groupby(["metric", "step"])["value"].median()  # doctest: +SKIP
    """
    pd = require_pandas()
    tables, dirs = _split_tables(runs)
    frames = [read_table(t) for t in tables]
    lineage = any("run_id" in f.columns for f in frames)
    found = find_runs(dirs) if dirs or not tables else []
    taken = {n for n, _ in found}.union(*(set(f["run"]) for f in frames))
    empty: list[str] = []
    several: list[str] = []  # one text per file holding several runs (the first few only)
    files_several = runs_several = 0
    for name, run_dir in found:
        got = read_run(run_dir, heads=heads)
        live = got.counts().nonzero()[0].tolist()  # runs with rows
        if not live:
            empty.append(str(run_dir))
            continue
        names = [""] * len(got.ids)
        names[live[0]], k = name, 1
        prefix = f"{name}#"
        if len(live) > 1 and not any(t.startswith(prefix) for t in taken):  # no number is taken: in one go
            numbered = [f"{prefix}{k}" for k in range(2, len(live) + 1)]
            for i, n in zip(live[1:], numbered, strict=True):
                names[i] = n
            taken.update(numbered)
        else:
            for i in live[1:]:  # NAME#2, NAME#3...; a number a run is named with already is skipped
                k += 1
                while f"{prefix}{k}" in taken:
                    k += 1
                names[i] = f"{prefix}{k}"
                taken.add(names[i])
        frames.append(_file_frame(names, got))
        lineage = lineage or got.identified
        if len(live) > 1:
            files_several += 1
            runs_several += len(live)
            if len(several) < 3:
                several.append(_runs_text(run_dir / TRAJECTORY_FILENAME, names, got, live))
    if several:
        more = (f"; and {files_several - len(several)} more file{'s' if files_several - len(several) != 1 else ''}"
                f" ({runs_several} runs in all)" if files_several > len(several) else "")
        warnings.warn("; ".join(several) + more + ". A fresh run started in a log_dir that already holds a "
                      "trajectory appends to it: give each run a log_dir of its own (resuming keeps one run)",
                      TrajectoryWarning, stacklevel=2)
    if not frames:
        raise TrajectoryError(
            f"no probe data in {', '.join(_short(d) for d in empty[:_NAMED_IN_WARNING])}"
            f"{f' and {len(empty) - _NAMED_IN_WARNING} more' if len(empty) > _NAMED_IN_WARNING else ''}: no valid "
            f"{TRAJECTORY_FILENAME} line and no attn_probe/... scalar in the event files"
        )
    if empty:
        extra = f" and {len(empty) - _NAMED_IN_WARNING} more" if len(empty) > _NAMED_IN_WARNING else ""
        warnings.warn(f"{', '.join(_short(d) for d in empty[:_NAMED_IN_WARNING])}{extra}: no probe data, skipped",
                      TrajectoryWarning, stacklevel=2)
    if not lineage:
        frames = [f.drop(columns=[c for c in LINEAGE if c in f.columns]) for f in frames]
    if not heads:
        frames = [f[f["head"].isna()] if i < len(tables) else f for i, f in enumerate(frames)]
    if not tables:  # rows validated while read: only the dtypes, the renames, duplicates and order
        df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        del frames
        return _finish(df)
    return normalize(pd.concat(frames, ignore_index=True))


def _finish(df: pd.DataFrame) -> pd.DataFrame:
    """The last steps of :func:`normalize` for rows the readers validated already."""
    for column in ("run", "group", "metric"):
        df[column] = df[column].astype(str)
    if df["metric"].isin(list(RENAMED_METRICS)).any():  # runs written before a metric was renamed
        df["metric"] = df["metric"].replace(RENAMED_METRICS)
    df = df.drop_duplicates(subset=ROW_KEY, keep="last")
    return df.sort_values(ROW_KEY, na_position="first", kind="stable").reset_index(drop=True)


def _runs_text(path: Path, names: list[str], found: FileRuns, live: list[int]) -> str:
    """``PATH holds N runs (...), loaded as separate runs: NAME (steps a to b), ...`` naming the
    first :data:`_NAMED_IN_WARNING` of the runs ``live`` (those with rows) only."""
    parts = []
    for i in live[:_NAMED_IN_WARNING]:
        first, last = found.step_range(i)
        parts.append(f"{_short(names[i])} ({f'step {first}' if first == last else f'steps {first} to {last}'})")
    if len(live) > _NAMED_IN_WARNING:
        parts.append(f"... and {len(live) - _NAMED_IN_WARNING} more")
    how = "told apart by their run headers" if found.identified else "the steps start again"
    return f"{_short(str(path))} holds {len(live)} runs ({how}), loaded as separate runs: {', '.join(parts)}"


def _split_tables(runs: RunsLike) -> tuple[list[Path], RunsLike]:
    """Exported table files among ``runs``, and the rest (directories, trajectory files)."""
    if isinstance(runs, Mapping):
        return [], runs
    items = [runs] if isinstance(runs, (str, os.PathLike)) else list(runs)
    suffixes = {s for ss in FORMATS.values() for s in ss}
    tables, rest = [], []
    for item in items:
        p = Path(item)
        is_table = (p.is_file() and p.name != TRAJECTORY_FILENAME and not is_event_file(p.name)
                    and p.suffix.lower() in suffixes)
        (tables if is_table else rest).append(p if is_table else item)
    return tables, rest


def as_frame(df_or_runs: Any, *, heads: bool = True) -> pd.DataFrame:
    """A long table from a DataFrame (validated) or from run directories (loaded; ``heads=False``:
    the layer-level rows only, :func:`load_trajectory`)."""
    pd = require_pandas()
    if isinstance(df_or_runs, pd.DataFrame):
        return normalize(df_or_runs)
    return load_trajectory(df_or_runs, heads=heads)


def read_table(path: PathLike, format: str | None = None) -> pd.DataFrame:
    """Read a table written by :func:`export_trajectory` back with the canonical dtypes."""
    pd = require_pandas()
    fmt = resolve_format(path, format)
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such file: {p}")
    if fmt == "csv":
        # pandas < 3 parses floats inexactly unless asked; pandas 3 is exact and deprecates the flag
        exact = {"float_precision": "round_trip"} if int(pd.__version__.split(".")[0]) < 3 else {}
        df = pd.read_csv(p, keep_default_na=False,
                         na_values={"layer": [""], "head": [""], "value": ["", "nan", "NaN"], "run_id": [""],
                                    "parent_run": [""], "parent_step": [""]},
                         dtype={"run": str, "group": str, "metric": str, "run_id": str, "parent_run": str}, **exact)
        for column in ("run", "group", "metric", "run_id", "parent_run"):
            if column in df.columns:
                text = df[column]
                df[column] = unescape_formulas(text).where(text.notna(), None)
    elif fmt == "parquet":
        require("pyarrow", "pandas")
        try:
            df = pd.read_parquet(p, engine="pyarrow")
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - pyarrow/pandas refuse it: unreadable, hostile metadata
            first = (str(exc).strip().splitlines() or [""])[0]
            raise TrajectoryError(f"{p}: pandas/pyarrow refused this Parquet table "
                                  f"({type(exc).__name__}: {first})") from exc
    else:
        recs, bad, lineage = [], 0, False
        with open(p, "rb") as fh:
            for line in lines_of(fh):
                if line is not None and not line.strip():
                    continue
                parsed = None if line is None else _parse_table_line(line)
                if parsed is None:
                    bad += 1
                else:
                    recs.append(parsed[0])
                    lineage = lineage or parsed[1]
        if bad:
            warnings.warn(f"{p}: skipped {bad} corrupt or truncated line{'s' if bad != 1 else ''}",
                          TrajectoryWarning, stacklevel=2)
        df = pd.DataFrame.from_records(recs, columns=list(COLUMNS) + list(LINEAGE))
        df["head"] = df["head"].astype("object").where(df["head"].notna(), None)
        df["parent_step"] = df["parent_step"].astype("object").where(df["parent_step"].notna(), None)
        if not lineage:
            df = df.drop(columns=list(LINEAGE))
    return normalize(df, source=str(p))


def _parse_table_line(line: str) -> tuple[tuple, bool] | None:
    """One line of an exported JSONL table as a row of :data:`COLUMNS` + :data:`LINEAGE` (and
    whether it had lineage keys), or ``None``."""
    rec = loads_line(line)
    if not isinstance(rec, dict) or not is_text(rec.get("run")):
        return None
    parsed = parse_record(rec, names=is_text)  # a table may hold any names a DataFrame had
    if parsed is None:
        return None
    lineage = tuple(rec.get(c) for c in LINEAGE)
    return (rec["run"], *parsed, *lineage), any(c in rec for c in LINEAGE)
