"""Alert rules (attn_probe.live.alerts) on synthetic sequences of logged rows."""

from __future__ import annotations

import math

import pytest

from attn_probe.live.alerts import Alert, AlertMonitor, AlertRule, check_rules, impossible_rule


def rows(value: float, *, metric: str = "max_logit", layer: int = 0, heads: tuple[float, ...] = ()) -> list[dict]:
    """One layer row and optional head rows, in the probe's row format."""
    out = [{"group": "self", "layer": layer, "name": f"layers.{layer}", "head": None, metric: value}]
    out += [{"group": "self", "layer": layer, "name": f"layers.{layer}", "head": h, metric: v}
            for h, v in enumerate(heads)]
    return out


def run(rule: AlertRule, series: list[tuple[int, float]], **kw) -> list[Alert]:
    monitor = AlertMonitor([rule])
    fired = []
    for step, value in series:
        fired += monitor.evaluate(step, rows(value, **kw))
    return fired


def test_threshold_fires_once_per_crossing():
    rule = AlertRule("max_logit", above=10.0)
    series = [(0, 1.0), (10, 9.9), (20, 10.0), (30, 10.5), (40, 50.0), (50, 3.0), (60, 11.0)]
    fired = run(rule, series)
    assert [(a.step, a.value) for a in fired] == [(30, 10.5), (60, 11.0)]
    assert fired[0].layer == 0 and fired[0].head is None and fired[0].metric == "max_logit"
    assert fired[0].message() == ("attn_probe alert at step 30: max_logit = 10.5 in self layer 0, all heads "
                                  "(rule: max_logit above 10)")


def test_threshold_never_fires_below():
    assert run(AlertRule("max_logit", above=10.0), [(s, 10.0 - 1 / (s + 1)) for s in range(100)]) == []


def test_growth_within_window():
    rule = AlertRule("max_logit", growth=2.0, within=30)
    # doubling over 40 steps: 4 -> 8 between steps 0 and 40; never x2 within 30 steps
    slow = [(s, 4.0 * 2 ** (s / 40)) for s in range(0, 200, 10)]
    assert run(rule, slow) == []
    # doubling over 20 steps: first x2 at step 20 (value 8 vs 4 at step 0)
    fast = [(s, 4.0 * 2 ** (s / 20)) for s in range(0, 60, 10)]
    fired = run(rule, fast)
    assert [a.step for a in fired] == [20]  # stays true afterwards: fires once
    assert fired[0].reference == 4.0 and fired[0].reference_step == 0
    assert "grew x2 from 4 at step 0" in fired[0].message()


def test_growth_compares_only_within_the_window():
    rule = AlertRule("entropy", growth=3.0, within=5)
    fired = run(rule, [(0, 1.0), (4, 2.0), (6, 3.0), (10, 6.5)], metric="entropy")
    # step 6: 3 vs min(2 at step 4) -> x1.5; step 10: 6.5 vs min(2 at 4? out of window; 3 at 6) -> x2.17
    assert fired == []
    fired = run(rule, [(0, 1.0), (4, 2.0), (5, 3.0)], metric="entropy")
    assert [(a.step, a.reference_step) for a in fired] == [(5, 0)]


def test_growth_ignores_non_positive_and_nan_references():
    rule = AlertRule("max_logit", growth=2.0, within=100, nan=False)
    assert run(rule, [(0, 0.0), (1, -5.0), (2, math.nan), (3, 1.0), (4, 1.5)]) == []
    assert [a.step for a in run(rule, [(0, 0.0), (3, 1.0), (4, 2.0)])] == [4]


def test_rearms_after_condition_clears():
    rule = AlertRule("max_logit", growth=2.0, within=10)
    fired = run(rule, [(0, 1.0), (1, 2.0), (2, 2.0), (30, 2.0), (31, 4.5)])
    assert [a.step for a in fired] == [1, 31]


def test_heads_and_layers_filters():
    monitor = AlertMonitor([AlertRule("max_logit", above=5.0, heads=True, layers=(1,))])
    fired = monitor.evaluate(7, rows(9.0, layer=0, heads=(9.0, 9.0)) + rows(9.0, layer=1, heads=(1.0, 6.0)))
    assert [(a.layer, a.head, a.value, a.step) for a in fired] == [(1, 1, 6.0, 7)]
    assert "self layer 1, head 1" in fired[0].message()


def test_several_rules_and_metrics_are_independent():
    monitor = AlertMonitor([AlertRule("max_logit", above=5.0), AlertRule("entropy", above=1.0)])
    step_rows = rows(6.0) + rows(0.5, metric="entropy")
    assert [a.metric for a in monitor.evaluate(0, step_rows)] == ["max_logit"]
    assert monitor.evaluate(1, rows(6.0) + rows(2.0, metric="entropy"))[0].metric == "entropy"


