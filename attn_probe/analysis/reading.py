"""Reading one run directory's files into rows: the trajectory file ``attn_probe.jsonl`` (the
canonical fast path, then line by line; runs split by run header or by restarting steps) and
TensorBoard event files (checked for corrupt records first). Values that are not what the
writers produce are skipped and counted, never an error.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..formats.events import has_event_files, is_event_file, scan_event_file
from ..formats.lines import Unreadable
from ..formats.runs import RunTracker, describe_events, looks_like_header, run_label, run_labels
from ..formats.tags import parse_tag
from ..formats.trajectory import HEADER_KEY, TRAJECTORY_FILENAME, decode_value, line_blocks, parse_header
from .table import MissingExtraError, TrajectoryWarning, is_int64, require_pandas

#: group and metric names: the tag grammar's segments (:mod:`attn_probe.formats.tags`), bounded
_NAME = re.compile(r"[A-Za-z0-9_]{1,128}")
#: a trajectory line longer than this is corrupt (a real one is a few hundred bytes); reading
#: stops there, so one endless line cannot exhaust memory
_MAX_LINE = 1 << 20


def _is_name(v: Any) -> bool:
    return isinstance(v, str) and _NAME.fullmatch(v) is not None


def _reject_constant(name: str) -> Any:
    # NaN/Infinity are not JSON; the writer never emits them (NaN is null)
    raise ValueError(f"non-standard JSON constant {name}")


def loads_line(line: str) -> Any:
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


def parse_record(rec: Any, names: Any = _is_name) -> tuple[str, int, int, int | None, str, float] | None:
    """``(group, step, layer, head, metric, value)`` of one decoded line, or ``None``.

    Valid means what the writer produces: ``step``/``layer``/``head`` integers within
    int64 (``head`` may be null), ``group``/``metric`` accepted by ``names`` (by default
    the tag grammar's names), ``value`` a finite number or null (NaN).
    """
    if not isinstance(rec, dict):
        return None
    step, layer, head = rec.get("step"), rec.get("layer"), rec.get("head")
    group, metric, value = rec.get("group"), rec.get("metric"), rec.get("value", "missing")
    if not (is_int64(step) and names(group) and names(metric)):
        return None
    if not (is_int64(layer) and (head is None or is_int64(head))):
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
    return parse_record(loads_line(line))


def lines_of(fh: Any) -> Iterator[str | None]:
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


class FileRuns:
    """The valid rows of one trajectory file as column arrays, each row tagged with its run's index.

    Run ``i`` is ``ids[i]`` (``None`` for a run written before run headers), ``parents[i]``,
    ``parent_steps[i]``. Rows are kept in numpy arrays per block (8 bytes a value; group and
    metric names as codes into :attr:`names`): one table for the whole file, whatever the
    number of runs, so memory and time are linear in the file with small constants.

    ``heads=False`` keeps only the layer-level rows (``head`` missing): memory then grows with
    those alone (what ``summary`` and the emergence read). Every row still counts in
    :meth:`counts` and :meth:`step_range`, so runs are found and named as when every row is kept.
    """

    def __init__(self, *, heads: bool = True) -> None:
        self.heads = heads
        self._runs: dict[int, list[int]] = {}  # heads=False: run -> [rows, first step, last step] of every row
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

    def _count(self, run: int, rows: int, low: int, high: int) -> None:
        held = self._runs.get(run)
        if held is None:
            self._runs[run] = [rows, low, high]
        else:
            held[0] += rows
            held[1] = min(held[1], low)
            held[2] = max(held[2], high)

    def add(self, run: int, row: tuple) -> None:
        """One row ``(group, step, layer, head, metric, value)`` (kept until :meth:`flush`)."""
        group, step, layer, head, metric, value = row
        if not self.heads:
            self._count(run, 1, step, step)
            if head is not None:
                return
        for column, v in zip(self._pending, (run, self.code(group), step, layer, 0 if head is None else head,
                                             head is None, self.code(metric), value), strict=True):
            column.append(v)

    def add_block(self, *columns: Any) -> None:
        """Rows as arrays ``(run, group code, step, layer, head, head missing, metric code, value)``."""
        self.flush()
        if not self.heads:
            import numpy as np

            runs, steps, missing = columns[0], columns[2], columns[5]
            for run in np.unique(runs).tolist():
                mine = steps[runs == run]
                self._count(run, len(mine), int(mine.min()), int(mine.max()))
            if not missing.all():
                columns = tuple(c[missing] for c in columns)
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
        """Rows per run (a numpy array), every row counted (``heads=False`` too)."""
        import numpy as np

        if not self.heads:
            counts = np.zeros(len(self.ids), dtype=np.int64)
            for run, (rows, _low, _high) in self._runs.items():
                counts[run] = rows
            return counts
        return np.bincount(self.columns()[0], minlength=len(self.ids))

    def step_range(self, run: int) -> tuple[int, int]:
        """First and last step of run ``run`` (which has rows)."""
        if not self.heads:
            _rows, low, high = self._runs[run]
            return low, high
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


def _text_blocks(fh: Any) -> Iterator[str | Unreadable]:
    """Blocks of complete lines of a binary file as text (bad UTF-8 replaced); an
    :class:`~attn_probe.formats.runs.Unreadable` for a line over :data:`_MAX_LINE` without a
    newline in reach (skipped through); a torn last line is read (and refused) as a line."""
    for _offset, block in line_blocks(fh, _READ_BLOCK, _MAX_LINE, keep_torn=True):
        yield block if isinstance(block, Unreadable) else block.decode("utf-8", errors="replace")


def _canonical_block(block: str, out: FileRuns) -> tuple[Any, ...] | None:
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


class _FileReader:
    """Reads one trajectory file into a :class:`FileRuns`, each row given to its run by a
    :class:`~attn_probe.formats.runs.RunTracker` (the rules the resume cut follows too).

    A valid header record starts its run's rows; a header that cannot be read, or a row whose
    step goes back after a header, starts a run without an id; a header reusing an earlier run's
    id starts ``<id>#2``; rows before any header are split by their steps starting again
    (:class:`~attn_probe.formats.runs.RunSplitter`). Blocks of rows as the sink writes them are
    parsed at once (a regular expression and numpy); other lines one by one.
    """

    def __init__(self, *, heads: bool = True) -> None:
        self.out = FileRuns(heads=heads)
        self.tracker = RunTracker()
        self.index: dict[tuple, int] = {}  # run key -> run index in ``out``
        self.line = 0  # lines read before the current block
        self.bad = 0

    def run_of(self, key: tuple | None, parent: str | None = None, parent_step: int | None = None) -> int:
        if key is None:  # a row before any header or row: cannot happen (the tracker opens a run)
            key = self.tracker.new_legacy()
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = self.out.new_run(run_label(key), parent, parent_step)
        return i

    def header(self, rec: dict, text: str) -> None:
        """A header-like line at :attr:`line` (``rec``: its JSON, or ``None``)."""
        header = parse_header(rec) if len(text) <= _MAX_LINE else None
        tracker = self.tracker
        if header is None:
            why = ("not valid JSON" if rec is None else f"no {HEADER_KEY} object" if HEADER_KEY not in rec
                   else f"its {HEADER_KEY} has no valid run_id or step")
            tracker.unreadable_header(self.line, why)
            return
        key = tracker.header(header.run_id, header.step, header.resumed, self.line)
        i = self.run_of(key, header.parent_run, header.parent_step)
        if key[0] == "legacy" and self.out.ids[i] is None:  # resumed from a checkpoint written before run ids
            self.out.ids[i] = header.run_id

    def legacy_runs(self, group: Any, step: Any, layer: Any, head: Any, missing: Any, metric: Any) -> Any:
        """The run index of each row of a block before any header (the steps starting again start a run)."""
        import numpy as np

        tracker = self.tracker
        split = tracker.splitter
        # each row's value (group, layer, head, metric) as one small int, found by numpy
        pd = require_pandas()
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
        if tracker.key is not None and split.continues(keys, int(step.min())):  # no row starts a run
            return np.full(len(step), self.run_of(tracker.key), dtype=np.int64)
        first, seen = split.first, split.seen
        current = None if tracker.key is None else self.run_of(tracker.key)
        runs = []
        for k, s in zip(inverse.tolist(), step.tolist(), strict=True):
            key = keys[k]
            if current is None or (s <= first and key in seen):
                current = self.run_of(tracker.new_legacy())
                seen.clear()
                first = s
            elif s < first:
                first = s
            seen.add(key)
            runs.append(current)
        split.first = first
        return np.array(runs, dtype=np.int64)

    def headed_runs(self, step: Any) -> Any:
        """The run index of each row of a block after a header (a step going back starts a run)."""
        import numpy as np

        tracker = self.tracker
        points = (np.flatnonzero(step[1:] < step[:-1]) + 1).tolist()
        if tracker.last is not None and int(step[0]) < tracker.last:
            points.insert(0, 0)
        runs = np.empty(len(step), dtype=np.int64)
        start, current = 0, self.run_of(tracker.key)
        for b in points:
            runs[start:b] = current
            if b > 0:
                tracker.last = int(step[b - 1])
            current = self.run_of(tracker.row_step(int(step[b]), self.line + b + 1))
            start = b
        runs[start:] = current
        tracker.last = int(step[-1])
        return runs

    def block(self, block: str) -> None:
        """One block of complete lines."""
        tracker, out = self.tracker, self.out
        fast = _canonical_block(block, out)
        if fast is not None:
            runs = self.headed_runs(fast[1]) if tracker.headed else self.legacy_runs(*fast[:6])
            out.add_block(runs, *fast)
            self.line += len(fast[1])
            return
        lines = block.split("\n")
        if lines[-1] == "":
            lines.pop()
        match = _CANONICAL.fullmatch
        nan = float("nan")
        for line in lines:
            self.line += 1
            if len(line) > _MAX_LINE:
                if looks_like_header(line[:4096]):
                    tracker.unreadable_header(self.line, f"{len(line)} characters, over the {_MAX_LINE}-byte limit",
                                              long=True)
                else:
                    self.bad += 1
                continue
            m = match(line)
            parsed = None
            if m is not None:
                step, group, layer, head, metric, value = m.groups()
                v = nan if value == "null" else float(value)
                if v != v or math.isfinite(v):  # a finite value or null (NaN)
                    parsed = (group, int(step), int(layer), None if head == "null" else int(head), metric, v)
            if parsed is None:
                if not line.strip():
                    continue
                rec = loads_line(line)
                if looks_like_header(line) or (isinstance(rec, dict) and HEADER_KEY in rec):
                    self.header(rec if isinstance(rec, dict) else None, line)
                    continue
                parsed = parse_record(rec)
                if parsed is None:
                    self.bad += 1
                    continue
            group, step, layer, head, metric, _ = parsed
            if tracker.headed:
                key = tracker.row_step(step, self.line)
            else:
                key = tracker.legacy_row((out.code(group), layer, head, out.code(metric)), step)
            out.add(self.run_of(key), parsed)

    def unreadable(self, part: Unreadable) -> None:
        """A line too long to read, or a torn last line too long to hold."""
        self.line += 1
        if not part.torn and looks_like_header(part.head):
            self.tracker.unreadable_header(self.line, f"{part.size} bytes, over the {_MAX_LINE}-byte limit",
                                           long=True)
        else:
            self.bad += 1


def _read_trajectory_file(path: Path, *, heads: bool = True) -> FileRuns:
    """The valid rows of a trajectory file, tagged by run (:class:`_FileReader`); one warning for
    the lines skipped, one naming the lines that started a run without its header. ``heads=False``:
    the layer-level rows only (:class:`FileRuns`)."""
    reader = _FileReader(heads=heads)
    with open(path, "rb") as fh:
        for block in _text_blocks(fh):
            if isinstance(block, Unreadable):
                reader.unreadable(block)
            else:
                reader.block(block)
    reader.tracker.end()
    out = reader.out
    out.ids = run_labels(list(reader.index), out.ids)  # ids that collide (a#2 twice) get distinct labels
    bad, tracker = reader.bad, reader.tracker
    if bad:
        warnings.warn(
            f"{path}: skipped {bad} corrupt or truncated line{'s' if bad != 1 else ''}",
            TrajectoryWarning,
            stacklevel=4,
        )
    if tracker.events:
        warnings.warn(
            f"{path}: {describe_events(tracker.events, tracker.counts)}. Each starts a run of its own: its rows "
            "are never given to the run before it (a run without a readable header has no run_id; a reused id "
            "is shown as ID#2)", TrajectoryWarning, stacklevel=4)
    return reader.out


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
            if parts is None or parts.stat is not None or parts.summary is not None:
                continue  # across-layer statistics and summaries over heads are not values of a layer or head
            if not (is_int64(parts.layer) and (parts.head is None or is_int64(parts.head))):
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
                if not is_int64(ev.step):
                    bad += 1
                    continue
                rows.append((parts.group, ev.step, parts.layer, parts.head, parts.metric, value))
    if bad:
        warnings.warn(f"{run_dir}: skipped {bad} malformed event value{'s' if bad != 1 else ''} or tag"
                      f"{'s' if bad != 1 else ''}", TrajectoryWarning, stacklevel=4)
    return rows


def read_run(run_dir: Path, *, heads: bool = True) -> FileRuns:
    """The rows of the run(s) in ``run_dir``: those of its trajectory file, or one run from its
    event files (no runs when there is nothing). ``heads=False``: the layer-level rows only."""
    traj = run_dir / TRAJECTORY_FILENAME
    if traj.is_file():
        found = _read_trajectory_file(traj, heads=heads)
        if found.ids or not has_event_files(str(run_dir)):
            return found
        warnings.warn(f"{traj} holds no valid line; reading the event files instead",
                      TrajectoryWarning, stacklevel=3)
    out = FileRuns(heads=heads)
    rows = _read_event_files(run_dir)
    if rows:
        run = out.new_run()
        for row in rows:
            out.add(run, row)
    return out
