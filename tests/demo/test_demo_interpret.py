"""The demo's end-of-run verdicts: measured numbers quoted only for a preset run as measured."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from attn_probe import demo


def _model(kind, symmetry):
    rows = [{"head": None, "layer": i, "symmetry": s, "directionality": -0.2} for i, s in enumerate(symmetry)]
    return demo.ModelResult(kind, Path("."), 6.0, [(10, 6.0)], rows, 1.0)


def _result(cfg, encoder, decoder=(0.0, 0.0, 0.0, 0.0), exits=None):
    models = {"encoder": _model("encoder", encoder), "decoder": _model("decoder", decoder)}
    return demo.DemoResult(Path("."), models, None, cfg, unigram_entropy=6.6,
                           plateau_exits=exits or {"encoder": None, "decoder": None})


def _text(result, cuda=False):
    return "\n".join(demo.interpret(result, cuda=cuda))


@pytest.mark.parametrize(("encoder", "verdict"), [
    ((0.46, 0.46, 0.47, 0.47), "inside"),  # gap +0.465, in the sweep's +0.449..+0.489
    ((0.50, 0.50, 0.50, 0.50), "above"),  # +0.50
    ((0.40, 0.44, 0.45, 0.50), "below"),  # +0.445
    ((0.4489, 0.4489, 0.4489, 0.4489), "inside"),  # the seed-0 run itself, +0.4489: quoted as +0.449
])
def test_cpu_preset_as_measured_gets_the_range_and_a_verdict(encoder, verdict):
    text = _text(_result(demo.DemoConfig(), encoder))
    assert f"  {verdict} the range measured for the cpu preset (+0.449 and +0.489 in two runs (seeds 0 and 1))" in text


def paper_table() -> list[dict[str, str]]:
    """The paper's trajectory table as shipped (package data), read here with csv alone."""
    import csv

    import attn_probe.baselines

    path = Path(attn_probe.baselines.__file__).with_name("paper_trajectories.csv")
    with path.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def paper_symmetry(layers: int, model: str, dataset: str) -> dict[int, float]:
    """step -> median layer symmetry of one of the paper's runs."""
    return {int(r["step"]): float(r["symmetry_median"]) for r in paper_table()
            if int(r["layers"]) == layers and r["model"] == model and r["dataset"] == dataset}


@pytest.mark.parametrize(("tokens", "dataset", "described"), [
    ("chars", "wikipedia", "Wikipedia, character-level"), ("wordpiece", "jigsaw", "Jigsaw")])
def test_verdict_names_the_papers_matching_run_at_the_same_step_and_at_its_end(tokens, dataset, described):
    """The cpu preset's 1,500 steps: the paper's nearest checkpoint is 1,000 (1,000 and 2,000 tie: the
    lower), its last 200,000; both models, with the values of the shipped table."""
    exits = {"encoder": 550, "decoder": 50}
    cfg = dataclasses.replace(demo.DemoConfig(), tokens=tokens)
    text = _text(_result(cfg, (0.3, 0.45, 0.5, 0.6), (0.0, 0.01, 0.03, 0.05), exits=exits))
    assert "a paper step is 131,072 tokens, a step here 1,024" in text
    for kind, mine in (("encoder", 0.475), ("decoder", 0.02)):
        table = paper_symmetry(4, kind, dataset)
        assert min(table) == 1000 and max(table) == 200_000 and len(table) == 200
        line = next(ln for ln in text.splitlines() if ln.startswith(f"  {kind} {mine:+.3f} at step 1,500; "))
        assert f"the paper's 4-layer {kind}, {described}" in line
        assert (f": {table[1000]:+.3f} at step 1,000 (its nearest checkpoint), {table[200_000]:+.3f} at step "
                "200,000 (its last)") in line
    other = paper_symmetry(4, "encoder", dataset)
    at_2600 = "\n".join(demo.interpret(_result(dataclasses.replace(cfg, steps=2600), (0.5,) * 4), cuda=False))
    assert f"{other[3000]:+.3f} at step 3,000 (its nearest checkpoint)" in at_2600


