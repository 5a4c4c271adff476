"""``load_trajectory`` never gives one run's rows to another (issue 35, Build 3).

Each file is written line by line with the format's own writer (``encode_header`` and rows as
the sink writes them), so how many rows each run holds, and their values, are known without
the reader: run A's values are 0.25, run B's 0.75. Then one header is damaged as the issue
found it (a NUL byte, truncated, edited, 17 MB long, deleted), or two files holding the same
run id are concatenated. Before the fix, the rows of B went into A (44 of 124 rows vanished as
duplicate steps; A showed B's values), with only "skipped 1 corrupt line", or no warning at all.
"""

from __future__ import annotations

import json
import tracemalloc
import warnings
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")

from attn_probe import load_trajectory  # noqa: E402
from attn_probe.analysis.trajectory import TrajectoryWarning  # noqa: E402
from attn_probe.formats.trajectory import TRAJECTORY_FILENAME, encode_header  # noqa: E402

A, B, C = "a" * 32, "b" * 32, "c" * 32
METRICS = ("symmetry", "directionality")


def rows(steps, value: float) -> list[bytes]:
    """The rows of one run: 2 layers x 2 metrics per step, every value ``value``."""
    return [(json.dumps({"step": s, "wall_time": 1.5, "group": "self", "layer": la, "head": None, "metric": m,
                         "value": value}) + "\n").encode() for s in steps for la in range(2) for m in METRICS]


def header(run_id: str, step: int = 0, resumed: bool = False, config: dict | None = None) -> bytes:
    return encode_header(run_id, step, wall_time=1.0, resumed=resumed, config=config or {"every": 5})


