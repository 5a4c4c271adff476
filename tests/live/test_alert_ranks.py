"""One stop decision on every rank: ``stop_on_alert`` and ``async_scoring`` in real DDP Trainer runs.

One ``torchrun`` gloo launch with 2 processes on CPU (``distributed_workers/alert_worker.py``, its
cases described there), bounded by :data:`tests.helpers.LAUNCH_TIMEOUT`; the probe's agreements
time out after 30 s there, so a stall in one of its collectives shows as a case taking that long.
The references are independent of the probe: the rules fire at the steps the doubling of W_q
implies (x2 per step, so x4 over two steps: a x3 rule fires at the second step after its first
value), and the ranks' own ``global_step``.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import launch

pytest.importorskip("transformers")

CASES = ("logit", "weights", "step0", "async", "async_stop")
AGREEMENT_TIMEOUT = 30.0  # the worker's


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("alert_ranks")
    launch("alert_worker.py", [str(out), *CASES], 2)

    def get(case: str) -> tuple[dict, dict]:
        return tuple(json.loads((out / f"{case}_rank{r}.json").read_text()) for r in (0, 1))

    get.out = out
    return get


@pytest.mark.parametrize("case, stop, fired", [
    ("logit", 3, [[3, "max_logit", 0, None]]),  # attention values after steps 1, 2, 3: x4 within 2 steps at 3
    ("weights", 2, [[2, "frobenius_norm", 0, None]]),  # weights at steps 0, 1, 2: x4 at step 2
    ("step0", 1, [[0, "frobenius_norm", 0, None], [0, "frobenius_norm", 1, None]]),  # stops after the first step
], ids=["logit-rule", "weight-rule", "rule-at-step-0"])
def test_stop_on_alert_stops_every_rank_at_the_same_step(runs, case, stop, fired):
    rank0, rank1 = runs(case)
    assert rank0["global_step"] == rank1["global_step"] == stop
    assert rank0["stop_requested"] and rank1["stop_requested"]
    assert rank0["fired"] == fired
    if case == "logit":  # the combined values: rank 1 evaluates the same rule to the same alert
        assert rank1["fired"] == fired
    for rank in (rank0, rank1):
        assert rank["failures"] == 0 and rank["warnings"] == []
        assert rank["elapsed"] < AGREEMENT_TIMEOUT  # no collective waited for its timeout


def test_async_scoring_with_a_slow_scorer_on_one_rank_never_stalls(runs):
    """Rank 0's scorer is held 1.5 s per snapshot (most snapshots skipped there, none on rank 1):
    the attention values are still combined at every due step, with no wait and no failure, and
    the last step's values are logged."""
    rank0, rank1 = runs("async")
    assert rank0["global_step"] == rank1["global_step"] == 8
    assert rank0["skipped"] >= 3 and rank1["skipped"] == 0
    for rank in (rank0, rank1):
        assert rank["failures"] == 0
        assert not [w for w in rank["warnings"] if "skipped" not in w], rank["warnings"]
        assert rank["elapsed"] < AGREEMENT_TIMEOUT
    rows = [json.loads(line) for line in (runs.out / "async" / "probe" / "attn_probe.jsonl").open()]
    assert {r["step"] for r in rows if r.get("metric") == "max_logit"} >= {8}


def test_a_stop_found_at_an_asynchronous_delivery_is_shared(runs):
    """The step-0 rule fires on rank 0 only when that snapshot's held scoring is delivered, steps
    later; every rank stops at the same step, well before the end."""
    rank0, rank1 = runs("async_stop")
    assert rank0["fired"][0][0] == 0
    assert rank0["global_step"] == rank1["global_step"] < 24
    assert rank0["stop_requested"] and rank1["stop_requested"]
    assert rank0["failures"] == rank1["failures"] == 0
