"""The paper's pretrained table (``attn_probe.baselines.pretrained``) against its CSV read here with
the ``csv`` module, against numbers stated in the paper's text, and against what the names say."""

from __future__ import annotations

import configparser
import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attn_probe.baselines import pretrained
from attn_probe.baselines.pretrained import (
    KINDS,
    kind_and_family,
    nearest_pretrained,
    pretrained_families,
    pretrained_family,
    pretrained_row,
    pretrained_rows,
)

ROOT = Path(__file__).resolve().parents[2]
CSV = ROOT / "attn_probe" / "baselines" / "paper_pretrained_scores.csv"
COLUMNS = ["symmetry_median", "symmetry_iqr_below", "symmetry_iqr_above",
           "directionality_median", "directionality_iqr_below", "directionality_iqr_above"]


def csv_rows() -> list[dict[str, str]]:
    with open(CSV, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def csv_values(row: dict[str, str]) -> tuple[float, ...]:
    return tuple(float(row[c]) for c in COLUMNS)


def test_every_row_as_in_the_csv():
    want = csv_rows()
    got = pretrained_rows()
    assert len(want) == len(got) == 80
    assert [r.name for r in got] == [w["model"] for w in want]
    for row, w in zip(got, want, strict=True):
        assert row.values() == csv_values(w)
        assert row.kind in KINDS


def test_attribution_header_names_the_paper_and_its_source():
    head = [line for line in CSV.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
    text = " ".join(head)
    assert "arXiv 2502.10927" in text and "github.com/matteosaponati/attention-geometry" in text
    assert "table-symmetry-scores-language.txt" in text and "table-directionality-scores-language.txt" in text


def test_distinct_value_sets_and_aliases():
    want = csv_rows()
    value_sets: dict[tuple[str, ...], list[str]] = {}
    for w in want:
        value_sets.setdefault(tuple(w[c] for c in COLUMNS), []).append(w["model"])
    assert len(value_sets) == 62  # computed here from the CSV's text
    distinct = pretrained_rows(distinct=True)
    assert len(distinct) == 62
    assert {r.values() for r in distinct} == {tuple(float(x) for x in k) for k in value_sets}
    for row in distinct:
        names = value_sets[tuple(f"{v}" for v in (next(w for w in want if w["model"] == row.name)[c]
                                                  for c in COLUMNS))]
        assert sorted([row.name, *row.aliases]) == sorted(names)
    # every name still finds a row with its own values, the other spelling included
    for w in want:
        assert pretrained_row(w["model"]).values() == csv_values(w)
        assert pretrained_row(w["model"].upper()).name == w["model"]
    assert "bert-base-uncased" in pretrained_row("bert-base").aliases


def test_numbers_the_paper_states():
    """The medians the paper's text states (symmetry, directionality) for a few models."""
    stated = {"bert-tiny": (0.77, -0.79), "bert-mini": (0.62, -0.33), "bert-base": (0.51, -0.08),
              "bert-large": (0.44, -0.03), "FacebookAI/roberta-base": (0.49, -0.12),
              "answerdotai/ModernBERT-base": (0.18, -0.04), "gpt2": (0.15, -0.58),
              "gpt-neo-125m": (0.14, -0.56), "meta-llama/Llama-3.1-8B": (0.00, -0.57),
              "mistralai/Mistral-7B-v0.1": (0.00, -0.58)}
    for name, (sym, dirn) in stated.items():
        row = pretrained_row(name)
        assert (row.symmetry, row.directionality) == (sym, dirn), name


def test_faults_are_flagged():
    llama3 = pretrained_row("llama3-8b")
    hub = pretrained_row("meta-llama/Meta-Llama-3-8B")
    assert (llama3.directionality, hub.directionality) == (-0.65, 0.01)
    assert any("meta-llama/Meta-Llama-3-8B" in f for f in llama3.faults)
    assert any("llama3-8b" in f for f in hub.faults)
    for a, b in (("llama3.2-1b", "meta-llama/Llama-3.2-1B"), ("gpt-neo-2.7b", "EleutherAI/gpt-neo-2.7B")):
        assert pretrained_row(a).values() != pretrained_row(b).values()
        assert any(b in f and "disagrees" in f for f in pretrained_row(a).faults)
    fake = pretrained_row("llama3.2-8b")
    assert fake.values() == pretrained_row("llama3.2-1b").values()
    assert fake.faults and "not a released model" in fake.faults[0]
    assert fake.layers is None and fake.width is None
    # the counts the docs state: 6 models whose two rows disagree (12 rows), 13 pairs of agreeing names
    assert sum(any("disagrees" in f for f in r.faults) for r in pretrained_rows()) == 12
    assert sum(1 for r in pretrained_rows() if r.aliases and not r.faults) == 26
    # rows without a fault: one model, one name, or two names that agree
    assert pretrained_row("gpt2").faults == () and pretrained_row("bert-base").faults == ()


def test_vision_rows_are_beit_and_never_beside_a_language_model():
    vision = [w["model"] for w in csv_rows() if "beit" in w["model"].lower()]
    assert len(vision) == 7
    assert {pretrained_row(n).kind for n in vision} == {"vision"}
    assert {r.kind for r in pretrained_rows()} - {"vision"} <= {"encoder", "decoder"}
    for kind in ("encoder", "decoder"):
        for family in (*pretrained_families(), None):
            assert all(r.kind == kind for r in nearest_pretrained(kind, family, 12, 768, n=80))


def test_shapes_the_names_state():
    for row in pretrained_rows():
        m = re.search(r"_L-(\d+)_H-(\d+)_", row.name)  # google/bert_uncased_L-4_H-256_A-4
        if m:
            assert (row.layers, row.width) == (int(m.group(1)), int(m.group(2)))
    # BERT's miniatures share one table of sizes; the short names are the same models
    for short, long in (("bert-tiny", "google/bert_uncased_L-2_H-128_A-2"),
                        ("bert-medium", "google/bert_uncased_L-8_H-512_A-8")):
        assert (pretrained_row(short).layers, pretrained_row(short).width) == \
            (pretrained_row(long).layers, pretrained_row(long).width)
    assert pretrained_row("gpt2").shape_text() == "12 x 768"
    assert pretrained_row("gpt2-medium").shape_text() == "24 x 1024"
    assert pretrained_row("llama3-8b").shape_text() == "32 x 4096"


def test_family_lookup():
    bert = pretrained_family("bert")
    assert [r.name for r in bert] == ["bert-tiny", "bert-mini", "bert-small", "bert-medium", "bert-distill",
                                      "bert-base", "bert-large"]
    assert len(pretrained_family("bert", distinct=False)) == 14
    with pytest.raises(ValueError, match="no family 'bart'") as info:
        pretrained_family("bart")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"did you mean gpt2-medium\?"):
        pretrained_row("gpt2-meduim")


def test_kind_and_family_of_configs():
    assert kind_and_family("bert") == ("encoder", "bert")
    assert kind_and_family("bert", is_decoder=True) == ("decoder", "bert")
    assert kind_and_family("gpt2") == ("decoder", "gpt2")
    assert kind_and_family("llama") == ("decoder", "llama")
    assert kind_and_family("t5", is_encoder_decoder=True) == ("encoder-decoder part", None)
    assert kind_and_family("mpnet") == (None, None)
    assert kind_and_family("mpnet", architectures=["MPNetForMaskedLM"]) == ("encoder", None)
    # the demo's models: a pre-LN RoBERTa, its decoder saved as ...ForCausalLM
    assert kind_and_family("roberta-prelayernorm", architectures=["RobertaPreLayerNormForCausalLM"]) == \
        ("decoder", "roberta")
    assert kind_and_family("roberta-prelayernorm") == ("encoder", "roberta")


def test_nearest_rows():
    minilm = nearest_pretrained("encoder", "bert", 6, 384)
    assert [r.name for r in minilm] == ["bert-mini", "bert-small", "bert-medium", "bert-distill"]
    assert {r.name for r in nearest_pretrained("decoder", "gpt2", 12, 768, n=1)} == {"gpt2"}
    # a BERT decoder (no such row): the decoders nearest in shape
    assert {r.family for r in nearest_pretrained("decoder", "bert", 12, 768)} <= {"gpt2", "openai-gpt", "gpt-neo"}
    # the row of no released model is never chosen, even where its shape would not matter
    llama = nearest_pretrained("decoder", "llama", 16, 2048, n=80)
    assert "llama3.2-8b" not in [r.name for r in llama] and "llama3.2-1b" in [r.name for r in llama]
    assert nearest_pretrained(None, None, 6, 384) == []
    assert nearest_pretrained("encoder-decoder part", None, 6, 512) == []


def test_reference_needs_neither_torch_nor_numpy_and_the_table_is_package_data():
    # the command's own code (the parser imports every command module: their imports are theirs)
    code = ("import argparse, sys; from attn_probe.commands import reference;"
            " reference.run(argparse.Namespace(family='gpt2', all=False));"
            " print(sorted(m for m in ('pandas', 'numpy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""}, check=True)
    assert out.stdout.splitlines()[-1] == "[]" and "distilbert/distilgpt2" in out.stdout
    packaged = configparser.ConfigParser()
    packaged.read(ROOT / "setup.cfg")
    assert pretrained.DATA_FILE == CSV.name in packaged["options.package_data"]["attn_probe.baselines"].split()


def test_the_docs_name_what_exists():
    """The module docstring and the command point at docs/scores.md; its section names every fault."""
    text = (ROOT / "docs" / "scores.md").read_text(encoding="utf-8")
    section = text.split("### Beside the paper's pretrained models", 1)[1]
    for said in ("llama3.2-8b", "meta-llama/Meta-Llama-3-8B", "62 distinct", "`vision`", "caption",
                 "attn_probe/baselines/paper_pretrained_scores.csv", "tests/commands/test_cli_reference.py"):
        assert said in section, said
    for path in ("attn_probe/baselines/paper_pretrained_scores.csv", "tests/commands/test_cli_reference.py"):
        assert (ROOT / path).is_file()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/scores.md#beside-the-papers-pretrained-models" in readme and "attn-probe reference" in readme
