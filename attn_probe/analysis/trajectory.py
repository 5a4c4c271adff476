"""Read probe runs back as one long table, and export it.

A *run directory* is a directory that holds the lossless trajectory file ``attn_probe.jsonl``
(see :mod:`attn_probe.trajectory_format`) or TensorBoard event files. The trajectory file is
preferred; event files are read only when it is missing (or holds nothing usable), with no
down-sampling, and their across-layer aggregate tags (``median``/``q25``/``q75``) are ignored
because :func:`attn_probe.analysis.summary.layer_quantiles` recomputes them.

The table is long: one row per value, columns ``run, group, step, layer, head, metric,
value``; ``layer`` and ``head`` are nullable ``Int64`` and ``head`` is ``<NA>`` on rows of the
layer-level matrix ``M = sum_h W_q^h W_k^h^T``. Event files store float32, the trajectory file
float64.

pandas (and pyarrow for Parquet) are optional: ``pip install attn-probe[pandas]``.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..sinks.tensorboard import has_event_files, is_event_file
from ..tags import parse_tag
from ..trajectory_format import TRAJECTORY_FILENAME, decode_value, encode_value

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = [
    "COLUMNS",
    "FORMATS",
    "MissingExtraError",
    "TrajectoryError",
    "TrajectoryWarning",
    "export_trajectory",
    "find_runs",
    "load_trajectory",
    "read_table",
]

PathLike = str | os.PathLike
#: what the loaders accept: one path, several, or ``{run name: path}``
RunsLike = PathLike | Sequence[PathLike] | Mapping[str, PathLike]

COLUMNS = ("run", "group", "step", "layer", "head", "metric", "value")
#: export format -> file name suffixes that select it
FORMATS: dict[str, tuple[str, ...]] = {
    "csv": (".csv",),
    "parquet": (".parquet", ".pq"),
    "jsonl": (".jsonl", ".ndjson"),
}
_KEY = ["run", "group", "metric", "layer", "head", "step"]


class TrajectoryError(ValueError):
    """No usable probe data where some was expected (the message says where and why)."""


class TrajectoryWarning(UserWarning):
    """Something was skipped while reading (corrupt lines, directories without probe data)."""


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require(module: str, extra: str) -> Any:
    """Import ``module`` or raise :class:`MissingExtraError` naming ``attn-probe[extra]``."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{module} is needed for this: pip install 'attn-probe[{extra}]'"
        ) from exc


def _pandas() -> Any:
    return require("pandas", "pandas")


# --------------------------------------------------------------------------- discovery




def _run_dirs_below(root: Path) -> list[Path]:
    """Run directories at or below ``root``, sorted.

    A directory holding ``attn_probe.jsonl`` is one run, and event files below it (a
    logging sub-directory) belong to it; directories below it with their own trajectory
    file are separate runs.
    """
    found: list[Path] = []

    def walk(d: Path, covered: bool) -> None:
        try:
            entries = sorted(d.iterdir())
        except OSError:
            return
        has_traj = (d / TRAJECTORY_FILENAME).is_file()
        if has_traj or (not covered and any(is_event_file(e.name) and e.is_file() for e in entries)):
            found.append(d)
        for e in entries:
            if e.is_dir() and not e.is_symlink():
                walk(e, covered or has_traj)

    walk(root, False)
    return found


