"""``attn-probe score``: in-process ``main([...])`` tests and one subprocess smoke test."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import tiny_model

from attn_probe import score_model
from attn_probe.cli import main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    model = tiny_model("bert", None, num_hidden_layers=3, intermediate_size=37, max_position_embeddings=32,
                       vocab_size=64).eval()
    path = tmp_path_factory.mktemp("bert")
    model.save_pretrained(path)
    return model, path


def _close(got: float | None, want: float, tol: float) -> bool:
    if got is None:
        return math.isnan(want)
    return abs(got - want) <= tol


def test_table_and_summary(bert_dir, capsys):
    model, path = bert_dir
    assert main(["score", str(path)]) == 0
    out = capsys.readouterr().out
    want = score_model(model)
    table = [line.split() for line in out.splitlines() if line.startswith("self ")]
    assert len(table) == 3
    for cells, row in zip(table, want, strict=True):
        group, layer, head, sym, dirn, *_norms, name = cells  # the scores come first
        assert (group, int(layer), head, name) == ("self", row["layer"], "-", row["name"])
        assert _close(float(sym), row["symmetry"], 6e-4) and _close(float(dirn), row["directionality"], 6e-4)
    summary = [line for line in out.splitlines() if "layers):" in line]
    assert len(summary) == 1 and "self" in summary[0] and "(3 layers)" in summary[0]
    median = sorted(r["symmetry"] for r in want)[1]
    assert f"symmetry {median:.2f} [" in summary[0]


@pytest.mark.parametrize("extra", [[], ["--per-head"], ["--num-std", "1.5"]], ids=["layer", "per-head", "num-std"])
def test_json_rows(bert_dir, capsys, extra):
    model, path = bert_dir
    assert main(["score", str(path), "--json", *extra]) == 0
    rows = json.loads(capsys.readouterr().out)
    num_std = float(extra[1]) if extra[:1] == ["--num-std"] else 2.0
    want = score_model(model, per_head="--per-head" in extra, num_std=num_std)
    assert len(rows) == len(want) == (3 * 5 if "--per-head" in extra else 3)
    for got, ref in zip(rows, want, strict=True):
        assert (got["group"], got["layer"], got["head"], got["name"]) == (ref["group"], ref["layer"], ref["head"], ref["name"])
        # float32 on both sides, on differently aligned copies of the weights: MKL may round
        # differently, and directionality of a 32 x 32 head amplifies that
        assert _close(got["symmetry"], ref["symmetry"], 1e-5)
        assert _close(got["directionality"], ref["directionality"], 1e-4)


@pytest.mark.parametrize("case", ["missing", "no-config", "unknown-type"])
def test_user_errors_are_one_line(tmp_path, capsys, case):
    path = tmp_path / "ckpt"
    if case != "missing":
        path.mkdir()
    if case == "unknown-type":
        (path / "config.json").write_text(json.dumps({"model_type": "no-such-model-type"}))
    assert main(["score", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attn-probe score: error: ") and "\n" not in err
    assert "Traceback" not in err


def test_bad_num_std_is_rejected_by_argparse(bert_dir, capsys):
    _, path = bert_dir
    with pytest.raises(SystemExit) as info:
        main(["score", str(path), "--num-std", "nan"])
    assert info.value.code == 2
    assert "--num-std" in capsys.readouterr().err


def test_subprocess_smoke(bert_dir, tmp_path):
    model, path = bert_dir
    exe = shutil.which("attn-probe")
    cmd = [exe] if exe else [sys.executable, "-m", "attn_probe"]
    ok = subprocess.run([*cmd, "score", str(path), "--json"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    rows = json.loads(ok.stdout)
    assert [r["name"] for r in rows] == [r["name"] for r in score_model(model)]
    bad = subprocess.run([*cmd, "score", str(tmp_path / "nope")], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr
    assert "no such file or directory" in bad.stderr


def test_json_writes_undefined_scores_as_null(tmp_path, capsys):
    model = tiny_model("bert", None, cls="BertModel", intermediate_size=37, max_position_embeddings=32,
                       vocab_size=64).eval()
    with torch.no_grad():
        model.encoder.layer[0].attention.self.query.weight.zero_()  # M = 0: both scores undefined
    model.save_pretrained(tmp_path / "zero")
    capsys.readouterr()  # drop what saving printed
    assert main(["score", str(tmp_path / "zero"), "--json"]) == 0

    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    rows = json.loads(capsys.readouterr().out, parse_constant=no_constants)
    assert (rows[0]["symmetry"], rows[0]["directionality"]) == (None, None)
    assert isinstance(rows[1]["symmetry"], float) and rows[1]["layer"] == 1 and rows[1]["head"] is None
