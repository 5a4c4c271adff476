"""FSDP2 gathers overlap the scoring: the next layer's all-gather is issued before this one is scored.

One real ``torchrun`` gloo run with 3 processes on CPU (``distributed_workers/prefetch_worker.py``),
on a Llama whose W_q and W_k split unevenly over the ranks, bounded by a timeout that kills the
process group. References: the unsharded weights (kept before ``fully_shard``) and
:func:`attn_probe.score_model` on them, in a single process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed_workers"))
from helpers import launch  # noqa: E402

RANKS = 3


def issues_then_yields(order: list[str]) -> list[str]:
    """Expected events on the receiving rank: each layer's two gathers, one layer ahead."""
    events = [f"issue {order[0]}"] * 2
    for i, name in enumerate(order):
        if i + 1 < len(order):
            events += [f"issue {order[i + 1]}"] * 2
        events.append(f"yield {name}")
    return events


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("prefetch")
    launch("prefetch_worker.py", [str(root)], RANKS, timeout=240)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(RANKS)]


def test_next_gather_is_in_flight_while_a_layer_is_scored(reports: list[dict]) -> None:
    walk = reports[0]["walk"]
    assert walk["events"] == issues_then_yields(["L0", "L1", "L2", "L3"])
    assert walk["exact"] == [True] * 4  # uneven shards gathered back bit for bit
    for other in reports[1:]:  # rank0_only: the others only take part, synchronously, same order
        assert other["walk"]["events"] == [f"issue L{i}" for i in range(4) for _ in range(2)]
        assert other["walk"]["exact"] == []


def test_at_most_two_layers_are_gathered_at_once(reports: list[dict]) -> None:
    # when a gather is issued, at most one other layer's gathered tensors are still alive,
    # over the plain walk, the probe's snapshot and gather_scores
    assert [r["alive"] for r in reports] == [1] * RANKS


def test_a_layer_one_rank_cannot_prepare_is_skipped_everywhere_and_the_walk_goes_on(reports: list[dict]) -> None:
    for r in reports:  # rank0_only=False: every rank receives; rank 1 failed to prepare layer 2
        assert r["fault"]["events"] == issues_then_yields(["L0", "L1", "L3"])
        assert r["fault"]["exact"] == [True] * 3


def test_a_stop_ends_the_walk_on_every_rank_after_handing_out_what_was_gathered(reports: list[dict]) -> None:
    # rank 1 asks to stop before layer 2's gather: no rank issues another gather; rank 0
    # still hands out layer 1, gathered ahead before the stop
    assert reports[0]["stop"]["events"] == issues_then_yields(["L0", "L1"])
    for other in reports[1:]:
        assert other["stop"]["events"] == [f"issue L{i}" for i in range(2) for _ in range(2)]


def test_probe_and_gather_scores_equal_single_process_scores(reports: list[dict]) -> None:
    assert reports[0]["probe"] < 1e-6
    assert reports[0]["gather_scores"] < 1e-6
    assert reports[0]["gather_scores_layers"] == 4
