"""Issue 44 item 3: ``summary`` reads only the rows it asks for. ``load_trajectory(heads=False)``
drops the per-head rows as the file is read, so memory grows with the layer-level rows alone; its
table equals the full load's layer-level rows (the independent reference: the loader that keeps
every row) on a file holding several runs, a resume cut back, and rows before run headers, and the
reader never holds a per-head row (counted at the reader's one entry for rows, a structural bound
that timing cannot give)."""

from __future__ import annotations

import json
import warnings

import pytest

pd = pytest.importorskip("pandas")

from attn_probe.analysis import reading  # noqa: E402
from attn_probe.analysis.trajectory import load_trajectory  # noqa: E402
from attn_probe.formats.cutting import cut_run  # noqa: E402
from attn_probe.formats.trajectory import encode_header  # noqa: E402


def _rows(step: int, run: float, heads: int = 3) -> list[str]:
    out = []
    for layer in range(2):
        for head in (None, *range(heads)):
            for metric in ("symmetry", "directionality"):
                value = run + step / 100 + layer / 10 + (head or 0) / 1000
                out.append(
                    json.dumps(
                        {
                            "step": step,
                            "wall_time": 1.0,
                            "group": "self",
                            "layer": layer,
                            "head": head,
                            "metric": metric,
                            "value": value,
                        }
                    )
                )
    return out


def _write(run_dir) -> None:
    run_dir.mkdir()
    path = run_dir / "attn_probe.jsonl"
    lines = []
    lines += [r for s in range(0, 4) for r in _rows(s, 9.0)]  # rows before run headers (a legacy run)
    lines += [r for s in range(0, 3) for r in _rows(s, 8.0)]  # the steps start again: a second legacy run
    lines.append(encode_header("a", 0, wall_time=1.0).decode().rstrip("\n"))
    lines += [r for s in range(0, 10) for r in _rows(s, 1.0)]
    lines.append(encode_header("b", 0, wall_time=1.0).decode().rstrip("\n"))
    lines += [r for s in range(0, 6) for r in _rows(s, 2.0, heads=0)[:2]]  # run b: layer 0 only
    lines += [r for s in range(0, 5) for r in _rows(s, 3.0)[2:8]]  # run b then per-head rows only
    lines.append(encode_header("c", 0, wall_time=1.0).decode().rstrip("\n"))
    lines += [r for s in range(0, 12) for r in _rows(s, 4.0)]
    path.write_text("\n".join(lines) + "\n")
    cut_run(path, 7, "c")  # the resume of run c at step 7: its rows from 7 on dropped
    with open(path, "ab") as fh:  # ... and the resumed run's rows
        fh.write(encode_header("c", 7, wall_time=2.0, resumed=True))
        fh.write(("\n".join(r for s in range(7, 9) for r in _rows(s, 5.0)) + "\n").encode())
    with open(path, "a") as fh:  # a run of per-head rows only, then a corrupt line
        fh.write(encode_header("d", 0, wall_time=1.0).decode())
        fh.write("\n".join(_rows(0, 6.0)[2:6]) + "\n{not json\n")


def test_layer_level_load_equals_the_full_loads_layer_rows(tmp_path):
    _write(tmp_path / "r")
    with warnings.catch_warnings(record=True) as full_warnings:
        warnings.simplefilter("always")
        full = load_trajectory(tmp_path / "r")
    with warnings.catch_warnings(record=True) as layer_warnings:
        warnings.simplefilter("always")
        layer = load_trajectory(tmp_path / "r", heads=False)
    expected = full[full["head"].isna()].reset_index(drop=True)
    # 7 runs: two before headers, a, b, c (resumed: one run), b's per-head rows after its steps went
    # back (a run of its own, per-head rows only), d (per-head rows only)
    assert full["run"].nunique() == 7 and (full["head"].notna()).any()
    assert set(full["run"]) - set(layer["run"]) == {"r#5", "r#7"}  # no layer-level row
    assert len(expected) > 0 and layer["head"].isna().all()
    pd.testing.assert_frame_equal(layer, expected)
    # runs found and named as with every row, with the same warnings
    assert [str(w.message) for w in layer_warnings] == [str(w.message) for w in full_warnings]


def test_the_reader_never_holds_a_per_head_row(tmp_path, monkeypatch):
    """Every row the reader keeps enters through FileRuns.add_block or FileRuns.add: with
    ``heads=False`` the rows it holds never exceed the file's layer-level rows, and none is per head."""
    _write(tmp_path / "r")
    most = [0]

    def counted(real):
        def method(self, *args):
            real(self, *args)
            most[0] = max(most[0], sum(len(b[0]) for b in self._blocks) + len(self._pending[0]))

        return method

    for name in ("add", "add_block"):
        monkeypatch.setattr(reading.FileRuns, name, counted(getattr(reading.FileRuns, name)))
    found = reading.read_run(tmp_path / "r", heads=False)
    held = most[0]
    monkeypatch.undo()
    everything = reading.read_run(tmp_path / "r")
    layer_rows = int(everything.columns()[5].sum())
    assert 0 < held <= layer_rows < len(everything.columns()[0])
    assert found.columns()[5].all() and len(found.columns()[0]) == layer_rows
    assert found.counts().tolist() == everything.counts().tolist()  # every row counted, as the full read


def test_summary_reads_the_layer_level_rows_only(tmp_path, monkeypatch):
    """``attn-probe summary`` loads with ``heads=False`` and prints what the full load summarises."""
    from attn_probe.analysis.summary import summarize
    from attn_probe.cli import main

    _write(tmp_path / "r")
    asked = []
    real = reading.read_run

    def read_run(run_dir, **kwargs):
        asked.append(kwargs.get("heads", True))
        return real(run_dir, **kwargs)

    monkeypatch.setattr("attn_probe.analysis.loading.read_run", read_run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["summary", str(tmp_path / "r"), "--format", "csv"]) == 0
        full = load_trajectory(tmp_path / "r")
        layer = load_trajectory(tmp_path / "r", heads=False)
    assert asked == [False, True, False]
    pd.testing.assert_frame_equal(summarize(layer), summarize(full))
