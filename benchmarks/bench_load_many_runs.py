"""Time and peak memory of ``load_trajectory`` on a hostile trajectory file of many one-row runs.

    python benchmarks/bench_load_many_runs.py --runs 1000000 [--headers]

Writes ``attn_probe.jsonl`` of RUNS one-row runs into a temporary directory (each row at step 0
again, so each starts a run, as in files written before run headers; ``--headers``: each run
with its own run header), then loads it in a fresh subprocess and prints the load time, the
child's peak RSS (``ru_maxrss``, imports included), the RSS after the imports, and the size of
the warning. The numbers in docs/post-hoc.md and docs/performance.md come from here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, resource, sys, time, warnings
from attn_probe.analysis.trajectory import load_trajectory
import pandas  # noqa: F401
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.monotonic()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    df = load_trajectory(sys.argv[1])
print(json.dumps({"seconds": round(time.monotonic() - t0, 2), "rows": len(df), "runs": int(df["run"].nunique()),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                  "rss_after_imports_mb": base >> 20,
                  "warning_bytes": len("\\n".join(str(w.message) for w in caught).encode())}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--headers", action="store_true", help="one run header per run")
    args = parser.parse_args()
    row = (json.dumps({"step": 0, "wall_time": 1732280000.125, "group": "self", "layer": 0, "head": None,
                       "metric": "symmetry", "value": 0.4123456789}) + "\n").encode()
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo))
    from attn_probe.formats.trajectory import encode_header

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "attn_probe.jsonl"
        with open(path, "wb") as fh:
            if args.headers:
                for i in range(args.runs):
                    fh.write(encode_header(f"{i:032x}", 0, wall_time=1.0) + row)
            else:
                for start in range(0, args.runs, 100_000):
                    fh.write(row * min(100_000, args.runs - start))
        size = path.stat().st_size
        proc = subprocess.run([sys.executable, "-c", CHILD, tmp], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(repo)}, check=True)
        result = json.loads(proc.stdout.splitlines()[-1])
    print(json.dumps({"file_mb": round(size / 2**20, 1), "headers": args.headers, **result,
                      "load_average": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
