"""The resume cut never cuts another run's rows (issue 35, Build 3).

* a file written by v0.3 (``fixtures/v03_two_runs.jsonl``, made with that release's code, see
  ``fixtures/make_v03_two_runs.py``) holding two runs without headers, resumed by a real
  ``attn_probe.watch(start_step=4)``: the first run keeps all its 48 rows byte for byte (before:
  24 of them were cut), the second run continues;
* :func:`cut_run` on files with a damaged, 17 MB or missing header, and with one run id used by
  two runs, against references that know which lines belong to which run because the test
  wrote them;
* ``extra_config`` values the run header cannot hold are refused at attach with one line.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

pd = pytest.importorskip("pandas")
from helpers import tiny_bert  # noqa: E402

import attn_probe  # noqa: E402
from attn_probe import load_trajectory  # noqa: E402
from attn_probe.formats.trajectory import TRAJECTORY_FILENAME, cut_run, encode_header  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "v03_two_runs.jsonl"
A, B = "a" * 32, "b" * 32


def rows(steps, value: float) -> list[bytes]:
    return [(json.dumps({"step": s, "wall_time": 1.5, "group": "self", "layer": la, "head": None,
                         "metric": "symmetry", "value": value}) + "\n").encode() for s in steps for la in range(2)]


def header(run_id: str, step: int = 0, resumed: bool = False, config: dict | None = None) -> bytes:
    return encode_header(run_id, step, wall_time=1.0, resumed=resumed, config=config or {"every": 5})


# --------------------------------------------------------------------------- v0.3 files


def test_the_v03_fixture_holds_two_header_less_runs_of_48_rows():
    lines = FIXTURE.read_bytes().splitlines(keepends=True)
    recs = [json.loads(line) for line in lines]
    assert len(recs) == 96 and not any("run_header" in r for r in recs)
    assert [r["step"] for r in recs[:48]] == [s for s in (0, 2, 4, 6) for _ in range(12)]
    assert [r["step"] for r in recs[48:]] == [s for s in (0, 2, 4, 6) for _ in range(12)]


def test_resuming_a_v03_file_of_two_runs_keeps_the_first_run_whole(tmp_path):
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    shutil.copy(FIXTURE, log_dir / TRAJECTORY_FILENAME)
    original = FIXTURE.read_bytes().splitlines(keepends=True)
    first, second = original[:48], original[48:]

    model = tiny_bert(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = attn_probe.watch(model, optimizer=opt, log_dir=str(log_dir), every=2, start_step=4,
                                 random_range=False)
        for _ in range(2):  # steps 5 and 6
            ids = torch.randint(0, 50, (4, 12))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        probe.close()
    said = "\n".join(str(w.message) for w in caught)

    after = (log_dir / TRAJECTORY_FILENAME).read_bytes().splitlines(keepends=True)
    assert after[:48] == first  # the first run, byte for byte
    # the second run: its rows before the resume step, then the resumed run's header and rows
    assert after[48:72] == [line for line in second if json.loads(line)["step"] < 4]
    assert "run_header" in json.loads(after[72]) and json.loads(after[72])["run_header"]["resumed"] is True
    assert "dropped 24 lines at steps >= 4" in said, said

    df = load_trajectory(log_dir)
    sizes = df.groupby("run").size().to_dict()
    assert sizes["run"] == 48  # before the fix: 24
    assert sorted(set(df[df.run == "run"]["step"])) == [0, 2, 4, 6]
    assert sizes["run#2"] == 24 + len(after) - 73  # its rows before step 4, and every row written since
    assert sorted(set(df[df.run == "run#2"]["step"])) == [0, 2, 4, 6]


# --------------------------------------------------------------------------- damaged headers


def nul(line: bytes) -> bytes:
    return line[:60] + b"\x00" + line[61:]


@pytest.mark.parametrize("chunk", [64, 1 << 22], ids=["tiny_chunks", "default_chunks"])
@pytest.mark.parametrize("how", ["nul", "truncated", "oversized", "deleted"])
def test_resuming_the_first_run_never_cuts_a_run_behind_a_damaged_header(tmp_path, how, chunk):
    a_rows, b_rows = rows(range(0, 50, 5), 0.25), rows(range(0, 50, 5), 0.75)
    bad = {"nul": nul(header(B)), "truncated": header(B)[:70] + b"\n", "deleted": b"",
           "oversized": header(B, config={"pad": "x" * (17 << 20)})}[how]
    path = tmp_path / TRAJECTORY_FILENAME
    path.write_bytes(b"".join([header(A), *a_rows, bad, *b_rows]))

    cut = cut_run(path, 20, A, otherwise="none", chunk_size=chunk)

    kept_a = [r for r in a_rows if json.loads(r)["step"] < 20]
    assert path.read_bytes() == b"".join([header(A), *kept_a, bad, *b_rows])  # B whole, its header line too
    assert cut.found and cut.run_id == A and cut.dropped == len(a_rows) - len(kept_a) == 12
    line = 1 + len(a_rows) + 1
    kind = {"oversized": "long header", "deleted": "steps go back"}.get(how, "damaged header")
    assert [(e.line, e.kind) for e in cut.events] == [(line, kind)]


@pytest.mark.parametrize("how", ["nul", "oversized"])
def test_a_plain_resume_cuts_nothing_when_the_last_run_has_no_readable_header(tmp_path, how):
    """``watch(start_step=...)`` resumes the file's last run; when its header cannot be read, which run
    that is cannot be known: nothing is cut, and the cut says why (the sink's message)."""
    bad = nul(header(B)) if how == "nul" else header(B, config={"pad": "x" * (17 << 20)})
    data = b"".join([header(A), *rows(range(0, 50, 5), 0.25), bad, *rows(range(0, 50, 5), 0.75)])
    path = tmp_path / TRAJECTORY_FILENAME
    path.write_bytes(data)
    cut = cut_run(path, 20)
    assert path.read_bytes() == data
    assert cut.dropped == 0 and cut.run_id is None and not cut.found and cut.last_unreadable
    assert cut.events[0].line == 22


def test_a_resume_says_when_the_last_run_has_no_readable_header(tmp_path):
    """The real sink, resumed by ``watch(start_step=20)``: the message names the line, nothing is cut."""
    data = b"".join([header(A), *rows(range(0, 50, 5), 0.25), nul(header(B)), *rows(range(0, 50, 5), 0.75)])
    run = tmp_path / "run"
    run.mkdir()
    (run / TRAJECTORY_FILENAME).write_bytes(data)
    model = tiny_bert(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attn_probe.watch(model, log_dir=str(run), every=1, start_step=20, random_range=False).close()
    said = "\n".join(str(w.message) for w in caught)
    assert "resuming at step 20: the last run in" in said and "has no readable run header (the file holds a run " \
        "header that cannot be read at line 22 (not valid JSON))" in said, said
    assert (run / TRAJECTORY_FILENAME).read_bytes().startswith(data)  # nothing cut, the new run appended
    df = load_trajectory(run)
    assert df.groupby("run").size().to_dict()["run#2"] == 20  # B, whole


def test_one_run_id_in_two_concatenated_files_cuts_only_the_later_run(tmp_path):
    first, second = rows(range(0, 50, 5), 0.25), rows(range(0, 50, 5), 0.75)
    path = tmp_path / TRAJECTORY_FILENAME
    path.write_bytes(b"".join([header(A), *first, header(A), *second]))
    cut = cut_run(path, 20, A, otherwise="none")
    assert path.read_bytes() == b"".join([header(A), *first, header(A),
                                          *[r for r in second if json.loads(r)["step"] < 20]])
    assert cut.dropped == 12 and [(e.line, e.kind) for e in cut.events] == [(22, "duplicate id")]


# --------------------------------------------------------------------------- extra_config


@pytest.mark.parametrize("value, words", [
    (float("nan"), "extra_config['lr'] is nan: the run header is JSON, which has no NaN or infinity"),
    (float("-inf"), "extra_config['lr'] is -inf: the run header is JSON, which has no NaN or infinity"),
    ({"when": object()}, "extra_config['lr']['when'] is a object (<object object at"),
    ("x" * (300 << 10), "extra_config takes 307210 bytes as JSON, over the 262144 the run header holds"),
])
def test_extra_config_the_header_cannot_hold_is_one_line_at_attach(tmp_path, value, words):
    model = tiny_bert(0)
    with pytest.raises((ValueError, TypeError)) as err:
        attn_probe.watch(model, log_dir=str(tmp_path / "run"), every=1, extra_config={"lr": value})
    assert words in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_json_extra_config_is_stored_in_the_header(tmp_path):
    model = tiny_bert(0)
    probe = attn_probe.watch(model, log_dir=str(tmp_path), every=1, extra_config={"lr": 1e-3, "tags": ["a", None]})
    probe.close()
    head = json.loads((tmp_path / TRAJECTORY_FILENAME).read_bytes().splitlines()[0])
    assert head["run_header"]["config"]["lr"] == 1e-3 and head["run_header"]["config"]["tags"] == ["a", None]
