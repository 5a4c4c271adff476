"""Issue 23 item 5: the trajectory file never drops a snapshot because its own writer is slow.

The trajectory sink is ``lossless``: when its lane is full the caller waits (bounded) for room,
and the lane writes every waiting snapshot in one write and one fsync. Snapshots are handed to a
real dispatcher back to back, far faster than one fsync per snapshot allows, through a lane of 4.
"""

from __future__ import annotations

import json
import threading
import time

from attn_probe.sinks import Record, RunInfo, Sink, Snapshot
from attn_probe.sinks import dispatch as dispatch_module
from attn_probe.sinks.dispatch import SinkDispatcher
from attn_probe.sinks.trajectory import TrajectorySink

RUN = RunInfo(config={}, model={}, groups=["self"], metrics=["symmetry"], per_head=False)


def snapshot(step: int, layers: int = 8) -> Snapshot:
    return Snapshot(step, 1.0 + step, [Record("self", i, None, "symmetry", step + i / 10) for i in range(layers)])


def test_back_to_back_snapshots_all_reach_the_trajectory_file(tmp_path):
    n = 3000
    sink = TrajectorySink(str(tmp_path))
    dispatcher = SinkDispatcher([sink], queue_size=4)
    dispatcher.start(RUN)
    for step in range(n):
        dispatcher.log(snapshot(step))
    assert dispatcher.close(timeout=120)
    (stats,) = dispatcher.stats()
    assert (stats.delivered, stats.dropped, stats.lost) == (n, 0, 0), stats
    rows = [json.loads(line) for line in (tmp_path / "attn_probe.jsonl").read_text().splitlines() if '"run_header"' not in line]
    assert [r["step"] for r in rows[::8]] == list(range(n))  # every snapshot, in order, whole
    assert [r["value"] for r in rows[:8]] == [i / 10 for i in range(8)]


class HungDisk(Sink):
    """A lossless sink whose first write never returns (a hung network filesystem)."""

    background = True
    lossless = True

    def __init__(self) -> None:
        self.release = threading.Event()

    def start(self, run):
        pass

    def log(self, snapshot):
        self.release.wait()

    def finish(self):
        pass


def test_a_hung_lossless_sink_costs_one_bounded_wait_then_drops(monkeypatch):
    monkeypatch.setattr(dispatch_module, "BACKPRESSURE_TIMEOUT", 1.0)
    sink = HungDisk()
    dispatcher = SinkDispatcher([sink], queue_size=2)
    dispatcher.start(RUN)
    t = time.monotonic()
    dispatcher.log(snapshot(0))  # taken by the lane, which hangs
    time.sleep(0.2)
    for step in range(1, 9):  # 2 fit; the 4th waits once, the rest are dropped at once
        dispatcher.log(snapshot(step))
    elapsed = time.monotonic() - t
    assert 1.0 <= elapsed < 3.0, elapsed
    (stats,) = dispatcher.stats()
    assert stats.dropped == 6, stats
    sink.release.set()
    assert dispatcher.close(timeout=30)
    assert dispatcher.stats()[0].delivered == 3
