"""The custom-scalars layout puts the paper's figure first (TensorBoard 2.21 draws, within a category,
the Multiline charts first and the Margin charts last, so the figure needs a category of its own)."""

from __future__ import annotations

import re

from attn_probe.sinks.tensorboard import custom_scalars_layout

PAPER_CHART = "symmetry: median across layers (q25-q75)"


def test_the_papers_figure_is_alone_in_the_first_category():
    layout = custom_scalars_layout(["self"], ["symmetry", "directionality", "spectral_norm"])
    first_category, *rest = layout.items()
    title, charts = first_category
    assert title == "attn_probe/self: symmetry, the paper's figure"
    # one chart: whatever order TensorBoard draws a category's charts in, this one comes first
    assert list(charts) == [PAPER_CHART]
    assert charts[PAPER_CHART] == ["Margin", ["attn_probe/self/symmetry/median", "attn_probe/self/symmetry/q25",
                                              "attn_probe/self/symmetry/q75"]]
    assert [t for t, _ in rest] == ["attn_probe/self", "attn_probe/self/norms"]
    # every chart is shown exactly once, the paper's figure included
    titles = [c for _, cs in layout.items() for c in cs]
    assert len(titles) == len(set((t, c) for t, cs in layout.items() for c in cs))
    assert sum(c == PAPER_CHART for c in titles) == 1
    scores = layout["attn_probe/self"]
    assert scores["directionality: median across layers (q25-q75)"][0] == "Margin"
    assert re.match(scores["symmetry: per layer"][1][0], "attn_probe/self/symmetry/layer_03")


def test_every_groups_figure_comes_before_the_other_charts():
    layout = custom_scalars_layout(["self", "cross"], ["symmetry", "directionality"])
    assert list(layout) == ["attn_probe/self: symmetry, the paper's figure",
                            "attn_probe/cross: symmetry, the paper's figure", "attn_probe/self", "attn_probe/cross"]


def test_once_per_run_metrics_get_no_chart_and_no_symmetry_no_figure():
    """The random-matrix range (random_*) is logged once per run: no per-step chart series."""
    layout = custom_scalars_layout(["self"], ["symmetry", "random_symmetry", "random_symmetry_sd"])
    tags = [t for charts in layout.values() for _, (_, ts) in charts.items() for t in ts]
    assert tags and not any("random_" in t for t in tags)
    assert list(custom_scalars_layout(["self"], ["directionality"])) == ["attn_probe/self"]
