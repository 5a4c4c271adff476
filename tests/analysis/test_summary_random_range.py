"""`attn-probe summary` / :func:`summarize` with the random-matrix range a run logged: the range is
a column beside the score it describes, not a score of its own."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from helpers import SEQ, VOCAB, tiny_llama

import attn_probe

REPO = Path(__file__).resolve().parents[2]


def train(log_dir: Path, **options) -> None:
    model = tiny_llama(vocab=VOCAB, seq=SEQ, layers=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attn_probe.watch(model, optimizer=opt, log_dir=str(log_dir), every=2, **options):
        for i in range(4):
            ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(i))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()


def logged(run: Path, metric: str) -> list[float]:
    with open(run / "attn_probe.jsonl") as f:
        rows = [json.loads(line) for line in f if '"run_header"' not in line]
    return [r["value"] for r in rows if r["metric"] == metric and r["head"] is None]


def test_summary_shows_the_random_range_beside_each_score(tmp_path):
    run = tmp_path / "run"
    train(run, per_head=True)
    table = attn_probe.summarize(run)
    assert not any(m.startswith("random_") for m in table["metric"])  # not scores of their own
    for metric in ("symmetry", "directionality"):
        row = table[table["metric"] == metric].iloc[0]
        assert row["random_mean"] == statistics.median(logged(run, f"random_{metric}"))
        assert row["random_sd"] == statistics.median(logged(run, f"random_{metric}_sd"))
    others = table[~table["metric"].isin(["symmetry", "directionality"])]
    assert others["random_mean"].isna().all()  # no range for the magnitudes
    out = subprocess.run([sys.executable, "-m", "attn_probe", "summary", str(run)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert "random W_qk" in out.stdout and "random_symmetry" not in out.stdout
    sym = next(line for line in out.stdout.splitlines() if " symmetry " in f" {line} ")
    want = table[table["metric"] == "symmetry"].iloc[0]
    assert f"{want['random_mean']:+.3f} ± {want['random_sd']:.3f}" in sym


def test_summary_without_the_range_has_no_random_column(tmp_path):
    run = tmp_path / "run"
    train(run, random_range=False)
    table = attn_probe.summarize(run)
    assert "random_mean" not in table.columns
    assert "random W_qk" not in attn_probe.analysis.summary.format_summary(table)
