"""The paper's figure is the first chart a browser shows in TensorBoard's Custom Scalars.

A real ``tensorboard`` server on a free localhost port serves a demo-like log directory (an
encoder and a decoder run written by the probe, and the paper's matching runs written by the
demo); headless Chromium loads the dashboard (``benchmarks/tensorboard_screenshot.py``) and the
charts are read in the order they appear on the page. Skipped without a Chromium-like browser
(Debian: ``apt-get install chromium``) or the ``websockets`` package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import tiny_model

import attn_probe

pytest.importorskip("websockets")
pytest.importorskip("tensorboard")

ROOT = Path(__file__).resolve().parents[2]


def _screenshot_module():
    spec = importlib.util.spec_from_file_location("tensorboard_screenshot", ROOT / "benchmarks" /
                                                  "tensorboard_screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _probe_run(log_dir: Path, seed: int) -> None:
    model = tiny_model("bert", seed, vocab_size=30, max_position_embeddings=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with attn_probe.watch(model, optimizer=opt, log_dir=str(log_dir), every=1):
        for i in range(3):
            ids = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(i))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()


def test_the_papers_figure_is_the_first_chart_in_the_browser(tmp_path):
    shot = _screenshot_module()
    if shot.find_browser() is None:
        pytest.skip("no Chromium-like browser installed")
    root = tmp_path / "demo"
    _probe_run(root / "encoder", 0)
    _probe_run(root / "decoder", 1)
    from attn_probe.demo.reference import matching_runs, write_paper_runs

    runs = matching_runs(["encoder", "decoder"], 2, "chars")
    if runs:  # the paper's runs beside the models, as the demo writes them
        write_paper_runs(root, runs, ["self"], 3)
    png = tmp_path / "custom_scalars.png"
    charts = shot.custom_scalars_charts(root, png, timeout=60)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert charts, "the dashboard showed no chart"
    first = charts[0]
    assert (first["title"], first["kind"]) == ("symmetry: median across layers (q25-q75)", "Margin")
    assert first["svg"] > 0  # it drew
    assert sum(c["title"] == first["title"] for c in charts) == 1
