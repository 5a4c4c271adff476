"""Figures after the paper: emergent dynamics of the scores, and one layer's W_qk heatmap.

matplotlib is optional (``pip install attn-probe[plot]``) and imported inside the functions,
with the non-interactive Agg backend unless pyplot is already loaded or ``MPLBACKEND`` is set.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..formats.tags import METRICS
from .loading import as_frame
from .summary import is_magnitude, layer_quantiles, warn_missing
from .table import TrajectoryError, require

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from ..extraction import AttentionLayer

__all__ = ["plot_dynamics", "plot_heatmap", "qk_for_layer", "resolve_references", "random_bands", "score_ylim", "RANDOM_BAND_LABEL"]

#: one colour per (run, group) in the dynamics figure
_RUN_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
                "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan")
_LINESTYLES = ("-", "--", ":", "-.")
#: lines of at most this many points get markers (one point alone is otherwise invisible)
_FEW_POINTS = 12
#: the note in a panel whose metric has no finite value
NO_FINITE_VALUES = "no finite values"


def _pyplot() -> Any:
    """pyplot on the Agg backend, unless pyplot is already in use or MPLBACKEND picks one
    (as Jupyter kernels do), so that notebooks keep their inline figures."""
    mpl = require("matplotlib", "plot")
    import sys

    if "matplotlib.pyplot" not in sys.modules and not os.environ.get("MPLBACKEND"):
        mpl.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def use_agg() -> None:
    """Switch matplotlib to the file-only Agg backend (what the CLI does before drawing)."""
    require("matplotlib", "plot").use("Agg")


def _check_path(path: str | os.PathLike | None) -> None:
    if path is not None and Path(path).suffix.lower() not in (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps"):
        raise ValueError(f"cannot tell the image format of {str(path)!r}: use .png, .pdf or .svg")


def _save(fig: Figure, path: str | os.PathLike | None) -> None:
    if path is None:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=fig.dpi, bbox_inches="tight")


def _select(values: Sequence[str] | str | None, available: list[str], what: str) -> list[str]:
    if values is None:
        return available
    chosen = [values] if isinstance(values, str) else list(values)
    unknown = [v for v in chosen if v not in available]
    if unknown:
        raise TrajectoryError(
            f"no {what} {', '.join(map(repr, unknown))} in the data; available: {', '.join(available) or 'none'}"
        )
    return chosen


def _legend(axes: list[Any], metrics: list[str], finite: Any, handles: list[Any], labels: list[str]) -> None:
    """The legend of the series drawn, in the first panel that has data."""
    if not handles:
        return
    ax = next((a for a, m in zip(axes, metrics, strict=True) if (finite["metric"] == m).any()), axes[0])
    ax.legend(handles, labels, fontsize="small", loc="best")


def _step_label(x: float, _pos: int | None = None) -> str:
    if abs(x) >= 1_000_000:
        return f"{x / 1_000_000:g}M"
    if abs(x) >= 1000:
        return f"{x / 1000:g}k"
    return f"{x:g}"


#: colours of the paper's reference runs (dashed), apart from the first user runs' colours
_REFERENCE_COLOURS = ("tab:purple", "tab:brown", "tab:olive", "tab:cyan", "tab:pink", "0.15")
#: the random-matrix range: grey, behind everything
RANDOM_BAND_LABEL = "random W_qk (±2 sd)"
_RANDOM_COLOUR = "0.55"
_RANDOM_ALPHA = 0.22
#: prefix of the random-matrix range's rows (attn_probe.baselines.random_range); never a panel
RANDOM_PREFIX = "random_"
#: score panels zoom to what they show, but never to less than this span of y (a gap of 0.1 then
#: fills up to 40% of the axis, and noise of 0.01 does not fill it)
_MIN_SCORE_SPAN = 0.25
#: how far past +-1 a score axis may reach, so that a line at exactly -1 is not hidden in the frame
_SCORE_EDGE = 0.05


def resolve_references(reference: Any) -> list[Any]:
    """The paper runs named by ``reference`` (a name, a comma list, a PaperRun or a sequence of them),
    in order, each once; an unknown name is a one-line ``ValueError`` listing the names."""
    from ..baselines.paper import PaperRun, paper_run

    if reference is None:
        return []
    items = [reference] if isinstance(reference, (str, PaperRun)) else list(reference)
    names: list[Any] = []
    for item in items:
        if isinstance(item, str):
            names.extend(part.strip() for part in item.split(",") if part.strip())
        else:
            names.append(item)
    return list(dict.fromkeys(paper_run(n) for n in names))


def _clip_reference(points: Sequence[Any], lo: float, hi: float) -> list[Any]:
    """The checkpoints in ``[lo, hi]`` and the nearest one beyond each end (so that the dashed line
    runs on to the axis' edge instead of stopping at the last checkpoint inside)."""
    inside = [p for p in points if lo <= p.step <= hi]
    before = [p for p in points if p.step < lo]
    after = [p for p in points if p.step > hi]
    return before[-1:] + inside + after[:1]


def random_bands(random_rows: Any, metric: str) -> list[tuple[float, float]]:
    """The random-matrix range of ``metric`` in ``random_rows`` (layer-level ``random_<metric>`` and
    ``random_<metric>_sd`` rows): per run and group, the median across layers of the mean and of
    the sd, as ``(mean - 2 sd, mean + 2 sd)``; equal bands once, in order."""
    import numpy as np

    bands: list[tuple[float, float]] = []
    mean_rows = random_rows[random_rows["metric"] == f"{RANDOM_PREFIX}{metric}"]
    sd_rows = random_rows[random_rows["metric"] == f"{RANDOM_PREFIX}{metric}_sd"]
    for (run, group), means in mean_rows.groupby(["run", "group"], sort=False):
        sds = sd_rows[(sd_rows["run"] == run) & (sd_rows["group"] == group)]
        m = means["value"].to_numpy(dtype=float)
        sd = sds["value"].to_numpy(dtype=float)
        m, sd = m[np.isfinite(m)], sd[np.isfinite(sd)]
        if not len(m) or not len(sd):
            continue
        mean, spread = float(np.median(m)), float(np.median(sd))
        band = (mean - 2 * spread, mean + 2 * spread)
        if not any(abs(band[0] - b[0]) < 5e-4 and abs(band[1] - b[1]) < 5e-4 for b in bands):
            bands.append(band)
    return bands


def score_ylim(values: Sequence[float]) -> tuple[float, float]:
    """y limits of a score panel that show what is drawn, and the gap between runs.

    The range of ``values`` (every drawn median, band edge, reference and random range) and 0
    (the dashed zero line: the sign stays readable), padded by 8% of the span, widened to at least
    :data:`_MIN_SCORE_SPAN` around its centre, rounded out to 0.05 and kept inside [-1.05, 1.05]
    (the scores' range, and room for a line at exactly -1 or 1). No value gives [-1, 1].
    """
    import math

    finite = [float(v) for v in values if math.isfinite(v)]
    if not finite:
        return (-1.0, 1.0)
    lo, hi = min(min(finite), 0.0), max(max(finite), 0.0)
    pad = 0.08 * (hi - lo)
    lo, hi = lo - pad, hi + pad
    if hi - lo < _MIN_SCORE_SPAN:
        mid = (lo + hi) / 2
        lo, hi = mid - _MIN_SCORE_SPAN / 2, mid + _MIN_SCORE_SPAN / 2
    lo, hi = math.floor(round(lo / 0.05, 6)) * 0.05, math.ceil(round(hi / 0.05, 6)) * 0.05
    edge = 1.0 + _SCORE_EDGE
    lo, hi = max(lo, -edge), min(hi, edge)
    if hi - lo < _MIN_SCORE_SPAN:  # the widening ran past an edge: keep the span on the other side
        lo, hi = (lo, lo + _MIN_SCORE_SPAN) if lo == -edge else (hi - _MIN_SCORE_SPAN, hi)
    return (round(lo, 10), round(hi, 10))


def plot_dynamics(
    df_or_runs: Any,
    *,
    metrics: Sequence[str] | str | None = None,
    groups: Sequence[str] | str | None = None,
    per_layer: bool = False,
    logx: bool = False,
    title: str | None = None,
    figsize: tuple[float, float] | None = None,
    path: str | os.PathLike | None = None,
    reference: str | Sequence[str] | Any | None = None,
    events: bool = True,
) -> Figure:
    """The emergent-dynamics figure: metrics of the layer-level matrices against training steps.

    One panel per metric (default: symmetry and directionality, whichever are present, else
    every metric in the data; ``metrics=`` picks any, e.g. ``"spectral_norm"`` or
    ``"ov_symmetry"``). By default each ``(run, group)`` is one colour: the median across
    layers as a line and the q25-q75 band around it. With ``per_layer=True`` every layer is a
    line coloured by depth (viridis, with a colorbar), and runs differ by line style. Score
    panels have a dashed zero line and a y range fitted to what they show (:func:`score_ylim`:
    0 included, at least 0.25 tall, inside [-1.05, 1.05]), so that a gap of 0.1 between an encoder and
    a decoder is visible; the magnitudes (norms, stable rank, ``qk_bound``:
    :func:`attn_probe.core.is_magnitude`) get a log y axis. ``df_or_runs`` is a long table or
    run directories (see :func:`~attn_probe.analysis.trajectory.load_trajectory`). Saved to
    ``path`` if given.

    ``reference`` names one or more of the paper's runs (:func:`attn_probe.baselines.paper.paper_runs`,
    e.g. ``"4-layer-encoder-wikipedia"``; a list or a comma list): each is drawn in the panel of
    its metric (symmetry, directionality) as a dashed median with a hatched q25-q75 band,
    labelled :meth:`~attn_probe.baselines.paper.PaperRun.describe`. The x range stays the
    runs': the paper's 200,000 steps are clipped to the steps shown (plus the nearest checkpoint
    beyond, so the line reaches the edge), and the label says so ("to 1.5k of 200k steps"); when
    no checkpoint (every 1,000 steps) falls in the runs' range, the range is widened to the
    nearest one.

    The random-matrix range: when the runs hold ``random_<metric>`` and ``random_<metric>_sd``
    rows (logged once per run, :mod:`attn_probe.baselines.random_range`), the score panel gets a
    grey horizontal band, mean ± 2 sd (medians across layers), labelled "random W_qk (±2 sd)".
    ``random_*`` rows are never panels of their own.

    ``events`` (median mode): a dotted vertical line at each series' median-layer departure and a
    dashed one at its takeoff, in its colour (:mod:`attn_probe.analysis.emergence`; a run without a
    logged range gets it from its run header's shapes when ``df_or_runs`` names run directories).

    NaN values are left out (lines join the finite steps). A metric with no finite value keeps
    its panel, with the note "no finite values", and a
    :class:`~attn_probe.analysis.trajectory.TrajectoryWarning` names it; when nothing chosen
    is finite, :class:`~attn_probe.analysis.trajectory.TrajectoryError` is raised. Lines of
    few points (at most 12) have markers; a single step is drawn as a point on an x range
    around it.

    Example:
        >>> fig = plot_dynamics(["runs/encoder", "runs/decoder"], path="dynamics.png",
        ...                     reference=["4-layer-encoder-jigsaw", "4-layer-decoder-jigsaw"])  # doctest: +SKIP
    """
    _check_path(path)
    references = resolve_references(reference)  # a bad name fails before anything is read
    plt = _pyplot()
    import numpy as np
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    df = as_frame(df_or_runs)
    df = df[df["head"].isna()]
    with_ranges = df
    is_random = df["metric"].str.startswith(RANDOM_PREFIX)
    random_rows, df = df[is_random], df[~is_random]
    present = list(dict.fromkeys(df["metric"]))
    asked = [metrics] if isinstance(metrics, str) else list(metrics or [])
    for m in asked:
        if m.startswith(RANDOM_PREFIX) and m not in present:
            base = m.removeprefix(RANDOM_PREFIX).removesuffix("_sd")
            raise TrajectoryError(f"{m} is the random-matrix range, not a panel: it is drawn as the grey band "
                                  f"in the {base} panel")
    default_metrics = [m for m in METRICS if m in present] or sorted(present)
    chosen_metrics = _select(metrics, present, "metric") if metrics is not None else default_metrics
    chosen_groups = _select(groups, sorted(dict.fromkeys(df["group"])), "group")
    df = df[df["metric"].isin(chosen_metrics) & df["group"].isin(chosen_groups)]
    if df.empty or not chosen_metrics:
        raise TrajectoryError("no layer-level values to plot for the chosen groups and metrics")
    finite = df[np.isfinite(df["value"].to_numpy(dtype=float))]
    if finite.empty:
        raise TrajectoryError(
            f"nothing finite to plot: every layer-level value of {', '.join(chosen_metrics)} "
            f"({len(df)} values) is NaN or infinite"
        )
    warn_missing(df, finite, "not drawn")
    random_rows = random_rows[random_rows["group"].isin(chosen_groups) & random_rows["run"].isin(set(df["run"]))]

    runs = list(dict.fromkeys(df["run"]))
    series = list(dict.fromkeys(zip(df["run"], df["group"], strict=True)))
    groups_per_run = {r: {g for rr, g in series if rr == r} for r in runs}
    several_groups = any(len(g) > 1 for g in groups_per_run.values())

    def label(run: str, group: str) -> str:
        return f"{run} ({group})" if several_groups else run

    def marker(n_points: int) -> dict[str, Any]:
        """Markers on a line of few points, so that one point, or two, are visible; not clipped,
        so that a score of exactly +-1 (on the y limit) or step 0 on a log axis shows whole."""
        if n_points > _FEW_POINTS:
            return {}
        return {"marker": "o", "markersize": 4.0 if per_layer else 4.5, "clip_on": False}

    n = len(chosen_metrics)
    fig, axes = plt.subplots(1, n, figsize=figsize or (4.6 * n + (0.8 if per_layer else 0), 3.6),
                             sharex=True, squeeze=False, layout="constrained")
    axes = list(axes[0])
    shown: dict[str, list[float]] = {m: [] for m in chosen_metrics}  # y values drawn, per panel
    handles: list[Any] = []
    labels: list[str] = []
    drawn: dict[tuple[str, str], int] = {}  # series with a line somewhere -> points of its longest line
    if per_layer:
        import matplotlib as mpl

        layers = df["layer"].astype(int)  # the colour scale spans every layer, NaN ones too
        lo, hi = int(layers.min()), int(layers.max())
        norm = mpl.colors.Normalize(vmin=lo, vmax=max(hi, lo + 1))
        cmap = mpl.colormaps["viridis"]
        for ax, metric in zip(axes, chosen_metrics, strict=True):
            sub = finite[finite["metric"] == metric]
            shown[metric].extend(sub["value"].to_numpy(dtype=float))
            for i, (run, group) in enumerate(series):
                part = sub[(sub["run"] == run) & (sub["group"] == group)]
                style = _LINESTYLES[i % len(_LINESTYLES)]
                for layer, lp in part.groupby("layer", sort=True):
                    lp = lp.sort_values("step")  # NaN steps are left out: the line joins across them
                    ax.plot(lp["step"], lp["value"], color=cmap(norm(int(layer))), linestyle=style,
                            linewidth=1.2, **marker(len(lp)))
                    drawn[(run, group)] = max(drawn.get((run, group), 0), len(lp))
        if len(series) > 1:
            handles = [Line2D([], [], color="0.3", linestyle=_LINESTYLES[i % len(_LINESTYLES)],
                              **marker(drawn.get(s, 0)))
                       for i, s in enumerate(series) if s in drawn]
            labels = [label(*s) for s in series if s in drawn]
        sm = mpl.cm.ScalarMappable(norm=norm, cmap=cmap)
        cbar = fig.colorbar(sm, ax=axes, pad=0.01, fraction=0.04)
        cbar.set_label("layer (depth)")
        if hi - lo <= 24:
            cbar.set_ticks(range(lo, hi + 1, max(1, (hi - lo + 1) // 8)))
    else:
        q = layer_quantiles(finite)
        for ax, metric in zip(axes, chosen_metrics, strict=True):
            sub = q[q["metric"] == metric]
            for i, (run, group) in enumerate(series):
                part = sub[(sub["run"] == run) & (sub["group"] == group)].sort_values("step")
                if part.empty:
                    continue
                colour = _RUN_COLOURS[i % len(_RUN_COLOURS)]
                if len(part) == 1:  # a band of zero width is invisible: the q25-q75 range as a bar
                    ax.vlines(part["step"], part["q25"], part["q75"], color=colour, alpha=0.35, linewidth=5)
                else:
                    ax.fill_between(part["step"], part["q25"], part["q75"], color=colour, alpha=0.25,
                                    linewidth=0)
                ax.plot(part["step"], part["median"], color=colour, linewidth=1.8, label=label(run, group),
                        **marker(len(part)))
                for column in ("median", "q25", "q75"):
                    shown[metric].extend(part[column].to_numpy(dtype=float))
                drawn[(run, group)] = max(drawn.get((run, group), 0), len(part))
        handles = [Line2D([], [], color=_RUN_COLOURS[i % len(_RUN_COLOURS)], linewidth=1.8,
                          **marker(drawn.get(s, 0)))
                   for i, s in enumerate(series) if s in drawn]
        labels = [label(*s) for s in series if s in drawn]

    steps = finite["step"]
    x_lo, x_hi = float(steps.min()), float(steps.max())
    ref_handles: list[Any] = []
    ref_labels: list[str] = []
    from ..baselines.paper import PAPER_METRICS

    if references and not any(m in PAPER_METRICS for m in chosen_metrics):
        import warnings

        from .table import TrajectoryWarning

        warnings.warn(f"the paper's trajectories hold {' and '.join(PAPER_METRICS)} only: no reference drawn "
                      f"in the {', '.join(chosen_metrics)} panel{'s' if n > 1 else ''}", TrajectoryWarning, stacklevel=2)
    if references and any(m in PAPER_METRICS for m in chosen_metrics):  # only the steps the runs' range shows
        from ..baselines.paper import paper_final, paper_trajectory

        checkpoints = sorted(set(paper_trajectory(references[0])["step"]))
        if not any(x_lo <= c <= x_hi for c in checkpoints):  # no checkpoint in range: reach the nearest
            nearest = min(checkpoints, key=lambda c: (min(abs(c - x_lo), abs(c - x_hi)), c))
            x_lo, x_hi = min(x_lo, float(nearest)), max(x_hi, float(nearest))
        for k, run in enumerate(references):
            colour = _REFERENCE_COLOURS[k % len(_REFERENCE_COLOURS)]
            last = paper_final(run, "symmetry").step
            traj = paper_trajectory(run)
            for ax, metric in zip(axes, chosen_metrics, strict=True):
                if metric not in PAPER_METRICS:
                    continue
                points = _clip_reference(list(traj[traj["metric"] == metric].itertuples(index=False)), x_lo, x_hi)
                xs = [p.step for p in points]
                med = [p.median for p in points]
                ax.fill_between(xs, [p.q25 for p in points], [p.q75 for p in points], facecolor=colour,
                                edgecolor=colour, alpha=0.13, hatch="///", linewidth=0, zorder=1.5)
                inside = sum(x_lo <= x <= x_hi for x in xs)
                ax.plot(xs, med, color=colour, linestyle="--", linewidth=1.6, zorder=2.5,
                        label=run.describe(), **({"marker": "s", "markersize": 3.5} if inside <= _FEW_POINTS else {}))
                for p in points:
                    shown[metric].extend((p.median, p.q25, p.q75))
            clipped = x_hi < last
            shown_to = f" (to {_step_label(x_hi)} of {_step_label(last)} steps)" if clipped else ""
            ref_handles.append(Line2D([], [], color=colour, linestyle="--", linewidth=1.6))
            ref_labels.append(run.describe() + shown_to)

    random_drawn = False
    for ax, metric in zip(axes, chosen_metrics, strict=True):
        if is_magnitude(metric) or random_rows.empty:
            continue
        for lo_, hi_ in random_bands(random_rows, metric):
            ax.axhspan(lo_, hi_, color=_RANDOM_COLOUR, alpha=_RANDOM_ALPHA, linewidth=0, zorder=0.5,
                       label=RANDOM_BAND_LABEL)
            shown[metric].extend((lo_, hi_))
            random_drawn = True
    if events and not per_layer:
        from .emergence import EMERGENCE_METRICS, emergence, lazy_shapes
        from .emergence_plot import draw_events

        found = emergence(with_ranges[with_ranges["run"].isin(runs) & with_ranges["group"].isin(chosen_groups)],
                          shapes=lazy_shapes(df_or_runs), metrics=[m for m in chosen_metrics if m in EMERGENCE_METRICS])
        for handle, text in draw_events(axes, chosen_metrics, found, series, _RUN_COLOURS):
            handles.append(handle)
            labels.append(text)
    if random_drawn:
        from matplotlib.patches import Patch

        handles.append(Patch(facecolor=_RANDOM_COLOUR, alpha=_RANDOM_ALPHA, linewidth=0))
        labels.append(RANDOM_BAND_LABEL)

    single_step = x_lo == x_hi
    for ax, metric in zip(axes, chosen_metrics, strict=True):
        if is_magnitude(metric):  # norms, stable rank: positive, growth over decades
            ax.set_yscale("log")
        else:  # scores live in [-1, 1]: show the part in use, the gap between runs readable
            ax.axhline(0.0, color="0.4", linestyle="--", linewidth=0.8, zorder=0)
            ax.set_ylim(*score_ylim(shown[metric]))
        ax.set_title(metric)
        ax.set_xlabel("step")
        if not (finite["metric"] == metric).any():
            ax.text(0.5, 0.5, NO_FINITE_VALUES, transform=ax.transAxes, ha="center", va="center",
                    color="0.35", fontsize="medium", bbox={"facecolor": "white", "edgecolor": "0.7"})
        if single_step:  # one step: a range around it, the step as the only tick (no log axis)
            pad = max(1.0, 0.05 * abs(x_lo))
            ax.set_xlim(x_lo - pad, x_lo + pad)
            ax.set_xticks([x_lo])
            ax.xaxis.set_major_formatter(FuncFormatter(_step_label))
        elif logx:
            positive = steps[steps > 0]
            thresh = float(positive.min()) if len(positive) else 1.0
            ax.set_xscale("symlog", linthresh=thresh, linscale=0.3)
            ax.set_xlim(0, x_hi * 1.05)
            ax.xaxis.set_major_formatter(FuncFormatter(
                lambda x, pos, t=thresh: "" if 0 < abs(x) < t else _step_label(x)))
        else:
            margin = 0.05 * (x_hi - x_lo)  # matplotlib's default margins, kept when a reference goes further
            ax.set_xlim(x_lo - margin, x_hi + margin)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
            ax.xaxis.set_major_formatter(FuncFormatter(_step_label))
        ax.grid(True, alpha=0.3)
    if ref_handles or random_drawn:  # long labels: one legend under the panels
        ncols = 1
        if n > 1 and ref_handles:  # the runs (and the random range) in one column, the paper's in the other
            rows = max(len(handles), len(ref_handles))
            blank = [Line2D([], [], alpha=0.0)] * rows
            handles = handles + blank[len(handles):] + ref_handles + blank[len(ref_handles):]
            labels = labels + [""] * (rows - len(labels)) + ref_labels + [""] * (rows - len(ref_labels))
            ncols = 2
        elif n > 1:
            ncols = min(len(handles), 4)
        else:
            handles, labels = handles + ref_handles, labels + ref_labels
        fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize="small", frameon=False)
    else:
        _legend(axes, chosen_metrics, finite, handles, labels)
    axes[0].set_ylabel("score per layer" if per_layer else "median across layers (q25-q75)")
    if title:
        fig.suptitle(title)
    _save(fig, path)
    return fig


# --------------------------------------------------------------------------- heatmap


def _pick_layer(found: list[AttentionLayer], layer: int, group: str | None, head: int | None) -> AttentionLayer:
    """The one record of ``found`` at ``layer`` (in ``group``); ``ValueError`` naming what exists."""
    groups = list(dict.fromkeys(a.group for a in found))
    if group is not None and group not in groups:
        raise ValueError(f"no group {group!r} in this model; groups: {', '.join(groups)}")
    matches = [a for a in found if a.layer == layer and (group is None or a.group == group)]
    if not matches:
        avail = sorted({a.layer for a in found if group is None or a.group == group})
        raise ValueError(f"no layer {layer}{f' in group {group!r}' if group else ''}; "
                         f"layers: {avail[0]}..{avail[-1]}" if avail else f"no layer {layer}")
    if len(matches) > 1:
        raise ValueError(f"layer {layer} exists in groups {', '.join(a.group for a in matches)}: "
                         "choose one with group=")
    att = matches[0]
    if head is not None and not 0 <= head < att.num_heads:
        raise ValueError(f"head {head} out of range: layer {layer} has {att.num_heads} heads")
    return att


def qk_for_layer(model: Any, layer: int, group: str | None = None, head: int | None = None
                 ) -> tuple[Any, str]:
    """The explicit float64 ``W_qk`` of one layer (or head) and the group it belongs to.

    ``model`` is an ``nn.Module`` or a local Hugging Face checkpoint directory; from a
    directory only that layer's query/key tensors are read
    (:func:`attn_probe.scoring.checkpoint.open_checkpoint`), never the whole model.
    """
    from torch import nn

    if isinstance(model, nn.Module):
        from ..extraction import find_attention

        att = _pick_layer(find_attention(model), layer, group, head)
        return att.qk_matrix(head=head), att.group
    from ..scoring.checkpoint import open_checkpoint

    found, tensors_of = open_checkpoint(model)
    att = _pick_layer(found, layer, group, head)
    return att.qk_matrix(tensors_of(att), head=head), att.group


def plot_heatmap(
    checkpoint: Any,
    layer: int,
    *,
    group: str | None = None,
    head: int | None = None,
    vmax: float | None = None,
    clip_percentile: float = 99.5,
    cmap: str = "RdBu_r",
    figsize: tuple[float, float] = (5.2, 4.6),
    path: str | os.PathLike | None = None,
) -> Figure:
    """Heatmap of one layer's (or head's) ``W_qk = sum_h W_q^h W_k^h^T`` (``d x d``).

    ``checkpoint`` is a local Hugging Face checkpoint directory or an ``nn.Module``. Rows are
    the query token's embedding dimensions, columns the key token's. The colour scale is
    diverging and symmetric around 0, ``[-vmax, vmax]``; by default ``vmax`` is the
    ``clip_percentile``-th percentile of ``|W_qk|`` so that a few large entries do not wash out
    the rest (``clip_percentile=100`` gives ``max |W_qk|``). The title gives the matrix's
    symmetry and directionality scores. Saved to ``path`` if given.
    """
    from ..definitions import directionality_score, symmetry_score

    _check_path(path)
    if not 0 < clip_percentile <= 100:
        raise ValueError(f"clip_percentile must be in (0, 100], got {clip_percentile}")
    if vmax is not None and not vmax > 0:
        raise ValueError(f"vmax must be positive, got {vmax}")
    m, grp = qk_for_layer(checkpoint, layer, group, head)
    sym = symmetry_score(m)
    dirn = directionality_score(m)
    plt = _pyplot()
    import numpy as np

    arr = m.numpy()
    finite = np.abs(arr[np.isfinite(arr)])
    if vmax is not None:
        scale = float(vmax)
    else:
        scale = float(np.percentile(finite, clip_percentile)) if finite.size else 1.0
    if not scale > 0:
        scale = 1.0
    fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    im = ax.imshow(arr, cmap=cmap, vmin=-scale, vmax=scale, interpolation="nearest", aspect="equal")
    cbar = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    cbar.set_label("$W_{qk}$ entry" + (" (clipped)" if scale < float(finite.max(initial=0.0)) else ""))
    ax.set_xlabel("key dimension (column)")
    ax.set_ylabel("query dimension (row)")
    where = f"{grp} layer {layer}" + (f" head {head}" if head is not None else "")
    ax.set_title(f"{where}: symmetry {sym:+.2f}, directionality {dirn:+.2f}", fontsize="medium")
    _save(fig, path)
    return fig