def _unique_names(paths: list[Path]) -> list[str]:
    """Directory names, lengthened with parent directories until they are unique."""
    parts = [p.resolve().parts for p in paths]
    depth = [1] * len(paths)
    while True:
        names = ["/".join(pt[-k:]) for pt, k in zip(parts, depth, strict=True)]
        clash = {n for n in names if names.count(n) > 1}
        grow = [i for i, n in enumerate(names) if n in clash and depth[i] < len(parts[i])]
        if not grow:
            break
        for i in grow:
            depth[i] += 1
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def find_runs(runs: RunsLike) -> list[tuple[str, Path]]:
    """``(name, directory)`` of every run directory at or below the given paths.

    The name is the directory's name, lengthened with its parents where two runs would
    otherwise share it; a mapping ``{name: path}`` names runs explicitly (nested runs
    become ``name/sub``). Raises ``FileNotFoundError`` for a missing path and
    :class:`TrajectoryError` when no run directory is found at all.
    """
    if isinstance(runs, Mapping):
        items: list[tuple[str | None, Path]] = [(str(k), Path(v)) for k, v in runs.items()]
    elif isinstance(runs, (str, os.PathLike)):
        items = [(None, Path(runs))]
    else:
        items = [(None, Path(r)) for r in runs]
    if not items:
        raise TrajectoryError("no run directory given")
    named: list[tuple[str, Path]] = []
    unnamed: list[Path] = []
    seen: set[Path] = set()
    for key, root in items:
        if not root.exists():
            raise FileNotFoundError(f"no such directory: {root}")
        single = root.is_file()
        if single:
            if root.name == TRAJECTORY_FILENAME or is_event_file(root.name):
                root = root.parent  # that run only, not the directories below it
            else:
                raise TrajectoryError(
                    f"{root} is a file; expected a run directory (with {TRAJECTORY_FILENAME} "
                    "or TensorBoard event files) or an exported table (.csv, .parquet, .jsonl)"
                )
        dirs = [d for d in ([root] if single else _run_dirs_below(root)) if d.resolve() not in seen]
        seen.update(d.resolve() for d in dirs)
        for d in dirs:
            if key is None:
                unnamed.append(d)
            else:
                rel = d.relative_to(root).as_posix()
                named.append((key if rel == "." else f"{key}/{rel}", d))
    if not named and not unnamed:
        given = ", ".join(str(p) for _, p in items)
        raise TrajectoryError(
            f"no probe data in {given}: no {TRAJECTORY_FILENAME} and no TensorBoard event "
            "files at or below it"
        )
    return named + list(zip(_unique_names(unnamed), unnamed, strict=True))


