"""The live view as a user meets it: the TensorBoard command the probe prints, run as printed.

A real ``tensorboard`` server is started with exactly the printed command line (under the default
``--load_fast`` and with ``--load_fast=false``) on a run of more than 1,000 snapshots, and every
point of a probe tag must come back from the scalars endpoint, the Time Series endpoint the
default dashboard uses, and the custom-scalars charts of the probe's layout.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
from helpers import stop_process_group, tiny_model

import attn_probe
from attn_probe.formats.tags import scalar_tag
from attn_probe.sinks.live_view import SCALARS_PER_TAG, figure_url, run_command, tensorboard_command

SNAPSHOTS = 1_500  # above TensorBoard's default of 1,000 points per tag
STARTUP_TIMEOUT_S = 180


def test_the_command_keeps_points_and_quotes_the_directory():
    assert SCALARS_PER_TAG >= 100_000 and SCALARS_PER_TAG < 2**63 - 1
    assert tensorboard_command("runs/a b") == f"tensorboard --logdir 'runs/a b' --samples_per_plugin scalars={SCALARS_PER_TAG}"


def test_a_runs_command_names_the_directory_holding_it(tmp_path, monkeypatch):
    """TensorBoard names a run by its path under --logdir: the run directory itself would be '.'."""
    tail = f" --samples_per_plugin scalars={SCALARS_PER_TAG}"
    assert run_command("out/runs/Nov23") == "tensorboard --logdir out/runs" + tail
    assert run_command("out/runs/Nov23/") == "tensorboard --logdir out/runs" + tail
    assert run_command("run") == "tensorboard --logdir ." + tail
    monkeypatch.chdir(tmp_path)
    assert run_command(".") == f"tensorboard --logdir {shlex.quote(str(tmp_path.parent))}" + tail
    assert figure_url() == "http://localhost:6006/#custom_scalars"


@pytest.fixture(scope="module")
def long_run(tmp_path_factory) -> tuple[Path, str]:
    """A real probe run of 1,501 snapshots (step 0 and 1..1,500) and the command it printed."""
    import contextlib
    import io

    torch.manual_seed(0)
    model = tiny_model("bert", None, vocab_size=30, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                       max_position_embeddings=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    log_dir = tmp_path_factory.mktemp("live view") / "run one"  # spaces: the command must quote them
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        probe = attn_probe.watch(model, optimizer=opt, log_dir=str(log_dir), every=1, metrics=["symmetry"])
    with probe:
        query = model.bert.encoder.layer[0].attention.self.query.weight
        for _ in range(SNAPSHOTS):
            with torch.no_grad():
                query.mul_(1.001)  # the values move, so each point is a real snapshot
            opt.step()
    (printed,) = re.findall(r"\(live view: (.*)\)", err.getvalue())
    return log_dir, printed


def post_form(url: str, **fields: str) -> object:
    data = urllib.parse.urlencode(fields).encode()
    req = urllib.request.Request(url, data=data, headers={"X-XSRF-Protected": "1"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read().decode())


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read().decode())


@pytest.mark.parametrize("extra", ["", " --load_fast=false"], ids=["load_fast_default", "load_fast_false"])
def test_printed_command_serves_every_point(long_run, extra):
    log_dir, printed = long_run
    assert printed == tensorboard_command(log_dir.parent)  # the run is served under its own name
    run = log_dir.name
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.Popen(printed + extra, shell=True, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)
    try:
        base = read_url(proc)
        tag = scalar_tag("self", "symmetry", layer=0)
        steps = list(range(SNAPSHOTS + 1))

        points = poll(lambda: get_json(f"{base}/data/plugin/scalars/scalars?" +
                                       urllib.parse.urlencode({"run": run, "tag": tag})), len(steps))
        assert [p[1] for p in points] == steps
        values = [p[2] for p in points]
        assert values[-1] != values[0]

        def time_series():
            (series,) = post_form(f"{base}/data/plugin/timeseries/timeSeries",
                                  requests=json.dumps([{"plugin": "scalars", "tag": tag}]))
            return series["runToSeries"].get(run, [])

        assert [p["step"] for p in poll(time_series, len(steps))] == steps

        layout = get_json(f"{base}/data/plugin/custom_scalars/layout")
        charts = [chart for category in layout["category"] for chart in category["chart"]]
        margin = next(c["margin"]["series"][0] for c in charts if "margin" in c)
        regex = next(c["multiline"]["tag"][0] for c in charts if "multiline" in c and "symmetry" in c["title"])
        for wanted in (margin["value"], margin["lower"], regex):
            data = get_json(f"{base}/data/plugin/custom_scalars/scalars?" +
                            urllib.parse.urlencode({"run": run, "tag": wanted}))
            assert data["regex_valid"]
            assert data["tag_to_events"], wanted
            for events in data["tag_to_events"].values():
                assert [e[1] for e in events] == steps
    finally:
        stop_process_group(proc)  # the server and its children


def read_url(proc: subprocess.Popen) -> str:
    """The address TensorBoard prints once it listens (it scans from port 6006 when none is given)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            pytest.fail("tensorboard exited: " + "".join(seen)[-2000:])
        seen.append(line)
        match = re.search(r"(http://\S+?)/? \(Press CTRL\+C", line)
        if match:
            return match.group(1).rstrip("/")
    pytest.fail("tensorboard printed no address: " + "".join(seen)[-2000:])


def poll(fetch, want: int) -> list:
    """``fetch()`` until it returns ``want`` points (the server loads event files in the background)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    got: list = []
    while time.monotonic() < deadline:
        try:
            got = fetch()
        except OSError:
            got = []
        if len(got) >= want:
            return got
        time.sleep(1)
    pytest.fail(f"served {len(got)} of {want} points within {STARTUP_TIMEOUT_S} s")
