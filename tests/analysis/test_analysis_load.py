"""Reading runs back: trajectory file vs event files, no down-sampling, resumed runs, bad input.

Fixture runs are written with the real writers (torch's SummaryWriter with the tag grammar's
``scalar_tag``, and JSONL lines following ``formats.trajectory``) from known values.
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from attn_probe import load_trajectory, summarize
from attn_probe.analysis.summary import layer_quantiles
from attn_probe.analysis.trajectory import MissingExtraError, TrajectoryError, TrajectoryWarning, find_runs
from attn_probe.core import DEFAULT_METRICS
from attn_probe.formats.tags import scalar_tag
from attn_probe.formats.trajectory import TRAJECTORY_FILENAME, encode_value

pytest.importorskip("tensorboard")


def f32(x: float) -> float:
    """A value that survives TensorBoard's float32 storage unchanged."""
    return float(np.float32(x))


def make_records(steps, layers=3, heads=0, groups=("self",), seed=0):
    """(group, step, layer, head, metric, value) with float32-exact values; one NaN."""
    rng = np.random.default_rng(seed)
    recs = []
    for step in steps:
        for group in groups:
            for layer in range(layers):
                for head in [None, *range(heads)]:
                    for metric in ("symmetry", "directionality"):
                        recs.append((group, step, layer, head, metric, f32(rng.uniform(-1, 1))))
    g, s, layer, h, m, _ = recs[len(recs) // 2]
    recs[len(recs) // 2] = (g, s, layer, h, m, float("nan"))
    return recs


def write_jsonl(run_dir: Path, recs, extra_lines=()) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / TRAJECTORY_FILENAME
    with open(path, "a", encoding="utf-8") as fh:
        for group, step, layer, head, metric, value in recs:
            fh.write(json.dumps({"step": step, "wall_time": time.time(), "group": group, "layer": layer,
                                 "head": head, "metric": metric, "value": encode_value(value)}) + "\n")
        for line in extra_lines:
            fh.write(line)
    return path


def write_events(run_dir: Path, recs, aggregates: bool = True, other_tags: bool = True) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run_dir))
    try:
        for group, step, layer, head, metric, value in recs:
            writer.add_scalar(scalar_tag(group, metric, layer=layer, head=head), value, step)
        if aggregates:  # must be ignored: the reader recomputes them
            steps = sorted({r[1] for r in recs})
            for step in steps:
                writer.add_scalar(scalar_tag("self", "symmetry", stat="median"), 42.0, step)
        if other_tags:
            writer.add_scalar("train/loss", 1.5, 0)
    finally:
        writer.close()


def expected_frame(recs, run: str) -> pd.DataFrame:
    df = pd.DataFrame(recs, columns=["group", "step", "layer", "head", "metric", "value"])
    df.insert(0, "run", run)
    df["layer"] = df["layer"].astype("Int64")
    df["head"] = pd.array([pd.NA if h is None else h for h in df["head"]], dtype="Int64")
    df = df[["run", "group", "step", "layer", "head", "metric", "value"]]
    key = ["run", "group", "metric", "layer", "head", "step"]
    return df.sort_values(key, na_position="first").reset_index(drop=True)


def test_trajectory_and_event_files_give_identical_rows(tmp_path):
    recs = make_records([0, 10, 20, 35], layers=3, heads=2, groups=("encoder", "decoder"))
    write_jsonl(tmp_path / "a" / "run", recs)
    write_events(tmp_path / "b" / "run", recs)
    from_jsonl = load_trajectory(tmp_path / "a" / "run")
    from_events = load_trajectory(tmp_path / "b" / "run")
    expected = expected_frame(recs, "run")
    pd.testing.assert_frame_equal(from_jsonl, expected)
    pd.testing.assert_frame_equal(from_events, expected)
    assert list(from_jsonl.columns) == ["run", "group", "step", "layer", "head", "metric", "value"]
    assert str(from_jsonl["head"].dtype) == "Int64" and str(from_jsonl["layer"].dtype) == "Int64"
    assert from_events["value"].isna().sum() == 1
    assert 42.0 not in set(from_events["value"])  # aggregate tags ignored


def test_trajectory_file_is_preferred_over_event_files(tmp_path):
    recs = make_records([0, 1], layers=2)
    write_jsonl(tmp_path, recs)
    write_events(tmp_path, [(g, s, la, h, m, 0.5) for g, s, la, h, m, _ in recs])
    df = load_trajectory(tmp_path)
    pd.testing.assert_frame_equal(df, expected_frame(recs, tmp_path.name))


def test_event_run_longer_than_tensorboards_default_reservoir(tmp_path):
    steps = range(12_000)
    values = [f32(math.sin(s / 100.0)) for s in steps]
    write_events(tmp_path / "long",
                 [("self", s, 0, None, "symmetry", v) for s, v in zip(steps, values, strict=True)],
                 aggregates=False)
    df = load_trajectory(tmp_path / "long")
    assert len(df) == 12_000
    assert df["step"].tolist() == list(steps)
    assert df["value"].tolist() == values


