"""The across-layer statistics, defined once in attn_probe.formats.tags and shared by every reader/writer."""

from __future__ import annotations

import math
import random

import pytest

from attn_probe.formats.tags import STAT_QUANTILES, STATS, layer_stats
from attn_probe.scoring.checkpoint import summarize_rows


def linear_quantile(values: list[float], q: float) -> float:
    """Explicit definition: linear interpolation between the order statistics at (n - 1) q."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


def test_stats_match_the_explicit_definition_and_skip_non_finite():
    rng = random.Random(0)
    for n in (1, 2, 3, 4, 7, 12):
        values = [rng.uniform(-1, 1) for _ in range(n)]
        got = layer_stats([*values, math.nan, None, math.inf])
        assert list(got) == list(STATS)
        for stat in STATS:
            assert got[stat] == pytest.approx(linear_quantile(values, STAT_QUANTILES[stat]), abs=1e-12)


def test_stats_of_nothing_finite_are_nan():
    assert all(math.isnan(v) for v in layer_stats([]).values())
    assert all(math.isnan(v) for v in layer_stats([math.nan, None]).values())


def test_checkpoint_summary_and_trajectory_reader_agree():
    pd = pytest.importorskip("pandas")
    from attn_probe.analysis.summary import layer_quantiles

    values = [0.9, -0.2, 0.35, math.nan, 0.1, 0.6]
    rows = [{"group": "self", "layer": i, "head": None, "symmetry": v, "directionality": -v}
            for i, v in enumerate(values)]
    (summary,) = summarize_rows(rows)
    df = pd.DataFrame({"run": "r", "group": "self", "step": 0, "layer": range(len(values)),
                       "head": None, "metric": "symmetry", "value": values})
    (row,) = layer_quantiles(df).to_dict("records")
    finite = [v for v in values if not math.isnan(v)]
    for stat in STATS:
        expected = linear_quantile(finite, STAT_QUANTILES[stat])
        assert summary[f"symmetry_{stat}"] == pytest.approx(expected, abs=1e-12)
        assert row[stat] == pytest.approx(expected, abs=1e-12)
    assert row["layers"] == len(finite)
