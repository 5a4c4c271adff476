"""Which run each line of a trajectory file belongs to: the rules every reader of the file follows.

The reader (:mod:`attn_probe.analysis.reading`) and the resume cut
(:func:`attn_probe.formats.trajectory.cut_run`) both walk the file in order and hand each line
that decides a run to one :class:`RunTracker`, so they agree on where every run starts. The
rules (also stated in ``docs/post-hoc.md``, "Runs in one file"):

* a valid header record starts its run's rows: the run it names when that id came before and
  the header resumes it (``resumed`` and a start step past that run's last row); a run of its
  own otherwise. A header that opens an id already used by an earlier run (a fresh header, or
  a resumption that would overlap that run's steps: two files concatenated) starts a separate
  run, numbered ``<id>#2``, ``<id>#3``... (:func:`run_labels`: a number that is itself an id
  in the file is skipped) and reported;
* a resumed header of an id not seen yet, right after rows written before run headers,
  continues those rows (a run resumed from a checkpoint written before run ids);
* a line that is a run header but cannot be read (damaged, truncated, edited, or longer than
  :data:`MAX_HEADER`) ends the run before it; the rows after it form a run without an id;
* inside a run after a header a snapshot's step never goes back (the writer appends in step
  order and cuts a resumed run back first), so a row whose step is lower than the row before
  it starts a run without an id too: a run whose header is missing;
* rows before any header (files written before run headers existed) are split by
  :class:`RunSplitter`.

Each of these events (except the ordinary first header of a run) is kept with its line number
(the first :data:`KEPT_EVENTS`; the rest are counted), for the readers' warnings.
Only the standard library is imported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .lines import Unreadable  # noqa: F401  (part of what the rules are about; re-exported)

__all__ = ["HEADER_SIGNS", "MAX_HEADER", "Event", "RunSplitter", "RunTracker", "Unreadable", "describe_events",
           "looks_like_header", "run_label", "run_labels"]

#: a header line longer than this is not read (its run is kept as a run without an id); the
#: writer refuses an ``extra_config`` that would make one (:mod:`attn_probe.live.config`)
MAX_HEADER = 1 << 20
#: how many events a tracker keeps with their line numbers
KEPT_EVENTS = 8
#: a header record holds these bytes; a row never does (its group is a name, never null)
HEADER_SIGNS = (b'"run_header"', b'"group": null')


def looks_like_header(line: bytes | str) -> bool:
    """Whether ``line`` (a whole line, or the first bytes of one) is, or was meant to be, a run
    header record: it holds the header key or the null group only a header has."""
    if isinstance(line, str):
        return any(sign.decode() in line for sign in HEADER_SIGNS)
    return any(sign in line for sign in HEADER_SIGNS)


class RunSplitter:
    """Tells apart the runs of rows written before run headers existed, row by row.

    A probe's steps only increase, and a resumed run first cuts the file before its resume step,
    so a value (``group, layer, head, metric``) is written again at a step at or before its last
    one only where a fresh run was started in a ``log_dir`` that already held one (its sink warns
    and appends), and such a run counts from step 0. A value written again at a step ``s`` starts
    a new run when ``s`` is at or before the first step of the current run, and otherwise
    continues it: a resume appended without the cut, whose rows from ``s`` on replace the
    earlier ones (the value written last counts). Values are compared one by one, so rows in any
    order within a run (a file written by hand metric by metric) stay one run.

    Every step of a run is at least its first (lowest) step, so "at or before its last step and
    at or before the run's first step" is "seen in this run and at or before its first step":
    only the set of values seen is kept (:attr:`seen`), and rows above :attr:`first` can be
    taken a block at a time (:meth:`continues`).
    """

    def __init__(self) -> None:
        self.first = 0  # the current run's lowest step
        self.seen: set[tuple] = set()  # the values (group, layer, head, metric) of the current run

    def starts_run(self, key: tuple, step: int, fresh: bool) -> bool:
        """Whether the row of value ``key`` at ``step`` starts a new run (``fresh``: none is open yet)."""
        new = fresh or (step <= self.first and key in self.seen)
        if new:
            self.seen.clear()
            self.first = step
        elif step < self.first:
            self.first = step
        self.seen.add(key)
        return new

    def continues(self, keys: Any, low: int) -> bool:
        """Rows of values ``keys`` whose lowest step is ``low``: when every step is above the run's
        first step none of them starts a run; they are taken (``True``), else nothing is done."""
        if low <= self.first:
            return False
        self.seen.update(keys)
        return True


@dataclass(frozen=True)
class Event:
    """Something a reader reports about a line: ``kind`` is ``"damaged header"``,
    ``"long header"``, ``"steps go back"`` or ``"duplicate id"``; ``detail`` says more."""

    line: int
    kind: str
    detail: str


#: a run's key: ("legacy", k) rows before any header, ("run", id, n) the n-th run of that id,
#: ("unknown", k) rows after an unreadable header or where steps go back
RunKey = tuple


@dataclass
class RunTracker:
    """The run of each line of one file, fed in file order (see the module docstring).

    ``key`` is the run the next row belongs to (``None`` before any row or header); ``headed``
    whether a header (valid or not) was seen, after which rows are checked with
    :meth:`row_step` instead of :attr:`splitter`.
    """

    key: RunKey | None = None
    headed: bool = False
    splitter: RunSplitter = field(default_factory=RunSplitter)
    events: list[Event] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    #: the step of the last row of the current run (after a header)
    last: int | None = None
    _legacy: int = 0
    _unknown: int = 0
    _latest: dict[str, RunKey] = field(default_factory=dict)  # run id -> its latest run
    _instances: dict[str, int] = field(default_factory=dict)
    _top: dict[RunKey, int] = field(default_factory=dict)  # run -> its highest step so far
    _claimed: set = field(default_factory=set)  # legacy runs continued by a resumed header

    def _note(self, line: int, kind: str, detail: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if len(self.events) < KEPT_EVENTS:
            self.events.append(Event(line, kind, detail))

    def _end_segment(self) -> None:
        if self.key is not None and self.last is not None:
            top = self._top.get(self.key)
            self._top[self.key] = self.last if top is None else max(top, self.last)
        self.last = None

    def latest(self, run_id: str) -> RunKey | None:
        """The key of the latest run of ``run_id`` seen so far (``None``: not in the file)."""
        return self._latest.get(run_id)

    def header(self, run_id: str, step: int, resumed: bool, line: int) -> RunKey:
        """A valid header record at ``line``: returns its run's key (a new key: a new run)."""
        self._end_segment()
        prev = self._latest.get(run_id)
        if prev is not None and resumed and self._top.get(prev, step - 1) < step:
            key = prev  # a resumption of that run
        elif prev is None and resumed and self.key is not None and self.key[0] == "legacy" \
                and self.key not in self._claimed:
            key = self.key  # resumed from a checkpoint written before run ids: continues those rows
            self._claimed.add(key)
        elif prev is not None:
            n = self._instances[run_id] = self._instances.get(run_id, 1) + 1
            key = ("run", run_id, n)
            why = "a fresh run header" if not resumed else \
                f"a resumption at step {step}, where that run already has rows up to step {self._top.get(prev)}"
            self._note(line, "duplicate id", f"run id {run_id} opened again ({why})")
        else:
            key = ("run", run_id, 1)
        self._latest[run_id] = key
        self.key, self.headed = key, True
        return key

    def unreadable_header(self, line: int, detail: str, *, long: bool = False) -> RunKey:
        """A line at ``line`` that is a run header but cannot be read: a new run without an id."""
        self._end_segment()
        self._unknown += 1
        self.key, self.headed = ("unknown", self._unknown), True
        self._note(line, "long header" if long else "damaged header", detail)
        return self.key

    def row_step(self, step: int, line: int) -> RunKey:
        """A row at ``step`` (at ``line``) after a header: its run's key (a new one where steps go back)."""
        if self.last is not None and step < self.last:
            before = self.last
            self._end_segment()
            self._unknown += 1
            self.key = ("unknown", self._unknown)
            self._note(line, "steps go back", f"step {step} after step {before}")
        self.last = step
        assert self.key is not None
        return self.key

    def legacy_row(self, value: tuple, step: int) -> RunKey:
        """A row of ``value`` at ``step`` before any header: its run's key (split by :attr:`splitter`)."""
        if self.splitter.starts_run(value, step, self.key is None):
            self.new_legacy()
        assert self.key is not None
        return self.key

    def new_legacy(self) -> RunKey:
        """Start the next run of rows before any header (for a reader that applies the splitter itself)."""
        self._legacy += 1
        self.key = ("legacy", self._legacy)
        return self.key

    @property
    def last_legacy(self) -> RunKey | None:
        """The last run of rows before any header (``None``: the file has none)."""
        return ("legacy", self._legacy) if self._legacy else None

    @property
    def runs(self) -> int:
        """How many runs were seen so far (each number of a repeated id counts)."""
        return self._legacy + self._unknown + sum(self._instances.values()) + \
            sum(1 for i in self._latest if i not in self._instances and self._latest[i][0] == "run")

    def end(self) -> None:
        """The file ended (records the last run's highest step)."""
        self._end_segment()


