"""When each layer's structure emerged: the *departure* and the *takeoff* of a score, post hoc.

Pure functions on the long table of :func:`~attn_probe.analysis.trajectory.load_trajectory`
(live runs and ``attn-probe score --trajectory`` runs alike). Two events, per layer and for the
median layer (the median across layers at each step), for ``symmetry`` and ``directionality``;
the rules are stated in docs/post-hoc.md ("When the structure emerged"):

* **departure**: the first logged step from which the score stays more than ``k`` standard
  deviations (``k = 3``) from the mean of the random range of the layer's shape
  (:mod:`attn_probe.baselines.random_range`) to the last logged step, where that tail holds at
  least ``hold`` logged steps (3) or the whole run. When no score in ``[-1, 1]`` can lie that far
  (``mean + k sd >= 1`` and ``mean - k sd <= -1``: directionality at ``d = 128``, whose sd is
  about 0.45), the status is ``not measurable`` (at this width), never ``not emerged``.
* **takeoff**: the rise is ``R = final - mean``, ``final`` being the last value of a running
  median of ``window`` (5) logged steps and ``mean`` the random range's mean (the score of an
  untrained layer). The takeoff is the first logged step from which that running median stays
  past ``mean + R / 2`` (half of the final rise). Claimed only after a departure and when
  ``|R| >= 2 k sd`` (a minimum rise: the half-way level itself lies beyond ``k`` sd, outside
  the random range); a running median ignores spikes of up to ``window // 2`` logged steps.
  The takeoff can precede the departure where the score dipped back into the range after it
  had risen (the departure is the step after the last dip).

Neither event is ever claimed for a run that did not leave the range (``not emerged``). An
event that holds from the first logged step is marked ``at_start`` (it happened at or before
that step: a fine-tuning run, or a scored checkpoint series that starts late). The rules use
the whole run: the live probe's causal reading (the condition held for 3 consecutive snapshots,
:mod:`attn_probe.sinks.emergence`, written once to TensorBoard text) can differ from these values
(docs/post-hoc.md).

The random range comes from the run's own ``random_*`` rows when it logged them, else from the
layers' shapes (``shapes=``, e.g. :func:`header_shapes` of the run directory), computed as the
probe computes it (seeded, the same numbers). Resumed runs: the loaders keep the value written
last for a repeated step (:func:`~attn_probe.analysis.table.normalize`), and so do these rules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["run_shapes", "lazy_shapes", "DEFAULT_SDS", "DEFAULT_HOLD", "DEFAULT_WINDOW", "EMERGENCE_METRICS", "Event", "departure",
           "takeoff", "series_events", "emergence", "format_emergence", "header_shapes", "median_events"]

#: standard deviations of the random range a score must stay beyond (``k``)
DEFAULT_SDS = 3.0
#: logged steps the departure must hold at the end of the run (or the whole run, when shorter)
DEFAULT_HOLD = 3
#: logged steps of the running median the takeoff is read on (odd)
DEFAULT_WINDOW = 5
#: the scores that have a random range
EMERGENCE_METRICS = ("symmetry", "directionality")

EMERGED = "emerged"
NOT_EMERGED = "not emerged"
NOT_MEASURABLE = "not measurable"
NO_RANGE = "no random range"
NO_VALUES = "no finite values"


@dataclass(frozen=True)
class Event:
    """The events of one series (a layer, or the median layer) of one score.

    ``status``: ``emerged``, ``not emerged``, ``not measurable`` (``k sd`` of the range covers
    the score's whole range ``[-1, 1]``), ``no random range`` or ``no finite values``.
    ``departure``/``takeoff``: logged steps, ``None`` unless emerged (``takeoff`` also ``None``
    when the rise is under ``2 k sd``: ``note`` says so); ``*_at_start``: the event holds from the
    first logged step (it happened at or before it). ``rise``: final running median minus the
    range's mean. ``note``: why, in words.
    """

    status: str
    departure: int | None = None
    departure_at_start: bool = False
    takeoff: int | None = None
    takeoff_at_start: bool = False
    mean: float = math.nan
    sd: float = math.nan
    k: float = DEFAULT_SDS
    rise: float = math.nan
    first_step: int | None = None
    last_step: int | None = None
    points: int = 0
    note: str = ""


def _check(k: float, hold: int, window: int) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k <= 0:
        raise ValueError(f"k must be a number of standard deviations > 0, got {k!r}")
    if isinstance(hold, bool) or not isinstance(hold, int) or hold < 1:
        raise ValueError(f"hold must be an int >= 1 (logged steps), got {hold!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1 or window % 2 == 0:
        raise ValueError(f"window must be an odd int >= 1 (logged steps), got {window!r}")


def _tail_length(flags: Sequence[bool]) -> int:
    """How many of the last ``flags`` are true in a row."""
    n = 0
    for f in reversed(flags):
        if not f:
            break
        n += 1
    return n


def departure(steps: Sequence[int], values: Sequence[float], mean: float, sd: float, *,
              k: float = DEFAULT_SDS, hold: int = DEFAULT_HOLD) -> Event:
    """The departure of one series (steps increasing, values finite) from the range ``mean ± k sd``.

    See the module docstring for the rule. ``takeoff`` is not set here (:func:`series_events`).
    """
    _check(k, hold, DEFAULT_WINDOW)
    n = len(values)
    base = {"mean": mean, "sd": sd, "k": float(k), "points": n,
            "first_step": int(steps[0]) if n else None, "last_step": int(steps[-1]) if n else None}
    if not n:
        return Event(NO_VALUES, note="no finite value", **base)
    if not (math.isfinite(mean) and math.isfinite(sd) and sd > 0):
        return Event(NO_RANGE, note="the run logged no random range and its layer shapes are unknown", **base)
    if mean + k * sd >= 1 and mean - k * sd <= -1:
        return Event(NOT_MEASURABLE, note=f"not measurable at this width: {k:g} sd = {k * sd:.2f} covers the "
                                          "score's whole range [-1, 1]", **base)
    beyond = [abs(v - mean) > k * sd for v in values]
    tail = _tail_length(beyond)
    if tail == 0:
        left = sum(beyond)
        why = (f"left the range at {left} logged step{'s' if left != 1 else ''} and came back" if left
               else "never left the range")
        return Event(NOT_EMERGED, note=why, **base)
    if tail < min(hold, n):
        return Event(NOT_EMERGED, note=f"beyond {k:g} sd only at the last {tail} logged step{'s' if tail != 1 else ''} "
                                       f"(fewer than {hold})", **base)
    at = n - tail
    return Event(EMERGED, departure=int(steps[at]), departure_at_start=at == 0, **base)


def running_median(values: Sequence[float], window: int = DEFAULT_WINDOW) -> list[float]:
    """Centred running median over ``window`` logged points (fewer at the ends)."""
    half = window // 2
    out = []
    for i in range(len(values)):
        part = sorted(values[max(0, i - half):i + half + 1])
        m = len(part)
        out.append(part[m // 2] if m % 2 else (part[m // 2 - 1] + part[m // 2]) / 2)
    return out


def takeoff(steps: Sequence[int], values: Sequence[float], mean: float, min_rise: float, *,
            window: int = DEFAULT_WINDOW) -> tuple[int | None, bool, float]:
    """``(step, at_start, rise)``: the first logged step from which the running median stays past
    half of the final rise from ``mean``; ``step`` is ``None`` when ``|rise| < min_rise``."""
    if not len(values):
        return None, False, math.nan
    smooth = running_median(list(values), window)
    rise = smooth[-1] - mean
    if not abs(rise) >= min_rise:
        return None, False, rise
    half = mean + rise / 2
    past = [(s - half) * rise > 0 for s in smooth]
    at = len(past) - _tail_length(past)
    return int(steps[at]), at == 0, rise


def series_events(steps: Sequence[int], values: Sequence[float], mean: float, sd: float, *,
                  k: float = DEFAULT_SDS, hold: int = DEFAULT_HOLD, window: int = DEFAULT_WINDOW) -> Event:
    """Both events of one series: NaN values are left out, steps sorted (one value a step)."""
    _check(k, hold, window)
    pairs = sorted((int(s), float(v)) for s, v in zip(steps, values, strict=True) if math.isfinite(float(v)))
    st = [s for s, _ in pairs]
    vs = [v for _, v in pairs]
    if len(set(st)) != len(st):
        raise ValueError("a step holds two values: de-duplicate first (the loaders keep the value written last)")
    ev = departure(st, vs, mean, sd, k=k, hold=hold)
    if ev.status != EMERGED:
        return ev
    step, at_start, rise = takeoff(st, vs, mean, 2 * k * sd, window=window)
    note = "" if step is not None else f"rise {rise:+.3f} is under 2 x {k:g} sd: no takeoff"
    return Event(**{**ev.__dict__, "takeoff": step, "takeoff_at_start": at_start, "rise": rise, "note": note})


# ------------------------------------------------------------------------------------- tables

def header_shapes(run_dir: str | Path) -> dict[tuple[str, int], Any]:
    """``{(group, layer): LayerShape}`` from the first run header of ``run_dir/attn_probe.jsonl``
    (its ``model.attention_layers``), empty when there is none (files written before run headers,
    or by ``attn-probe score --trajectory`` before it recorded them). Reads one line of at most
    the header's size limit."""
    from ..formats.trajectory import HEADER_KEY, MAX_HEADER, TRAJECTORY_FILENAME, loads

    path = Path(run_dir)
    path = path / TRAJECTORY_FILENAME if path.is_dir() else path
    try:
        with open(path, "rb") as fh:
            line = fh.readline(MAX_HEADER)
    except OSError:
        return {}
    rec = loads(line)
    return _model_shapes(rec.get(HEADER_KEY) if isinstance(rec, dict) else None)


def _model_shapes(header: Any) -> dict[tuple[str, int], Any]:
    """``{(group, layer): LayerShape}`` of one ``run_header`` object's ``model.attention_layers``."""
    from ..baselines.random_range import LayerShape

    model = header.get("model") if isinstance(header, dict) else None
    layers = model.get("attention_layers") if isinstance(model, dict) else None
    shapes: dict[tuple[str, int], Any] = {}
    for a in layers if isinstance(layers, list) else []:
        try:
            shapes[(str(a["group"]), int(a["layer"]))] = LayerShape(
                int(a["hidden_size"]), int(a["head_dim"]), int(a["num_heads"]), int(a["num_kv_heads"]))
        except (KeyError, TypeError, ValueError):
            continue
    return shapes


def run_shapes(runs: Any) -> dict[str, dict[tuple[str, int], Any]]:
    """``{run name: header_shapes(its directory)}`` for the run directories among ``runs`` (named as
    :func:`~attn_probe.analysis.loading.load_trajectory` names them): the shapes of each file's first
    header, under the directory's name only (``NAME#2``... of a file that holds several runs have
    their own headers: :func:`lazy_shapes` reads those). Best effort: empty where nothing is found."""
    from .runs import find_runs
    from .table import TrajectoryError

    try:
        found = find_runs(runs)
    except (TrajectoryError, OSError, ValueError):
        return {}
    out: dict[str, dict[tuple[str, int], Any]] = {}
    for name, run_dir in found:
        shapes = header_shapes(run_dir)
        if shapes:
            out[name] = shapes
    return out


class _HeaderShapes:
    """The callable :func:`lazy_shapes` returns: a run's shapes from its own run header, found by
    its ``run_id`` label among the runs of the file it was loaded from (one walk of each file asked
    about, :func:`attn_probe.formats.cutting.run_headers`); never another run's."""

    def __init__(self, runs: Any) -> None:
        self.runs = runs
        self._dirs: list[tuple[str, Path]] | None = None
        self._files: dict[Path, dict[str, dict]] = {}

    def _candidates(self, run: str) -> list[Path]:
        if self._dirs is None:
            from .runs import find_runs
            from .table import TrajectoryError

            try:
                self._dirs = find_runs(self.runs)
            except (TrajectoryError, OSError, ValueError):
                self._dirs = []
        return [d for name, d in self._dirs
                if run == name or (run.startswith(name + "#") and run[len(name) + 1:].isdigit())]

    def __call__(self, run: str, run_id: str | None = None) -> Mapping[tuple[str, int], Any]:
        if run_id is None:  # a run without a readable header: no shapes of its own to read
            return {}
        from ..formats.cutting import run_headers
        from ..formats.trajectory import TRAJECTORY_FILENAME

        found = []
        for d in self._candidates(run):
            if d not in self._files:
                self._files[d] = run_headers(d / TRAJECTORY_FILENAME)
            if run_id in self._files[d]:
                found.append(_model_shapes(self._files[d][run_id]))
        return found[0] if found and all(f == found[0] for f in found) else {}


def lazy_shapes(runs: Any) -> Any:
    """A callable ``run -> {(group, layer): LayerShape}`` for :func:`emergence`'s ``shapes=``: each
    run's shapes from its own run header, read when a run without a logged range asks (a file of
    several runs is walked once, :func:`attn_probe.formats.cutting.run_headers`, and each run found
    by its ``run_id``; a run without a readable header gets none: its emergence says it has no
    range). ``None`` when ``runs`` is a DataFrame (no directories to read)."""
    if hasattr(runs, "columns"):
        return None
    return _HeaderShapes(runs)


def _ranges_from_shapes(shapes: Mapping[tuple[str, int], Any],
                        only: Any = None) -> dict[tuple[str, int, str], tuple[float, float]]:
    """``{(group, layer, metric): (mean, sd)}`` computed as the live probe does (no time budget, its
    bound on drawn numbers: the same seeded draws, the same values), for the ``(group, layer)``
    pairs ``only`` (``None``: every layer): only their shapes are drawn, whatever the header names."""
    from ..baselines.random_range import PROBE_ENTRIES, random_range_rows

    class _Layer:
        def __init__(self, group: str, layer: int, shape: Any) -> None:
            self.group, self.layer = group, layer
            self.hidden_size, self.head_dim = shape.d_model, shape.head_dim
            self.num_heads, self.num_kv_heads = shape.num_heads, shape.num_kv_heads

    layers = [_Layer(g, lay, s) for (g, lay), s in shapes.items()]
    rows, _ = random_range_rows(layers, metrics=EMERGENCE_METRICS, per_head=False, budget=None,
                                max_entries=PROBE_ENTRIES, only=only)
    values = {(g, lay, m): v for g, lay, _, m, v in rows}
    out = {}
    for (g, lay) in shapes:
        for m in EMERGENCE_METRICS:
            if (g, lay, f"random_{m}") in values:
                out[(g, lay, m)] = (values[(g, lay, f"random_{m}")], values[(g, lay, f"random_{m}_sd")])
    return out


def _shapes_for(shapes: Any, run: str, run_id: str | None = None) -> Mapping[tuple[str, int], Any]:
    """``shapes`` is ``{(group, layer): shape}`` for every run, ``{run: {(group, layer): shape}}``, or
    a callable ``run -> {(group, layer): shape}`` (:func:`lazy_shapes`'s also takes the run's
    ``run_id``). A run missing from a mapping has none: ``NAME#2`` never borrows ``NAME``'s."""
    if isinstance(shapes, _HeaderShapes):
        return shapes(run, run_id) or {}
    if callable(shapes):
        return shapes(run) or {}
    if not shapes:
        return {}
    if all(isinstance(key, tuple) for key in shapes):
        return shapes
    return shapes.get(run) or {}


def emergence(df_or_runs: Any, *, k: float = DEFAULT_SDS, hold: int = DEFAULT_HOLD, window: int = DEFAULT_WINDOW,
              shapes: Any = None, metrics: Sequence[str] = EMERGENCE_METRICS) -> pd.DataFrame:
    """Departure and takeoff per ``run, group, metric`` and layer, and for the median layer.

    ``df_or_runs``: a long table or run directories (:func:`~attn_probe.analysis.loading.as_frame`:
    duplicate steps of a resumed run keep the value written last). Only layer-level rows count.
    The random range per layer: the run's ``random_<metric>``/``_sd`` rows, else ``shapes``
    (``{(group, layer): LayerShape}``, or ``{run: {...}}``); the median layer's range is the
    median across layers of the means and of the sds (one layer's sd: the median of several
    random layers varies less, so this is the cautious side). Columns: ``run, group, metric,
    layer`` (``<NA>`` for the median layer) and :class:`Event`'s fields.
    """
    from .loading import as_frame
    from .summary import RANDOM_PREFIX, layer_quantiles
    from .table import require_pandas

    _check(k, hold, window)
    pd = require_pandas()
    df = as_frame(df_or_runs)
    df = df[df["head"].isna()]
    random = df[df["metric"].str.startswith(RANDOM_PREFIX)]
    df = df[df["metric"].isin(list(metrics))]
    logged: dict[tuple[str, str, int, str], float] = {
        (r, g, int(lay), m): float(v)
        for r, g, lay, m, v in zip(random["run"], random["group"], random["layer"], random["metric"],
                                   random["value"], strict=True)}
    rows: list[dict[str, Any]] = []
    computed: dict[str, dict] = {}
    run_ids: dict[str, str] = {}  # run -> its run_id label (runs with a readable header)
    if "run_id" in df.columns:
        ids = df[["run", "run_id"]].dropna().drop_duplicates("run")
        run_ids = dict(zip(ids["run"], ids["run_id"], strict=True))
    unlogged: dict[str, set[tuple[str, int]]] = {}  # run -> the layers without a logged range: computed
    distinct = df[["run", "group", "layer", "metric"]].dropna().drop_duplicates()
    for run, group, layer, metric in zip(distinct["run"], distinct["group"], distinct["layer"], distinct["metric"],
                                         strict=True):
        if not all(math.isfinite(logged.get((run, group, int(layer), f"{RANDOM_PREFIX}{metric}{sd}"), math.nan))
                   for sd in ("", "_sd")):
            unlogged.setdefault(run, set()).add((group, int(layer)))
    order = {m: i for i, m in enumerate(metrics)}
    keys = list(dict.fromkeys(zip(df["run"], df["group"], df["metric"], strict=True)))
    runs_order = {r: i for i, r in enumerate(dict.fromkeys(df["run"]))}
    keys.sort(key=lambda key: (runs_order[key[0]], key[1], order[key[2]]))
    parts = dict(iter(df.groupby(["run", "group", "metric"], sort=False)))
    for run, group, metric in keys:
        part = parts[(run, group, metric)]
        per_layer: dict[int, tuple[float, float]] = {}
        for layer in sorted(int(x) for x in part["layer"].dropna().unique()):
            mean = logged.get((run, group, layer, f"{RANDOM_PREFIX}{metric}"), math.nan)
            sd = logged.get((run, group, layer, f"{RANDOM_PREFIX}{metric}_sd"), math.nan)
            if not (math.isfinite(mean) and math.isfinite(sd)):
                found = _shapes_for(shapes, run, run_ids.get(run))
                if found:
                    if run not in computed:
                        computed[run] = _ranges_from_shapes(found, unlogged.get(run, set()))
                    mean, sd = computed[run].get((group, layer, metric), (math.nan, math.nan))
            per_layer[layer] = (mean, sd)
        for layer, lp in part.groupby("layer", sort=True):
            mean, sd = per_layer[int(layer)]
            ev = series_events(lp["step"].tolist(), lp["value"].tolist(), mean, sd, k=k, hold=hold, window=window)
            rows.append({"run": run, "group": group, "metric": metric, "layer": int(layer), **ev.__dict__})
        q = layer_quantiles(part)
        means = [m for m, _ in per_layer.values() if math.isfinite(m)]
        sds = [s for _, s in per_layer.values() if math.isfinite(s)]
        mean = float(pd.Series(means).median()) if means else math.nan
        sd = float(pd.Series(sds).median()) if sds else math.nan
        ev = series_events(q["step"].tolist(), q["median"].tolist(), mean, sd, k=k, hold=hold, window=window)
        rows.append({"run": run, "group": group, "metric": metric, "layer": None, **ev.__dict__})
    columns = ["run", "group", "metric", "layer", *Event.__dataclass_fields__]
    out = pd.DataFrame(rows, columns=columns)
    for column in ("layer", "departure", "takeoff", "first_step", "last_step"):
        out[column] = out[column].astype("Int64")
    return out


def median_events(table: pd.DataFrame) -> pd.DataFrame:
    """The median layer's rows of :func:`emergence`'s table."""
    return table[table["layer"].isna()]


def _missing(v: Any) -> bool:
    from .table import is_na

    return is_na(v)


def _event_text(step: Any, at_start: bool) -> str:
    if _missing(step):
        return "-"
    return f"<={int(step)}" if at_start else str(int(step))


def describe(row: Any) -> str:
    """``departure 200, takeoff 575`` or the status (``not emerged``, ``not measurable at this width``)."""
    if row.status == EMERGED:
        text = f"departure {_event_text(row.departure, row.departure_at_start)}, "
        if _missing(row.takeoff):
            return text + f"no takeoff (rise {row.rise:+.3f} under 2 x {row.k:g} sd)"
        return text + f"takeoff {_event_text(row.takeoff, row.takeoff_at_start)}"
    if row.status == NOT_MEASURABLE:
        return f"not measurable at this width ({row.k:g} sd = {row.k * row.sd:.2f})"
    return row.status


def _layer_text(row: Any) -> str:
    if row.status == EMERGED:
        return f"{_event_text(row.departure, row.departure_at_start)}/{_event_text(row.takeoff, row.takeoff_at_start)}"
    return {NOT_EMERGED: "no", NOT_MEASURABLE: "n/m", NO_RANGE: "?", NO_VALUES: "nan"}.get(row.status, "?")


def format_emergence(table: pd.DataFrame) -> str:
    """Plain text of :func:`emergence`'s table: per run, one line per group and score with the
    median layer's events and each layer's ``departure/takeoff`` (``no``: not emerged, ``n/m``:
    not measurable at this width, ``?``: no random range). A run with no random range for any
    layer (nor layer shapes to compute it) is left out; ``""`` when none is left. Names escaped."""
    from ..formats.logdir import printable

    known = table[~table["status"].isin([NO_RANGE, NO_VALUES])]
    table = table[table["run"].isin(set(known["run"]))]  # runs with no range at all: left out
    if table.empty:
        return ""
    k = float(table["k"].iloc[0])
    lines = [f"when the structure emerged (departure: first step after which the score stays beyond {k:g} sd of the "
             "random range; takeoff: the running median passes half of its final rise; <=N: already at the first "
             "logged step)"]
    for run, part in table.groupby("run", sort=False):
        lines.append(f"run {printable(run)}")
        body = []
        for (group, metric), sub in part.groupby(["group", "metric"], sort=False):
            med = median_events(sub)
            layers = sub[sub["layer"].notna()]
            head = describe(next(med.itertuples(index=False))) if len(med) else "-"
            cells = " ".join(f"{int(r.layer)}:{_layer_text(r)}" for r in layers.itertuples(index=False))
            body.append((printable(group), printable(metric), f"median layer: {head}", f"layers {cells}"))
        widths = [max(len(r[i]) for r in body) for i in range(3)]
        for r in body:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3])
    return "\n".join(lines)
