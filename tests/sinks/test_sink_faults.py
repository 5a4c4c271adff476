"""Sink faults: a disk that fills and frees again, a nearly full disk at resume, two writers in one dir.

The disk-full cases run on a real small filesystem: a tmpfs of 200 KB mounted by the test
(root only), and, everywhere, a write-failing variant: ``RLIMIT_FSIZE`` lowered in a
subprocess (writes past the limit fail with EFBIG, as a full disk fails them with ENOSPC).
Each scenario runs in a subprocess bounded by a timeout.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: helpers, tracker_servers
ROOT = os.path.dirname(TESTS)
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
EVERY, STEPS, FILL_AT, FREE_AT = 5, 300, 100, 250


@pytest.fixture
def tmpfs(tmp_path):
    """A 200 KB tmpfs mounted at ``tmp_path/disk`` (root only)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(disk)], capture_output=True,
                         text=True, timeout=30)
    if out.returncode != 0:
        pytest.fail(f"mounting a tmpfs failed although running as root: {out.stderr}")
    try:
        yield str(disk)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30)


ROOT_ONLY = pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root; the 'fsize' variant "
                               "covers the same code paths here")


COMMON = """
import errno, json, os, resource, sys, warnings
import torch
from transformers import BertConfig, BertForMaskedLM
import attn_probe

MODE, DISK = {mode!r}, {disk!r}

def tiny_bert(seed=0):
    torch.manual_seed(seed)
    return BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=12))

FILLER = os.path.join(DISK, "filler")
_, HARD = resource.getrlimit(resource.RLIMIT_FSIZE)

def fill(leave=0, limit=1):
    if MODE == "fsize":  # every write past `limit` bytes of a file fails (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, HARD))
        return
    fd = os.open(FILLER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    if leave:
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    os.close(fd)

def free():
    if MODE == "fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, (HARD, HARD))
    elif os.path.exists(FILLER):
        os.remove(FILLER)

def probe_warnings(record):
    return [str(w.message) for w in record if "attn_probe" in str(w.message)]
"""

DISK_FULL = COMMON + """
BACKGROUND, BORROWED = {background}, {borrowed}
log_dir = os.path.join(DISK, "run")
model = tiny_bert()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
writer = None
if BORROWED:
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(log_dir)
user_failures = 0
with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    kw = dict(writer=writer) if BORROWED else dict(log_dir=log_dir)
    probe = attn_probe.watch(model, optimizer=opt, every={every}, metrics=("symmetry", "directionality"),
                             background=BACKGROUND, **kw)
    for i in range(1, {steps} + 1):
        if i in ({fill_at}, {free_at}):
            probe.flush()  # what was taken before the change of disk state is on disk
            fill() if i == {fill_at} else free()
        ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(i))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()  # the probe snapshots here when due
        opt.zero_grad()
        if writer is not None:
            try:  # the user's own logging through the borrowed writer
                writer.add_scalar("loss", loss.item(), i)
            except OSError:
                user_failures += 1
    probe.flush()
    stats = [vars(s) for s in probe.sink_stats()]
    probe.close()
    if writer is not None:
        writer.close()
print("RESULT=" + json.dumps({{"step": probe.step, "warnings": probe_warnings(record), "stats": stats,
                               "files": sorted(os.listdir(log_dir)), "user_failures": user_failures}}))
"""


def outages_of(lost: list[int], taken: list[int]) -> list[list[int]]:
    """``lost`` split into runs of consecutive snapshots of ``taken`` (a snapshot delivered between
    two lost ones ends an outage)."""
    outages: list[list[int]] = []
    for step in lost:
        if outages and taken.index(step) == taken.index(outages[-1][-1]) + 1:
            outages[-1].append(step)
        else:
            outages.append([step])
    return outages


