"""Across-layer statistics of a trajectory: median and interquartile range per step.

The paper reports one score per layer (the layer-level matrix ``M = sum_h W_q^h W_k^h^T``),
summarised by the median and the 25th/75th percentiles across layers, as defined once in
:data:`attn_probe.formats.tags.STAT_QUANTILES` / :func:`attn_probe.formats.tags.layer_stats`: linear
interpolation between order statistics (numpy's default); NaN layers are left out.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from ..formats.tags import STAT_QUANTILES, STATS
from .loading import as_frame
from .table import TrajectoryError, TrajectoryWarning, require_pandas

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


#: the prefix of the random-matrix range's rows (:mod:`attn_probe.baselines.random_range`)
RANDOM_PREFIX = "random_"

__all__ = ["layer_quantiles", "summarize", "format_summary", "warn_missing", "is_magnitude"]


def layer_quantiles(df_or_runs: Any) -> pd.DataFrame:
    """Median, q25 and q75 across layers for every ``run, group, metric, step``.

    Only layer-level rows (``head`` is ``<NA>``) count. Columns: ``run, group, metric, step,
    median, q25, q75, layers`` (``layers`` = number of finite layer values at that step).
    """
    pd = require_pandas()
    df = as_frame(df_or_runs, heads=False)
    layer_rows = df[df["head"].isna() & df["value"].notna()]
    keys = ["run", "group", "metric", "step"]
    if layer_rows.empty:
        return pd.DataFrame(columns=[*keys, *STATS, "layers"])
    g = layer_rows.groupby(keys, sort=True)["value"]
    # vectorised form of tags.layer_stats (pandas' quantile interpolates linearly too)
    columns = {stat: g.quantile(STAT_QUANTILES[stat]) for stat in STATS}
    return pd.DataFrame({**columns, "layers": g.size()}).reset_index()


def _in_registry_order(metrics: Any) -> list[str]:
    """Distinct metrics, those of :data:`attn_probe.core.METRICS` first in its order, then the rest."""
    from ..core import METRICS

    order = {m: i for i, m in enumerate(METRICS)}
    return sorted(dict.fromkeys(metrics), key=lambda m: (order.get(m, len(order)), m))


def warn_missing(layer_rows: pd.DataFrame, finite: pd.DataFrame, what: str) -> None:
    """One :class:`TrajectoryWarning` per run and group naming the metrics of ``layer_rows``
    that have no row in ``finite`` (every layer-level value NaN or infinite): ``what`` says
    what happens to them ("left out of the summary")."""
    have = set(zip(finite["run"], finite["group"], finite["metric"], strict=True))
    missing: dict[tuple[str, str], list[str]] = {}
    for key in dict.fromkeys(zip(layer_rows["run"], layer_rows["group"], layer_rows["metric"], strict=True)):
        if key not in have:
            missing.setdefault(key[:2], []).append(key[2])
    for (run, group), metrics in missing.items():
        metrics = _in_registry_order(metrics)
        noun = "metric" if len(metrics) == 1 else "metrics"
        warnings.warn(f"run {run}, group {group}: no finite layer-level value of {', '.join(metrics)} "
                      f"(all NaN); {noun} {what}", TrajectoryWarning, stacklevel=3)


def summarize(df_or_runs: Any) -> pd.DataFrame:
    """First and last median [q25, q75] across layers, per run, group and score.

    ``df_or_runs`` is a long table from :func:`~attn_probe.analysis.trajectory.load_trajectory`
    or what it accepts (run directories). One row per ``run, group, metric`` with
    ``first_step, first_median, first_q25, first_q75, last_step, last_median, last_q25,
    last_q75, layers`` ("first"/"last" = earliest/latest step with a finite layer-level value).
    A metric with no finite layer-level value in a run and group (the probe writes NaN for
    undefined scores) has no row; a :class:`~attn_probe.analysis.trajectory.TrajectoryWarning`
    names it. Raises :class:`~attn_probe.analysis.trajectory.TrajectoryError` when there is no
    finite layer-level value.
    """
    pd = require_pandas()
    df = as_frame(df_or_runs, heads=False)  # run directories: only their layer-level rows are read
    layer_rows = df[df["head"].isna()]
    random = layer_rows[layer_rows["metric"].str.startswith(RANDOM_PREFIX)]
    layer_rows = layer_rows[~layer_rows["metric"].str.startswith(RANDOM_PREFIX)]
    q = layer_quantiles(layer_rows)
    if q.empty:
        if layer_rows.empty:
            raise TrajectoryError("no layer-level values to summarise (only per-head rows)")
        raise TrajectoryError(f"no layer-level values to summarise: all {len(layer_rows)} layer-level values "
                              f"({', '.join(_in_registry_order(layer_rows['metric']))}) are NaN")
    warn_missing(layer_rows, q, "left out of the summary")
    rows = []
    for (run, group, metric), part in q.groupby(["run", "group", "metric"], sort=False):
        part = part.sort_values("step")
        first, last = part.iloc[0], part.iloc[-1]
        rows.append({
            "run": run, "group": group, "metric": metric,
            "first_step": int(first["step"]), "first_median": first["median"],
            "first_q25": first["q25"], "first_q75": first["q75"],
            "last_step": int(last["step"]), "last_median": last["median"],
            "last_q25": last["q25"], "last_q75": last["q75"],
            "layers": int(last["layers"]),
        })
    out = pd.DataFrame(rows)
    if not random.empty:
        ranges = random.groupby(["run", "group", "metric"])["value"].median().to_dict()
        out["random_mean"] = [ranges.get((r, g, f"{RANDOM_PREFIX}{m}"), float("nan"))
                              for r, g, m in zip(out["run"], out["group"], out["metric"], strict=True)]
        out["random_sd"] = [ranges.get((r, g, f"{RANDOM_PREFIX}{m}_sd"), float("nan"))
                            for r, g, m in zip(out["run"], out["group"], out["metric"], strict=True)]
    # runs in the order given, metrics in the registry's order (the paper's two first), unknown last
    from ..core import METRICS

    order = {m: i for i, m in enumerate(METRICS)}
    out["_m"] = [order.get(m, len(order)) for m in out["metric"]]
    run_order = {r: i for i, r in enumerate(dict.fromkeys(q["run"]))}
    out["_r"] = [run_order[r] for r in out["run"]]
    out = out.sort_values(["_r", "group", "_m", "metric"], kind="stable").drop(columns=["_m", "_r"])
    return out.reset_index(drop=True)


def is_magnitude(metric: str) -> bool:
    """:func:`attn_probe.core.is_magnitude`, also for a metric known by a new name
    (:data:`~attn_probe.analysis.trajectory.RENAMED_METRICS`: ``ov_gain_bound`` as ``ov_qk_bound``)."""
    from ..core import is_magnitude as core
    from .table import RENAMED_METRICS

    old = {new: old for old, new in RENAMED_METRICS.items()}
    return core(metric) or core(old.get(metric, metric))


def format_summary(table: pd.DataFrame, digits: int = 2) -> str:
    """Plain-text rendering of :func:`summarize`'s table: one block per run.

    Scores in ``[-1, 1]`` (symmetry, directionality) carry their sign (``+0.41``); magnitudes
    (norms, stable rank, bounds: :func:`is_magnitude`) are never negative and are printed
    without one. A run that logged the random-matrix range gets a last column with its median
    across layers, ``mean ± sd`` of one random ``W_qk`` of the layers' shapes. Names are escaped (:func:`attn_probe.formats.logdir.printable`): a run name cannot
    clear the terminal or forge a line.
    """
    from ..formats.logdir import printable

    def cell(m: float, lo: float, hi: float, sign: str) -> str:
        return f"{m:{sign}.{digits}f} [{lo:{sign}.{digits}f}, {hi:{sign}.{digits}f}]"

    lines: list[str] = []
    for run, part in table.groupby("run", sort=False):
        if lines:
            lines.append("")
        lines.append(f"run {printable(run)}")
        with_random = "random_mean" in part.columns and bool(part["random_mean"].notna().any())
        body = [("group", "score", "first step", "median [q25, q75]", "last step",
                 "median [q25, q75]", "layers") + (("random W_qk",) if with_random else ())]
        for r in part.itertuples(index=False):
            sign = "" if is_magnitude(r.metric) else "+"
            row = (printable(r.group), printable(r.metric), str(r.first_step),
                   cell(r.first_median, r.first_q25, r.first_q75, sign),
                   str(r.last_step), cell(r.last_median, r.last_q25, r.last_q75, sign), str(r.layers))
            if with_random:
                mean, sd = r.random_mean, r.random_sd
                spread = f"{sd:.{digits + 1}f}" if sd == sd else "n/a"  # NaN: too few draws in the time budget
                row += ("" if mean != mean else f"{mean:+.{digits + 1}f} ± {spread}",)
            body.append(row)
        widths = [max(len(row[i]) for row in body) for i in range(len(body[0]))]
        right = {2, 4, 6}
        for row in body:
            lines.append("  " + "  ".join(
                c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip())
    return "\n".join(lines)
