"""The lossless trajectory sink: ``attn_probe.jsonl`` beside the event files.

Schema: :mod:`attn_probe.trajectory_format` (one JSON object per value). Every snapshot is
appended, flushed and fsync'd, so a crash loses at most the snapshot being written; on
resume, rows with ``step >= resume_step`` are dropped first so steps stay unique and ordered.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import IO

from ..trajectory_format import FIELDS, TRAJECTORY_FILENAME, encode_value
from . import RunInfo, Snapshot

__all__ = ["TrajectorySink", "truncate_trajectory"]


def truncate_trajectory(path: str, resume_step: int) -> int:
    """Drop rows with ``step >= resume_step`` (and a torn last line) in place; returns rows dropped."""
    if not os.path.exists(path):
        return 0
    kept: list[str] = []
    dropped = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
                keep = line.endswith("\n") and int(row["step"]) < resume_step
            except (ValueError, KeyError, TypeError):
                keep = False
            if keep:
                kept.append(line)
            else:
                dropped += 1
    if dropped:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


class TrajectorySink:
    """Append one JSON line per value to ``<log_dir>/attn_probe.jsonl``."""

    def __init__(self, log_dir: str, filename: str = TRAJECTORY_FILENAME) -> None:
        self.path = os.path.join(log_dir, filename)
        self._file: IO[str] | None = None

    def start(self, run: RunInfo) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if run.resume_step is not None:
            truncate_trajectory(self.path, run.resume_step)
        elif os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            warnings.warn(
                f"attn_probe: {self.path} already holds a trajectory; this run starts again at step 0 "
                "and its rows are appended after the old ones. Use a fresh log_dir for a new run.",
                RuntimeWarning,
                stacklevel=2,
            )
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, snapshot: Snapshot) -> None:
        if self._file is None:
            raise RuntimeError("TrajectorySink.log() before start()")
        lines = []
        for r in snapshot.records:
            row = dict(zip(FIELDS, (snapshot.step, snapshot.wall_time, r.group, r.layer, r.head,
                                    r.metric, encode_value(r.value)), strict=True))
            lines.append(json.dumps(row, allow_nan=False) + "\n")
        self._file.write("".join(lines))
        self._file.flush()
        os.fsync(self._file.fileno())

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
