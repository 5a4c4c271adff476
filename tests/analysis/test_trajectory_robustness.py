"""Hostile input never makes a run unreadable (issue 11, item 4).

A real run is written once by the live probe (a tiny BERT, ``attn_probe.watch``), then
copied and damaged per test: hostile JSONL lines are skipped with the counted warning and
every other value still loads exactly; an event file corrupted mid-file is reported with
its byte offset, while a torn last record (a file still being written) is not; the
``summary``, ``export`` and ``plot`` commands answer with warnings, never a traceback.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("tensorboard")

from attn_probe.analysis.trajectory import (  # noqa: E402
    TrajectoryWarning,
    load_trajectory,
    normalize,
    read_table,
    scan_event_file,
)
from attn_probe.formats.trajectory import TRAJECTORY_FILENAME  # noqa: E402

HOSTILE = {
    "huge_int_step": '{"step": 1000000000000000000000000000000, "wall_time": 1.0, "group": "self", '
                     '"layer": 0, "head": null, "metric": "symmetry", "value": 0.5}',
    "int64_overflow_step": '{"step": 9223372036854775808, "group": "self", "layer": 0, "head": null, '
                           '"metric": "symmetry", "value": 0.5}',
    "infinity_step": '{"step": Infinity, "group": "self", "layer": 0, "head": null, "metric": "symmetry", '
                     '"value": 0.5}',
    "nan_step": '{"step": NaN, "group": "self", "layer": 0, "head": null, "metric": "symmetry", "value": 0.5}',
    "float_step": '{"step": 1e30, "group": "self", "layer": 0, "head": null, "metric": "symmetry", "value": 0.5}',
    "huge_float_value": '{"step": 1, "group": "self", "layer": 0, "head": null, "metric": "symmetry", '
                        '"value": 1e400}',
    "nan_value_literal": '{"step": 1, "group": "self", "layer": 0, "head": null, "metric": "symmetry", '
                         '"value": NaN}',
    "infinity_value": '{"step": 1, "group": "self", "layer": 0, "head": null, "metric": "symmetry", '
                      '"value": -Infinity}',
    "int_value_beyond_float": '{"step": 1, "group": "self", "layer": 0, "head": null, "metric": "symmetry", '
                              '"value": ' + "9" * 400 + "}",
    "huge_layer": '{"step": 1, "group": "self", "layer": 100000000000000000000000, "head": null, '
                  '"metric": "symmetry", "value": 0.5}',
    "huge_head": '{"step": 1, "group": "self", "layer": 0, "head": -100000000000000000000000, '
                 '"metric": "symmetry", "value": 0.5}',
    "bool_step": '{"step": true, "group": "self", "layer": 0, "head": null, "metric": "symmetry", "value": 0.5}',
    "too_many_digits": '{"step": ' + "1" * 5000 + ', "group": "self", "layer": 0, "head": null, '
                       '"metric": "symmetry", "value": 0.5}',
    "deep_list": "[" * 100_000 + "]" * 100_000,
    "deep_object": '{"a": ' * 50_000 + "1" + "}" * 50_000,
    "lone_surrogate_group": '{"step": 1, "group": "\\ud800", "layer": 0, "head": null, "metric": "symmetry", '
                            '"value": 0.5}',
    "mathtext_metric": '{"step": 1, "group": "self", "layer": 0, "head": null, "metric": "$\\\\frac{$", '
                       '"value": 0.5}',
    "list_value": '{"step": 1, "group": "self", "layer": 0, "head": null, "metric": "symmetry", "value": [1]}',
    "not_an_object": "[1, 2, 3]",
    "garbage": "\x00\x01 not json at all",
}


# --------------------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """attn_probe.jsonl and event files of a real probe run: 3 layers, per-head rows, 4 steps."""
    pytest.importorskip("transformers")
    import torch
    from helpers import tiny_model  # after the skip: helpers imports transformers

    import attn_probe

    root = tmp_path_factory.mktemp("real")
    model = tiny_model("bert", 0, cls="BertModel", vocab_size=30, hidden_size=16, num_hidden_layers=3,
                       num_attention_heads=2, intermediate_size=20, max_position_embeddings=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # random_range=False: the JSONL and the event files then hold the same rows (the range is
        # written to the trajectory file only)
        probe = attn_probe.watch(model, optimizer=opt, log_dir=str(root / "run"), every=1, per_head=True,
                                 random_range=False)
        for _ in range(3):
            model(input_ids=torch.randint(0, 30, (2, 8))).last_hidden_state.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        probe.close()
    run = root / "run"
    assert (run / TRAJECTORY_FILENAME).is_file() and list(run.glob("*tfevents*"))
    return run


def copy_run(real_run: Path, dest: Path, jsonl: bool = True) -> Path:
    dest.mkdir(parents=True)
    for f in real_run.iterdir():
        if f.is_file() and (jsonl or f.name != TRAJECTORY_FILENAME) and not f.name.startswith("."):
            shutil.copy(f, dest / f.name)
    return dest


def load_quietly(path) -> tuple[pd.DataFrame, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = load_trajectory(path)
    return df, [str(w.message) for w in caught if issubclass(w.category, TrajectoryWarning)]


def insert_lines(path: Path, lines: list[str | bytes]) -> None:
    """Put each line after a different valid line (and the last one at the end)."""
    good = path.read_bytes().splitlines(keepends=True)
    assert len(good) > len(lines)
    out = []
    for i, line in enumerate(good):
        out.append(line)
        if i < len(lines):
            extra = lines[i]
            out.append((extra if isinstance(extra, bytes) else extra.encode("utf-8", "surrogatepass")) + b"\n")
    path.write_bytes(b"".join(out))


@pytest.fixture(scope="module")
def clean(real_run) -> pd.DataFrame:
    df, msgs = load_quietly(real_run)
    assert msgs == [] and len(df) > 0 and df["head"].notna().any()
    return df


# --------------------------------------------------------------------------- hostile JSONL lines


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_line_is_skipped_and_counted(real_run, clean, tmp_path, name):
    run = copy_run(real_run, tmp_path / "run")
    insert_lines(run / TRAJECTORY_FILENAME, [HOSTILE[name]])
    df, msgs = load_quietly(run)
    pd.testing.assert_frame_equal(df, clean)
    assert msgs == [f"{run / TRAJECTORY_FILENAME}: skipped 1 corrupt or truncated line"]


def test_every_hostile_line_at_once_plus_overlong_and_broken_utf8(real_run, clean, tmp_path):
    run = copy_run(real_run, tmp_path / "run")
    lines: list[str | bytes] = list(HOSTILE.values())
    lines.append("x" * (3 << 20))  # longer than any real line: skipped without reading it whole
    lines.append(b'{"step": 1, "group": "s\xff\xfeelf", "layer": 0, "head": null, "metric": "symmetry", '
                 b'"value": 0.5}')
    insert_lines(run / TRAJECTORY_FILENAME, lines)
    with open(run / TRAJECTORY_FILENAME, "ab") as fh:
        fh.write(b'{"step": 3, "group": "self", "lay')  # torn last line
    df, msgs = load_quietly(run)
    pd.testing.assert_frame_equal(df, clean)
    assert msgs == [f"{run / TRAJECTORY_FILENAME}: skipped {len(lines) + 1} corrupt or truncated lines"]


def test_extreme_but_valid_integers_load_exactly(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    big = 2**63 - 1
    recs = [
        {"step": big, "group": "self", "layer": 0, "head": None, "metric": "symmetry", "value": 0.25},
        {"step": -(2**63), "group": "self", "layer": big, "head": big, "metric": "symmetry", "value": 1e308},
        {"step": 0, "group": "self", "layer": 1, "head": None, "metric": "symmetry", "value": None},
    ]
    (run / TRAJECTORY_FILENAME).write_text("".join(json.dumps(r) + "\n" for r in recs))
    df, msgs = load_quietly(run)
    assert msgs == []
    assert sorted(df["step"].tolist()) == [-(2**63), 0, big]
    row = df[df["step"] == -(2**63)].iloc[0]
    assert int(row["layer"]) == big and int(row["head"]) == big and row["value"] == 1e308
    assert np.isnan(df[df["step"] == 0]["value"].iloc[0])


# --------------------------------------------------------------------------- the commands


@pytest.mark.parametrize("argv", [
    ["summary"], ["summary", "--format", "csv"],
    ["export", "-o", "{out}/t.csv"], ["export", "-o", "{out}/t.parquet"], ["export", "-o", "{out}/t.jsonl"],
    ["plot", "-o", "{out}/f.png"], ["plot", "--per-layer", "--logx", "-o", "{out}/f.png"],
])
def test_commands_warn_and_never_trace_back(real_run, tmp_path, capsys, argv):
    pytest.importorskip("matplotlib")
    if "{out}/t.parquet" in argv:
        pytest.importorskip("pyarrow")
    from attn_probe.cli import main

    run = copy_run(real_run, tmp_path / "run")
    insert_lines(run / TRAJECTORY_FILENAME, list(HOSTILE.values()))
    clean_dir = copy_run(real_run, tmp_path / "clean")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = [a.replace("{out}", str(out_dir)) for a in argv]
    assert main([args[0], str(run), *args[1:]]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    assert f"warning: {run / TRAJECTORY_FILENAME}: skipped {len(HOSTILE)} corrupt or truncated lines" in err
    if args[0] == "summary":  # same numbers as the undamaged run
        assert main([args[0], str(clean_dir), *args[1:]]) == 0
        assert capsys.readouterr().out.replace("clean", "run") == out
    if args[0] == "export":
        exported = read_table(args[-1])
        pd.testing.assert_frame_equal(exported.drop(columns="run"),
                                      load_trajectory(clean_dir).drop(columns="run"))


def test_exported_tables_with_hostile_rows_skip_them_with_a_count(tmp_path, clean):
    csv = tmp_path / "t.csv"
    clean.to_csv(csv, index=False)
    with open(csv, "a") as fh:
        for bad in ("run,self,1e30,0,,symmetry,0.5", "run,self,inf,0,,symmetry,0.5",
                    "run,self,abc,0,,symmetry,0.5", "run,self,1.5,0,,symmetry,0.5",
                    "run,self,5,99999999999999999999999,,symmetry,0.5", "run,self,5,0,,symmetry,oops",
                    "run,self,5,0,0.5,symmetry,0.5"):
            fh.write(bad + "\n")
    with pytest.warns(TrajectoryWarning, match=r"t\.csv: skipped 7 rows with an invalid step"):
        got = read_table(csv)
    pd.testing.assert_frame_equal(got, clean)

    jsonl = tmp_path / "t.jsonl"
    lines = [json.dumps({**r, "layer": int(r["layer"]), "head": None if pd.isna(r["head"]) else int(r["head"]),
                         "value": None if np.isnan(r["value"]) else r["value"]})
             for r in clean.to_dict("records")]
    hostile = [HOSTILE["huge_int_step"].replace("{", '{"run": "x", ', 1), HOSTILE["deep_list"],
               HOSTILE["infinity_step"].replace("{", '{"run": "x", ', 1), '{"run": 5}']
    jsonl.write_text("\n".join(lines + hostile) + "\n")
    with pytest.warns(TrajectoryWarning, match=r"t\.jsonl: skipped 4 corrupt or truncated lines"):
        got = read_table(jsonl)
    pd.testing.assert_frame_equal(got, clean)


def test_normalize_drops_rows_that_would_wrap_around(clean):
    df = clean.astype({"step": "float64"}).copy()
    df.loc[len(df)] = ["run", "self", 1e30, 0, None, "symmetry", 0.5] + [None] * (len(df.columns) - 7)  # astype(int64) gives -2**63
    with pytest.warns(TrajectoryWarning, match="skipped 1 row"):
        got = normalize(df)
    pd.testing.assert_frame_equal(got, clean)


# --------------------------------------------------------------------------- event files


def event_file(run: Path) -> Path:
    (f,) = run.glob("*tfevents*")
    return f


def test_intact_event_files_load_without_a_warning(real_run, clean, tmp_path):
    run = copy_run(real_run, tmp_path / "events", jsonl=False)
    assert scan_event_file(event_file(run)) is None
    df, msgs = load_quietly(run)
    assert msgs == []
    assert len(df) == len(clean)


def test_event_file_corrupted_mid_file_is_reported_with_its_offset(real_run, tmp_path):
    run = copy_run(real_run, tmp_path / "events", jsonl=False)
    f = event_file(run)
    intact, _ = load_quietly(run)
    data = bytearray(f.read_bytes())
    pos = len(data) // 2
    record = max(o for o in record_offsets(data) if o <= pos)
    data[pos] ^= 0x5A
    f.write_bytes(bytes(data))
    found = scan_event_file(f)
    assert found is not None
    off, problem = found
    assert off == record and "checksum" in problem
    df, msgs = load_quietly(run)
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith(f"{f}: corrupt event record at byte offset {off} of {len(data)}")
    # what TensorBoard could read is the part before the corruption, unchanged
    assert 0 < len(df) < len(intact)
    merged = df.merge(intact, on=["run", "group", "step", "layer", "head", "metric"], suffixes=("", "_ok"))
    assert len(merged) == len(df)
    np.testing.assert_array_equal(merged["value"], merged["value_ok"])


@pytest.mark.parametrize("where", ["length", "length_crc", "data_crc_of_last_record"])
def test_each_part_of_the_framing_is_checked(real_run, tmp_path, where):
    run = copy_run(real_run, tmp_path / "events", jsonl=False)
    f = event_file(run)
    data = bytearray(f.read_bytes())
    offsets = record_offsets(data)
    if where == "length":
        at = offsets[len(offsets) // 2]
        data[at + 1] ^= 0x01
    elif where == "length_crc":
        at = offsets[len(offsets) // 2]
        data[at + 9] ^= 0x01
    else:
        at = offsets[-1]
        data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    off, problem = scan_event_file(f)
    assert off == at
    assert problem == ("record data fails its checksum" if where.startswith("data")
                       else "record length fails its checksum")


def record_offsets(data: bytes) -> list[int]:
    out, off = [], 0
    while off < len(data):
        out.append(off)
        off += 16 + int.from_bytes(data[off:off + 8], "little")
    assert off == len(data)
    return out


@pytest.mark.parametrize("cut", [1, 4, 15, "header_only", "half_record"])
def test_torn_last_record_is_not_corruption(real_run, tmp_path, cut):
    run = copy_run(real_run, tmp_path / "events", jsonl=False)
    f = event_file(run)
    data = f.read_bytes()
    last = record_offsets(data)[-1]
    keep = {"header_only": last + 12, "half_record": (last + len(data)) // 2}.get(cut)
    f.write_bytes(data[:keep] if keep is not None else data[:-cut])
    assert scan_event_file(f) is None
    df, msgs = load_quietly(run)
    assert msgs == [] and len(df) > 0


def test_zero_filled_tail_is_not_corruption_but_junk_is(real_run, tmp_path):
    run = copy_run(real_run, tmp_path / "events", jsonl=False)
    f = event_file(run)
    data = f.read_bytes()
    f.write_bytes(data + b"\0" * 4096)  # a crash after the file grew, before its data was written
    assert scan_event_file(f) is None
    f.write_bytes(data + b"\x01" * 64)
    assert scan_event_file(f) == (len(data), "record length fails its checksum")


def test_numpy_checksums_match_tensorboards(tmp_path):
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    from attn_probe.formats.events import crc_tools, masked_crc32c_many

    _, table = crc_tools()
    rng = np.random.default_rng(0)
    for length in (0, 1, 8, 13, 200):
        buf = rng.integers(0, 256, size=40 * (length + 5), dtype=np.uint8)
        starts = np.arange(0, len(buf) - length, length + 5)
        got = masked_crc32c_many(buf, starts, length, table)
        assert [int(c) for c in got] == [masked_crc32c(buf[s:s + length].tobytes()) for s in starts]


def test_event_tags_beyond_int64_are_skipped_and_counted(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "events"
    with SummaryWriter(str(run)) as w:
        w.add_scalar("attn_probe/self/symmetry/layer_00", 0.5, 1)
        w.add_scalar("attn_probe/self/symmetry/layer_" + "9" * 30, 0.25, 1)
        w.add_scalar("attn_probe/self/symmetry/layer_01/head_" + "9" * 30, 0.25, 1)
    df, msgs = load_quietly(run)
    assert df[["step", "layer", "value"]].values.tolist() == [[1, 0, 0.5]]
    assert msgs == [f"{run}: skipped 2 malformed event values or tags"]
