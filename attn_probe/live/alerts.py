"""Alert rules on logged metrics: a value above a threshold, or growing by a factor within N steps.

A rule watches one metric name on the probe's rows (``{group, layer, name, head, <metric>:
value}``), the layer rows (``head`` ``None``) or, with ``heads=True``, the per-head rows.
:class:`AlertMonitor` evaluates the rules on each logged step and returns the :class:`Alert`\\ s
that fired, for the caller to warn, notify a tracker, call a user callback or stop training.
It is deterministic in the values and steps alone, so on values that are identical on every
rank (after the probe's reduction) every rank fires the same alerts and takes the same stop
decision without a collective.

A rule fires when its condition *becomes* true for a ``(group, layer, head)`` and re-arms once
the condition is false again, so a value that stays high alerts once, not on every step:

- ``above``: ``value > above``;
- ``growth`` within ``within`` steps: ``value >= growth * v`` for some positive value ``v``
  logged for the same row at a step in ``[step - within, step)``.

Non-finite values: a NaN value fires by default (``nan=True``: NaN weights or logits are what an
alert is for), once per ``(group, layer, metric)`` however many rules and heads watch it, and
again only after that metric of that layer was finite; it neither fires nor re-arms the rule's
own condition and never enters a growth rule's history. ``+inf`` is above every threshold (an
``above`` rule fires); ``-inf`` fires nothing.

:func:`impossible_rule` names a rule that can never fire on a given run (a metric not logged, a
head rule without per-head values, a layer that is not measured): the probe refuses it at attach.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AlertRule:
    """One rule on ``metric``: exactly one of ``above=threshold`` or ``growth=factor, within=steps``.

    ``heads``: watch the per-head rows instead of the layer rows; ``layers``: only these
    layer indices (all when ``None``); ``nan``: a NaN value fires too (once per layer and
    metric, see the module docstring). Invalid values raise ``ValueError`` at construction.

    Example:
        >>> AlertRule("max_logit", above=100.0)
        AlertRule(metric='max_logit', above=100.0, growth=None, within=None, heads=False, layers=None, nan=True)
    """

    metric: str
    above: float | None = None
    growth: float | None = None
    within: int | None = None
    heads: bool = False
    layers: tuple[int, ...] | None = None
    nan: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"AlertRule: metric must be a metric name, got {self.metric!r}")
        if (self.above is None) == (self.growth is None):
            raise ValueError(f"AlertRule({self.metric!r}): give exactly one of above=... or growth=..., within=...")
        if self.above is not None:
            if not _real(self.above) or math.isnan(self.above):
                raise ValueError(f"AlertRule({self.metric!r}): above must be a number, got {self.above!r}")
            if self.within is not None:
                raise ValueError(f"AlertRule({self.metric!r}): within applies to growth rules only")
        else:
            if not _real(self.growth) or not self.growth > 1 or math.isinf(self.growth):
                raise ValueError(f"AlertRule({self.metric!r}): growth must be a factor > 1, got {self.growth!r}")
            if isinstance(self.within, bool) or not isinstance(self.within, int) or self.within < 1:
                raise ValueError(f"AlertRule({self.metric!r}): growth needs within=<steps >= 1>, got {self.within!r}")
        if self.layers is not None:
            layers = tuple(self.layers)
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
                raise ValueError(f"AlertRule({self.metric!r}): layers must be layer indices, got {self.layers!r}")
            object.__setattr__(self, "layers", layers)
        for flag in ("heads", "nan"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"AlertRule({self.metric!r}): {flag} must be True or False, got {getattr(self, flag)!r}")

    def describe(self) -> str:
        """The rule in words, e.g. ``above 100`` or ``x2 within 50 steps``."""
        if self.above is not None:
            return f"above {self.above:g}"
        return f"x{self.growth:g} within {self.within} steps"


def _real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class Alert:
    """A rule that fired: which metric, where (group, layer, head), the value and the step.

    For growth rules ``reference`` is the earlier value it grew from, at ``reference_step``;
    a NaN value (``value`` NaN) fired through the rule's ``nan`` default.
    """

    rule: AlertRule
    metric: str
    group: str
    layer: int
    head: int | None
    value: float
    step: int
    reference: float | None = None
    reference_step: int | None = None

    def message(self) -> str:
        """One line naming step, metric, value, group, layer, head and the rule (no file, no source line)."""
        where = f"{self.group} layer {self.layer}, " + ("all heads" if self.head is None else f"head {self.head}")
        line = f"attn_probe alert at step {self.step}: {self.metric} = {self.value:.6g} in {where}"
        rule = f"rule: {self.metric} {self.rule.describe()}"
        if math.isnan(self.value):
            return f"{line} (not a number: non-finite weights or activations; {rule})"
        if self.reference is not None:
            factor = self.value / self.reference
            return f"{line} (grew x{factor:.3g} from {self.reference:.6g} at step {self.reference_step}; {rule})"
        return f"{line} ({rule})"


def check_rules(rules: Iterable[AlertRule] | None, known: Collection[str] | None = None) -> tuple[AlertRule, ...]:
    """The ``alerts=[...]`` option validated: a tuple of :class:`AlertRule`; with ``known``, every
    rule's metric must be one of those names (``ValueError`` listing them)."""
    if rules is None:
        return ()
    if isinstance(rules, AlertRule):
        rules = [rules]
    out = tuple(rules)
    for rule in out:
        if not isinstance(rule, AlertRule):
            raise TypeError(f"alerts must be AlertRule objects, got {type(rule).__name__}")
        if known is not None and rule.metric not in known:
            raise ValueError(f"alert on unknown metric {rule.metric!r}; logged metrics: {', '.join(sorted(known))}")
    return out