def _random_rows(run_dir: Path, mean: float, sd: float, layers: int = 4) -> None:
    import json

    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, "group": "self", "layer": i, "head": None, "metric": m, "value": v}
            for i in range(layers) for m, v in (("random_symmetry", mean), ("random_symmetry_sd", sd),
                                                ("symmetry", 0.9))]
    (run_dir / "attn_probe.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_verdict_states_the_distance_from_the_runs_own_random_range(tmp_path):
    result = _result(demo.DemoConfig(), (0.46, 0.46, 0.48, 0.48), (0.0, 0.0, 0.0, 0.0))
    result.models["encoder"].run_dir = tmp_path / "encoder"
    result.models["decoder"].run_dir = tmp_path / "decoder"
    _random_rows(tmp_path / "encoder", 0.01, 0.0083)
    text = _text(result)
    # (0.47 - 0.01) / 0.0083 = 55.4
    assert "  encoder +0.470 is 55 sd above the random range (+0.010 \u00b1 0.008)" in text
    assert "decoder +0.000 is" not in text  # the decoder's run logged no random range: nothing said
    _random_rows(tmp_path / "decoder", 0.02, 0.01)
    with (tmp_path / "decoder" / "attn_probe.jsonl").open("a") as f:
        f.write('{"step": 5, "metric": "random_symmetry", "val')  # a torn last line: skipped
    assert "  decoder +0.000 is 2.0 sd below the random range (+0.020 \u00b1 0.010)" in _text(result)


def _random_directionality_rows(run_dir: Path, sd: float, layers: int = 4) -> None:
    import json

    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, "group": "self", "layer": i, "head": None, "metric": m, "value": v}
            for i in range(layers) for m, v in (("random_directionality", 0.0), ("random_directionality_sd", sd))]
    with (run_dir / "attn_probe.jsonl").open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


def _directionality(result, kind, values):
    for row, value in zip(result.models[kind].rows, values, strict=True):
        row["directionality"] = value


def test_verdict_says_what_directionality_shows_at_this_width(tmp_path):
    """The decoder's median directionality -0.164 against d = 128's random spread (sd 0.40): inside it,
    so the run does not show the decoder's direction; against a narrow spread it does."""
    result = _result(demo.DemoConfig(), (0.46, 0.46, 0.48, 0.48), (0.0, 0.0, 0.0, 0.0))
    _directionality(result, "decoder", (-0.3, -0.2, -0.128, 0.1))  # median -0.164
    _directionality(result, "encoder", (0.01, 0.03, 0.05, 0.07))  # median +0.040
    for kind in ("encoder", "decoder"):
        result.models[kind].run_dir = tmp_path / kind
    assert "directionality" not in _text(result)  # no random range logged: nothing said
    _random_directionality_rows(tmp_path / "encoder", 0.40)
    _random_directionality_rows(tmp_path / "decoder", 0.40)
    text = _text(result)
    assert ("directionality (median across layers; a random layer's sd at d = 128, more than 2 sd away tells it "
            "from chance):") in text
    # -0.164 / 0.40 = 0.41 sd; +0.040 / 0.40 = 0.1 sd
    assert ("  decoder directionality -0.164 is 0.4 sd below the random range (+0.000 \u00b1 0.400 at d = 128): "
            "inside the random range: at d = 128 directionality does not tell this model from random weights") in text
    assert "  encoder directionality +0.040 is 0.1 sd above the random range (+0.000 \u00b1 0.400 at d = 128)" in text
    (tmp_path / "decoder" / "attn_probe.jsonl").unlink()
    _random_directionality_rows(tmp_path / "decoder", 0.05)  # -0.164 / 0.05 = 3.3 sd
    assert ("  decoder directionality -0.164 is 3.3 sd below the random range (+0.000 \u00b1 0.050 at d = 128): "
            "beyond it, negative: a few keys (columns) dominate, the paper's signature of a decoder") in _text(result)


def test_suggested_heatmaps_are_the_most_symmetric_encoder_and_most_directional_decoder_layer(tmp_path):
    result = _result(demo.DemoConfig(), (0.19, 0.75, 0.30, 0.75), (0.0, 0.0, 0.0, 0.0))
    _directionality(result, "encoder", (0.9, 0.0, 0.0, 0.0))  # not the encoder's criterion
    _directionality(result, "decoder", (-0.10, 0.05, -0.41, 0.30))
    result = dataclasses.replace(result, root=tmp_path)
    for kind in ("encoder", "decoder"):
        result.models[kind].model_dir = tmp_path / kind / "model"
    assert demo.final_model_commands(result) == [
        f"attn-probe score {tmp_path}/encoder/model",
        f"attn-probe score {tmp_path}/decoder/model",
        # symmetry +0.75 at layers 1 and 3: the lower one
        f"attn-probe heatmap {tmp_path}/encoder/model --layer 1 -o {tmp_path}/encoder_layer1.png",
        # |directionality| 0.41 at layer 2
        f"attn-probe heatmap {tmp_path}/decoder/model --layer 2 -o {tmp_path}/decoder_layer2.png",
    ]
    from attn_probe.demo.run import heatmap_reasons

    assert heatmap_reasons(result) == ("the encoder's most symmetric layer (1: symmetry +0.750) and the decoder's "
                                       "most directional layer (2: directionality -0.410)")