def test_corrupt_and_truncated_lines_are_skipped_with_one_counting_warning(tmp_path):
    recs = make_records([0, 5], layers=2)
    bad = ['not json at all\n', '{"step": "x", "group": "self", "layer": 0, "head": null, '
           '"metric": "symmetry", "value": 1.0}\n', '{"step": 7, "wall_time": 1.0, "gro']
    write_jsonl(tmp_path, recs, extra_lines=bad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = load_trajectory(tmp_path)
    ours = [w for w in caught if issubclass(w.category, TrajectoryWarning)]
    assert len(ours) == 1
    assert "skipped 3 corrupt or truncated lines" in str(ours[0].message)
    pd.testing.assert_frame_equal(df, expected_frame(recs, tmp_path.name))


def test_resumed_run_keeps_the_value_written_last(tmp_path):
    first = [("self", s, 0, None, "symmetry", f32(s / 10)) for s in range(6)]
    resumed = [("self", s, 0, None, "symmetry", f32(-s / 10)) for s in range(3, 8)]
    write_jsonl(tmp_path / "traj", first)
    write_jsonl(tmp_path / "traj", resumed)  # appended after a restart from step 3
    write_events(tmp_path / "events", first, aggregates=False, other_tags=False)
    time.sleep(1.1)  # the second event file sorts after the first
    write_events(tmp_path / "events", resumed, aggregates=False, other_tags=False)
    assert len(list((tmp_path / "events").glob("*tfevents*"))) == 2
    want = [s / 10 for s in range(3)] + [-s / 10 for s in range(3, 8)]
    for name in ("traj", "events"):
        df = load_trajectory(tmp_path / name)
        assert df["step"].tolist() == list(range(8)), name
        np.testing.assert_array_equal(df["value"].to_numpy(), np.array(want, dtype=np.float32), err_msg=name)


def test_restart_marker_drops_stale_event_steps(tmp_path):
    """A resumed writer with purge_step=N (SessionLog.START) hides the old steps >= N."""
    from torch.utils.tensorboard import SummaryWriter

    tag = scalar_tag("self", "symmetry", layer=0)
    with SummaryWriter(str(tmp_path)) as w:
        for s in range(10):
            w.add_scalar(tag, 0.25, s)
    time.sleep(1.1)
    with SummaryWriter(str(tmp_path), purge_step=5) as w:  # new schedule after the restart
        for s in (5, 7):
            w.add_scalar(tag, -0.5, s)
    df = load_trajectory(tmp_path)
    assert df["step"].tolist() == [0, 1, 2, 3, 4, 5, 7]
    assert df["value"].tolist() == [0.25] * 5 + [-0.5] * 2


def test_nested_runs_are_named_after_their_directories(tmp_path):
    recs = make_records([0, 1], layers=2)
    for parent in ("seed1", "seed2"):
        write_jsonl(tmp_path / parent / "encoder", recs)
        write_events(tmp_path / parent / "decoder", recs)
    assert sorted(load_trajectory(tmp_path / "seed1")["run"].unique()) == ["decoder", "encoder"]
    both = load_trajectory([tmp_path / "seed1", tmp_path / "seed2"])
    assert sorted(both["run"].unique()) == ["seed1/decoder", "seed1/encoder", "seed2/decoder", "seed2/encoder"]
    assert len(both) == 4 * len(recs)
    named = load_trajectory({"enc": tmp_path / "seed1" / "encoder", "dec": tmp_path / "seed2" / "decoder"})
    assert sorted(named["run"].unique()) == ["dec", "enc"]
    # the same directory given twice is one run
    assert [n for n, _ in find_runs([tmp_path / "seed1", tmp_path / "seed1" / "encoder"])] == ["decoder", "encoder"]


def test_event_files_below_a_trajectory_directory_belong_to_it(tmp_path):
    recs = make_records([0, 1], layers=2)
    write_jsonl(tmp_path / "run", recs)
    write_events(tmp_path / "run" / "runs" / "tb", recs)
    assert [n for n, _ in find_runs(tmp_path)] == ["run"]


@pytest.mark.parametrize("case", ["missing", "empty", "no_probe_tags", "only_corrupt"])
def test_unusable_input_raises_a_clear_error(tmp_path, case):
    target = tmp_path / "run"
    if case == "empty":
        target.mkdir()
    elif case == "no_probe_tags":
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(target)) as w:
            w.add_scalar("train/loss", 1.0, 0)
    elif case == "only_corrupt":
        write_jsonl(target, [], extra_lines=["garbage\n", '{"step": 1'])
    expected = FileNotFoundError if case == "missing" else TrajectoryError
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrajectoryWarning)
        with pytest.raises(expected, match=str(target)):
            load_trajectory(target)


