"""Write a large trajectory file (``attn_probe.jsonl``) of real-looking rows, reproducibly.

    python benchmarks/make_big_trajectory.py OUT_DIR --mb 1024 [--layers 12 --heads 8]

One run, written with the project's own encoders (:func:`attn_probe.formats.trajectory.encode_header`
and :func:`~attn_probe.formats.trajectory.encode_rows`): a run header, then at every step one
snapshot of the rows a probe writes for a ``layers`` x ``heads`` model (per layer and per head:
``symmetry``, ``directionality``, ``frobenius_norm``; per layer: ``max_logit``, ``entropy``),
values drifting smoothly with the step (deterministic: no random source). The rows of one step are
encoded once and repeated over the steps with the step and values substituted, so a gigabyte is
written in about a minute. Prints the file's path, size and number of steps.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attn_probe.formats.trajectory import TRAJECTORY_FILENAME, encode_header, encode_rows  # noqa: E402

RUN_ID = "0123456789abcdef0123456789abcdef"
WALL = 1765000000.0


@dataclass
class _Record:
    group: str
    layer: int
    head: int | None
    metric: str
    value: float


@dataclass
class _Snapshot:
    step: int
    wall_time: float
    records: list


def snapshot(step: int, layers: int, heads: int) -> bytes:
    """The encoded rows of one step."""
    records = []
    for layer in range(layers):
        for head in (None, *range(heads)):
            phase = layer * 0.37 + (head or 0) * 0.11
            records.append(
                _Record("self", layer, head, "symmetry", 0.1 + 0.3 * math.tanh(step / 4000 + phase))
            )
            records.append(_Record("self", layer, head, "directionality", 0.5 - 0.2 * math.tanh(step / 5000)))
            records.append(_Record("self", layer, head, "frobenius_norm", 10.0 + step * 1e-3 + phase))
        records.append(_Record("self", layer, None, "max_logit", 5.0 + math.sin(step / 300 + layer)))
        records.append(_Record("self", layer, None, "entropy", 2.0 + math.cos(step / 300 + layer)))
    return encode_rows([_Snapshot(step, WALL + step, records)])


def write(out_dir: Path, size: int, layers: int, heads: int) -> tuple[Path, int]:
    """A one-run file of about ``size`` bytes in ``out_dir``; returns its path and number of steps."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / TRAJECTORY_FILENAME
    header = encode_header(
        RUN_ID,
        0,
        wall_time=WALL,
        config={"every": 1, "run_id": RUN_ID},
        model={"layers": layers, "heads": heads},
    )
    written = step = 0
    # ten distinct snapshots of real encoded rows, repeated with the step substituted
    templates = [snapshot(s, layers, heads) for s in range(10)]
    with open(path, "wb", buffering=1 << 22) as fh:
        fh.write(header)
        written += len(header)
        while written < size:
            block = templates[step % 10]
            old = b'{"step": %d, "wall_time": %s' % (step % 10, repr(WALL + step % 10).encode())
            new = b'{"step": %d, "wall_time": %s' % (step, repr(WALL + step).encode())
            block = block.replace(old, new)
            fh.write(block)
            written += len(block)
            step += 1
    return path, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=8)
    args = parser.parse_args()
    path, steps = write(args.out_dir, args.mb << 20, args.layers, args.heads)
    print(path, os.path.getsize(path), steps)


if __name__ == "__main__":
    main()
