"""Issue 29: every probe snapshot reaches a user's W&B run, or a warning says so at the first loss.

Real offline W&B runs, read back from their ``.wandb`` files (``tests/wandb_usages.py``, one
subprocess for all usages: W&B's process-wide state stays out of pytest, and it is bounded).
The probe snapshots every 10 updates, the user logs every 100:

* never passing ``step=`` (one ``log()`` per step, or a step split as ``log(commit=False)`` then
  ``log()``): all 51 snapshots of 500 updates reach W&B, each equal to ``attn_probe.jsonl``, and
  every row of the user's holds what the user logged together (was: 5 of 51, no warning);
* passing ``step=`` (once or split): only one snapshot per user step can; the first missing one
  is named in a warning with "1 lost so far" and the fix, the total at close; every user row is
  at the user's step;
* ``WandbSink(run, separate_run=True)``: all snapshots, in a probe run of the same group, none in
  the user's run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("wandb")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: helpers, tracker_servers
ROOT = os.path.dirname(TESTS)
RUNS = ("plain@500", "split@100", "step@300", "split_step@500", "separate@100", "separate_split@100")


@pytest.fixture(scope="module")
def usages(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wandb_rows")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true",
           "WANDB_DISABLE_CODE": "true", "WANDB_CONFIG_DIR": str(tmp / "cfg"), "WANDB_CACHE_DIR": str(tmp / "cache")}
    env.pop("WANDB_MODE", None)
    res = subprocess.run([sys.executable, os.path.join(TESTS, "wandb_usages.py"), str(tmp / "out"), *RUNS],
                         capture_output=True, text=True, timeout=900, env=env, cwd=str(tmp))
    results = {}
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results[r["usage"]] = r
    assert res.returncode == 0 and len(results) == len(RUNS), f"{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return results


def snapshot_steps(steps: int) -> list[int]:
    return list(range(0, steps + 1, 10))


@pytest.mark.parametrize("usage, steps", [("plain", 500), ("split", 100)])
def test_a_user_who_never_passes_step_gets_every_snapshot(usages, usage, steps):
    r = usages[usage]
    assert "error" not in r, r
    assert r["snapshots"] == len(snapshot_steps(steps))
    assert r["reached"] == snapshot_steps(steps)  # 500 updates: all 51 (was 5)
    assert r["wrong_values"] == []
    assert r["user_rows_found"] == r["user_rows_wanted"]  # nothing lost, a split step still one row
    assert r["warnings"] == []


@pytest.mark.parametrize("usage, steps", [("step", 300), ("split_step", 500)])
def test_a_user_who_passes_step_is_warned_at_the_first_lost_snapshot(usages, usage, steps):
    r = usages[usage]
    want = snapshot_steps(steps)
    missing = [s for s in want if s not in r["reached"]]
    assert missing, "with step= and fewer user steps than snapshots, some cannot land"
    assert r["wrong_values"] == []
    first = r["warnings"][0]
    assert f"snapshot at step {missing[0]} did not reach" in first and "(1 lost so far)" in first
    assert "separate_run=True" in first
    if len(missing) > 1:
        assert len(r["warnings"]) == 2 and r["warnings"][1].startswith(f"attn_probe: {len(missing)} of the probe")
    # the user's rows: all there, each at the user's own step, a split step in one row
    assert r["user_rows_found"] == r["user_rows_wanted"]
    assert r["user_rows_at_their_step"] == len(r["user_rows_wanted"]) == steps // 100


@pytest.mark.parametrize("usage", ["separate", "separate_split"])
def test_a_probe_owned_run_gets_every_snapshot_whatever_the_user_does(usages, usage):
    r = usages[usage]
    assert "error" not in r, r
    assert r["reached"] == snapshot_steps(100)
    assert r["wrong_values"] == []
    assert r["warnings"] == []
    assert not r["probe_keys_in_user_run"]
    assert r["groups"] == ["g29", "g29"]
    assert r["user_rows_found"] == r["user_rows_wanted"] and r["user_rows_at_their_step"] == 1
