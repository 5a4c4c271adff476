"""Issue 35: W&B on its public contract. The user's own logs are never lost, moved or merged.

Real offline W&B runs, read back from their ``.wandb`` files (``tests/wandb_usages.py``, one
subprocess for everything: W&B's process-wide state stays out of pytest, and it is bounded).
Six ways of logging x 50 updates, the probe snapshotting every update: ``step=k``; no ``step=``;
``log(step=k, commit=False)`` then ``log(commit=True)``; ``step=`` on some updates only; a user
thread logging beside the loop; a real Trainer ``report_to=["wandb"]`` with ``logging_steps=3``.
Each in three runs: without the probe (the reference), with the default ``WandbSink(run)`` (a
W&B run of the probe's own) and with ``separate_run=False`` (joining the user's rows).

* The user's rows (their keys and W&B's ``_step``) are identical with and without the probe,
  in both modes (was: ``loss`` lost at 40 of 40 steps with the split pattern).
* Default: every snapshot is a row of the probe's run, equal to ``attn_probe.jsonl``, in the
  user's group; nothing of the probe's in the user's run.
* Joining: every snapshot is in the user's run or told: the snapshots said lost are missing,
  the missing ones are among those said lost or possibly lost, and the warning's counts are those.
* Two probes (two models) on one user run with a user thread, 20 attempts, half of them
  joining: none hangs (each bounded by 10 s; was: hung in 1 of 3), and the two probes' keys
  never mix (``attn_probe/...`` and ``attn_probe_2/...``, each equal to its own JSONL).
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
USAGES = ("step", "plain", "split", "some_step", "thread", "trainer")
MODES = ("none", "separate", "join")
PAIRS = 20
SNAPSHOTS = list(range(51))  # steps 0..50: every update of 50, and the first


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wandb_contract")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true",
           "WANDB_DISABLE_CODE": "true", "WANDB_CONFIG_DIR": str(tmp / "cfg"), "WANDB_CACHE_DIR": str(tmp / "cache")}
    env.pop("WANDB_MODE", None)
    items = [f"{u}:{m}" for u in USAGES for m in MODES] + [f"pair:{PAIRS}"]
    res = subprocess.run([sys.executable, os.path.join(TESTS, "wandb_usages.py"), str(tmp / "out"), *items],
                         capture_output=True, text=True, timeout=900, env=env, cwd=str(tmp))
    found = {}
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            found[r["item"]] = r
    assert res.returncode == 0 and len(found) == len(items) - 1 + PAIRS, f"{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return found


@pytest.mark.parametrize("mode", ["separate", "join"])
@pytest.mark.parametrize("usage", USAGES)
def test_the_users_own_rows_are_the_same_with_and_without_the_probe(results, usage, mode):
    without, with_probe = results[f"{usage}:none"], results[f"{usage}:{mode}"]
    assert without["rows"], "the reference run holds the user's rows"
    if usage == "thread":  # two threads' rows interleave differently from run to run: each key's series
        assert with_probe["series"] == without["series"]
        assert with_probe["series"]["gpu"] == list(range(200))
    else:
        assert with_probe["rows"] == without["rows"]
    if usage == "trainer":  # and they are what the Trainer logged
        logged = [{k: v for k, v in r.items() if k != "_step"} for r in with_probe["rows"] if "train/loss" in r]
        assert [sorted(r) for r in logged] == [sorted(r) for r in with_probe["log_history"]]
        assert all(r[k] == pytest.approx(h[k]) for r, h in zip(logged, with_probe["log_history"], strict=True) for k in h)
        assert len(with_probe["log_history"]) == 16  # logging_steps=3 over 50 updates
    else:
        assert with_probe["series"]["loss"] == pytest.approx([1.0 / k for k in range(1, 51)])


@pytest.mark.parametrize("usage", USAGES)
def test_by_default_every_snapshot_is_a_row_of_the_probes_own_run(results, usage):
    r = results[f"{usage}:separate"]
    assert r["snapshots"] == SNAPSHOTS
    assert r["reached"] == SNAPSHOTS
    assert r["wrong_values"] == []
    assert not r["probe_keys_in_user_run"]
    assert r["probe_run_group"] == "g35"
    assert r["warnings"] == []


@pytest.mark.parametrize("usage", USAGES)
def test_joining_the_users_run_every_snapshot_is_there_or_told(results, usage):
    r = results[f"{usage}:join"]
    assert r["snapshots"] == SNAPSHOTS
    assert r["wrong_values"] == []
    missing = sorted(set(SNAPSHOTS) - set(r["reached"]))
    if "lost" in r:  # the plain-loop sink, read directly
        assert set(r["lost"]) <= set(missing), "a snapshot said lost is in the run"
        assert set(missing) <= set(r["lost"]) | set(r["maybe_lost"]), "a missing snapshot was not told"
        assert (r["told_lost"], r["told_maybe"]) == (len(r["lost"]), len(r["maybe_lost"]))
    assert r["told_lost"] <= len(missing) <= r["told_lost"] + r["told_maybe"]
    if missing:
        said = [w for w in r["warnings"] if "did not reach" in w]
        assert len(said) == 1 and "wandb_separate_run=True" in said[0]  # told once, at close, with the way out
    if usage == "trainer":  # the Trainer commits a row every 3 updates: most snapshots cannot land
        assert len(missing) >= 30


def test_two_probes_on_one_run_never_hang_nor_share_a_key(results):
    attempts = [results[f"pair{i}"] for i in range(PAIRS)]
    hung = [a["attempt"] for a in attempts if a["hung"]]
    assert not hung, f"attempts {hung} did not finish within 10 s"
    assert max(a["seconds"] for a in attempts) < 10
    for a in attempts:
        for probe in a["probes"]:
            assert probe["snapshots"] == list(range(11))
            assert probe["wrong_values"] == [], a  # each key prefix holds its own model's values
            if a["mode"] == "separate":
                assert probe["reached"] == probe["snapshots"]
    assert {a["mode"] for a in attempts} == {"separate", "join"}
