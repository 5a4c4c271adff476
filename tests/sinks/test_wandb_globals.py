"""Issue 44 finding 5: the probe's own W&B run never becomes the user's ``wandb.run``.

A user script that only uses W&B's globals (a plain ``wandb.init()``, ``wandb.run``,
``wandb.log``, ``wandb.config``, ``wandb.finish()``, then ``wandb.init(name="user2")``) runs
three times per mode: without the probe (the reference), with ``WandbSink(run)`` (the probe's
run beside the user's) and with ``WandbSink(project=...)`` started before the user's first
``wandb.init`` (a run the sink creates). Each call's outcome (the run it gives, ``wandb.config``
values, any exception) and, offline, every row of the user's runs read back from their
``.wandb`` files must be the same with the probe as without it; the probe's run holds every
snapshot and nothing of the user's. Was: a plain ``wandb.init()`` returned the probe's run, the
user's rows after ``wandb.finish()`` landed in it and ``wandb.log`` raised; disabled, ``wandb.run``
became the probe's run and ``wandb.config.lr`` raised. One subprocess per mode: W&B's
process-wide state stays out of pytest, and it is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("wandb")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: helpers, tracker_servers
ROOT = os.path.dirname(TESTS)

SCRIPT = """
import json, os, sys, warnings
sys.path.insert(0, {tests!r})
import torch, wandb
import attn_probe
from attn_probe.sinks.wandb import WandbSink, probe_run_id
from tracker_servers import tiny_bert, wandb_history

torch.set_num_threads(1)
MODE, ROOT = {mode!r}, {root!r}
warnings.simplefilter("ignore")


def user_script(probe_kind):
    out, runs = [], {{}}

    def note(what, fn):
        try:
            out.append([what, "ok", fn()])
        except Exception as exc:  # the outcome is what the user sees
            out.append([what, "raised", type(exc).__name__])

    def name_of(run):
        return None if run is None else [k for k, v in runs.items() if v is run] or ["other"]

    model = tiny_bert(0, layers=1, hidden=16, heads=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = [0]

    def train(n):
        for _ in range(n):
            step[0] += 1
            g = torch.Generator().manual_seed(step[0])
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g) * 0.05
            opt.step()  # the probe's snapshot
            opt.zero_grad()
            note("log", lambda: wandb.log({{"loss": 1.0 / step[0]}}))

    probe = sink = None
    if probe_kind == "own":  # the probe first, with a run the sink creates
        sink = WandbSink(project="globals", name="probe-own", mode=MODE, dir=ROOT)
        probe = attn_probe.watch(model, optimizer=opt, log_dir=os.path.join(ROOT, probe_kind), every=1, sinks=[sink])
    train(2)  # wandb.log before any wandb.init of the user's
    if probe is not None:
        probe.flush(timeout=120)  # the probe's run exists now
    runs["user1"] = wandb.init(project="globals", name="user1", config={{"lr": 0.1}}, mode=MODE, dir=ROOT)
    if probe_kind == "beside":
        sink = WandbSink(runs["user1"])
        probe = attn_probe.watch(model, optimizer=opt, log_dir=os.path.join(ROOT, probe_kind), every=1, sinks=[sink])
    train(3)
    if probe is not None:
        probe.flush(timeout=120)
    note("wandb.run", lambda: name_of(wandb.run))
    note("plain wandb.init()", lambda: name_of(wandb.init()))
    note("wandb.run after init", lambda: name_of(wandb.run))
    note("wandb.config.lr", lambda: wandb.config.lr)
    note("wandb.config.update", lambda: wandb.config.update({{"wd": 0.01}}))
    note("wandb.config.wd", lambda: wandb.config.wd)
    train(3)
    note("wandb.finish()", lambda: wandb.finish())
    note("wandb.run after finish", lambda: name_of(wandb.run))
    runs["user2"] = wandb.init(project="globals", name="user2", config={{"lr": 0.2}}, mode=MODE, dir=ROOT)
    note("user2 is a new run", lambda: runs["user2"] is not runs["user1"])
    note("wandb.run after user2", lambda: name_of(wandb.run))
    note("user2 name", lambda: runs["user2"].name)
    note("wandb.config.lr 2", lambda: wandb.config.lr)
    train(3)
    if probe is not None:
        probe.flush(timeout=120)
    note("plain wandb.init() 2", lambda: name_of(wandb.init()))
    note("wandb.run 2", lambda: name_of(wandb.run))
    own_id = getattr(sink.run, "id", None) if sink is not None else None  # the run the sink created
    if probe is not None:
        probe.close()
    note("wandb.run after close", lambda: name_of(wandb.run))
    note("log after close", lambda: wandb.log({{"after": 1.0}}))
    note("wandb.config.lr after close", lambda: wandb.config.lr)
    note("wandb.finish() 2", lambda: wandb.finish())
    note("wandb.run at the end", lambda: name_of(wandb.run))
    result = {{"calls": out, "user_rows": {{}}}}
    if MODE == "offline":
        for name, run in runs.items():
            rows = wandb_history(ROOT, run_id=run.id)
            result["user_rows"][name] = [{{k: v for k, v in r.items() if not k.startswith("_") or k == "_step"}}
                                         for r in rows]
        if probe is not None:
            probe_id = probe_run_id(runs["user1"].id) if probe_kind == "beside" else own_id
            rows = wandb_history(ROOT, run_id=probe_id)
            result["probe_steps"] = sorted(int(r["attn_probe/step"]) for r in rows if "attn_probe/step" in r)
            result["user_keys_in_probe_run"] = sorted({{k for r in rows for k in r if not k.startswith(("attn_probe", "_"))}})
    return result


