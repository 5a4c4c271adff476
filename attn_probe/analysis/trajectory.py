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
import math
import os
import re
import struct
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..event_files import has_event_files, is_event_file
from ..tags import parse_tag
from ..trajectory_format import HEADER_KEY, TRAJECTORY_FILENAME, decode_value, encode_value, parse_header

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = [
    "COLUMNS",
    "LINEAGE",
    "FORMATS",
    "MissingExtraError",
    "TrajectoryError",
    "TrajectoryWarning",
    "export_trajectory",
    "NamedRun",
    "find_runs",
    "load_trajectory",
    "read_table",
    "RENAMED_METRICS",
    "check_output_path",
    "escape_formulas",
    "unescape_formulas",
]

PathLike = str | os.PathLike
#: what the loaders accept: one path, several, or ``{run name: path}``
RunsLike = PathLike | Sequence[PathLike] | Mapping[str, PathLike]

COLUMNS = ("run", "group", "step", "layer", "head", "metric", "value")
#: lineage columns, present when a loaded run has a run header: its id, its parent's id and step
LINEAGE = ("run_id", "parent_run", "parent_step")
#: export format -> file name suffixes that select it
FORMATS: dict[str, tuple[str, ...]] = {
    "csv": (".csv",),
    "parquet": (".parquet", ".pq"),
    "jsonl": (".jsonl", ".ndjson"),
}
_KEY = ["run", "group", "metric", "layer", "head", "step"]
#: metric names written by earlier versions -> their names now; every loader renames on read
RENAMED_METRICS: dict[str, str] = {"ov_qk_bound": "ov_gain_bound"}
#: first characters that make a spreadsheet read a CSV cell as a formula (or smuggle one in)
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


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




#: how deep below a given path run directories are looked for (a Trainer's output_dir/runs/<run>
#: is 2 deep; a sweep of sweeps a few more)
MAX_DEPTH = 64


def _run_dirs_below(root: Path) -> list[Path]:
    """Run directories at or below ``root``, in sorted depth-first order.

    A directory holding ``attn_probe.jsonl`` is one run, and event files below it (a
    logging sub-directory) belong to it; directories below it with their own trajectory
    file are separate runs. The walk is iterative, follows symbolic links to directories
    but enters each directory once (a link loop is skipped), and raises
    :class:`TrajectoryError` (one line) below :data:`MAX_DEPTH` levels.
    """
    found: list[Path] = []
    seen: set[tuple[int, int]] = set()
    stack: list[tuple[Path, bool, int]] = [(root, False, 0)]
    while stack:
        d, covered, depth = stack.pop()
        try:
            st = d.stat()
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue  # entered already: a symbolic link loop, or a second link to it
            seen.add(key)
            entries = sorted(d.iterdir())
        except (OSError, RuntimeError):
            continue
        has_traj = (d / TRAJECTORY_FILENAME).is_file()
        if has_traj or (not covered and any(is_event_file(e.name) and e.is_file() for e in entries)):
            found.append(d)
        subdirs = [e for e in entries if _is_dir(e)]
        if subdirs and depth >= MAX_DEPTH:
            from ..logdir import printable

            raise TrajectoryError(
                f"{printable(root)}: directories nested more than {MAX_DEPTH} levels deep below it "
                f"(at {printable(subdirs[0].relative_to(root).parts[0])}/...); point at the run "
                "directories themselves, or at a parent nearer them")
        stack.extend((e, covered or has_traj, depth + 1) for e in reversed(subdirs))
    return found


def _is_dir(p: Path) -> bool:
    try:
        return p.is_dir()
    except OSError:
        return False


#: a Trainer's default TensorBoard run directory: ``<Mon DD_HH-MM-SS>_<host>`` (SummaryWriter's
#: default, possibly with the ``_N`` of :func:`attn_probe.logdir.unique_log_dir`) under ``runs/``
_TRAINER_RUN = re.compile(r"^[^\W\d_]+\d{2}_\d{2}-\d{2}-\d{2}_.+$")


class NamedRun(os.PathLike):
    """A run path with the name the user gave it (``NAME=PATH`` on the command line).

    A path everywhere (``os.fspath``); :func:`find_runs` names the runs at or below it
    ``NAME`` (``NAME/sub`` for nested runs), like a ``{name: path}`` mapping.
    """

    def __init__(self, name: str, path: PathLike) -> None:
        self.name = str(name)
        self.path = os.fspath(path)

    def __fspath__(self) -> str:
        return self.path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NamedRun) and (self.name, self.path) == (other.name, other.path)

    def __hash__(self) -> int:
        return hash((self.name, self.path))

    def __repr__(self) -> str:
        return f"NamedRun({self.name!r}, {self.path!r})"


def parse_run_argument(text: str) -> str | NamedRun:
    """``NAME=PATH`` as a :class:`NamedRun`; anything else (an existing path included) as is.

    An argument that exists as a path stays a path even if it contains ``=``; ``NAME`` may
    not contain a path separator.
    """
    if "=" in text and not os.path.exists(text):
        name, path = text.split("=", 1)
        if name and path and "/" not in name and os.sep not in name:
            return NamedRun(name, path)
    return text


def trainer_output_dir(run_dir: Path) -> Path | None:
    """``output_dir`` when ``run_dir`` is a Trainer's default ``output_dir/runs/<time>_<host>``."""
    d = run_dir.resolve()
    if d.parent.name == "runs" and _TRAINER_RUN.match(d.name) and d.parent.parent.name:
        return d.parent.parent
    return None