def test_changed_settings_get_no_measured_range():
    cfg = dataclasses.replace(demo.DemoConfig(), steps=300, arch="bert", symmetric_init=True)
    text = _text(_result(cfg, (0.1, 0.1, 0.1, 0.1)))
    assert "+0.449" not in text and "inside" not in text
    assert ("no measured range to compare with: the cpu preset's measured runs differ from this one "
            "(--arch bert, --steps 300, --symmetric-init)") in text
    # what does not change the training does not count
    same = dataclasses.replace(demo.DemoConfig(), seed=2, every=10, save_every=100, threads=1, concurrent=True,
                               out_dir="elsewhere", name="x", progress=False, figure=False)
    assert demo.measured_differences(same) == []
    assert demo.measured_differences(dataclasses.replace(demo.DemoConfig(), text=["a.txt"])) == ["--text"]


def _gpu_cfg(**changes):
    values = demo.resolve_preset("paper-small")
    values["precision"] = "bf16"  # as on the H100 where it was measured
    values.update(changes)
    return demo.DemoConfig(preset="paper-small", **values)


@pytest.mark.parametrize(("encoder", "measured", "paper"), [
    # the measured run: median +0.490, layers' IQR [+0.385, +0.563]; the paper's 4-layer range +0.35..+0.66
    ((0.44, 0.45, 0.47, 0.50), "inside", "inside"),  # median 0.46
    ((0.36, 0.36, 0.37, 0.38), "below", "inside"),  # 0.365
    ((0.60, 0.62, 0.63, 0.64), "above", "inside"),  # 0.625
    ((0.10, 0.20, 0.30, 0.30), "below", "below"),  # 0.25
    ((0.70, 0.70, 0.70, 0.70), "above", "above"),
])
def test_gpu_preset_compares_with_the_measured_run_and_the_paper(encoder, measured, paper):
    text = _text(_result(_gpu_cfg(), encoder, exits={"encoder": 810, "decoder": 300}), cuda=True)
    median = sorted(encoder)[1] / 2 + sorted(encoder)[2] / 2
    assert (f"encoder median layer symmetry {median:+.3f}: {measured} the range across layers of this preset's "
            "measured run (+0.49; layers' IQR +0.39 to +0.56; one seed, one H100), "
            f"and {paper} the paper's 4-layer range (+0.35 to +0.66)") in text
    assert "the run-to-run spread of this preset is not measured yet" in text
    assert "+0.449" not in text


def test_gpu_preset_with_other_settings_is_compared_with_the_paper_only():
    text = _text(_result(_gpu_cfg(steps=3000), (0.4, 0.4, 0.4, 0.4)), cuda=True)
    assert "inside the paper's 4-layer range (+0.35 to +0.66); no measured run to compare with" in text
    assert "(--steps 3000)" in text and "one seed, one H100" not in text
    pre_ln = demo.measured_differences(_gpu_cfg(arch="bert-preln"))
    assert pre_ln == ["--arch bert-preln"]


def test_failures_are_named_first():
    result = _result(demo.DemoConfig(), (0.1, 0.1, 0.1, 0.1))
    result = dataclasses.replace(result, models={"encoder": result.models["encoder"]},
                                 failures={"decoder": "RuntimeError: out of memory"})
    lines = demo.interpret(result, cuda=False)
    assert lines[0] == "decoder: did not finish (RuntimeError: out of memory); the other results are kept"
    assert result.gap is None and "median layer symmetry:" not in "\n".join(lines)


def test_the_quoted_paper_range_is_the_tables():
    """PAPER_4LAYER_ENCODER (the paper-small verdict's range) is the span of the 4-layer encoders' last
    checkpoints in the shipped table, to the two decimals it is quoted with."""
    finals = [paper_symmetry(4, "encoder", d)[200_000] for d in ("wikipedia", "red_pajama", "jigsaw")]
    assert demo.PAPER_4LAYER_ENCODER == (round(min(finals), 2), round(max(finals), 2))


def test_an_unreadable_paper_table_is_said_and_the_verdict_goes_on(monkeypatch):
    import attn_probe.baselines.paper as paper

    def broken(*args, **kwargs):
        raise FileNotFoundError("paper_trajectories.csv")

    monkeypatch.setattr(paper, "paper_point", broken)
    text = _text(_result(demo.DemoConfig(), (0.5,) * 4))
    assert "the paper's trajectories could not be read (FileNotFoundError: paper_trajectories.csv)" in text
    assert "phase: before the takeoff" in text
