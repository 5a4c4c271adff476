"""The random-matrix range stays off the ranks' agreement clock (issue 35, item 4; issue 44, item 3).

Real 2-rank gloo DDP runs (``tests/distributed_workers/range_worker.py``, bounded by a timeout
that kills the whole process group), ``agreement_timeout=3`` and ``stop_on_alert``: the ranks share
a stop decision at every snapshot, each an agreement bounded by 3 s. A layer whose range takes
longer than that to compute must cost no rank its probe (the main process computes it on a thread of
its own, the other rank not at all); a real stall in the user's loop still disables it, with a
warning that names the timeout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import launch

from attn_probe.baselines.random_range import PROBE_ENTRIES, LayerShape, random_range

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("range_ranks")
    launch("range_worker.py", [str(out)], 2, timeout=420)
    return out


def read(out: Path, case: str) -> list[dict]:
    return [json.loads((out / f"{case}_rank{rank}.json").read_text()) for rank in range(2)]


def trajectory(log_dir: Path) -> list[dict]:
    with open(os.path.join(log_dir, "attn_probe.jsonl")) as f:
        return [json.loads(line) for line in f if '"run_header"' not in line]


def test_a_range_slower_than_the_agreement_timeout_disables_no_rank(results: Path) -> None:
    ranks = read(results, "range")
    assert [r["disabled"] for r in ranks] == [False, False], [r["warnings"] for r in ranks]
    assert not [w for r in ranks for w in r["warnings"] if "agreement between ranks failed" in w]
    # issue 44: the main process computes the range on a thread of its own, the other rank not at all
    assert [r["range_computed_on"] for r in ranks] == ["another thread", "none"]
    rows = trajectory(results / "range")
    scores = {r["step"] for r in rows if r["metric"] == "symmetry"}
    assert scores == {0, 2, 4}
    ranges = [r for r in rows if r["metric"].startswith("random_")]
    # once, with one snapshot (or on their own at close()), the range of the layer's shape
    assert len({r["step"] for r in ranges}) == 1 and len(ranges) == len({r["metric"] for r in ranges}) == 4
    want = random_range(LayerShape(2048, 64, 32, 8), budget=None, max_entries=4 * PROBE_ENTRIES, per_head=False,
                        cache=False)
    by = {r["metric"]: r["value"] for r in ranges}  # the workers' torch threads differ from this process's
    assert by["random_symmetry"] == pytest.approx(want.symmetry, rel=1e-6)
    assert by["random_symmetry_sd"] == pytest.approx(want.symmetry_sd, rel=1e-6)


def test_a_real_stall_disables_the_probe_and_the_warning_names_the_timeout(results: Path) -> None:
    ranks = read(results, "stall")
    assert [r["disabled"] for r in ranks] == [True, True]
    for r in ranks:
        failed = [w for w in r["warnings"] if "agreement between ranks failed" in w]
        assert len(failed) == 1, r["warnings"]
        assert "(after the agreement timeout, 3 s)" in failed[0] and "None" not in failed[0], failed[0]
    # rank 0 wrote step 2 before its stop decision timed out; nothing after
    assert {r["step"] for r in trajectory(results / "stall") if r["metric"] == "symmetry"} == {0, 2}
