"""The process that writes the probe's W&B runs (``attn_probe/sinks/wandb_process.py``, issue 44).

Real offline W&B, read back from the run files, in a subprocess (W&B's process-wide state stays
out of pytest; bounded): two runs share one child process, which ends when the last is finished;
a forked process holding its pipe (a DataLoader worker) does not keep it alive; a training
process that ends without finishing leaves the run finished (its ``exit`` record written, exit
code 1); a W&B error in the child is raised in the training process, naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("wandb")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)

SCRIPT = """
import json, os, sys, time
sys.path.insert(0, {tests!r})
import wandb
from attn_probe.sinks.wandb_process import ChildRun
from tracker_servers import finished_wandb_records, wandb_history

root = {root!r}
out = {{}}
a = ChildRun(dict(project="proc", name="a", mode="offline", dir=root))
b = ChildRun(dict(project="proc", name="b", mode="offline", dir=root))
out["one_process"] = a.pid == b.pid and a.pid is not None
out["globals_untouched"] = wandb.run is None
pid = a.pid
holder = os.fork()  # holds the child's pipes as a DataLoader worker would
if holder == 0:
    time.sleep(20)
    os._exit(0)
for k in range(3):
    a.log({{"x": float(k)}})
    b.log({{"y": float(k)}})
try:
    a.log({{1: 2.0}})  # W&B refuses a key that is not a string
except RuntimeError as exc:
    out["error"] = str(exc)
a.finish()
out["alive_after_first"] = os.path.exists(f"/proc/{{pid}}") and open(f"/proc/{{pid}}/stat").read().split()[2] != "Z"
t = time.monotonic()
b.finish()
out["end_s"] = time.monotonic() - t
out["alive_after_last"] = os.path.exists(f"/proc/{{pid}}")
os.kill(holder, 9)
os.waitpid(holder, 0)
out["rows"] = {{n: [{{k: v for k, v in r.items() if not k.startswith("_")}} for r in wandb_history(root, run_id=r.id)]
               for n, r in (("a", a), ("b", b))}}
# a training process that ends without finishing: the child finishes the run
code = ("import sys; from attn_probe.sinks.wandb_process import ChildRun; "
        f"r = ChildRun(dict(project='proc', name='c', mode='offline', dir={{root!r}})); r.log({{{{'z': 1.0}}}}); "
        "print(r.id, flush=True); import os; os._exit(0)")
run_id = __import__("subprocess").run([sys.executable, "-c", code], capture_output=True, text=True,
                                      timeout=120).stdout.strip()
records = finished_wandb_records(root, run_id=run_id, timeout=60)
out["orphan_exit_code"] = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, forks")
def test_one_child_for_the_probes_runs_ended_by_the_last_and_never_orphaned(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
        "WANDB_CACHE_DIR": str(tmp_path / "cache"),
    }
    env.pop("WANDB_MODE", None)
    (tmp_path / "wb").mkdir()
    code = SCRIPT.format(tests=TESTS, root=str(tmp_path / "wb"))
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=env
    )
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, f"{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["one_process"] and out["globals_untouched"]
    assert out["error"].startswith("W&B log in the probe's process failed:"), out["error"]
    assert out["alive_after_first"] and not out["alive_after_last"]
    assert out["end_s"] < 10, out  # told to end: the forked holder of its pipe does not keep it (30 s wait)
    assert out["rows"] == {
        "a": [{"x": 0.0}, {"x": 1.0}, {"x": 2.0}],
        "b": [{"y": 0.0}, {"y": 1.0}, {"y": 2.0}],
    }
    assert out["orphan_exit_code"] == [1]