def impossible_rule(rule: AlertRule, *, logged: Collection[str], per_head: bool,
                    layers: Collection[int]) -> str | None:
    """Why ``rule`` can never fire on a run that logs ``logged`` (per-head values when
    ``per_head``) for the layer indices ``layers``; ``None`` when it can."""
    if rule.metric not in logged:
        return f"{rule.metric!r} is not logged in this run (logged metrics: {', '.join(sorted(logged))})"
    if rule.heads and not per_head:
        return "heads=True needs per-head values: pass per_head=True"
    if rule.layers is not None:
        missing = sorted(set(rule.layers) - set(layers))
        if missing:
            return (f"layer{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                    f"{'are' if len(missing) > 1 else 'is'} not measured (measured layers: "
                    f"{', '.join(map(str, sorted(set(layers))))})")
    return None


class AlertMonitor:
    """Evaluates :class:`AlertRule`\\ s on each step's rows; keeps only a ``within``-step history."""

    def __init__(self, rules: Sequence[AlertRule], known: Collection[str] | None = None) -> None:
        self.rules = check_rules(rules, known)
        self._active: set[tuple] = set()
        self._history: dict[tuple, deque[tuple[int, float]]] = {}
        #: ``(metric, group, layer)`` whose NaN already fired and has not been finite since
        self._nan_active: set[tuple] = set()

    def evaluate(self, step: int, rows: Iterable[Mapping]) -> list[Alert]:
        """The alerts that fire at ``step`` given that step's rows, in rule then row order.

        A step at or before one already seen (a resumed run) drops the history from that step on.
        """
        fired: list[Alert] = []
        rows = list(rows)
        nan_now: set[tuple] = set()  # fired now
        nan_seen: set[tuple] = set()
        finite_now: set[tuple] = set()
        for r, rule in enumerate(self.rules):
            for row in rows:
                value = row.get(rule.metric)
                head = row.get("head")
                if value is None or (head is not None) != rule.heads:
                    continue
                layer = row.get("layer")
                if rule.layers is not None and layer not in rule.layers:
                    continue
                value = float(value)
                where = (rule.metric, row.get("group"), layer)
                if math.isnan(value):
                    nan_seen.add(where)
                    if rule.nan and where not in self._nan_active and where not in nan_now:
                        nan_now.add(where)
                        fired.append(Alert(rule, rule.metric, str(row.get("group")), int(layer), head, value, step))
                    continue
                finite_now.add(where)
                key = (r, row.get("group"), layer, head)
                alert = self._check(rule, key, step, value)
                if alert is not None:
                    fired.append(Alert(rule, rule.metric, str(row.get("group")), int(layer), head, value,
                                       step, *alert))
        self._nan_active = (self._nan_active - (finite_now - nan_seen)) | nan_now  # finite again: a later NaN fires again
        return fired

    def _check(self, rule: AlertRule, key: tuple, step: int, value: float) -> tuple | None:
        """``None`` if nothing fires, else ``(reference, reference_step)`` (``(None, None)`` for above)."""
        found: tuple | None = None
        if rule.above is not None:
            if value > rule.above:
                found = (None, None)
        else:
            past = self._history.setdefault(key, deque())
            while past and past[-1][0] >= step:
                past.pop()  # a resumed run rewinds
            while past and past[0][0] < step - rule.within:
                past.popleft()
            positive = [(v, s) for s, v in past if v > 0]
            if positive:
                low, low_step = min(positive)
                if value >= rule.growth * low:
                    found = (low, low_step)
            past.append((step, value))
        if found is None:
            self._active.discard(key)
            return None
        if key in self._active:
            return None
        self._active.add(key)
        return found


__all__ = ["Alert", "AlertMonitor", "AlertRule", "check_rules", "impossible_rule"]
