"""The verdict's lines on when each model's structure emerged: the median layer's departure and
takeoff (:mod:`attn_probe.analysis.emergence`) beside the loss-plateau rule."""

from __future__ import annotations

from typing import Any


def emergence_lines(models: dict[str, Any], plateau_exits: dict[str, int | None]) -> list[str]:
    """Per model and score, the median layer's events read from its run's trajectory, and how far
    the symmetry takeoff lies from the model's plateau exit. Never raises (a line says what failed)."""
    try:
        from ..analysis.emergence import describe, emergence, median_events
        from ..analysis.table import is_na
        from ..formats.trajectory import TRAJECTORY_FILENAME

        lines = []
        for kind, r in models.items():
            if not (r.run_dir / TRAJECTORY_FILENAME).is_file():  # a result built by hand, a run that failed
                continue
            table = median_events(emergence(r.run_dir))
            for row in table.itertuples(index=False):
                text = f"  {kind} {row.metric}: {describe(row)}"
                exit_step = plateau_exits.get(kind)
                if row.metric == "symmetry" and not is_na(row.takeoff) and exit_step is not None:
                    gap = int(row.takeoff) - exit_step
                    text += f" ({abs(gap):,} steps {'after' if gap >= 0 else 'before'} the plateau exit)"
                lines.append(text)
    except Exception as exc:  # noqa: BLE001  (the verdict still says the rest)
        return [f"when the structure emerged could not be read ({type(exc).__name__}: {exc})"]
    if not lines:
        return []
    return ["when the structure emerged (median layer; departure: stays beyond 3 sd of the random range; "
            "takeoff: half of the final rise; attn-probe summary gives each layer):", *lines]