for kind in ("none", "beside", "own"):
    print("RESULT " + json.dumps({{"kind": kind, **user_script(kind)}}), flush=True)
wandb.teardown()
"""


@pytest.fixture(scope="module", params=["offline", "disabled"])
def outcomes(request, tmp_path_factory):
    mode = request.param
    tmp = tmp_path_factory.mktemp(f"wandb_globals_{mode}")
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_CONFIG_DIR": str(tmp / "cfg"),
        "WANDB_CACHE_DIR": str(tmp / "cache"),
    }
    # so that a plain wandb.init() works
    env.update(WANDB_MODE=mode, WANDB_DIR=str(tmp / "wb"), WANDB_PROJECT="globals")
    code = SCRIPT.format(tests=TESTS, mode=mode, root=str(tmp / "wb"))
    (tmp / "wb").mkdir()
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(tmp),
    )
    found = {}
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            found[r["kind"]] = r
    assert res.returncode == 0 and len(found) == 3, f"{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return mode, found


@pytest.mark.parametrize("kind", ["beside", "own"])
def test_the_users_wandb_globals_behave_as_without_the_probe(outcomes, kind):
    mode, found = outcomes
    without, with_probe = found["none"], found[kind]
    assert without["calls"][:2] == [["log", "raised", "Error"]] * 2  # before any wandb.init: W&B refuses
    assert ["wandb.run after user2", "ok", ["user2"]] in without["calls"]
    if mode == "offline":  # W&B's default reinit: a plain wandb.init() returns the active run
        assert not [c for c in without["calls"][2:] if c[1] == "raised"], without["calls"]
        assert ["plain wandb.init()", "ok", ["user1"]] in without["calls"]
    assert with_probe["calls"] == without["calls"]


@pytest.mark.parametrize("kind", ["beside", "own"])
def test_the_users_rows_and_the_probes_run_read_back(outcomes, kind):
    mode, found = outcomes
    if mode != "offline":
        pytest.skip("disabled: W&B writes no file")
    without, with_probe = found["none"], found[kind]
    assert [r["loss"] for r in without["user_rows"]["user1"]] == pytest.approx([1.0 / k for k in range(3, 9)])
    assert [r["loss"] for r in without["user_rows"]["user2"] if "loss" in r] == pytest.approx(
        [1 / 9, 1 / 10, 1 / 11]
    )
    assert with_probe["user_rows"] == without["user_rows"]
    assert with_probe["user_keys_in_probe_run"] == []
    # every snapshot: own, from the first update (step 0 and 11 updates); beside, attached after 2 of them
    assert with_probe["probe_steps"] == list(range(12 if kind == "own" else 10))
