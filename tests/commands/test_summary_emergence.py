"""``attn-probe summary``'s emergence events: in ``--format csv`` (read back with the ``csv``
module), and for runs written by ``attn-probe score --trajectory`` (their header now holds the
layer shapes, so the random range, and the events, can be computed for them)."""

from __future__ import annotations

import csv
import io
import json

import pytest
import torch
from helpers import tiny_bert

pytest.importorskip("pandas")

from attn_probe.cli import main  # noqa: E402
from attn_probe.formats.trajectory import TRAJECTORY_FILENAME  # noqa: E402

STEPS = list(range(0, 300, 10))  # 30 logged steps
MEAN, SD = 0.01, 0.02  # 3 sd = 0.06


def write_run(run_dir, jump_at):
    """Three layers whose symmetry jumps from the mean to 0.5 at ``jump_at[layer]`` (``None``: never);
    directionality stays at the mean; a spectral norm (no random range)."""
    run_dir.mkdir(parents=True)
    with open(run_dir / TRAJECTORY_FILENAME, "w") as fh:
        def row(step, layer, metric, value):
            fh.write(json.dumps({"step": step, "wall_time": 0.0, "group": "self", "layer": layer, "head": None,
                                 "metric": metric, "value": value}) + "\n")
        for layer in jump_at:
            for metric in ("symmetry", "directionality"):
                row(0, layer, f"random_{metric}", MEAN)
                row(0, layer, f"random_{metric}_sd", SD)
        for step in STEPS:
            for layer, at in jump_at.items():
                row(step, layer, "symmetry", 0.5 if at is not None and step >= at else MEAN)
                row(step, layer, "directionality", MEAN)
                row(step, layer, "spectral_norm", 1.0 + step)


def test_summary_csv_has_the_median_layers_events(tmp_path, capsys):
    write_run(tmp_path / "runs" / "a", {0: 50, 1: 100, 2: None})  # the median layer jumps with layer 1
    write_run(tmp_path / "runs" / "b", {0: None, 1: None, 2: None})
    assert main(["summary", str(tmp_path / "runs"), "--format", "csv"]) == 0
    out = capsys.readouterr().out
    rows = {(r["run"], r["metric"]): r for r in csv.DictReader(io.StringIO(out, newline=""))}
    assert set(rows) == {(r, m) for r in "ab" for m in ("symmetry", "directionality", "spectral_norm")}
    a = rows[("a", "symmetry")]
    # a clean step: the departure and the takeoff (half of the rise) are both the step, 100
    assert (a["emergence"], a["departure_step"], a["takeoff_step"]) == ("emerged", "100", "100")
    assert (a["departure_at_start"], a["takeoff_at_start"]) == ("False", "False")
    for key in (("a", "directionality"), ("b", "symmetry"), ("b", "directionality")):
        assert rows[key]["emergence"] == "not emerged"
        assert rows[key]["departure_step"] == rows[key]["takeoff_step"] == rows[key]["departure_at_start"] == ""
    norm = rows[("a", "spectral_norm")]
    assert norm["emergence"] == norm["departure_step"] == norm["takeoff_step"] == ""  # no random range
    assert norm["first_step"] == "0" and norm["last_step"] == str(STEPS[-1])  # the summary's own columns stay


def symmetric(model):
    """Every layer's W_k set to its W_q: W_qk = W_q W_q^T, symmetry 1."""
    with torch.no_grad():
        for layer in model.bert.encoder.layer:
            layer.attention.self.key.weight.copy_(layer.attention.self.query.weight)


@pytest.mark.timeout(300)
def test_score_trajectory_runs_get_shapes_in_their_header_and_events_in_the_summary(tmp_path, capsys):
    model = tiny_bert(seed=0, layers=2, hidden=32, heads=4)
    out = tmp_path / "trained"
    for step in range(0, 60, 10):
        if step == 30:
            symmetric(model)
        model.save_pretrained(out / f"checkpoint-{step}")
    run = tmp_path / "scored"
    assert main(["score", str(out), "--trajectory", str(run)]) == 0
    capsys.readouterr()
    with open(run / TRAJECTORY_FILENAME) as fh:
        header = json.loads(fh.readline())["run_header"]
    layers = header["model"]["attention_layers"]
    assert [(a["group"], a["layer"], a["hidden_size"], a["head_dim"], a["num_heads"], a["num_kv_heads"])
            for a in layers] == [("self", 0, 32, 8, 4, 4), ("self", 1, 32, 8, 4, 4)]
    assert main(["summary", str(run), "--format", "csv"]) == 0
    rows = {r["metric"]: r for r in csv.DictReader(io.StringIO(capsys.readouterr().out, newline=""))}
    # symmetry 1 from checkpoint-30 on, a random init before: the departure is 30 (3 logged steps hold)
    assert (rows["symmetry"]["emergence"], rows["symmetry"]["departure_step"]) == ("emerged", "30")
    assert main(["summary", str(run)]) == 0
    text = capsys.readouterr().out
    assert "median layer: departure 30" in text