# --------------------------------------------------------------------------- readers


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_line(line: str) -> tuple[str, int, int, int | None, str, float] | None:
    """``(group, step, layer, head, metric, value)``; ``None`` if the line is not valid."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict):
        return None
    step, layer, head = rec.get("step"), rec.get("layer"), rec.get("head")
    group, metric, value = rec.get("group"), rec.get("metric"), rec.get("value", "missing")
    if not (_is_int(step) and isinstance(group, str) and isinstance(metric, str)):
        return None
    if not (_is_int(layer) and (head is None or _is_int(head))):
        return None
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return None
    return group, step, layer, head, metric, decode_value(value)


def _read_trajectory_file(path: Path) -> list[tuple]:
    rows: list[tuple] = []
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            parsed = _parse_line(line)
            if parsed is None:
                bad += 1
            else:
                rows.append(parsed)
    if bad:
        warnings.warn(
            f"{path}: skipped {bad} corrupt or truncated line{'s' if bad != 1 else ''}",
            TrajectoryWarning,
            stacklevel=4,
        )
    return rows


def _read_event_files(run_dir: Path) -> list[tuple]:
    """Every per-layer/per-head scalar of the event files in ``run_dir`` (not below it)."""
    try:
        from tensorboard.backend.event_processing import event_accumulator as ea
        from tensorboard.util import tensor_util
    except ImportError as exc:  # pragma: no cover - tensorboard is a core dependency
        raise MissingExtraError("tensorboard is needed to read event files: pip install tensorboard") from exc

    # One accumulator over the directory reads its event files in name (= time) order, so
    # a resumed run's restart marker (SessionLog.START at step N, e.g. from
    # SummaryWriter(purge_step=N)) drops the stale steps >= N as TensorBoard does; other
    # repeated steps keep the value written last (see normalize()).
    acc = ea.EventAccumulator(
        str(run_dir),
        size_guidance={ea.SCALARS: 0, ea.TENSORS: 0, ea.IMAGES: 1, ea.AUDIO: 1,
                       ea.HISTOGRAMS: 1, ea.COMPRESSED_HISTOGRAMS: 1},
        purge_orphaned_data=True,
    )
    try:
        acc.Reload()
    except Exception as exc:  # corrupt event data: report, do not crash
        warnings.warn(f"{run_dir}: unreadable event files skipped ({type(exc).__name__}: {exc})",
                      TrajectoryWarning, stacklevel=4)
        return []
    rows: list[tuple] = []
    tags = acc.Tags()
    for tag in tags.get("scalars", []):
        parts = parse_tag(tag)
        if parts is None or parts.stat is not None:
            continue
        for ev in acc.Scalars(tag):
            rows.append((parts.group, ev.step, parts.layer, parts.head, parts.metric, float(ev.value)))
    for tag in tags.get("tensors", []):  # scalars written with new_style=True
        parts = parse_tag(tag)
        if parts is None or parts.stat is not None:
            continue
        for ev in acc.Tensors(tag):
            arr = tensor_util.make_ndarray(ev.tensor_proto)
            if arr.size == 1:
                rows.append((parts.group, ev.step, parts.layer, parts.head, parts.metric, float(arr.item())))
    return rows


def _read_run(run_dir: Path) -> list[tuple]:
    traj = run_dir / TRAJECTORY_FILENAME
    if traj.is_file():
        rows = _read_trajectory_file(traj)
        if rows or not has_event_files(str(run_dir)):
            return rows
        warnings.warn(f"{traj} holds no valid line; reading the event files instead",
                      TrajectoryWarning, stacklevel=3)
    return _read_event_files(run_dir)


def normalize(df: pd.DataFrame) -> pd.DataFrame:
    """Coerce a long table to the canonical dtypes, drop duplicate steps (keep last), sort."""
    pd = _pandas()
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise TrajectoryError(f"table lacks column(s) {', '.join(missing)}; expected {', '.join(COLUMNS)}")
    out = pd.DataFrame({
        "run": df["run"].astype(str),
        "group": df["group"].astype(str),
        "step": pd.to_numeric(df["step"]).astype("int64"),
        "layer": pd.to_numeric(df["layer"]).astype("Int64"),
        "head": pd.to_numeric(df["head"]).astype("Int64"),
        "metric": df["metric"].astype(str),
        "value": pd.to_numeric(df["value"]).astype("float64"),
    })
    out = out.drop_duplicates(subset=_KEY, keep="last")
    out = out.sort_values(_KEY, na_position="first", kind="stable").reset_index(drop=True)
    return out


def load_trajectory(runs: RunsLike) -> pd.DataFrame:
    """Load one or more runs as a long table ``run, group, step, layer, head, metric, value``.

    ``runs`` is a run directory, a parent of run directories (``encoder/`` and ``decoder/``
    give two runs), a table written by :func:`export_trajectory`, a list of those, or
    ``{name: directory}``. Duplicate steps of a resumed
    run keep the value written last. Corrupt or truncated trajectory lines are skipped with
    one :class:`TrajectoryWarning` per file; directories without probe data are skipped with
    a warning, and :class:`TrajectoryError` is raised when nothing usable is left.

    Example:
        >>> df = load_trajectory("runs/encoder")                      # doctest: +SKIP
        >>> df[df["head"].isna()].groupby(["metric", "step"])["value"].median()  # doctest: +SKIP
    """
    pd = _pandas()
    tables, dirs = _split_tables(runs)
    frames = [read_table(t) for t in tables]
    found = find_runs(dirs) if dirs or not tables else []
    empty = []
    for name, run_dir in found:
        rows = _read_run(run_dir)
        if not rows:
            empty.append(str(run_dir))
            continue
        frames.append(pd.DataFrame.from_records(
            [(name, *r) for r in rows],
            columns=["run", "group", "step", "layer", "head", "metric", "value"],
        ))
    if not frames:
        raise TrajectoryError(
            f"no probe data in {', '.join(empty)}: no valid {TRAJECTORY_FILENAME} line and no "
            "attn_probe/... scalar in the event files"
        )
    for d in empty:
        warnings.warn(f"{d}: no probe data, skipped", TrajectoryWarning, stacklevel=2)
    return normalize(pd.concat(frames, ignore_index=True))


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


def as_frame(df_or_runs: Any) -> pd.DataFrame:
    """A long table from a DataFrame (validated) or from run directories (loaded)."""
    pd = _pandas()
    if isinstance(df_or_runs, pd.DataFrame):
        return normalize(df_or_runs)
    return load_trajectory(df_or_runs)


# --------------------------------------------------------------------------- export


def resolve_format(path: PathLike, format: str | None = None) -> str:
    """``csv``, ``parquet`` or ``jsonl`` from ``format`` or from the file name's suffix."""
    if format is not None:
        fmt = format.lower().lstrip(".")
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
        return fmt
    suffix = Path(path).suffix.lower()
    for fmt, suffixes in FORMATS.items():
        if suffix in suffixes:
            return fmt
    raise ValueError(
        f"cannot tell the format of {str(path)!r} from its suffix; use one of "
        f"{', '.join(s for ss in FORMATS.values() for s in ss)} or pass format="
    )


