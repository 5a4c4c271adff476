"""Time of the resume cut (``cut_trajectory``) on a large header-less trajectory file.

    python benchmarks/bench_cut.py --mb 600 [--code DIR ...]

Writes ``attn_probe.jsonl`` of about MB megabytes into a temporary directory: one run, a
snapshot of 18 rows (3 layers x 3 heads-or-layer x 2 metrics) per step, as in
``tests/formats/test_logdir_cut.py``'s 1 GB test; then, for each checkout ``DIR`` given (default:
this one), copies the file and cuts it at a third of its steps in a fresh subprocess that
imports only ``attn_probe.formats`` (no torch), printing the lines dropped and the seconds. Give
two checkouts (e.g. an exported older commit and this one) to compare them on the same file;
each is run twice, alternating, to see the noise of a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import importlib, sys, time, types
package = types.ModuleType("attn_probe")  # the package without its __init__ (no torch)
package.__path__ = [sys.argv[1]]
sys.modules["attn_probe"] = package
fmt = importlib.import_module("attn_probe.formats.trajectory")
t0 = time.monotonic()
dropped = fmt.cut_trajectory(sys.argv[2], int(sys.argv[3]))
print(dropped, round(time.monotonic() - t0, 2))
"""


def write_file(path: Path, size: int) -> int:
    """A one-run file of about ``size`` bytes; returns its number of steps."""
    def line(layer: int, head: int | None, metric: str) -> bytes:
        return (json.dumps({"step": 123456789, "wall_time": 1732280000.125, "group": "self", "layer": layer,
                            "head": head, "metric": metric, "value": 0.4123456789}) + "\n").encode()

    template = b"".join(line(la, h, m) for la in range(3) for h in (None, 0, 1) for m in ("symmetry", "directionality"))
    written = step = 0
    with open(path, "wb", buffering=1 << 22) as fh:
        while written < size:
            block = template.replace(b"123456789", str(step).encode())
            fh.write(block)
            written += len(block)
            step += 1
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=600)
    parser.add_argument("--code", nargs="*", default=[str(Path(__file__).resolve().parents[1])],
                        help="checkouts to compare (each holding attn_probe/)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        original = Path(tmp) / "original.jsonl"
        steps = write_file(original, args.mb << 20)
        path = Path(tmp) / "attn_probe.jsonl"
        resume = steps // 3
        for _ in range(2):
            for code in args.code:
                shutil.copy(original, path)
                out = subprocess.run([sys.executable, "-c", CHILD, os.path.join(code, "attn_probe"), str(path),
                                      str(resume)], capture_output=True, text=True, check=True)
                dropped, seconds = out.stdout.split()
                print(f"{code}: {args.mb} MB, {steps} steps, cut at {resume}: {dropped} lines dropped in {seconds} s")


if __name__ == "__main__":
    main()
