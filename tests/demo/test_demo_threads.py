"""The demo's CPU count and thread choice: crafted cgroup files and affinities, and the real machine."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from attn_probe import demo


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _proc(tmp_path, text):
    path = tmp_path / "proc_self_cgroup"
    path.write_text(text + "\n")
    return path


def test_cgroup_v2_quota(tmp_path):
    root = tmp_path / "cg"
    _write(root / "cpu.max", "150000 100000")
    assert demo.cgroup_cpu_quota(root, _proc(tmp_path, "0::/")) == pytest.approx(1.5)
    _write(root / "cpu.max", "max 100000")
    assert demo.cgroup_cpu_quota(root, _proc(tmp_path, "0::/")) is None


def test_cgroup_v2_limit_of_a_parent_applies(tmp_path):
    root = tmp_path / "cg"
    _write(root / "a" / "b" / "cpu.max", "max 100000")
    _write(root / "a" / "cpu.max", "300000 100000")
    _write(root / "cpu.max", "max 100000")
    assert demo.cgroup_cpu_quota(root, _proc(tmp_path, "0::/a/b")) == pytest.approx(3.0)
    _write(root / "a" / "b" / "cpu.max", "50000 100000")  # the smallest limit on the path wins
    assert demo.cgroup_cpu_quota(root, _proc(tmp_path, "0::/a/b")) == pytest.approx(0.5)


@pytest.mark.parametrize("mount", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_quota(tmp_path, mount):
    root = tmp_path / "cg"
    proc = _proc(tmp_path, "4:memory:/x\n2:cpuacct:/\n1:cpu:/")
    _write(root / mount / "cpu.cfs_quota_us", "200000")
    _write(root / mount / "cpu.cfs_period_us", "100000")
    assert demo.cgroup_cpu_quota(root, proc) == pytest.approx(2.0)
    _write(root / mount / "cpu.cfs_quota_us", "-1")  # no limit
    assert demo.cgroup_cpu_quota(root, proc) is None


def test_no_cgroup_files_no_quota(tmp_path):
    assert demo.cgroup_cpu_quota(tmp_path / "missing", tmp_path / "missing_proc") is None


def test_budget_counts_affinity_and_quota(tmp_path):
    root = tmp_path / "cg"
    _write(root / "cpu.max", "250000 100000")
    proc = _proc(tmp_path, "0::/")
    b = demo.cpu_budget(affinity=range(16), cgroup_root=root, proc_cgroup=proc, load=0.5)
    assert (b.affinity, b.quota, b.cpus, b.load) == (16, 2.5, 2, 0.5)  # floor(min(16, 2.5))
    b = demo.cpu_budget(affinity=[3], cgroup_root=root, proc_cgroup=proc, load=0.0)
    assert b.cpus == 1  # the affinity is the smaller limit
    assert "1 CPU available (affinity 1, cgroup quota 2.5 CPUs), load average 0.00" == b.describe()


def test_budget_of_this_machine():
    """Against other counters of the same facts: nproc (the affinity) and /proc/loadavg."""
    b = demo.cpu_budget()
    nproc = shutil.which("nproc")
    if nproc:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_THREAD_LIMIT")}
        assert b.affinity == int(subprocess.run([nproc], capture_output=True, text=True, env=env).stdout)
    if os.path.exists("/proc/loadavg"):
        before = float(open("/proc/loadavg").read().split()[0])
        after = float(open("/proc/loadavg").read().split()[0])
        b = demo.cpu_budget()
        assert min(before, after) - 1 <= b.load <= max(before, after) + 1


@pytest.mark.parametrize(
    ("affinity", "quota", "load", "given", "threads", "concurrent", "words"),
    [
        (2, None, 0.0, None, 1, True, ["at most two CPUs", "2 free cores", "same time"]),
        # busy: still at the same time, one thread each (a larger share of the shared CPUs)
        (2, None, 1.2, None, 1, True, ["at most two CPUs", "1 free core:", "same time", "busy machine"]),
        (2, None, 3.7, None, 1, True, ["0 free cores", "same time"]),
        (16, 4.0, 0.3, None, 2, True, ["cgroup quota 4 CPUs", "4 free cores"]),  # 4 threads alone, 2 each at once
        (16, None, 20.0, None, 1, True, ["above the 16 CPUs", "0 free cores"]),
        (8, None, 3.0, None, 2, True, ["5 free cores"]),  # 8 alone; 5 // 2 = 2 each at once
        (8, None, 7.0, None, 1, True, ["1 free core:"]),  # 8 alone; 1 each at once
        (16, None, 0.0, 3, 3, True, ["--threads 3"]),  # given threads are kept
        (1, None, 0.0, None, 1, False, ["1 CPU, fewer than the 2 models", "one after the other"]),
    ],
)
def test_plan(affinity, quota, load, given, threads, concurrent, words):
    budget = demo.CpuBudget(affinity, quota, load)
    plan = demo.plan_threads(budget, models=2, threads=given, default_threads=16)
    assert (plan.threads, plan.concurrent) == (threads, concurrent)
    assert plan.reason.startswith(budget.describe())
    for w in words:
        assert w in plan.reason, (w, plan.reason)


def test_plan_threads_alone_and_forced():
    idle = demo.CpuBudget(8, None, 0.0)
    alone = demo.plan_threads(idle, models=1, default_threads=4)
    assert (alone.threads, alone.concurrent) == (4, False)  # torch's own choice, within the 8 CPUs
    busy = demo.CpuBudget(2, None, 6.0)
    forced = demo.plan_threads(busy, models=2, concurrent=True, default_threads=2)
    assert forced.concurrent and forced.threads == 1 and "--concurrent" in forced.reason
    seq = demo.plan_threads(idle, models=2, concurrent=False, default_threads=4)
    assert not seq.concurrent and seq.threads == 4 and "--sequential" in seq.reason
    no_load = demo.CpuBudget(4, None, None)  # no load average on this OS: counts as idle
    assert demo.plan_threads(no_load, models=2, default_threads=4).threads == 2


def test_the_demo_prints_and_applies_its_choice(tmp_path, capsys):
    pytest.importorskip("transformers")
    cfg = demo.DemoConfig(size="tiny", steps=2, batch_size=2, seq_len=16, every=1, vocab_size=200,
                          max_chars=20_000, models=("encoder",), figure=False, progress=False,
                          out_dir=str(tmp_path), name="t")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        result = demo.run_demo(cfg, budget=demo.CpuBudget(2, None, 5.0))
        assert torch.get_num_threads() == 1  # what the encoder trained with
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert "threads: 2 CPUs available (affinity 2, no cgroup CPU quota), load average 5.00: one thread" in out
    assert result.plan == demo.plan_threads(demo.CpuBudget(2, None, 5.0), models=1)