def _name_parts(paths: list[Path]) -> list[tuple[str, ...]]:
    """Path components to name each run by (the name is the last one, or more on a clash).

    A Trainer's default run directory is named after its ``output_dir``; several of them
    under one ``output_dir`` keep their directory's name after it (``out/Nov23_...``).
    """
    outputs = [trainer_output_dir(p) for p in paths]
    parts = []
    for p, out in zip(paths, outputs, strict=True):
        if out is None:
            parts.append(p.resolve().parts)
        elif outputs.count(out) > 1:
            parts.append((*out.parts[:-1], f"{out.name}/{p.resolve().name}"))
        else:
            parts.append(out.parts)
    return parts


def _unique_names(paths: list[Path], taken: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Run names (see :func:`_name_parts`), lengthened with parent directories until they are
    unique; names still shared, or already ``taken`` by a named run, get ``#2``, ``#3``..."""
    parts = _name_parts(paths)
    depth = [1] * len(paths)
    while True:
        names = ["/".join(pt[-k:]) for pt, k in zip(parts, depth, strict=True)]
        clash = {n for n in names if names.count(n) > 1}
        grow = [i for i, n in enumerate(names) if n in clash and depth[i] < len(parts[i])]
        if not grow:
            break
        for i in grow:
            depth[i] += 1
    seen: dict[str, int] = {n: 1 for n in taken}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        name = n if seen[n] == 1 else f"{n}#{seen[n]}"
        while name != n and name in seen:
            seen[n] += 1
            name = f"{n}#{seen[n]}"
        seen.setdefault(name, 1)
        out.append(name)
    return out


def find_runs(runs: RunsLike) -> list[tuple[str, Path]]:
    """``(name, directory)`` of every run directory at or below the given paths.

    The name is the directory's name; a Trainer's default run directory
    (``output_dir/runs/<time>_<host>``) is named after ``output_dir``. Names are lengthened
    with parent directories where two runs would otherwise share one. A mapping
    ``{name: path}`` or a :class:`NamedRun` (``NAME=PATH`` on the command line) names runs
    explicitly: the run at or below the path is ``name``, several runs below it ``name/sub``.
    Raises ``FileNotFoundError`` for a missing path and :class:`TrajectoryError` when no run
    directory is found at all or a name is given twice.
    """
    if isinstance(runs, Mapping):
        items: list[tuple[str | None, Path]] = [(str(k), Path(v)) for k, v in runs.items()]
    elif isinstance(runs, (str, os.PathLike)):
        items = [(runs.name if isinstance(runs, NamedRun) else None, Path(runs))]
    else:
        items = [(r.name if isinstance(r, NamedRun) else None, Path(r)) for r in runs]
    if not items:
        raise TrajectoryError("no run directory given")
    given = [k for k, _ in items if k is not None]
    twice = sorted({k for k in given if given.count(k) > 1})
    if twice:
        raise TrajectoryError(f"run name given twice: {', '.join(twice)}")
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
                # the one run below a named path (a Trainer's output_dir) takes the name itself
                named.append((key if rel == "." or len(dirs) == 1 else f"{key}/{rel}", d))
    if not named and not unnamed:
        given_paths = ", ".join(str(p) for _, p in items)
        raise TrajectoryError(
            f"no probe data in {given_paths}: no {TRAJECTORY_FILENAME} and no TensorBoard event "
            "files at or below it"
        )
    taken = {n for n, _ in named}
    return named + list(zip(_unique_names(unnamed, taken), unnamed, strict=True))


# --------------------------------------------------------------------------- readers


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
#: group and metric names: the tag grammar's segments (:mod:`attn_probe.tags`), bounded
_NAME = re.compile(r"[A-Za-z0-9_]{1,128}")
#: a trajectory line longer than this is corrupt (a real one is a few hundred bytes); reading
#: stops there, so one endless line cannot exhaust memory
_MAX_LINE = 1 << 20


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_int64(v: Any) -> bool:
    """An ``int`` (not ``bool``) that fits the table's int64/Int64 columns."""
    return _is_int(v) and _INT64_MIN <= v <= _INT64_MAX


def _is_name(v: Any) -> bool:
    return isinstance(v, str) and _NAME.fullmatch(v) is not None


def _reject_constant(name: str) -> Any:
    # NaN/Infinity are not JSON; the writer never emits them (NaN is null)
    raise ValueError(f"non-standard JSON constant {name}")


def _loads(line: str) -> Any:
    """``json.loads`` that fails with ``None`` on anything (deep nesting, huge numbers, ...)."""
    try:
        return json.loads(line, parse_constant=_reject_constant)
    except (ValueError, RecursionError, OverflowError, TypeError, MemoryError):
        return None


def _finite_float(v: Any) -> float | None:
    """``v`` as a finite float, or ``None`` (bools, strings, ints beyond float range, inf)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _is_text(v: Any) -> bool:
    """A ``str`` that can be written back as UTF-8 (no lone surrogates)."""
    if not isinstance(v, str):
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parse_record(rec: Any, names: Any = _is_name) -> tuple[str, int, int, int | None, str, float] | None:
    """``(group, step, layer, head, metric, value)`` of one decoded line, or ``None``.

    Valid means what the writer produces: ``step``/``layer``/``head`` integers within
    int64 (``head`` may be null), ``group``/``metric`` accepted by ``names`` (by default
    the tag grammar's names), ``value`` a finite number or null (NaN).
    """
    if not isinstance(rec, dict):
        return None
    step, layer, head = rec.get("step"), rec.get("layer"), rec.get("head")
    group, metric, value = rec.get("group"), rec.get("metric"), rec.get("value", "missing")
    if not (_is_int64(step) and names(group) and names(metric)):
        return None
    if not (_is_int64(layer) and (head is None or _is_int64(head))):
        return None
    if value is None:
        return group, step, layer, head, metric, float("nan")
    f = _finite_float(value)
    if f is None:
        return None
    return group, step, layer, head, metric, decode_value(f)


def _parse_line(line: str) -> tuple[str, int, int, int | None, str, float] | None:
    """One trajectory line as ``(group, step, layer, head, metric, value)``; ``None`` if it
    is not valid. NaN/Infinity literals, ``10**30``, 1e400, deep nesting or broken UTF-8 in
    a name make a line corrupt, never an error."""
    return _parse_record(_loads(line))


def _lines(fh: Any) -> Iterator[str | None]:
    """Lines of a binary file as text (bad UTF-8 replaced); ``None`` for an overlong line."""
    while True:
        raw = fh.readline(_MAX_LINE + 1)
        if not raw:
            return
        if len(raw) > _MAX_LINE:
            while not raw.endswith(b"\n"):  # drop the rest of it, chunk by chunk
                raw = fh.readline(_MAX_LINE)
                if not raw:
                    break
            yield None
            continue
        yield raw.decode("utf-8", errors="replace")


class _RunSplitter:
    """Tells apart the unidentified runs of rows written before run headers existed, row by row.

    A probe's steps only increase, and a resumed run first cuts the file before its resume step
    (:func:`attn_probe.trajectory_format.cut_run`), so a value (``group, layer, head,
    metric``) is written again at a step at or before its last one only where a fresh run was
    started in a ``log_dir`` that already held one (its sink warns and appends), and such a run
    counts from step 0. A value written again at a step ``s`` starts a new run when ``s`` is at or
    before the first step of the current run, and otherwise continues it: a resume appended
    without the cut, whose rows from ``s`` on replace the earlier ones (the value written last
    counts, :func:`normalize`). Values are compared one by one, so rows in any order within a
    run (a file written by hand metric by metric) stay one run. Files with run headers need no
    guess: every row belongs to the run of the header before it.
    """

    def __init__(self) -> None:
        self._first = 0  # the current run's first step
        self._last: dict[tuple, int] = {}  # (group, layer, head, metric) -> its last step in the current run

    def starts_run(self, row: tuple, fresh: bool) -> bool:
        """Whether ``row`` starts a new run (``fresh``: no unidentified run is open yet)."""
        group, step, layer, head, metric, _ = row
        key = (group, layer, head, metric)
        last = self._last.get(key)
        new = fresh or (last is not None and step <= last and step <= self._first)
        if new:
            self._last.clear()
            self._first = step
        self._first = min(self._first, step)
        self._last[key] = step
        return new


class _FileRuns:
    """The valid rows of one trajectory file as column arrays, each row tagged with its run's index.

    Run ``i`` is ``ids[i]`` (``None`` for a run written before run headers), ``parents[i]``,
    ``parent_steps[i]``. Rows are kept in numpy arrays per block (8 bytes a value; group and
    metric names as codes into :attr:`names`): one table for the whole file, whatever the
    number of runs, so memory and time are linear in the file with small constants.
    """

    def __init__(self) -> None:
        self.ids: list[str | None] = []
        self.parents: list[str | None] = []
        self.parent_steps: list[int | None] = []
        self.names: dict[str, int] = {}  # group and metric names -> code
        self._blocks: list[tuple[Any, ...]] = []  # (run, group, step, layer, head, head_missing, metric, value)
        self._pending: tuple[list, ...] = ([], [], [], [], [], [], [], [])

    def new_run(self, run_id: str | None = None, parent: str | None = None, parent_step: int | None = None) -> int:
        self.ids.append(run_id)
        self.parents.append(parent)
        self.parent_steps.append(parent_step)
        return len(self.ids) - 1

    def code(self, name: str) -> int:
        return self.names.setdefault(name, len(self.names))

    def add(self, run: int, row: tuple) -> None:
        """One row ``(group, step, layer, head, metric, value)`` (kept until :meth:`flush`)."""
        group, step, layer, head, metric, value = row
        for column, v in zip(self._pending, (run, self.code(group), step, layer, 0 if head is None else head,
                                             head is None, self.code(metric), value), strict=True):
            column.append(v)

    def add_block(self, *columns: Any) -> None:
        """Rows as arrays ``(run, group code, step, layer, head, head missing, metric code, value)``."""
        self.flush()
        self._blocks.append(columns)

    def flush(self) -> None:
        import numpy as np

        pending = self._pending
        if pending[0]:
            self._blocks.append(tuple(np.array(c, dtype=t) for c, t in zip(
                pending, (np.int64, np.int64, np.int64, np.int64, np.int64, bool, np.int64, np.float64), strict=True)))
            self._pending = ([], [], [], [], [], [], [], [])

    def columns(self) -> tuple[Any, ...]:
        """``(run, group, step, layer, head, head missing, metric, value)`` arrays of every row."""
        import numpy as np

        self.flush()
        if not self._blocks:
            return tuple(np.array([], dtype=t) for t in (np.int64, np.int64, np.int64, np.int64, np.int64, bool,
                                                          np.int64, np.float64))
        out = tuple(np.concatenate(c) if len(self._blocks) > 1 else c[0] for c in zip(*self._blocks, strict=True))
        self._blocks = [out]
        return out

    @property
    def identified(self) -> bool:
        return any(r is not None for r in self.ids)

    def counts(self) -> Any:
        """Rows per run (a numpy array)."""
        import numpy as np

        return np.bincount(self.columns()[0], minlength=len(self.ids))

    def step_range(self, run: int) -> tuple[int, int]:
        """First and last step of run ``run`` (which has rows)."""
        cols = self.columns()
        steps = cols[2][cols[0] == run]
        return int(steps.min()), int(steps.max())


_NUMBER = r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?"
#: a row exactly as the sink writes it (``json.dumps`` of :data:`FIELDS`): read without json;
#: 18 digits at most, so the integers fit int64; anything else goes through json and validation
_ROW = (r'\{"step": (-?\d{1,18}), "wall_time": ' + _NUMBER + r', "group": "([A-Za-z0-9_]{1,128})", '
        r'"layer": (-?\d{1,18}), "head": (null|-?\d{1,18}), "metric": "([A-Za-z0-9_]{1,128})", '
        r'"value": (null|' + _NUMBER + r')\}')
_CANONICAL = re.compile(_ROW + r"\n?")
#: the same, for every line of a block at once
_CANONICAL_LINES = re.compile(r"^" + _ROW + r"$", re.MULTILINE)
#: bytes read at once
_READ_BLOCK = 4 << 20


def _text_blocks(fh: Any) -> Iterator[str | None]:
    """Blocks of complete lines of a binary file as text (bad UTF-8 replaced); ``None`` for a
    line over :data:`_MAX_LINE` without a newline in reach (skipped through)."""
    buf = b""
    skipping = False
    while True:
        chunk = fh.read(_READ_BLOCK)
        if not chunk:
            break
        if skipping:
            nl = chunk.find(b"\n")
            if nl < 0:
                continue
            chunk, skipping = chunk[nl + 1:], False
        buf += chunk
        end = buf.rfind(b"\n") + 1
        if end == 0:
            if len(buf) > _MAX_LINE:
                yield None
                buf, skipping = b"", True
            continue
        yield buf[:end].decode("utf-8", errors="replace")
        buf = buf[end:]
    if buf.strip() and not skipping:
        yield buf.decode("utf-8", errors="replace")  # a torn last line: read (and refused) as a line


def _canonical_block(block: str, out: _FileRuns) -> tuple[Any, ...] | None:
    """``(group, step, layer, head, head missing, metric, value)`` arrays of a block whose every
    line is a row as the sink writes it, else ``None``. Parsed by numpy, names as codes."""
    import numpy as np

    rows = _CANONICAL_LINES.findall(block)
    if not rows or len(rows) != block.count("\n"):
        return None
    table = np.array(rows)  # (rows, 6) strings, built in C
    del rows
    step, group, layer, head, metric, value = (table[:, i] for i in range(6))
    values = np.where(value == "null", "nan", value).astype(np.float64)
    if np.isinf(values).any():  # 1e400: not a finite number
        return None
    missing = head == "null"
    heads = np.where(missing, "0", head).astype(np.int64)

    def codes(names: Any) -> Any:
        uniq, inverse = np.unique(names, return_inverse=True)
        return np.array([out.code(str(u)) for u in uniq], dtype=np.int64)[inverse.ravel()]

    return (codes(group), step.astype(np.int64), layer.astype(np.int64), heads, missing, codes(metric), values)


def _read_trajectory_file(path: Path) -> _FileRuns:
    """The valid rows of a trajectory file, tagged by run.

    A header record (:mod:`attn_probe.trajectory_format`) starts the rows of its run (the run
    it names when that id came before: a resumption; a resumed header of a new id continues
    the unidentified run before it: a resume from a checkpoint written before run ids).
    Rows before any header are split into runs by :class:`_RunSplitter`. Blocks of rows as the
    sink writes them are parsed at once (a regular expression and numpy); other lines are parsed
    and validated one by one.
    """
    import numpy as np

    out = _FileRuns()
    splitter = _RunSplitter()
    by_id: dict[str, int] = {}
    current: int | None = None  # the run the next row belongs to
    identified = False  # inside a header's rows
    bad = 0
    nan = float("nan")
    isfinite = math.isfinite
    match = _CANONICAL.fullmatch

    def runs_of(group: Any, step: Any, layer: Any, head: Any, missing: Any, metric: Any) -> Any:
        """The run index of each row of a block (before any header: the steps starting again start a run)."""
        nonlocal current
        if identified:
            return np.full(len(step), current, dtype=np.int64)
        first, last = splitter._first, splitter._last
        ids, parents, parent_steps = out.ids, out.parents, out.parent_steps
        # each row's value (group, layer, head, metric) as one small int, found by numpy
        pd = _pandas()
        combined = np.zeros(len(step), dtype=np.int64)
        for column in (group, layer, np.where(missing, np.iinfo(np.int64).min, head), metric):
            codes, uniq = pd.factorize(column)  # hashing, linear; each count <= the block's rows (< 2**15.2)
            combined = combined * len(uniq) + codes
        inverse, _ = pd.factorize(combined)
        at = np.unique(inverse, return_index=True)[1]  # a row of each value, in the order of ``inverse``'s codes
        # the same key as rows read one by one get (global group/metric codes), so runs continue across blocks
        keys = [(g, la, None if hm else h, m) for g, la, h, hm, m in zip(
            group[at].tolist(), layer[at].tolist(), head[at].tolist(), missing[at].tolist(), metric[at].tolist(),
            strict=True)]
        runs = []
        for k, s in zip(inverse.tolist(), step.tolist(), strict=True):
            key = keys[k]
            prev = last.get(key)
            if current is None or (prev is not None and s <= prev and s <= first):
                ids.append(None)
                parents.append(None)
                parent_steps.append(None)
                current = len(ids) - 1
                last.clear()
                first = s
            elif s < first:
                first = s
            last[key] = s
            runs.append(current)
        splitter._first = first
        return np.array(runs, dtype=np.int64)

    with open(path, "rb") as fh:
        for block in _text_blocks(fh):
            if block is None:
                bad += 1
                continue
            fast = _canonical_block(block, out)
            if fast is not None:
                out.add_block(runs_of(*fast[:6]), *fast)
                continue
            lines = block.split("\n")
            if lines[-1] == "":
                lines.pop()
            for line in lines:
                if len(line) > _MAX_LINE:
                    bad += 1
                    continue
                m = match(line)
                parsed = None
                if m is not None:
                    step, group, layer, head, metric, value = m.groups()
                    v = nan if value == "null" else float(value)
                    if v != v or isfinite(v):  # a finite value or null (NaN)
                        parsed = (group, int(step), int(layer), None if head == "null" else int(head), metric, v)
                if parsed is None:
                    if not line.strip():
                        continue
                    rec = _loads(line)
                    if isinstance(rec, dict) and HEADER_KEY in rec:
                        header = parse_header(rec)
                        if header is None:
                            bad += 1
                            continue
                        if header.run_id in by_id:
                            current = by_id[header.run_id]
                        elif header.resumed and current is not None and out.ids[current] is None:
                            out.ids[current] = header.run_id
                        else:
                            current = out.new_run(header.run_id, header.parent_run, header.parent_step)
                        by_id[header.run_id] = current
                        identified = True
                        continue
                    parsed = _parse_record(rec)
                    if parsed is None:
                        bad += 1
                        continue
                group, step, layer, head, metric, _ = parsed
                if not identified:
                    key = (out.code(group), layer, head, out.code(metric))
                    prev = splitter._last.get(key)
                    if current is None or (prev is not None and step <= prev and step <= splitter._first):
                        current = out.new_run()
                        splitter._last.clear()
                        splitter._first = step
                    splitter._first = min(splitter._first, step)
                    splitter._last[key] = step
                out.add(current, parsed)
    if bad:
        warnings.warn(
            f"{path}: skipped {bad} corrupt or truncated line{'s' if bad != 1 else ''}",
            TrajectoryWarning,
            stacklevel=4,
        )
    return out


# TFRecord framing of event files: u64 length, masked crc32c of the length, data, masked crc32c
# of the data (all little-endian)
_RECORD_HEADER = struct.Struct("<QI")
_CRC = struct.Struct("<I")
_FRAME = _RECORD_HEADER.size + _CRC.size  # bytes of a record besides its data
#: bytes of the file checked at once
_WINDOW = 32 << 20
#: records of one length checked together with numpy; fewer go through TensorBoard's crc
_BATCH_MIN = 16


def _crc_tools() -> tuple[Any, Any]:
    """TensorBoard's own ``masked_crc32c`` (its event writer uses it) and its CRC-32C table."""
    import numpy as np
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as tb

    return tb.masked_crc32c, np.asarray(tb.CRC_TABLE, dtype=np.uint32)


def _masked_crc32c_many(buf: Any, starts: Any, length: int, table: Any) -> Any:
    """Masked CRC-32C of ``buf[s:s+length]`` for every ``s`` in ``starts``, vectorised over
    the records (one numpy step per byte position), as TensorBoard's ``masked_crc32c``."""
    import numpy as np

    crc = np.full(len(starts), 0xFFFFFFFF, dtype=np.uint32)
    for j in range(length):
        crc = table[(crc ^ buf[starts + j]) & 0xFF] ^ (crc >> 8)
    crc ^= np.uint32(0xFFFFFFFF)
    return (((crc >> 15) | (crc << 17)) + np.uint32(0xA282EAD8)).astype(np.uint32)


def _first_bad_record(buf: Any, rel: Any, lengths: Any, tools: tuple[Any, Any]) -> tuple[int, str] | None:
    """``(index, problem)`` of the first record in ``buf`` (at offsets ``rel``) whose length
    or data fails its checksum, or ``None``."""
    import numpy as np

    masked_crc32c, table = tools
    stored = lambda at: (buf[at].astype(np.uint32) | (buf[at + 1].astype(np.uint32) << 8)  # noqa: E731
                         | (buf[at + 2].astype(np.uint32) << 16) | (buf[at + 3].astype(np.uint32) << 24))
    n = len(rel)
    bad_len = _masked_crc32c_many(buf, rel, 8, table) != stored(rel + 8)
    bad_data = np.zeros(n, dtype=bool)
    data_at, crc_at = rel + _RECORD_HEADER.size, rel + _RECORD_HEADER.size + lengths
    for length in np.unique(lengths):
        idx = np.nonzero(lengths == length)[0]
        if len(idx) >= _BATCH_MIN:
            bad_data[idx] = _masked_crc32c_many(buf, data_at[idx], int(length), table) != stored(crc_at[idx])
        else:
            for i in idx:
                a = int(data_at[i])
                bad_data[i] = masked_crc32c(buf[a:a + int(length)].tobytes()) != int(stored(crc_at[i:i + 1])[0])
    first_len = int(np.argmax(bad_len)) if bad_len.any() else n
    first_data = int(np.argmax(bad_data)) if bad_data.any() else n
    if first_len == n and first_data == n:
        return None
    if first_len <= first_data:
        return first_len, "record length fails its checksum"
    return first_data, "record data fails its checksum"


def _zero_tail(fh: Any, off: int) -> bool:
    fh.seek(off)
    while chunk := fh.read(1 << 20):
        if chunk.strip(b"\0"):
            return False
    return True


def scan_event_file(path: PathLike) -> tuple[int, str] | None:
    """Check the record framing of an event file to its end: ``(byte offset, what is wrong)``
    of the first corrupt record, or ``None`` when every record is intact.

    TensorBoard's loader stops at a corrupt record (and says so only at debug level), so
    everything after that offset is lost to it. A torn last record (a file still being
    written, or cut by a crash) is not corruption, and neither is an all-zero tail (a
    crash after the file grew but before its data reached the disk). Checksums are TensorBoard's
    masked CRC-32C, computed with numpy over many records at once.
    """
    import numpy as np

    tools = _crc_tools()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        # walk the framing: where each record starts and how long its data is
        offsets: list[int] = []
        lengths: list[int] = []
        off = 0
        tail: bytes | None = None  # header of a last record that runs past the end
        while off + _RECORD_HEADER.size <= size:
            fh.seek(off)
            head = fh.read(_RECORD_HEADER.size)
            if len(head) < _RECORD_HEADER.size:
                break
            length = _RECORD_HEADER.unpack(head)[0]
            if off + _FRAME + length > size:
                tail = head
                break
            offsets.append(off)
            lengths.append(length)
            off += _FRAME + length
        # check the records window by window; the first bad one is reported
        offs, lens = np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        ends = offs + _FRAME + lens
        i = 0
        while i < len(offs):
            j = max(i + 1, int(np.searchsorted(ends, offs[i] + _WINDOW, side="right")))
            fh.seek(int(offs[i]))
            raw = fh.read(int(ends[j - 1] - offs[i]))
            if len(raw) < ends[j - 1] - offs[i]:
                return None  # the file shrank while we read it
            found = _first_bad_record(np.frombuffer(raw, dtype=np.uint8), offs[i:j] - offs[i], lens[i:j], tools)
            if found is not None:
                bad_off = int(offs[i + found[0]])
                return None if _zero_tail(fh, bad_off) else (bad_off, found[1])
            i = j
        if tail is not None and tools[0](tail[:8]) != _CRC.unpack(tail[8:])[0]:
            # not a torn record: its length is garbage
            return None if _zero_tail(fh, off) else (off, "record length fails its checksum")
    return None


def _check_event_files(run_dir: Path) -> None:
    """Warn about each event file in ``run_dir`` that is corrupt before its end."""
    try:
        files = sorted(e for e in run_dir.iterdir() if is_event_file(e.name) and e.is_file())
    except OSError:
        return
    for f in files:
        try:
            found = scan_event_file(f)
            size = f.stat().st_size
        except OSError:
            continue
        if found is not None:
            off, problem = found
            warnings.warn(
                f"{f}: corrupt event record at byte offset {off} of {size} ({problem}); TensorBoard "
                f"reads this file only up to there, so the values in its last {size - off} bytes are "
                "missing",
                TrajectoryWarning,
                stacklevel=5,
            )


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
    _check_event_files(run_dir)
    try:
        acc.Reload()
    except Exception as exc:  # corrupt event data: report, do not crash
        warnings.warn(f"{run_dir}: unreadable event files skipped ({type(exc).__name__}: {exc})",
                      TrajectoryWarning, stacklevel=4)
        return []
    rows: list[tuple] = []
    bad = 0
    tags = acc.Tags()
    for kind in ("scalars", "tensors"):  # tensors: scalars written with new_style=True
        for tag in tags.get(kind, []):
            parts = parse_tag(tag)
            if parts is None or parts.stat is not None:
                continue
            if not (_is_int64(parts.layer) and (parts.head is None or _is_int64(parts.head))):
                bad += 1  # a layer_/head_ number beyond int64
                continue
            for ev in (acc.Scalars(tag) if kind == "scalars" else acc.Tensors(tag)):
                try:
                    if kind == "scalars":
                        value = float(ev.value)
                    else:
                        arr = tensor_util.make_ndarray(ev.tensor_proto)
                        if arr.size != 1:
                            continue
                        value = float(arr.item())
                except Exception:  # noqa: BLE001 - a malformed event is skipped and counted
                    bad += 1
                    continue
                if not _is_int64(ev.step):
                    bad += 1
                    continue
                rows.append((parts.group, ev.step, parts.layer, parts.head, parts.metric, value))
    if bad:
        warnings.warn(f"{run_dir}: skipped {bad} malformed event value{'s' if bad != 1 else ''} or tag"
                      f"{'s' if bad != 1 else ''}", TrajectoryWarning, stacklevel=4)
    return rows


def _read_run(run_dir: Path) -> _FileRuns:
    """The rows of the run(s) in ``run_dir``: those of its trajectory file, or one run from its
    event files (no runs when there is nothing)."""
    traj = run_dir / TRAJECTORY_FILENAME
    if traj.is_file():
        found = _read_trajectory_file(traj)
        if found.ids or not has_event_files(str(run_dir)):
            return found
        warnings.warn(f"{traj} holds no valid line; reading the event files instead",
                      TrajectoryWarning, stacklevel=3)
    out = _FileRuns()
    rows = _read_event_files(run_dir)
    if rows:
        run = out.new_run()
        for row in rows:
            out.add(run, row)
    return out


def _is_na(v: Any) -> bool:
    """A scalar missing value (``None``, NaN, ``pd.NA``); never an error for other objects."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return True
    try:
        import pandas as pd

        return v is pd.NA or v is pd.NaT or (hasattr(v, "dtype") and getattr(v, "ndim", 1) == 0
                                              and bool(pd.isna(v)))
    except Exception:  # noqa: BLE001
        return False


def _as_int64(v: Any) -> int | None:
    """``v`` as an int within int64, or ``None`` (also for fractions, inf, text, containers)."""
    if isinstance(v, bool):
        return None
    try:
        if isinstance(v, str):
            v = v.strip()
            try:
                v = int(v)
            except ValueError:
                v = float(v)
        elif hasattr(v, "dtype") and getattr(v, "ndim", 1) == 0:  # numpy scalar
            v = v.item()
        if isinstance(v, float):
            if not math.isfinite(v) or v != math.floor(v):
                return None
            v = int(v)
    except (ValueError, TypeError, OverflowError):
        return None
    return v if _is_int64(v) else None


def _int_column(s: pd.Series, nullable: bool) -> tuple[Any, Any]:
    """``(Int64 values, bad-row mask)``: rows that are not integers within int64 are bad
    (and missing ones too unless ``nullable``). Fast paths for integer and float columns."""
    import numpy as np

    pd = _pandas()
    n = len(s)
    if pd.api.types.is_integer_dtype(s.dtype) and not pd.api.types.is_unsigned_integer_dtype(s.dtype):
        out = s.astype("Int64")
        na = out.isna().to_numpy()
        return out, (np.zeros(n, dtype=bool) if nullable else na)
    if pd.api.types.is_float_dtype(s.dtype):
        f = s.to_numpy(dtype="float64", na_value=np.nan)
        na = np.isnan(f)
        with np.errstate(invalid="ignore"):
            good = np.isfinite(f) & (f == np.trunc(f)) & (f >= -(2.0**63)) & (f < 2.0**63)
        vals = np.where(good, f, 0.0).astype(np.int64)
    else:  # object, strings, unsigned, bool: one by one
        vals = np.zeros(n, dtype=np.int64)
        good = np.zeros(n, dtype=bool)
        na = np.zeros(n, dtype=bool)
        for i, v in enumerate(s.tolist()):
            if _is_na(v):
                na[i] = True
                continue
            iv = _as_int64(v)
            if iv is not None:
                vals[i], good[i] = iv, True
    bad = ~good & ~na if nullable else ~good
    return pd.Series(pd.arrays.IntegerArray(vals, ~good), index=s.index), bad


def _float_column(s: pd.Series) -> tuple[Any, Any]:
    """``(float64 values, bad-row mask)``: missing is NaN; text, bools, containers are bad."""
    import numpy as np

    pd = _pandas()
    if (pd.api.types.is_float_dtype(s.dtype) or pd.api.types.is_integer_dtype(s.dtype)) and \
            not pd.api.types.is_bool_dtype(s.dtype):
        return s.to_numpy(dtype="float64", na_value=np.nan), np.zeros(len(s), dtype=bool)
    vals = np.full(len(s), np.nan)
    bad = np.zeros(len(s), dtype=bool)
    for i, v in enumerate(s.tolist()):
        if _is_na(v):
            continue
        try:
            if isinstance(v, bool) or not isinstance(v, (int, float, str)) and not hasattr(v, "dtype"):
                raise TypeError
            vals[i] = float(v)
        except (ValueError, TypeError, OverflowError):
            bad[i] = True
    return vals, bad


def _str_column(s: pd.Series) -> tuple[Any, Any]:
    """``(str values, bad-row mask)``: text that cannot be written as UTF-8 (lone surrogates) is bad."""
    import numpy as np

    out = s.astype(str)
    unique = out.unique().tolist()
    try:  # all of them at once: one encode (a lone surrogate fails it)
        "".join(unique).encode("utf-8")
        wrong: list[str] = []
    except UnicodeEncodeError:
        wrong = [v for v in unique if not _is_text(v)]
    return out, (out.isin(wrong).to_numpy() if wrong else np.zeros(len(s), dtype=bool))


def _optional_text_column(s: pd.Series) -> tuple[Any, Any]:
    """``(object values, bad-row mask)`` of a nullable text column: missing is ``None``; text
    that cannot be written as UTF-8, or a non-text value, is bad."""
    import numpy as np

    values = s.to_numpy(dtype=object, na_value=None)
    out = np.empty(len(values), dtype=object)
    bad = np.zeros(len(values), dtype=bool)
    cache: dict[Any, bool] = {}
    for i, v in enumerate(values):
        if isinstance(v, str):
            ok = cache.get(v)
            if ok is None:
                ok = cache[v] = _is_text(v)
            if ok:
                out[i] = v
                continue
        elif v is None or _is_na(v):
            continue
        bad[i] = True
    return out, bad


def normalize(df: pd.DataFrame, source: str | None = None) -> pd.DataFrame:
    """Coerce a long table to the canonical dtypes, drop duplicate steps (keep last), sort.

    The lineage columns (:data:`LINEAGE`) are kept when present (missing ones added empty).
    Metric names of earlier versions are renamed (:data:`RENAMED_METRICS`: ``ov_qk_bound`` is
    ``ov_gain_bound``). Rows whose ``step`` is not an integer within int64 (missing, fractional, ``1e30``,
    text), whose ``layer``/``head`` is not such an integer or missing, or whose ``value`` is
    not a number are dropped with one :class:`TrajectoryWarning` counting them
    (``source`` names where they came from).
    """
    import numpy as np

    pd = _pandas()
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise TrajectoryError(f"table lacks column(s) {', '.join(missing)}; expected {', '.join(COLUMNS)}")
    step, bad_step = _int_column(df["step"], nullable=False)
    layer, bad_layer = _int_column(df["layer"], nullable=True)
    head, bad_head = _int_column(df["head"], nullable=True)
    value, bad_value = _float_column(df["value"])
    cols = {c: _str_column(df[c]) for c in ("run", "group", "metric")}
    bad = bad_step | bad_layer | bad_head | bad_value
    for _, b in cols.values():
        bad |= b
    metric = cols["metric"][0]
    if metric.isin(list(RENAMED_METRICS)).any():  # runs written before a metric was renamed
        metric = metric.replace(RENAMED_METRICS)
    out = pd.DataFrame({
        "run": cols["run"][0],
        "group": cols["group"][0],
        "step": step.fillna(0).astype("int64"),
        "layer": layer,
        "head": head,
        "metric": metric,
        "value": pd.Series(value, index=df.index, dtype="float64"),
    })
    if any(c in df.columns for c in LINEAGE):  # lineage: text ids or missing, an int64 step or missing
        for c in ("run_id", "parent_run"):
            text, bad_text = _optional_text_column(df[c]) if c in df.columns else (None, None)
            out[c] = text if text is not None else None
            if bad_text is not None:
                bad |= bad_text
        if "parent_step" in df.columns:
            parent_step, bad_parent = _int_column(df["parent_step"], nullable=True)
            out["parent_step"] = parent_step
            bad |= bad_parent
        else:
            out["parent_step"] = pd.array([pd.NA] * len(out), dtype="Int64")
    if bad.any():
        n = int(bad.sum())
        warnings.warn(
            f"{source or 'the table'}: skipped {n} row{'s' if n != 1 else ''} with an invalid step, layer, "
            "head, value or name (steps, layers and heads must be integers within int64)",
            TrajectoryWarning, stacklevel=3,
        )
        out = out[~np.asarray(bad)]
    out = out.drop_duplicates(subset=_KEY, keep="last")
    out = out.sort_values(_KEY, na_position="first", kind="stable").reset_index(drop=True)
    return out


def escape_formulas(values: pd.Series) -> pd.Series:
    """Text cells made inert for spreadsheets: a leading ``'`` before ``=``, ``+``, ``-``, ``@``,
    tab or carriage return (OWASP's CSV-injection rule), and before a leading ``'`` too, so that
    :func:`unescape_formulas` restores every name exactly. Only for text columns: numbers that
    start with ``-`` are values, not formulas."""
    text = values.astype(str)
    risky = text.str.startswith((*FORMULA_START, "'"))
    return text.where(~risky, "'" + text)


def unescape_formulas(values: pd.Series) -> pd.Series:
    """Inverse of :func:`escape_formulas` (a CSV written by ``export``, read back)."""
    text = values.astype(str)
    escaped = text.str.startswith(tuple("'" + c for c in (*FORMULA_START, "'")))
    return text.where(~escaped, text.str[1:])


def _file_frame(names: list[str], found: _FileRuns) -> pd.DataFrame:
    """One table of a file's rows (``names[i]`` is run ``i``'s name), with exact dtypes (no float
    round trip for the ints) and the lineage columns; the run columns share one string per run."""
    import numpy as np

    pd = _pandas()
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
    from ..logdir import printable

    text = printable(name)
    return text if len(text) <= _NAME_IN_WARNING else text[:_NAME_IN_WARNING - 3] + "..."


def load_trajectory(runs: RunsLike) -> pd.DataFrame:
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
    (:class:`_RunSplitter`); a resumed run stays one run. Time and memory are linear in the
    files, whatever the number of runs. Corrupt or truncated trajectory lines are skipped with
    one :class:`TrajectoryWarning` per file; directories without probe data are skipped with a
    warning, and :class:`TrajectoryError` is raised when nothing usable is left.

    Example:
        >>> df = load_trajectory("runs/encoder")                      # doctest: +SKIP
        >>> df[df["head"].isna()].groupby(["metric", "step"])["value"].median()  # doctest: +SKIP
    """
    pd = _pandas()
    tables, dirs = _split_tables(runs)
    frames = [read_table(t) for t in tables]
    lineage = any("run_id" in f.columns for f in frames)
    found = find_runs(dirs) if dirs or not tables else []
    taken = {n for n, _ in found}.union(*(set(f["run"]) for f in frames))
    empty: list[str] = []
    several: list[str] = []  # one text per file holding several runs (the first few only)
    files_several = runs_several = 0
    for name, run_dir in found:
        got = _read_run(run_dir)
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
    df = df.drop_duplicates(subset=_KEY, keep="last")
    return df.sort_values(_KEY, na_position="first", kind="stable").reset_index(drop=True)


def _runs_text(path: Path, names: list[str], found: _FileRuns, live: list[int]) -> str:
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
            rec[c] = None if _is_na(v) else int(v) if c == "parent_step" else v
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
            for line in _lines(fh):
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
    rec = _loads(line)
    if not isinstance(rec, dict) or not _is_text(rec.get("run")):
        return None
    parsed = _parse_record(rec, names=_is_text)  # a table may hold any names a DataFrame had
    if parsed is None:
        return None
    lineage = tuple(rec.get(c) for c in LINEAGE)
    return (rec["run"], *parsed, *lineage), any(c in rec for c in LINEAGE)
