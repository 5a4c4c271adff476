"""A stage after the assembly: the alert rules (:mod:`attn_probe.alerts`) on each snapshot's values.

Every rank evaluates the rules on the values it has (the combined ones, identical on every rank),
so all ranks take the same stop decision without a collective. On the main process a fired
alert is one warning line, a call of the user's ``alert_callback``, and ``run.alert`` of the
active W&B run, sent from a daemon thread: the training thread never waits on a tracker.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..alerts import Alert, AlertMonitor
from ..config import ProbeConfig
from ..isolation import Failures, safe_warn
from ..sinks import Snapshot

__all__ = ["Alerting", "build_alerting"]


class Alerting:
    """``check(snapshot)``: evaluate the rules; ``stop_requested`` once one fired with ``stop_on_alert``."""

    def __init__(self, rules: Sequence[Any], known: Iterable[str], *, stop_on_alert: bool,
                 callback: Callable[[Alert], Any] | None, is_main_process: bool, failures: Failures) -> None:
        self.monitor = AlertMonitor(rules, known=set(known))  # ValueError naming the known metrics
        self.stop_on_alert = stop_on_alert
        self.callback = callback
        self.is_main_process = is_main_process
        self.failures = failures
        self.stop_requested = False

    def check(self, snapshot: Snapshot) -> list[Alert]:
        rows: dict[tuple, dict[str, Any]] = {}
        for r in snapshot.records:
            key = (r.group, r.layer, r.head)
            rows.setdefault(key, {"group": r.group, "layer": r.layer, "head": r.head})[r.metric] = r.value
        fired = self.monitor.evaluate(snapshot.step, rows.values())
        if fired and self.stop_on_alert:
            self.stop_requested = True
        if fired and self.is_main_process:
            for alert in fired:
                safe_warn(alert.message())
                if self.callback is not None:
                    try:
                        self.callback(alert)
                    except Exception as exc:  # noqa: BLE001 - user code must not stop training
                        self.failures.report("the alert callback", exc)
                _tracker_alert(alert, self.failures)
        return fired


def build_alerting(config: ProbeConfig, known: Iterable[str], *, is_main_process: bool,
                   failures: Failures) -> Alerting | None:
    """The stage for ``config.alerts`` (``None`` without rules); raises ``ValueError`` naming
    the ``known`` metrics when a rule names another."""
    if not config.alerts:
        return None
    return Alerting(config.alerts, known, stop_on_alert=config.stop_on_alert, callback=config.alert_callback,
                    is_main_process=is_main_process, failures=failures)


def _tracker_alert(alert: Alert, failures: Failures) -> None:
    """``run.alert`` of the active W&B run, if W&B is in use here, on a daemon thread (never waited for)."""
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None or not hasattr(run, "alert"):
        return

    def send() -> None:
        try:
            run.alert(title=f"attn_probe: {alert.metric} in layer {alert.layer}", text=alert.message())
        except Exception as exc:  # noqa: BLE001
            failures.report("the W&B alert", exc)

    threading.Thread(target=send, name="attn_probe-alert", daemon=True).start()
