"""Issue 23 item 2: a hung W&B service must not stall training.

A real offline W&B run; after a few steps its service process (``wandb-core``, a child of the
training process) is stopped with SIGSTOP. The W&B sink makes every W&B call after its start on
its own lane (by default it logs into a W&B run of its own beside the user's, created there), so
every training step (the probe's snapshot included) stays fast and ``close()`` is bounded by
``sink_timeout``. Once the service continues, the snapshots taken meanwhile reach the probe's run.
The script runs in a subprocess: a stopped service must not be able to hang pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("wandb")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the service through /proc")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: helpers, tracker_servers
ROOT = os.path.dirname(TESTS)
SINK_TIMEOUT = 5.0

SCRIPT = """
import json, os, signal, sys, time, warnings
sys.path.insert(0, {tests!r})
import torch, wandb
import attn_probe
from attn_probe.sinks.wandb import WandbSink, probe_run_id
from tracker_servers import VOCAB, SEQ, child_pids, tiny_bert, wandb_history

torch.set_num_threads(1)
STEPS, STOP_AFTER = 8, 3
run = wandb.init(project="attn-probe-stalled", mode="offline")
service = child_pids(os.getpid(), "wandb-core")
assert len(service) == 1, service
model = tiny_bert()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
out = {{"step_s": [], "user_log_s": []}}
warnings.simplefilter("ignore")
probe = attn_probe.watch(model, optimizer=opt, log_dir={log_dir!r}, every=1, sink_timeout={timeout!r},
                         sinks=[WandbSink(run)])
try:
    for i in range(STEPS):
        if i == STOP_AFTER:
            assert probe.flush(timeout=60)
            os.kill(service[0], signal.SIGSTOP)
        t = time.monotonic()
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(i))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()  # the probe's snapshot, handed to the W&B sink
        opt.zero_grad()
        out["step_s"].append(time.monotonic() - t)
        t = time.monotonic()
        run.log({{"loss": loss.item()}})  # the user's own logging, with the same stopped service
        out["user_log_s"].append(time.monotonic() - t)
    t = time.monotonic()
    probe.close()
    out["close_s"] = time.monotonic() - t
finally:
    os.kill(service[0], signal.SIGCONT)
run.finish()
out["probe_steps"] = sorted(int(r["attn_probe/step"])
                            for r in wandb_history(os.environ["WANDB_DIR"], run_id=probe_run_id(run.id))
                            if "attn_probe/step" in r)
print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_stopped_wandb_service_does_not_stall_training(tmp_path):
    wb = tmp_path / "wb"
    wb.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DIR": str(wb),
           "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
           "WANDB_CONFIG_DIR": str(tmp_path / "wbconfig"), "WANDB_CACHE_DIR": str(tmp_path / "wbcache")}
    code = SCRIPT.format(tests=TESTS, log_dir=str(tmp_path / "run"), timeout=SINK_TIMEOUT)
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=400, env=env, cwd=str(tmp_path))
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, f"rc={res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-6000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    stalled = out["step_s"][3:]
    assert max(stalled) < 2.0, out  # was 30 s per step: run.step waited on the stopped service
    assert max(out["user_log_s"]) < 2.0, out
    assert out["close_s"] < SINK_TIMEOUT + 10.0, out
    # the snapshots taken while the service was stopped reached the run once it continued
    assert [s for s in out["probe_steps"] if s > 3], out