def _records(df: pd.DataFrame) -> Iterator[dict[str, Any]]:
    pd = _pandas()
    for run, group, step, layer, head, metric, value in df[list(COLUMNS)].itertuples(index=False):
        yield {
            "run": run,
            "group": group,
            "step": int(step),
            "layer": None if pd.isna(layer) else int(layer),
            "head": None if pd.isna(head) else int(head),
            "metric": metric,
            "value": encode_value(value),
        }


def export_trajectory(df_or_runs: Any, path: PathLike, format: str | None = None) -> Path:
    """Write the long table (or the runs it is loaded from) to CSV, Parquet or JSONL.

    The format comes from ``format`` or the suffix (``.csv``, ``.parquet``/``.pq``,
    ``.jsonl``/``.ndjson``). Values are written losslessly (CSV and JSONL use the shortest
    repr that round-trips; NaN and ``<NA>`` become empty cells / ``null``). Read the file
    back with :func:`read_table`. Returns the path written.
    """
    fmt = resolve_format(path, format)
    if fmt == "parquet":
        require("pyarrow", "pandas")
    df = as_frame(df_or_runs)
    out = Path(path)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "csv":
        df.to_csv(out, index=False)
    elif fmt == "parquet":
        df.to_parquet(out, index=False, engine="pyarrow")
    else:
        with open(out, "w", encoding="utf-8") as fh:
            for rec in _records(df):
                fh.write(json.dumps(rec, allow_nan=False) + "\n")
    return out


def read_table(path: PathLike, format: str | None = None) -> pd.DataFrame:
    """Read a table written by :func:`export_trajectory` back with the canonical dtypes."""
    pd = _pandas()
    fmt = resolve_format(path, format)
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such file: {p}")
    if fmt == "csv":
        # pandas < 3 parses floats inexactly unless asked; pandas 3 is exact and deprecates the flag
        exact = {"float_precision": "round_trip"} if int(pd.__version__.split(".")[0]) < 3 else {}
        df = pd.read_csv(p, keep_default_na=False,
                         na_values={"layer": [""], "head": [""], "value": ["", "nan", "NaN"]},
                         dtype={"run": str, "group": str, "metric": str}, **exact)
    elif fmt == "parquet":
        require("pyarrow", "pandas")
        df = pd.read_parquet(p, engine="pyarrow")
    else:
        with open(p, encoding="utf-8") as fh:
            recs = [json.loads(line) for line in fh if line.strip()]
        df = pd.DataFrame.from_records(recs, columns=list(COLUMNS))
        df["value"] = [decode_value(v) for v in df["value"]]
        df["head"] = df["head"].astype("object").where(df["head"].notna(), None)
    return normalize(df)
