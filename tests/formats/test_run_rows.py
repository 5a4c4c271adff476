"""RunRows: one run's values of a few metrics read back from a trajectory file, snapshot by snapshot
(what a resumed probe replays into its alert rules)."""

from __future__ import annotations

import json
import math

from attn_probe.formats.run_rows import RunRows
from attn_probe.formats.trajectory import encode_header


def _row(step, metric, value, layer=0, head=None, spaced=False):
    rec = {
        "step": step,
        "wall_time": 1.0,
        "group": "self",
        "layer": layer,
        "head": head,
        "metric": metric,
        "value": value,
    }
    text = json.dumps(rec, separators=(",", ":") if spaced else None)  # compact: not the sink's spelling
    return text + "\n"


def test_only_the_runs_own_rows_of_the_metrics_asked_for(tmp_path):
    path = tmp_path / "attn_probe.jsonl"
    a, b = "a" * 32, "b" * 32
    lines = [
        encode_header(a, 0, wall_time=1.0).decode(),
        _row(0, "frobenius_norm", 1.0),
        _row(0, "symmetry", 0.5),
        _row(0, "frobenius_norm", 2.0, head=1),
        _row(1, "frobenius_norm", None),
        _row(1, "frobenius_norm", 3.5, layer=1, spaced=True),
        encode_header(b, 0, wall_time=2.0).decode(),  # another run in the same file: never replayed
        _row(0, "frobenius_norm", 99.0),
        _row(1, "frobenius_norm", 99.0),
        encode_header(a, 2, wall_time=3.0, resumed=True).decode(),
        _row(2, "frobenius_norm", 4.0),
    ]
    path.write_text("".join(lines))
    reader = RunRows(path, a, {"frobenius_norm"})
    got = [(step, [(r[2], r[3], r[5]) for r in rows]) for _key, step, rows in reader]
    assert [s for s, _ in got] == [0, 1, 2]
    assert got[0][1] == [(0, None, 1.0), (0, 1, 2.0)]
    assert got[1][1][1] == (1, None, 3.5) and math.isnan(got[1][1][0][2])  # null reads back as NaN
    assert got[2][1] == [(0, None, 4.0)]
    assert reader.latest == ("run", a, 1)  # the resumed header continues run a
    assert list(RunRows(tmp_path / "missing.jsonl", a, {"frobenius_norm"})) == []
