"""Export round trips: CSV, Parquet and JSONL give back exactly the table that was written."""

from __future__ import annotations

import json
import time

import numpy as np
import pandas as pd
import pytest

from attn_probe import export_trajectory, load_trajectory
from attn_probe.analysis.trajectory import read_table, resolve_format
from attn_probe.formats.trajectory import TRAJECTORY_FILENAME, encode_value


def write_run(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / TRAJECTORY_FILENAME, "w", encoding="utf-8") as fh:
        for group, step, layer, head, metric, value in rows:
            fh.write(json.dumps({"step": step, "wall_time": time.time(), "group": group, "layer": layer,
                                 "head": head, "metric": metric, "value": encode_value(value)}) + "\n")


AWKWARD = [0.1 + 0.2, 1e-300, -0.0, 1 / 3, -0.9999999999999999, 5e-324, float("nan")]


@pytest.fixture
def two_runs(tmp_path):
    rng = np.random.default_rng(1)
    n = 0
    for k, name in enumerate(("enc, \"quoted\"", "dec")):  # a run name CSV must quote
        rows = []
        for step in (0, 50, 1_000_000):
            for layer in range(3):
                for head in (None, 0, 1):
                    for metric in ("symmetry", "directionality", "vo_symmetry"):
                        if layer == 1:  # every awkward value, NaN included, several times
                            v, n = AWKWARD[n % len(AWKWARD)], n + 1
                        else:
                            v = float(rng.normal())
                        rows.append(("self" if k == 0 else "decoder", step, layer, head, metric, v))
        write_run(tmp_path / "runs" / name, rows)
    return tmp_path / "runs"


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".jsonl", ".pq", ".ndjson"])
def test_round_trip_is_exact(two_runs, tmp_path, suffix):
    df = load_trajectory(two_runs)
    assert sorted(df["run"].unique()) == ["dec", 'enc, "quoted"']
    out = export_trajectory(df, tmp_path / f"out{suffix}")
    back = read_table(out)
    pd.testing.assert_frame_equal(back, df)
    # bit-exact values, NaN where NaN, -0.0 kept as a value equal to 0
    np.testing.assert_array_equal(back["value"].to_numpy(), df["value"].to_numpy())
    np.testing.assert_array_equal(np.signbit(back["value"].to_numpy()), np.signbit(df["value"].to_numpy()))
    assert np.signbit(df["value"].to_numpy()).any() and (df["value"] == 5e-324).any()
    assert back["head"].isna().sum() == df["head"].isna().sum() > 0
    assert back["value"].isna().sum() == df["value"].isna().sum() > 0
    # and an exported table loads like a run directory
    pd.testing.assert_frame_equal(load_trajectory(out), df)


def test_export_from_run_directories_equals_export_of_the_loaded_table(two_runs, tmp_path):
    a = export_trajectory(two_runs, tmp_path / "a.csv")
    b = export_trajectory(load_trajectory(two_runs), tmp_path / "b.csv")
    assert a.read_bytes() == b.read_bytes()


def test_jsonl_export_is_one_valid_json_object_per_row(two_runs, tmp_path):
    df = load_trajectory(two_runs)
    out = export_trajectory(df, tmp_path / "t.txt", format="jsonl")
    lines = out.read_text().splitlines()
    assert len(lines) == len(df)
    recs = [json.loads(line) for line in lines]  # strict JSON: no NaN literals
    assert set(recs[0]) == {"run", "group", "step", "layer", "head", "metric", "value"}
    assert any(r["value"] is None for r in recs) and any(r["head"] is None for r in recs)


def test_format_comes_from_the_suffix_or_the_argument(tmp_path):
    assert resolve_format("x.CSV") == "csv"
    assert resolve_format("x.pq") == "parquet"
    assert resolve_format("x.out", "jsonl") == "jsonl"
    assert resolve_format("x.csv", "parquet") == "parquet"
    with pytest.raises(ValueError, match="suffix"):
        resolve_format("x.xlsx")
    with pytest.raises(ValueError, match="unknown format"):
        resolve_format("x.csv", "feather")


def test_parquet_written_with_an_explicit_format_reads_back(two_runs, tmp_path):
    df = load_trajectory(two_runs)
    out = export_trajectory(df, tmp_path / "table.bin", format="parquet")
    pd.testing.assert_frame_equal(read_table(out, format="parquet"), df)
