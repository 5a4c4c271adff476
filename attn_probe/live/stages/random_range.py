"""The random-matrix range of the layers' shapes, computed off the training thread (issue 44).

At attach, a fresh run's main process starts one daemon thread that computes the range
(:func:`random_range_records`: :func:`attn_probe.baselines.random_range.random_range_rows`, seeded
draws whose count follows from the shapes alone, each distinct layer shape computed once and
cached, so its memory is that of one shape's draws whatever the depth). The training thread does
not wait for it: the façade hands its rows to the sinks with the first snapshot it publishes
after they are ready (:meth:`BackgroundRange.take`), at that snapshot's step. At ``close()``
(and at interpreter exit for a probe never closed) it waits for them within :data:`CLOSE_WAIT`
seconds and writes them on their own; not ready by then, it warns that they were lost and
counts it. They are never silently absent.

Only the main process writes the trajectory, so only it computes the range: the other ranks
compute nothing, and no collective depends on it (the values are seeded: any process, or a
post-hoc reader, computes the same numbers from the header's shapes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from ...baselines import random_range
from ...isolation import safe_warn
from ...sinks import Record

__all__ = ["CLOSE_WAIT", "BackgroundRange", "random_range_records"]

#: seconds ``close()`` (and the interpreter-exit hook) waits for a range still being computed
CLOSE_WAIT = 60.0


def random_range_records(
    layers: Sequence[Any], metrics: Sequence[str], *, per_head: bool, num_std: float
) -> tuple[list[Record], str | None]:
    """The random-matrix range of ``layers`` as records, and the one warning to give (or ``None``).

    No time budget: at most :data:`~attn_probe.baselines.random_range.PROBE_ENTRIES` drawn numbers,
    so the draws and the values depend on the shapes alone. Never raises: a failure is no records
    and a warning saying so; shapes that got fewer draws, or none, are named in the warning.
    """
    try:
        rows, notes = random_range.random_range_rows(
            layers,
            metrics=metrics,
            per_head=per_head,
            num_std=num_std,
            budget=None,
            max_entries=random_range.PROBE_ENTRIES,
        )
        message = (
            f"attn_probe: the random-matrix range: {'; '.join(notes)}. (random_range=False turns it off.)"
            if notes
            else None
        )
        return [Record(*row) for row in rows], message
    except Exception as exc:  # noqa: BLE001 - a reference range must never stop training
        return [], (
            f"attn_probe: the random-matrix range could not be computed ({type(exc).__name__}: {exc}); "
            "it is not logged. Training and the scores are not affected."
        )


class BackgroundRange:
    """The range of ``layers`` computed on a daemon thread started here (``thread_id``: its ident).

    :meth:`take` hands the rows over once, on the caller's thread (with the warning
    :func:`random_range_records` gave, if any); :meth:`wait` waits for them. ``finished_at``:
    ``time.perf_counter()`` when they were ready (``None`` before).
    """

    def __init__(
        self, layers: Sequence[Any], metrics: Sequence[str], *, per_head: bool, num_std: float
    ) -> None:
        self.thread_id: int | None = None
        self.finished_at: float | None = None
        self._rows: list[Record] = []
        self._message: str | None = None
        self._taken = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        args = (list(layers), list(metrics), bool(per_head), float(num_std))
        self._thread = threading.Thread(
            target=self._run, args=args, name="attn_probe-random-range", daemon=True
        )
        try:
            self._thread.start()
        except Exception as exc:  # noqa: BLE001 - e.g. no thread left: no range, said once; attach goes on
            self._message = (
                f"attn_probe: the random-matrix range could not be computed ({type(exc).__name__}: {exc}); "
                "it is not logged. Training and the scores are not affected."
            )
            self.finished_at = time.perf_counter()
            self._done.set()

    def _run(self, layers: list[Any], metrics: list[str], per_head: bool, num_std: float) -> None:
        self.thread_id = threading.get_ident()
        try:
            self._rows, self._message = random_range_records(
                layers, metrics, per_head=per_head, num_std=num_std
            )
        finally:
            self.finished_at = time.perf_counter()
            self._done.set()

    @property
    def pending(self) -> bool:
        """Rows not handed over yet (computed or not)."""
        return not self._taken

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the rows are computed (``timeout`` seconds, ``None``: no limit); whether they are."""
        return self._done.wait(timeout)

    def take(self, timeout: float = 0.0) -> list[Record] | None:
        """The rows, once (waiting ``timeout`` seconds at most); ``[]`` once taken or when none were
        computed, ``None`` while not ready. Gives the computation's warning, once. Never raises."""
        if self._taken or not self._done.wait(timeout):
            return [] if self._taken else None
        with self._lock:
            if self._taken:
                return []
            self._taken = True
            rows, message, self._rows = self._rows, self._message, []
        if message is not None:
            safe_warn(message, stacklevel=3)
        return rows
