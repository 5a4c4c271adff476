"""The random-matrix range stays off the ranks' agreement clock (issue 35, item 4).

Real 2-rank gloo DDP runs (``tests/distributed_workers/range_worker.py``, bounded by a timeout
that kills the whole process group), ``agreement_timeout=3`` and ``stop_on_alert``: the ranks share
a stop decision at every snapshot, each an agreement bounded by 3 s. A layer whose range takes
longer than that to compute must cost no rank its probe; a real stall in the user's loop still
disables it, with a warning that names the timeout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import launch

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
    # the range really is slower than the ranks' timeout: every rank computes it at attach
    assert min(r["attach_seconds"] for r in ranks) > 3.0, [r["attach_seconds"] for r in ranks]
    rows = trajectory(results / "range")
    scores = {r["step"] for r in rows if r["metric"] == "symmetry"}
    assert scores == {0, 2, 4}
    ranges = [r for r in rows if r["metric"].startswith("random_")]
    assert {r["step"] for r in ranges} == {0} and {r["metric"] for r in ranges} >= {"random_symmetry",
                                                                                      "random_symmetry_sd"}


def test_a_real_stall_disables_the_probe_and_the_warning_names_the_timeout(results: Path) -> None:
    ranks = read(results, "stall")
    assert [r["disabled"] for r in ranks] == [True, True]
    for r in ranks:
        failed = [w for w in r["warnings"] if "agreement between ranks failed" in w]
        assert len(failed) == 1, r["warnings"]
        assert "(after the agreement timeout, 3 s)" in failed[0] and "None" not in failed[0], failed[0]
    # rank 0 wrote step 2 before its stop decision timed out; nothing after
    assert {r["step"] for r in trajectory(results / "stall") if r["metric"] == "symmetry"} == {0, 2}