def steps_text(steps: list[int]) -> str:
    """How a warning names lost steps: one, up to four listed, or the first, the last and the count."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    if len(steps) <= 4:
        return "steps " + ", ".join(map(str, steps))
    return f"steps {steps[0]} to {steps[-1]} ({len(steps)} snapshots)"


def run_script(code, timeout=300):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return json.loads(out.stdout.rsplit("RESULT=", 1)[1])


def read_rows(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data.endswith(b"\n"), "a partial last line"
    return [json.loads(line) for line in data.decode().splitlines() if '"run_header"' not in line]


@pytest.mark.parametrize("mode,background,borrowed", [
    pytest.param("tmpfs", True, False, marks=ROOT_ONLY, id="tmpfs-background"),
    pytest.param("tmpfs", False, True, marks=ROOT_ONLY, id="tmpfs-inline-borrowed-writer"),
    pytest.param("fsize", True, False, id="fsize-background"),
])
def test_disk_full_then_freed_both_sinks_resume(tmp_path, request, mode, background, borrowed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from attn_probe.formats.events import truncate_torn_record

    if mode == "tmpfs":
        disk = request.getfixturevalue("tmpfs")
    else:
        disk = str(tmp_path / "disk")
        os.makedirs(disk)
    t0 = time.monotonic()
    res = run_script(DISK_FULL.format(mode=mode, disk=disk, background=background, borrowed=borrowed,
                                      every=EVERY, steps=STEPS, fill_at=FILL_AT, free_at=FREE_AT))
    log_dir = os.path.join(disk, "run")
    assert res["step"] == STEPS  # training went on through the fault
    taken = list(range(0, STEPS + 1, EVERY))
    stats = {s["sink"].split("(")[0]: s for s in res["stats"]}
    assert set(stats) == {"TensorBoardSink", "TrajectorySink"}
    msgs = res["warnings"]
    outages_told = 0
    for name, s in stats.items():
        lost = s["lost_steps"]
        # only snapshots taken while the disk was full are lost, and the sink is healthy again
        assert lost and set(lost) <= set(range(FILL_AT, FREE_AT)) and not s["failing"], (name, s)
        assert lost == sorted(set(lost)), lost
        assert s["delivered"] == len(taken) - len(lost) and s["dropped"] == 0
        # Some snapshots taken while the disk is full may still fit (tmpfs pages' slack, the load
        # of the machine decides how many): the lost steps are then several outages, and each is
        # told by a pair of warnings, when it stopped and when it resumed.
        outages = outages_of(lost, taken)
        mine = [m for m in msgs if f"logging to {name}" in m]
        assert len(mine) == 2 * len(outages), (mine, outages)
        for (stopped, resumed), outage in zip(zip(mine[::2], mine[1::2], strict=True), outages, strict=True):
            after = taken[taken.index(outage[-1]) + 1]  # the snapshot that got through again
            assert f"stopped at step {outage[0]}" in stopped, (stopped, outage)
            assert f"resumed at step {after}; lost {steps_text(outage)} while it failed" in resumed, (resumed, outage)
        outages_told += len(mine)
    assert len(msgs) == outages_told, msgs

    # the trajectory: every snapshot except the lost ones, whole lines only
    rows = read_rows(os.path.join(log_dir, "attn_probe.jsonl"))
    want = sorted(set(taken) - set(stats["TrajectorySink"]["lost_steps"]))
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps) and sorted(set(steps)) == want
    # 2 layers x 2 metrics each, and the random-matrix range once at step 0 (2 layers x 4)
    assert len(rows) == len(want) * 2 * 2 + 2 * 4
    # TensorBoard: a new event file after the dead one, no torn record left, every step at most once
    events = [f for f in res["files"] if "tfevents" in f]
    assert len(events) >= 2 and not [f for f in res["files"] if ".tmp" in f or "write_test" in f]
    assert all(truncate_torn_record(os.path.join(log_dir, f)) == 0 for f in events)
    ea = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    ea.Reload()
    tb_lost = stats["TensorBoardSink"]["lost_steps"]
    # the first lost snapshot of each outage may have part of its scalars written before the write failed
    tb_first = {outage[0] for outage in outages_of(tb_lost, taken)}
    for tag in ("attn_probe/self/symmetry/layer_00", "attn_probe/self/directionality/median"):
        got = [e.step for e in ea.Scalars(tag)]
        assert got == sorted(set(got)), tag
        assert set(taken) - set(tb_lost) <= set(got) <= set(taken) - (set(tb_lost) - tb_first), (tag, got)
    if borrowed:  # the reopened writer works for its owner again
        loss_steps = [e.step for e in ea.Scalars("loss")]
        assert set(range(FREE_AT, STEPS + 1)) <= set(loss_steps) and res["user_failures"] > 0
    assert time.monotonic() - t0 < 300


NEARLY_FULL = COMMON + """
log_dir = os.path.join(DISK, "run")
model = tiny_bert()
for start in (0, 0):  # a run, then one restarted at step 0 in the same directory (rows appended)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = attn_probe.Probe(model, log_dir=log_dir, every=None, metrics=("symmetry", "directionality"),
                             background=False)
    for step in range(start, 40):
        p.snapshot(step)
    p.close(final_snapshot=False)
path = os.path.join(log_dir, "attn_probe.jsonl")
before = open(path, "rb").read()
names = sorted(os.listdir(log_dir))
outcomes = []
for leave, limit in ((0, 1), (4096, 400)):  # full; a little room (the trajectory's rewrite does not fit)
    fill(leave=leave, limit=limit)
    try:
        attn_probe.Probe(model, log_dir=log_dir, every=None, start_step=30,
                         metrics=("symmetry", "directionality")).close(final_snapshot=False)
        outcomes.append("opened")
    except attn_probe.LogDirError as exc:
        outcomes.append("LogDirError: " + str(exc))
    except OSError as exc:
        outcomes.append("raw " + repr(exc))
    free()
    outcomes.append({{"unchanged": open(path, "rb").read() == before, "files": sorted(os.listdir(log_dir)),
                      "before": names}})
from attn_probe.formats.trajectory import cut_run, file_runs
first_run = file_runs(path)[0].run_id
fill(limit=400)
try:  # cutting the first of the two runs rewrites the file (the kept rows are not a prefix): that
    cut_run(path, 30, first_run)  # fails on the full disk, leaving no temporary file and the file untouched
    outcomes.append("rewritten")