def load(path: Path) -> tuple[pd.DataFrame, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = load_trajectory(path)
    return df, [str(w.message) for w in caught if issubclass(w.category, TrajectoryWarning)]


def per_run(df: pd.DataFrame) -> dict[str, tuple[int, list[float]]]:
    """``{run: (rows, sorted distinct values)}``."""
    return {run: (len(g), sorted(set(g["value"]))) for run, g in df.groupby("run")}


A_ROWS = rows(range(0, 80, 5), 0.25)  # 16 steps: 64 rows
B_ROWS = rows(range(0, 60, 5), 0.75)  # 12 steps: 48 rows, steps again from 0
C_ROWS = rows(range(0, 15, 5), 0.5)  # 3 steps: 12 rows


def damaged(how: str) -> bytes | None:
    """B's header as the issue found it damaged (``None``: deleted)."""
    good = header(B)
    if how == "nul":
        return good[:60] + b"\x00" + good[61:]
    if how == "truncated":
        return good[:len(good) // 2] + b"\n"
    if how == "edited":  # the run_header object removed by hand: the line is still header-shaped
        rec = json.loads(good)
        del rec["run_header"]
        return (json.dumps(rec) + "\n").encode()
    if how == "oversized":  # 17 MB: longer than any reader holds
        return header(B, config={"pad": "x" * (17 << 20)})
    return None


@pytest.mark.parametrize("how", ["nul", "truncated", "edited", "oversized", "deleted"])
def test_a_damaged_second_header_ends_the_first_run(tmp_path, how):
    run = tmp_path / "run"
    run.mkdir()
    bad = damaged(how)
    lines = [header(A), *A_ROWS, *([bad] if bad is not None else []), *B_ROWS, header(C), *C_ROWS]
    (run / TRAJECTORY_FILENAME).write_bytes(b"".join(lines))
    bad_line = 1 + len(A_ROWS) + 1  # the line B's header is (or was) on; the first row of B when deleted

    tracemalloc.start()
    try:
        df, msgs = load(run)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert per_run(df) == {"run": (64, [0.25]), "run#2": (48, [0.75]), "run#3": (12, [0.5])}
    ids = df.groupby("run")["run_id"].first()
    assert ids["run"] == A and pd.isna(ids["run#2"]) and ids["run#3"] == C
    assert len(df) == len(A_ROWS) + len(B_ROWS) + len(C_ROWS)  # nothing vanished
    # the warning names the line and what happened there
    said = "\n".join(msgs)
    kind = {"oversized": "a run header too long to read",
            "deleted": "rows whose step goes back with no run header between (a missing header)"}.get(how, "a run header that cannot be read")
    assert f"{kind} at line {bad_line} (" in said, said
    assert "corrupt" not in said  # the header is not counted as a corrupt row: it is named
    assert peak < (16 << 20), peak  # the 17 MB line is never held whole


def test_the_issues_file_124_rows(tmp_path):
    """The issue's count: 80 + 44 rows, the second header with one NUL byte."""
    run = tmp_path / "run"
    run.mkdir()
    first, second = rows(range(0, 100, 5), 0.25), rows(range(0, 55, 5), 0.75)  # 80 and 44 rows
    good = header(B)
    (run / TRAJECTORY_FILENAME).write_bytes(b"".join([header(A), *first, good[:60] + b"\x00" + good[61:], *second]))
    df, _ = load(run)
    assert per_run(df) == {"run": (80, [0.25]), "run#2": (44, [0.75])}


@pytest.mark.parametrize("second", ["fresh", "resumed_overlapping"])
def test_two_files_of_one_run_id_concatenated_stay_two_runs(tmp_path, second):
    """Two copies of one run's files (a run copied, both continued) put end to end: 122 + 122 rows."""
    run = tmp_path / "run"
    run.mkdir()
    one = rows(range(0, 155, 5), 0.25)[:122]
    two = rows(range(0, 155, 5), 0.75)[:122]
    head2 = header(A) if second == "fresh" else header(A, 0, resumed=True)
    (run / TRAJECTORY_FILENAME).write_bytes(b"".join([header(A), *one, head2, *two]))
    df, msgs = load(run)
    assert per_run(df) == {"run": (122, [0.25]), "run#2": (122, [0.75])}
    assert df.groupby("run")["run_id"].first().to_dict() == {"run": A, "run#2": f"{A}#2"}
    said = "\n".join(msgs)
    assert f"a run header reusing the id of an earlier run at line {2 + 122} (run id {A} opened again" in said


def test_a_resumed_run_with_another_run_between_stays_one_run(tmp_path):
    """The ordinary case is unchanged: A, then B, then A resumed past its last row: two runs, no warning
    about ids."""
    run = tmp_path / "run"
    run.mkdir()
    a1, a2 = rows(range(0, 40, 5), 0.25), rows(range(40, 80, 5), 0.25)
    (run / TRAJECTORY_FILENAME).write_bytes(b"".join([header(A), *a1, header(B), *B_ROWS,
                                                       header(A, 40, resumed=True), *a2]))
    df, msgs = load(run)
    assert per_run(df) == {"run": (64, [0.25]), "run#2": (48, [0.75])}
    assert not any("reusing" in m or "cannot be read" in m for m in msgs)


@pytest.mark.parametrize("order", ["literal_last", "literal_first"])
def test_ids_that_collide_with_a_numbered_label_get_distinct_labels(tmp_path, order):
    """Issue 44, finding 12: the ids ``a``, ``a`` and a literal ``a#2`` in one file. The second run of
    ``a`` was labelled ``a#2``, as the literal one is: two runs showed one run_id. Each run now shows
    its own label, the literal id as it is, and a second reading gives the same labels."""
    run = tmp_path / "run"
    run.mkdir()
    parts = [header("a"), *rows(range(0, 20, 5), 0.25), header("a"), *rows(range(0, 20, 5), 0.75)]
    literal = [header("a#2"), *rows(range(0, 20, 5), 0.5)]
    parts = parts + literal if order == "literal_last" else literal + parts
    (run / TRAJECTORY_FILENAME).write_bytes(b"".join(parts))
    df, _ = load(run)
    labels = df.groupby("run")["run_id"].agg(lambda s: sorted(set(s)))
    assert all(len(v) == 1 for v in labels)  # one label a run
    by_value = {sorted(set(g["value"]))[0]: g["run_id"].iloc[0] for _, g in df.groupby("run")}
    assert by_value == {0.25: "a", 0.75: "a#3", 0.5: "a#2"}  # distinct; the literal id kept as written
    again, _ = load(run)
    assert again[["run", "run_id"]].equals(df[["run", "run_id"]])  # stable