def test_identical_inputs_give_identical_alerts():
    """What every rank relies on: the same rows give the same decisions."""
    rules = [AlertRule("max_logit", above=3.0), AlertRule("max_logit", growth=1.5, within=3)]
    series = [(s, 1.0 + (s % 7) * 0.6) for s in range(40)]
    a, b = AlertMonitor(rules), AlertMonitor(rules)
    out_a = [x for s, v in series for x in a.evaluate(s, rows(v))]
    out_b = [x for s, v in series for x in b.evaluate(s, rows(v))]
    assert out_a == out_b and out_a


def test_resumed_run_rewinds_history():
    rule = AlertRule("max_logit", growth=2.0, within=100)
    monitor = AlertMonitor([rule])
    for step, value in [(0, 1.0), (10, 1.5), (20, 1.9)]:
        assert monitor.evaluate(step, rows(value)) == []
    # resumed from a checkpoint at step 10 with a different trajectory: the old step 20 is gone
    assert monitor.evaluate(10, rows(5.0))[0].reference_step == 0


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"),
    ({"above": 1.0, "growth": 2.0, "within": 3}, "exactly one"),
    ({"above": float("nan")}, "above must be a number"),
    ({"above": 1.0, "within": 3}, "growth rules only"),
    ({"growth": 1.0, "within": 3}, "factor > 1"),
    ({"growth": 2.0}, "within"),
    ({"growth": 2.0, "within": 0}, "within"),
    ({"above": 1.0, "layers": (-1,)}, "layer indices"),
    ({"above": 1.0, "nan": 1}, "nan must be True or False"),
], ids=["none", "both", "nan", "within-on-above", "factor", "no-within", "zero-within", "layers", "nan-flag"])
def test_invalid_rules(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlertRule("max_logit", **kwargs)


def test_check_rules():
    rule = AlertRule("max_logit", above=1.0)
    assert check_rules(None) == ()
    assert check_rules(rule) == (rule,)
    with pytest.raises(TypeError, match="AlertRule"):
        check_rules([{"metric": "max_logit"}])
    with pytest.raises(ValueError, match="unknown metric 'max_logit'; logged metrics: entropy, symmetry"):
        check_rules([rule], known={"symmetry", "entropy"})


def test_nan_fires_once_per_layer_and_metric_with_the_step():
    """A NaN value fires by default (a diverging run), once per (layer, metric) however many rules
    and heads watch it, and again only after the value was finite; the rule's own condition and
    a growth rule's history are untouched by it."""
    nan = math.nan
    monitor = AlertMonitor([AlertRule("max_logit", above=10.0), AlertRule("max_logit", growth=2.0, within=5),
                            AlertRule("max_logit", above=10.0, heads=True)])
    assert monitor.evaluate(0, rows(1.0, heads=(1.0, 1.0))) == []
    fired = monitor.evaluate(1, rows(nan, heads=(nan, nan)) + rows(nan, layer=1))
    assert [(a.step, a.layer, a.head, a.rule.above) for a in fired] == [(1, 0, None, 10.0), (1, 1, None, 10.0)]
    assert all(math.isnan(a.value) for a in fired)
    assert fired[0].message() == ("attn_probe alert at step 1: max_logit = nan in self layer 0, all heads "
                                  "(not a number: non-finite weights or activations; rule: max_logit above 10)")
    assert monitor.evaluate(2, rows(nan, heads=(nan, nan)) + rows(nan, layer=1)) == []  # still NaN: once
    # layer 0 finite again (1.5: growth x1.5 from step 0, the NaN never entered the history), then NaN again
    assert monitor.evaluate(3, rows(1.5, heads=(1.0, 1.0))) == []
    assert [(a.step, a.layer) for a in monitor.evaluate(4, rows(nan, heads=(nan, nan)))] == [(4, 0)]


def test_nan_false_and_infinities():
    """nan=False: NaN fires nothing; +inf is above every threshold; -inf fires nothing."""
    assert run(AlertRule("max_logit", above=10.0, nan=False), [(0, math.nan), (1, math.nan)]) == []
    assert [a.step for a in run(AlertRule("max_logit", above=1e300), [(0, 1.0), (1, math.inf)])] == [1]
    assert run(AlertRule("max_logit", above=-1e300), [(0, -math.inf)]) == []


@pytest.mark.parametrize("rule, why", [
    (AlertRule("max_logit", above=1.0), "'max_logit' is not logged in this run (logged metrics: spectral_norm, symmetry)"),
    (AlertRule("symmetry", above=1.0, heads=True), "heads=True needs per-head values: pass per_head=True"),
    (AlertRule("symmetry", above=1.0, layers=(0, 7, 9)), "layers 7, 9 are not measured (measured layers: 0, 1)"),
    (AlertRule("symmetry", above=1.0, layers=(1,)), None),
], ids=["not-logged", "heads-without-per-head", "layer-outside", "possible"])
def test_impossible_rule(rule, why):
    assert impossible_rule(rule, logged={"symmetry", "spectral_norm"}, per_head=False, layers=[0, 1]) == why