except (OSError, attn_probe.LogDirError) as exc:
    outcomes.append("LogDirError: attn_probe cannot write its log directory (full) " + repr(exc))
free()
outcomes.append({{"unchanged": open(path, "rb").read() == before, "files": sorted(os.listdir(log_dir)),
                  "before": names}})
probe = attn_probe.Probe(model, log_dir=log_dir, every=None, start_step=30,  # room again: the resume works
                         metrics=("symmetry", "directionality"))
probe.snapshot(30)
probe.close(final_snapshot=False)
rows = [json.loads(line) for line in open(path) if '"run_header"' not in line]
print("RESULT=" + json.dumps({{"outcomes": outcomes, "steps": [r["step"] for r in rows]}}))
"""


@pytest.mark.parametrize("mode", [pytest.param("tmpfs", marks=ROOT_ONLY), "fsize"])
def test_nearly_full_disk_at_resume_is_a_log_dir_error_and_leaves_no_temporary_files(tmp_path, request, mode):
    if mode == "tmpfs":
        disk = request.getfixturevalue("tmpfs")
    else:
        disk = str(tmp_path / "disk")
        os.makedirs(disk)
    res = run_script(NEARLY_FULL.format(mode=mode, disk=disk))
    outcomes = res["outcomes"]
    for result, after in zip(outcomes[::2], outcomes[1::2], strict=True):
        assert result.startswith("LogDirError: attn_probe cannot write its log directory"), result
        assert "full" in result or "File too large" in result, result
        assert after["unchanged"], "the trajectory was modified by a resume that failed"
        assert after["files"] == after["before"], after  # no temporary file, no new event file, no lock file
    # the resume (no run id: the file's last run) cuts only the second run at step 30; the first
    # run's rows are all kept (0..39), then the second run's before 30, then the resumed step
    per_step = 4  # 2 layers x 2 metrics
    first = per_step + 2 * 4  # each fresh run's step 0 also holds the random-matrix range (2 layers x 4)
    assert res["steps"] == ([0] * first + [s for s in range(1, 40) for _ in range(per_step)]
                            + [0] * first + [s for s in range(1, 30) for _ in range(per_step)] + [30] * per_step)


HOLDER = """
import sys, time
import torch
from transformers import BertConfig, BertForMaskedLM
import attn_probe
torch.manual_seed(0)
model = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=12))
try:
    probe = attn_probe.Probe(model, log_dir=sys.argv[1], every=None, metrics=("symmetry",))
except attn_probe.LogDirError as exc:
    print("REFUSED " + type(exc).__name__ + ": " + str(exc), flush=True)
    sys.exit(3)
probe.snapshot(0)
print("HOLDING", flush=True)
sys.stdin.readline()  # hold the directory until told to go
probe.close(final_snapshot=False)
print("CLOSED", flush=True)
"""


def test_two_processes_with_one_log_dir(tmp_path):
    log_dir = str(tmp_path / "shared")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-c", HOLDER, log_dir]
    first = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=ROOT)
    try:
        line = first.stdout.readline()
        assert line.startswith("HOLDING"), line + first.stderr.read()[-3000:]
        second = subprocess.run(cmd, input="", capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
        assert second.returncode == 3, second.stdout + second.stderr[-3000:]
        assert "REFUSED LogDirInUseError" in second.stdout and f"pid {first.pid}" in second.stdout
        out, err = first.communicate("go\n", timeout=120)
        assert first.returncode == 0 and "CLOSED" in out, err[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    third = subprocess.run(cmd, input="go\n", capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert third.returncode == 0 and "CLOSED" in third.stdout, third.stderr[-3000:]  # free after the first ended
    rows = [json.loads(line) for line in open(os.path.join(log_dir, "attn_probe.jsonl")) if '"run_header"' not in line]
    # first and third wrote (2 layers, and the random-matrix range: 2 layers x 2); the refused one did not
    assert [r["step"] for r in rows] == [0] * 12


def test_default_directories_are_unique_and_a_named_one_is_refused(tmp_path, monkeypatch):
    import torch
    from helpers import tiny_model

    import attn_probe
    from attn_probe.formats.logdir import LogDirInUseError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("attn_probe.live.stages.outputs.default_log_dir", lambda: os.path.join("runs", "same_second_host"))
    torch.manual_seed(0)
    model = tiny_model("bert", None)
    a = attn_probe.Probe(model, every=None, metrics=("symmetry",))
    b = attn_probe.Probe(model, every=None, metrics=("symmetry",))
    assert a.log_dir != b.log_dir and {os.path.basename(a.log_dir), os.path.basename(b.log_dir)} == {
        "same_second_host", "same_second_host_1"}
    with pytest.raises(LogDirInUseError):  # a directory the user named is refused, not renamed
        attn_probe.Probe(model, log_dir=a.log_dir, every=None)
    a.close(), b.close()
    attn_probe.Probe(model, log_dir=a.log_dir, every=None, start_step=1).close()  # free after close
