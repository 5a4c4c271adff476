"""Cutting ``attn_probe.jsonl`` back to a resume step in constant memory (``formats.trajectory.cut_run``).

The large case writes a real 1 GB trajectory and cuts it in a child process that loads
``attn_probe/formats/trajectory.py`` (and ``logdir.py``) without the package's ``__init__``
(stdlib only, no torch), under an address-space limit, with
its peak resident memory and its time measured; the file is deleted afterwards. Small cases
compare the result with an independent reference (every line parsed with ``json``), at the
default chunk size and at tiny ones (the documented ``chunk_size=``/``max_line=`` parameters).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import attn_probe
from attn_probe.formats.logdir import LogDirError, LogDirLock, check_log_dir
from attn_probe.formats.trajectory import MAX_LINE, cut_trajectory

PACKAGE_DIR = Path(attn_probe.__file__).resolve().parent


def line(step: int, layer: int = 0, head: int | None = None, metric: str = "symmetry") -> bytes:
    """One line as the trajectory sink writes it."""
    return (json.dumps({"step": step, "wall_time": 1732280000.125, "group": "self", "layer": layer,
                        "head": head, "metric": metric, "value": 0.4123456789}) + "\n").encode()


def reference(data: bytes, resume_step: int) -> tuple[bytes, int]:
    """What the cut must leave, and how many lines go: every complete line parsed with json."""
    kept, dropped = [], 0
    for raw in data.splitlines(keepends=True):
        try:
            step = json.loads(raw)["step"] if raw.endswith(b"\n") else None
        except (ValueError, KeyError, TypeError):
            step = None
        if isinstance(step, int) and not isinstance(step, bool) and step < resume_step:
            kept.append(raw)
        else:
            dropped += 1
    return b"".join(kept), dropped


def snapshot(step: int) -> bytes:
    return b"".join(line(step, la, h, m) for la in range(3) for h in (None, 0, 1)
                    for m in ("symmetry", "directionality"))


@pytest.mark.parametrize("chunk", [64, 1 << 22], ids=["tiny_chunks", "default_chunks"])
@pytest.mark.parametrize("case", ["prefix", "torn_tail", "reused_log_dir", "corrupt_lines", "nothing_to_cut",
                                  "all_dropped", "overlong_line"])
def test_cut_matches_a_json_reference(tmp_path, chunk, case):
    max_line = MAX_LINE
    data = b"".join(snapshot(s) for s in range(0, 50, 5))
    if case == "torn_tail":
        data += line(50)[:30]
    elif case == "reused_log_dir":  # a second run appended from step 0 after the first one
        data += b"".join(snapshot(s) for s in range(0, 30, 5))
    elif case == "corrupt_lines":
        data = snapshot(0) + b"garbage\n" + snapshot(5) + b'{"wall_time": 1, "step": 7}\n' + line(8)[:40] + \
            b"\n" + b"\n" + snapshot(30) + b'{"step": "x"}\n' + snapshot(10)
    elif case == "overlong_line":
        max_line = 1000
        data = snapshot(0) + b'{"step": 1, "pad": "' + b"x" * 5000 + b'"}\n' + snapshot(5) + snapshot(40)
    path = tmp_path / "attn_probe.jsonl"
    path.write_bytes(data)
    resume = {"nothing_to_cut": 1000, "all_dropped": 0}.get(case, 20)
    inode = path.stat().st_ino
    want, want_dropped = reference(data, resume)
    if case == "reused_log_dir":  # only the last run is resumed: the first one is kept whole (issue 35)
        first = b"".join(snapshot(s) for s in range(0, 50, 5))
        want, want_dropped = reference(data[len(first):], resume)
        want = first + want
    if case == "overlong_line":  # json reads the long line; the cut drops it unread (over max_line)
        want, want_dropped = snapshot(0) + snapshot(5), 1 + snapshot(40).count(b"\n")
    assert cut_trajectory(path, resume, chunk_size=chunk, max_line=max_line) == want_dropped
    assert path.read_bytes() == want
    if case in ("prefix", "torn_tail", "nothing_to_cut", "all_dropped"):
        assert path.stat().st_ino == inode  # cut in place: no second copy, no free space needed
    assert [p.name for p in tmp_path.iterdir()] == ["attn_probe.jsonl"]  # no temporary file left


def test_missing_file_is_nothing_to_cut(tmp_path):
    assert cut_trajectory(tmp_path / "attn_probe.jsonl", 10) == 0
    assert not (tmp_path / "attn_probe.jsonl").exists()


def test_failures_are_log_dir_errors(tmp_path):
    (tmp_path / "attn_probe.jsonl").mkdir()  # a directory where the file should be
    with pytest.raises(LogDirError, match=r"cannot cut its trajectory file .* resume step 10: "):
        cut_trajectory(tmp_path / "attn_probe.jsonl", 10)


CHILD = textwrap.dedent("""
    import importlib, json, resource, signal, sys, time, types
    package = types.ModuleType("attn_probe")  # the package without its __init__ (no torch)
    package.__path__ = [sys.argv[1]]
    sys.modules["attn_probe"] = package
    fmt = importlib.import_module("attn_probe.formats.trajectory")
    mode, path, resume = sys.argv[2], sys.argv[3], int(sys.argv[4])

    def status(key):
        for row in open("/proc/self/status"):
            if row.startswith(key + ":"):
                return int(row.split()[1]) * 1024

    if mode == "memory":
        limit = status("VmSize") + (256 << 20)  # the whole process may grow by 256 MiB at most
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    else:  # "fsize": no file may grow past 64 KiB (the temporary copy fails with EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak resident size
    start_rss = status("VmRSS")
    t0 = time.monotonic()
    try:
        dropped = fmt.cut_trajectory(path, resume)
        error = None
    except Exception as exc:
        dropped, error = None, f"{type(exc).__name__}: {exc}"
    print(json.dumps({"dropped": dropped, "error": error, "seconds": time.monotonic() - t0,
                      "peak_growth": status("VmHWM") - start_rss}))
