"""A real ``tensorboard`` server serves the probe's scalars and custom_scalars layout."""

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import torch
from helpers import stop_process_group, tiny_model

import attn_probe
from attn_probe.formats.tags import scalar_tag

VOCAB, SEQ = 50, 12
STARTUP_TIMEOUT_S = 90


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(base, path, **params):
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read().decode())


@pytest.fixture
def probe_run(tmp_path):
    model = tiny_model("bert", 0, vocab_size=VOCAB, max_position_embeddings=SEQ)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log_dir = tmp_path / "logs" / "run1"
    with attn_probe.watch(model, optimizer=opt, log_dir=str(log_dir), every=2, per_head=True):
        for i in range(4):
            ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(i))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    return tmp_path / "logs"


@pytest.fixture
def server(probe_run):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(probe_run), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop_process_group(proc, timeout=15)  # the server and its children


def wait_for_tags(base, proc, wanted):
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    last_error = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tensorboard exited early: {proc.stderr.read().decode()[-2000:]}")
        try:
            tags = get_json(base, "/data/plugin/scalars/tags")
            if wanted <= set(tags.get("run1", {})):
                return tags["run1"]
        except OSError as exc:  # not listening yet
            last_error = exc
        time.sleep(0.5)
    pytest.fail(f"tensorboard did not serve the probe's tags within {STARTUP_TIMEOUT_S} s ({last_error})")


def test_server_serves_scalars_and_layout(server):
    base, proc = server
    wanted = {scalar_tag("self", "symmetry", layer=0), scalar_tag("self", "directionality", stat="median"),
              scalar_tag("self", "symmetry", layer=1, head=3)}
    tags = wait_for_tags(base, proc, wanted)
    assert all(t.startswith("attn_probe/") for t in tags)

    points = get_json(base, "/data/plugin/scalars/scalars", run="run1", tag=scalar_tag("self", "symmetry", layer=0))
    assert [step for _, step, _ in points] == [0, 2, 4]

    layout = get_json(base, "/data/plugin/custom_scalars/layout")
    categories = {c["title"]: c for c in layout["category"]}
    # the paper's figure alone first, the scores, the norms
    assert [c["title"] for c in layout["category"]] == [
        "attn_probe/self: symmetry, the paper's figure", "attn_probe/self", "attn_probe/self/norms"]
    category = categories["attn_probe/self"]
    charts = {c["title"]: c for c in category["chart"]}
    (paper,) = categories["attn_probe/self: symmetry, the paper's figure"]["chart"]
    assert paper["title"] == "symmetry: median across layers (q25-q75)"
    margin = paper["margin"]["series"][0]
    assert (margin["value"], margin["lower"], margin["upper"]) == (
        "attn_probe/self/symmetry/median", "attn_probe/self/symmetry/q25", "attn_probe/self/symmetry/q75")
    (regex,) = charts["directionality: per layer"]["multiline"]["tag"]
    import re

    matched = sorted(t for t in tags if re.match(regex, t))
    assert matched == [scalar_tag("self", "directionality", layer=i) for i in (0, 1)]
