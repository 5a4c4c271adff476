"""Every script in examples/ runs, in its tiny mode (ATTN_PROBE_EXAMPLE_TINY=1), in a temporary directory."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script, tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.setenv("ATTN_PROBE_EXAMPLE_TINY", "1")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)  # restored after the script sets it
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script)])
    runpy.run_path(str(script), run_name="__main__")
    if script.stem == "emergent_dynamics":
        out = capsys.readouterr().out
        root = tmp_path / "runs" / "example"
        assert (root / "dynamics.png").is_file() and "figure: runs/example/dynamics.png" in out
        for kind in ("encoder", "decoder"):
            assert (root / kind / "attn_probe.jsonl").stat().st_size > 0
            tags = _scalar_tags(root / kind)
            # the Trainer's loss curves and the probe's scores in one TensorBoard run, as in the demo
            assert {"train/loss", "train/learning_rate"} <= tags, sorted(tags)
            assert "attn_probe/self/symmetry/median" in tags, sorted(tags)
            assert not list((root / kind / "trainer").glob("runs/*")), "the Trainer logged elsewhere"


def _scalar_tags(run_dir: Path) -> set[str]:
    """Every scalar tag in the event files of ``run_dir`` (not its subdirectories)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return set(acc.Tags()["scalars"])
