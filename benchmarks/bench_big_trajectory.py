"""Resume attach, ``load_trajectory`` and ``summary`` next to a large trajectory: seconds and peak memory.

    python benchmarks/make_big_trajectory.py /tmp/big --mb 1024     # once: the 1 GB file
    python benchmarks/bench_big_trajectory.py /tmp/big/attn_probe.jsonl [--what resume load summary]

Each measurement runs in a fresh subprocess on a fresh copy of the file (the resume cuts it) and
prints ``what seconds peak_MiB added_MiB``: the wall time of the call, the process's peak resident
memory (``VmHWM`` of ``/proc/self/status``) and that peak less the resident memory just before the
call (imports and the model excluded).

- ``resume``: :func:`attn_probe.watch` of a tiny Llama (``transformers``) with ``log_dir=`` the
  file's directory, ``start_step=`` three steps before the file's last (three snapshots are cut)
  and a growth alert rule on ``frobenius_norm`` (its state is replayed from the file's rows).
- ``load``: :func:`attn_probe.load_trajectory` of the directory.
- ``summary``: ``attn-probe summary DIR`` (:func:`attn_probe.cli.main`), output discarded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import contextlib, io, os, sys, time
sys.path.insert(0, sys.argv[1])
what, run_dir, last = sys.argv[2], sys.argv[3], int(sys.argv[4])

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024

import attn_probe
if what == "resume":
    from attn_probe.live.alerts import AlertRule
    from tests.helpers import tiny_llama
    model = tiny_llama()
    before = status("VmRSS")
    t0 = time.monotonic()
    probe = attn_probe.watch(model, every=1, log_dir=run_dir, start_step=last - 2,
                             alerts=[AlertRule("frobenius_norm", growth=2.0, within=8)])
    seconds = time.monotonic() - t0
    probe.close()
elif what == "load":
    before = status("VmRSS")
    t0 = time.monotonic()
    df = attn_probe.load_trajectory(run_dir)
    seconds = time.monotonic() - t0
elif what == "summary":
    from attn_probe.cli import main
    before = status("VmRSS")
    t0 = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()):
        main(["summary", run_dir])
    seconds = time.monotonic() - t0
print(what, round(seconds, 1), round(status("VmHWM")), round(status("VmHWM") - before))
"""


def last_step(path: Path) -> int:
    """The step of the file's last line."""
    with open(path, "rb") as fh:
        fh.seek(max(0, os.path.getsize(path) - 4096))
        line = fh.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    return int(line.split(b'"step": ', 1)[1].split(b",", 1)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path, help="a trajectory file (benchmarks/make_big_trajectory.py)")
    parser.add_argument(
        "--what", nargs="+", default=["resume", "load", "summary"], choices=("resume", "load", "summary")
    )
    parser.add_argument("--code", default=str(ROOT), help="the checkout to measure (holding attn_probe/)")
    parser.add_argument("--tmp", default=None, help="where the copies go (default: beside the file)")
    args = parser.parse_args()
    last = last_step(args.file)
    for what in args.what:
        with tempfile.TemporaryDirectory(dir=args.tmp or args.file.parent) as tmp:
            shutil.copyfile(args.file, Path(tmp) / "attn_probe.jsonl")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([args.code, str(ROOT)])}
            out = subprocess.run(
                [sys.executable, "-c", CHILD, args.code, what, tmp, str(last)],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            print(out.stdout.strip() or f"{what} failed: {out.stderr.strip()[-2000:]}", flush=True)


if __name__ == "__main__":
    main()