""")


def run_child(mode: str, path: Path, resume: int, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(PACKAGE_DIR), mode, str(path), str(resume)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_1gb_trajectory_is_cut_in_constant_memory_and_bounded_time(tmp_path):
    """126k-step-sized file: the old list-of-lines cut needed ~1.4 GiB more RSS and raised a bare
    MemoryError under this limit."""
    if shutil.disk_usage(tmp_path).free < (3 << 30):
        pytest.skip("needs 3 GB of free disk")
    path = tmp_path / "attn_probe.jsonl"
    template = snapshot(123456789)  # 18 lines per snapshot, one for every step
    per_step = {}
    size, step = 0, 0
    resume, cut_at = 40_000, None
    try:
        with open(path, "wb", buffering=1 << 22) as fh:
            while size < (1 << 30):
                block = template.replace(b"123456789", str(step).encode())
                if step == resume:
                    cut_at = size
                per_step[len(block)] = per_step.get(len(block), 0) + 1
                fh.write(block)
                size += len(block)
                step += 1
        lines_after = (step - resume) * template.count(b"\n")
        result = run_child("memory", path, resume, timeout=300)
        assert result["error"] is None, result
        assert result["dropped"] == lines_after
        assert path.stat().st_size == cut_at
        with open(path, "rb") as fh:  # the new end is the last line of step resume - 1
            fh.seek(cut_at - len(template) - 64)
            tail = fh.read()
        assert tail.endswith(b"\n") and json.loads(tail.splitlines()[-1])["step"] == resume - 1
        assert result["peak_growth"] < (64 << 20), result  # a few 4 MiB chunks, not the file
        assert result["seconds"] < 120, result  # ~6 s measured on a busy 2-core machine
    finally:
        path.unlink(missing_ok=True)


def test_a_failed_rewrite_leaves_the_file_and_no_temporary_file(tmp_path):
    """The last run (A, resumed once) is cut at 20, and run B between its parts is kept: a rewrite;
    the copy fails (EFBIG)."""
    from attn_probe.formats.trajectory import encode_header

    path = tmp_path / "attn_probe.jsonl"
    data = (encode_header("a" * 32, 0, wall_time=1.0) + b"".join(snapshot(s) for s in range(40))
            + encode_header("b" * 32, 0, wall_time=2.0) + b"".join(snapshot(s) for s in range(10))
            + encode_header("a" * 32, 40, wall_time=3.0, resumed=True) + snapshot(40))
    path.write_bytes(data)
    result = run_child("fsize", path, 20, timeout=60)
    assert result["dropped"] is None
    assert result["error"].startswith("LogDirError: attn_probe cannot cut its trajectory file")
    assert "resume step 20" in result["error"]
    assert path.read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["attn_probe.jsonl"]


def test_the_trajectory_sink_resumes_through_the_streaming_cut(tmp_path):
    from attn_probe.sinks import RunInfo
    from attn_probe.sinks.trajectory import TrajectorySink

    (tmp_path / "attn_probe.jsonl").mkdir()  # unusable: the sink must say so as a LogDirError
    sink = TrajectorySink(str(tmp_path))
    info = RunInfo({}, {}, ["self"], ["symmetry"], False)
    info.resume_step = 10
    # refused when the sink takes the file's lock, before the cut (issue 44: one writer a file)
    with pytest.raises(LogDirError, match="cannot write its trajectory file .*Is a directory"):
        sink.start(info)


@pytest.mark.parametrize("url", ["s3://bucket/runs/x", "gs://b/r", "file:///tmp/x", "runs/http://x"])
def test_a_url_log_dir_is_a_log_dir_error(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LogDirError, match=r"looks like a URL \(it contains '://'\)"):
        check_log_dir(url)
    with pytest.raises(LogDirError, match="looks like a URL"):
        LogDirLock(url).acquire()
    assert list(tmp_path.iterdir()) == []  # nothing created locally