def run_label(key: RunKey) -> str | None:
    """The run id a reader shows for ``key``: ``id``, ``id#2`` for a later run of the same id,
    ``None`` for a run without an id."""
    if key[0] != "run":
        return None
    return key[1] if key[2] == 1 else f"{key[1]}#{key[2]}"


def run_labels(keys: Sequence[RunKey], ids: Sequence[str | None]) -> list[str | None]:
    """The run ids a reader shows for a file's runs ``keys`` (in file order), all distinct.

    ``ids[i]`` is the id run ``i`` carries itself (``None``: none; for a later run of an id, that
    id). The first run of each id shows it as it is (a branch's ``parent_run`` names it so); a
    later run of an id shows ``id#2``, ``id#3``... in order, skipping every label the file's runs
    show already: a file holding the ids ``a``, ``a`` and a literal ``a#2`` shows ``a``, ``a#3``,
    ``a#2``. The labels depend on the file alone, so a file read twice shows the same ones.
    """
    later = [key[0] == "run" and key[2] > 1 for key in keys]
    taken = {run_id for run_id, again in zip(ids, later, strict=True) if run_id is not None and not again}
    following: dict[str, int] = {}
    out: list[str | None] = []
    for key, run_id, again in zip(keys, ids, later, strict=True):
        if not again:
            out.append(run_id)
            continue
        n = max(key[2], following.get(key[1], 2))
        while f"{key[1]}#{n}" in taken:
            n += 1
        label = f"{key[1]}#{n}"
        taken.add(label)
        following[key[1]] = n + 1
        out.append(label)
    return out


def describe_events(events: list[Event], counts: dict[str, int] | None = None) -> str:
    """One clause per kind of event, naming the first lines of each (``counts``: how many there
    were of each kind, default those in ``events``)."""
    texts = {
        "damaged header": "a run header that cannot be read",
        "long header": "a run header too long to read",
        "steps go back": "rows whose step goes back with no run header between (a missing header)",
        "duplicate id": "a run header reusing the id of an earlier run",
    }
    parts: list[str] = []
    for kind, what in texts.items():
        shown = [e for e in events if e.kind == kind]
        n = len(shown) if counts is None else counts.get(kind, 0)
        if not n:
            continue
        lines = ", ".join(f"line {e.line} ({e.detail})" for e in shown[:3])
        more = f" and {n - len(shown[:3])} more" if n > len(shown[:3]) else ""
        parts.append(f"{what} at {lines}{more}")
    return "; ".join(parts)
