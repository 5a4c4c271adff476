"""The paper side by side: its matching runs as TensorBoard runs beside the demo's, and the random range.

The paper's trajectories (:mod:`attn_probe.baselines.paper`) are written as one TensorBoard run
per matching paper run, ``<root>/paper-<name>``, with the tags of the demo's own across-layer
series (``attn_probe/{group}/{metric}/{median,q25,q75}``), so that the paper's figure in Custom
Scalars draws the paper's run beside the user's. The random-matrix range is read from the run's
own ``random_*`` rows (logged once per run by the probe).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

#: the scores the paper's table holds
PAPER_METRICS = ("symmetry", "directionality")
#: the prefix of a paper run's directory under the demo's root
PAPER_RUN_PREFIX = "paper-"


def paper_tokens(tokens: str) -> str:
    """The paper's tokenisation matching the demo's ``--tokens``: ``chars`` or ``wordpiece``."""
    return "wordpiece" if tokens == "wordpiece" else "chars"


def matching_runs(kinds: Iterable[str], layers: int, tokens: str) -> dict[str, Any]:
    """Model kind -> the paper's matching :class:`~attn_probe.baselines.paper.PaperRun`.

    Empty when the paper's table is not available (the package data missing).
    """
    try:
        from ..baselines.paper import matching_paper_run
    except ImportError:
        return {}
    return {kind: matching_paper_run(kind, layers, paper_tokens(tokens)) for kind in kinds}


def clip_step(last_step: int, steps: Iterable[int]) -> int:
    """The last paper checkpoint to show: the first one at or beyond ``last_step`` (else the last)."""
    ordered = sorted(steps)
    return next((s for s in ordered if s >= last_step), ordered[-1])


def write_paper_runs(root: Path, runs: dict[str, Any], groups: list[str], last_step: int) -> list[Path]:
    """One TensorBoard run per paper run, ``root/paper-<name>``, up to :func:`clip_step`.

    Written afresh (an earlier reference run's event files in that directory are removed).
    Returns the run directories written.
    """
    from torch.utils.tensorboard import SummaryWriter

    from ..analysis.runs import REFERENCE_MARKER
    from ..baselines.paper import paper_trajectory
    from ..formats.tags import BAND_STATS, scalar_tag
    from ..sinks.tensorboard import CONFIG_TEXT_TAG

    written = []
    for run in dict.fromkeys(runs.values()):
        table = paper_trajectory(run.name)
        end = clip_step(last_step, table["step"].unique())
        run_dir = root / f"{PAPER_RUN_PREFIX}{run.name}"
        for old in run_dir.glob("events.out.tfevents.*"):
            old.unlink()
        writer = SummaryWriter(log_dir=str(run_dir))
        (run_dir / REFERENCE_MARKER).write_text(  # `attn-probe plot/summary runs/demo` skip this directory
            f"{run.describe()}: the paper's trajectory for TensorBoard, written by attn-probe demo; not a probe run\n")
        try:
            writer.add_text(CONFIG_TEXT_TAG, f"{run.describe()}: median and quartiles across layers per checkpoint "
                            "(the paper's released repository; attn_probe.baselines.paper)", global_step=0)
            for row in table[table["step"] <= end].sort_values("step").itertuples(index=False):
                if row.metric not in PAPER_METRICS:
                    continue
                for group in groups:
                    for stat in BAND_STATS:
                        writer.add_scalar(scalar_tag(group, row.metric, stat=stat), float(getattr(row, stat)),
                                          int(row.step))
        finally:
            writer.close()
        written.append(run_dir)
    return written


class RandomRange(NamedTuple):
    """The range of a score of a random W_qk of the run's layer shapes: mean and standard deviation."""

    mean: float
    sd: float

    def distance(self, value: float) -> float:
        """How many standard deviations ``value`` lies from the mean (inf when the sd is 0)."""
        return (value - self.mean) / self.sd if self.sd > 0 else float("inf")


def random_range(run_dir: Path, metric: str = "symmetry") -> RandomRange | None:
    """The run's own random range of ``metric`` (median across layers of its ``random_{metric}``
    and ``random_{metric}_sd`` rows in ``attn_probe.jsonl``), or None when the run has none."""
    path = Path(run_dir) / "attn_probe.jsonl"
    if not path.is_file():
        return None
    means: dict[Any, float] = {}
    sds: dict[Any, float] = {}
    with path.open() as f:
        for line in f:
            if f'"random_{metric}' not in line:
                continue
            try:
                row = json.loads(line)
            except ValueError:  # a torn last line of an interrupted run
                continue
            if row.get("head") is not None:
                continue
            key = (row.get("group"), row.get("layer"))
            if row.get("metric") == f"random_{metric}":
                means[key] = float(row["value"])
            elif row.get("metric") == f"random_{metric}_sd":
                sds[key] = float(row["value"])
    if not means or not sds:
        return None
    return RandomRange(statistics.median(means.values()), statistics.median(sds.values()))
