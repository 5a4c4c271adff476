"""The probe's collective protocol: no rank-local event may hang or kill a sharded job.

Real ``torchrun`` gloo runs with 2 processes on CPU (``distributed_workers/protocol_worker.py``),
each bounded by a timeout that kills the whole process group, so a hang fails the test. In every
case training must complete, and every snapshot that was logged must be complete and equal to
:func:`attn_probe.score_model` on the full weights saved through the framework's own API.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from attn_probe import score_model

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed_workers"))
import shard_worker  # noqa: E402
from helpers import launch  # noqa: E402

TOL = 1e-5
STEPS = 5
CASES = {"fsdp2": ["raise1", "clock", "oom", "timeout", "count", "builtin", "surgery", "surgery1"],
         "fsdp1": ["raise1", "clock", "oom"],
         "ddp": ["count"]}
#: steps logged when the fault skips step 2 on every rank (step 0 at attach, then every step)
ALL_BUT_2 = {0, 1, 3, 4, 5}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """One torchrun launch for every case (lazily, once): ``get(setup, case)`` is its directory."""
    done: list[Path] = []

    def get(setup: str, case: str) -> Path:
        if not done:
            root = tmp_path_factory.mktemp("protocol")
            cases = ",".join(f"{s}:{c}" for s, cs in CASES.items() for c in cs)
            launch("protocol_worker.py", [cases, str(root)], 2, timeout=240)
            done.append(root)
        return done[0] / setup / case

    return get


def trajectory(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "probe" / "attn_probe.jsonl").read_text().splitlines()
            if line.strip()]
    got: dict = {}
    for r in rows:
        key = (r["step"], r["group"], r["layer"], r["head"], r["metric"])
        assert key not in got, f"duplicate row {key}"
        got[key] = r["value"]
    return got


def reference(out: Path, step: int) -> list[dict]:
    model = shard_worker.bert()
    missing, unexpected = model.load_state_dict(torch.load(out / f"ref_{step}.pt", weights_only=True), strict=False)
    assert not unexpected and not [k for k in missing if "weight" in k]
    return score_model(model)


def assert_logged_snapshots_complete_and_right(out: Path) -> set[int]:
    got = trajectory(out)
    steps = {k[0] for k in got}
    for step in steps:
        rows = reference(out, step)
        want = {(step, r["group"], r["layer"], None, m): r[m] for r in rows for m in ("symmetry", "directionality")}
        have = {k: v for k, v in got.items() if k[0] == step and k[4] in ("symmetry", "directionality")
                and k[3] is None}
        assert set(have) == set(want), f"step {step}: incomplete snapshot"
        for key, value in want.items():
            assert have[key] == pytest.approx(value, abs=TOL), key
    return steps


def ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("setup", ["fsdp2", "fsdp1"])
def test_schedule_raising_on_one_rank_skips_that_step_on_all(runs, setup: str) -> None:
    out = runs(setup, "raise1")
    assert [r["steps"] for r in ranks(out)] == [STEPS, STEPS]
    assert assert_logged_snapshots_complete_and_right(out) == ALL_BUT_2
    assert not any(r["disabled"] for r in ranks(out))


@pytest.mark.parametrize("setup", ["fsdp2", "fsdp1"])
def test_wall_clock_schedule_is_made_consistent(runs, setup: str) -> None:
    out = runs(setup, "clock")
    assert [r["steps"] for r in ranks(out)] == [STEPS, STEPS]
    steps = assert_logged_snapshots_complete_and_right(out)
    assert 0 in steps and len(steps) >= 2
    assert not any(r["disabled"] for r in ranks(out))


@pytest.mark.parametrize("setup", ["fsdp2", "fsdp1"])
def test_out_of_memory_in_one_layers_gather_on_one_rank(runs, setup: str) -> None:
    out = runs(setup, "oom")
    assert [r["steps"] for r in ranks(out)] == [STEPS, STEPS]
    assert assert_logged_snapshots_complete_and_right(out) == ALL_BUT_2
    assert not any(r["disabled"] for r in ranks(out))


def test_agreement_timeout_disables_the_probe_on_every_rank(runs) -> None:
    out = runs("fsdp2", "timeout")
    info = ranks(out)
    assert [r["steps"] for r in info] == [STEPS, STEPS]  # training went on
    assert [r["disabled"] for r in info] == [True, True]
    assert all(any("disabled" in w for w in r["warnings"]) for r in info)
    assert assert_logged_snapshots_complete_and_right(out) == {0, 1, 2}


def test_ddp_issues_no_collectives_and_sharded_runs_use_the_agreement_group(runs) -> None:
    ddp = ranks(runs("ddp", "count"))
    assert [r["collectives"] for r in ddp] == [{}, {}]
    assert assert_logged_snapshots_complete_and_right(runs("ddp", "count")) == set(range(STEPS + 1))
    fsdp2 = ranks(runs("fsdp2", "count"))
    # the agreement group is made once at attach; agreements run on it (all_reduce)
    assert [r["collectives"].get("new_group") for r in fsdp2] == [1, 1]
    assert all(r["collectives"].get("all_reduce", 0) > 0 for r in fsdp2)
    assert assert_logged_snapshots_complete_and_right(runs("fsdp2", "count")) == set(range(STEPS + 1))


def test_builtin_schedule_agrees_only_on_due_steps(runs) -> None:
    out = runs("fsdp2", "builtin")
    # every=2 over 5 steps: snapshots at 0 (attach), 2, 4 and 5 (close), each 1 decision +
    # 1 plan + 1 per layer (2) = 4 agreements; steps 1, 3 and 5 of on_update agree on nothing
    assert [r["collectives"] for r in ranks(out)] == [{"new_group": 1, "all_reduce": 16}] * 2
    assert assert_logged_snapshots_complete_and_right(out) == {0, 2, 4, 5}


def test_schedules_say_whether_they_are_deterministic() -> None:
    from attn_probe.live.config import ProbeConfig
    from attn_probe.live.schedules import any_of, every, is_deterministic, log_spaced

    assert all(is_deterministic(s) for s in (every(3), log_spaced(4), any_of(every(2), log_spaced()), None))
    assert is_deterministic(ProbeConfig(every=5).schedule)
    assert not is_deterministic(lambda step: True)
    assert not is_deterministic(any_of(every(2), lambda step: step == 7))
    for bad in (0, -1.0, float("nan"), True, "10"):
        with pytest.raises(ValueError):
            ProbeConfig(agreement_timeout=bad)
    assert ProbeConfig(agreement_timeout=5).agreement_timeout == 5.0


def test_no_model_surgery_is_reported_when_there_was_none(runs) -> None:
    for setup, cases in CASES.items():
        for case in cases:
            if not case.startswith("surgery"):
                for r in ranks(runs(setup, case)):
                    assert not any("model changed" in w for w in r["warnings"]), (setup, case, r["warnings"])


def test_model_surgery_on_every_rank_is_followed(runs) -> None:
    out = runs("fsdp2", "surgery")
    info = ranks(out)
    assert [r["steps"] for r in info] == [STEPS, STEPS]
    assert all(any("model changed after attach" in w for w in r["warnings"]) for r in info)
    # every snapshot logged, each equal to the live model's (the new module from step 2 on)
    assert assert_logged_snapshots_complete_and_right(out) == set(range(STEPS + 1))


def test_model_surgery_on_one_rank_only_skips_snapshots_but_never_hangs(runs) -> None:
    out = runs("fsdp2", "surgery1")
    info = ranks(out)
    assert [r["steps"] for r in info] == [STEPS, STEPS]
    assert any("model changed after attach" in w for w in info[1]["warnings"])
    assert not any("model changed after attach" in w for w in info[0]["warnings"])
    # rank 1 now reads layer 0 locally where rank 0 gathers it: the plans differ, every rank skips
    assert assert_logged_snapshots_complete_and_right(out) == set(range(STEPS + 1))
    assert not any(r["disabled"] for r in info)


# --------------------------------------------------------------------------- isolation (-W error)
W_ERROR_SCRIPT = r'''
import sys
from pathlib import Path

import torch
from transformers import BertConfig, BertModel

import attn_probe
from attn_probe.scoring.pairs import QKPair


class FailsLater(QKPair):
    """A score pair that fails from its third call on: the final snapshot at close() fails."""

    calls = 0

    def score(self, layer, query, key, **kw):
        FailsLater.calls += 1
        if FailsLater.calls > 2:
            raise RuntimeError("injected failure in the final snapshot")
        return super().score(layer, query, key, **kw)


out = Path(sys.argv[1])
torch.manual_seed(0)
model = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=32), add_pooling_layer=False)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
probe = attn_probe.watch(model, optimizer=opt, log_dir=str(out / "run"), every=100, pairs=[FailsLater()])
for _ in range(2):
    model(input_ids=torch.randint(0, 64, (2, 8))).last_hidden_state.pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
probe.close()  # the final snapshot (step 2) fails: the script must go on
torch.save(model.state_dict(), out / "model.pt")
print("saved, failures:", probe.failures)
'''


def test_failure_in_the_final_snapshot_does_not_escape_under_w_error(tmp_path: Path) -> None:
    import os
    import subprocess

    script = tmp_path / "train.py"
    script.write_text(W_ERROR_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-W", "error", str(script), str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "saved, failures: 1" in proc.stdout
    assert (tmp_path / "model.pt").exists()
    assert "injected failure in the final snapshot" in proc.stderr  # reported on stderr instead