def test_mixed_usable_and_unusable_runs_keep_the_usable_one(tmp_path):
    recs = make_records([0, 1], layers=2)
    write_jsonl(tmp_path / "good", recs)
    write_jsonl(tmp_path / "bad", [], extra_lines=["garbage\n"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = load_trajectory(tmp_path)
    messages = [str(w.message) for w in caught if issubclass(w.category, TrajectoryWarning)]
    assert len(messages) == 2
    assert "skipped 1 corrupt or truncated line" in messages[0] and "no probe data" in messages[1]
    assert df["run"].unique().tolist() == ["good"]


def test_layer_quantiles_and_summary_match_numpy(tmp_path):
    rng = np.random.default_rng(3)
    steps = [0, 100, 250]
    vals = {(s, la): float(rng.uniform(-1, 1)) for s in steps for la in range(5)}
    recs = [("self", s, la, None, "symmetry", v) for (s, la), v in vals.items()]
    recs += [("self", s, 0, 1, "symmetry", 9.0) for s in steps]  # a head row: not a layer value
    write_jsonl(tmp_path / "r", recs)
    q = layer_quantiles(tmp_path / "r")
    for s in steps:
        layer_vals = [vals[(s, la)] for la in range(5)]
        row = q[q["step"] == s].iloc[0]
        assert row["median"] == pytest.approx(np.median(layer_vals), abs=1e-15)
        assert row["q25"] == pytest.approx(np.percentile(layer_vals, 25), abs=1e-15)
        assert row["q75"] == pytest.approx(np.percentile(layer_vals, 75), abs=1e-15)
        assert row["layers"] == 5
    table = summarize(tmp_path / "r")
    assert len(table) == 1
    row = table.iloc[0]
    assert (row["first_step"], row["last_step"]) == (0, 250)
    assert row["first_median"] == pytest.approx(np.median([vals[(0, la)] for la in range(5)]))
    assert row["last_q75"] == pytest.approx(np.percentile([vals[(250, la)] for la in range(5)], 75))


def test_missing_pandas_names_the_extra(tmp_path, monkeypatch):
    write_jsonl(tmp_path, make_records([0], layers=1))
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(MissingExtraError, match=r"attn-probe\[pandas\]"):
        load_trajectory(tmp_path)


def test_reads_what_the_live_probe_writes(tmp_path):
    """End to end with the real probe: both sources agree, and recomputed statistics match
    the probe's own median/q25/q75 tags."""
    pytest.importorskip("transformers")
    import shutil

    import torch
    from helpers import tiny_model  # after the skip: helpers imports transformers

    import attn_probe

    model = tiny_model("bert", 0, cls="BertModel", vocab_size=30, hidden_size=16, num_hidden_layers=3,
                       num_attention_heads=2, intermediate_size=20, max_position_embeddings=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    probe = attn_probe.watch(model, optimizer=opt, log_dir=str(tmp_path / "run"), every=1)
    for _ in range(3):
        model(input_ids=torch.randint(0, 30, (2, 8))).last_hidden_state.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    probe.close()
    (tmp_path / "events").mkdir()
    for f in (tmp_path / "run").glob("*tfevents*"):
        shutil.copy(f, tmp_path / "events" / f.name)
    from_traj = load_trajectory(tmp_path / "run")
    from_events = load_trajectory(tmp_path / "events")
    # the random-matrix range is in the trajectory file only (docs/scores.md): 3 layers x 4, at step 0
    rand = from_traj["metric"].str.startswith("random_")
    assert rand.sum() == 3 * 4 and set(from_traj[rand]["step"]) == {0}
    from_traj = from_traj[~rand].reset_index(drop=True)
    assert sorted(from_traj["step"].unique()) == [0, 1, 2, 3]
    assert len(from_traj) == 4 * 3 * len(DEFAULT_METRICS)
    assert from_traj["run_id"].nunique() == 1 and from_traj["parent_run"].isna().all()  # a run header
    pd.testing.assert_frame_equal(from_traj.drop(columns=["run", "value", "run_id", "parent_run", "parent_step"]),
                                  from_events.drop(columns=["run", "value"]))
    np.testing.assert_array_equal(from_traj["value"].to_numpy(np.float32), from_events["value"].to_numpy())

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "events"), size_guidance={"scalars": 0})
    acc.Reload()
    q = layer_quantiles(from_traj)
    for stat in ("median", "q25", "q75"):
        for metric in ("symmetry", "directionality"):
            logged = {e.step: e.value for e in acc.Scalars(scalar_tag("self", metric, stat=stat))}
            ours = q[q["metric"] == metric].set_index("step")[stat]
            for step, v in logged.items():
                assert ours[step] == pytest.approx(v, abs=1e-6), (stat, metric, step)


def test_writer_and_reader_agree_on_what_an_event_file_is(tmp_path):
    """The sink's resume check (has_event_files) and the reader's run discovery share one rule."""
    from attn_probe.formats.events import has_event_files

    events = tmp_path / "events"
    write_events(events, make_records([0], layers=1))
    (tmp_path / "empty").mkdir()
    nested = tmp_path / "nested"
    write_events(nested / "sub", make_records([0], layers=1))
    assert has_event_files(str(events)) and not has_event_files(str(tmp_path / "empty"))
    assert not has_event_files(str(nested))  # only the directory itself counts
    assert not has_event_files(str(tmp_path / "missing"))
    assert {d.name for _, d in find_runs(tmp_path)} == {"events", "sub"}
