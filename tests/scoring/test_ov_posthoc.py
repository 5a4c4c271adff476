"""The OV circuit on the post-hoc paths: ``score_model(pairs=...)``, ``score_checkpoint``,
``gather_scores`` and ``attn-probe score --pair ov`` (``--json``, ``--trajectory``).

References are formed here from the models' own modules (value and output-projection weights
sliced per head by hand, ``W_ov^h = W_o^h W_v^h`` in float64, ``torch.linalg.svdvals``), not
from attn_probe's extraction.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_model
from transformers import (
    T5Config,
    T5ForConditionalGeneration,
)

import attn_probe
from attn_probe import core as metrics_module
from attn_probe.cli import main
from attn_probe.definitions import directionality_score, symmetry_score
from attn_probe.distributed import gather_scores
from attn_probe.extraction import UnsupportedModelError
from attn_probe.scoring.checkpoint import CheckpointError, CheckpointWeights, score_checkpoint
from attn_probe.scoring.pairs import OVPair, QKPair

D, H = 32, 4
DH = D // H
OV = tuple("ov_" + m for m in metrics_module.DEFAULT_METRICS if m != "qk_bound") + ("ov_gain_bound",)


def bert():
    return tiny_model("bert", None, vocab_size=40, hidden_size=D, num_attention_heads=H, intermediate_size=48,
                      max_position_embeddings=16)


def gpt2():
    return tiny_model("gpt2", None, vocab_size=40, n_embd=D, n_layer=2, n_head=H, n_positions=16)


def llama_gqa():
    return tiny_model("llama", None, vocab_size=40, hidden_size=D, num_hidden_layers=2, num_attention_heads=H,
                      num_key_value_heads=2, intermediate_size=48, max_position_embeddings=16)


MODELS = {"bert": bert, "gpt2": gpt2, "llama-gqa": llama_gqa}


def perturbed(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    with torch.no_grad():  # distinct values everywhere (some inits are constant or zero)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def value_output(model, name):
    """Per layer, in order: ``(W_v (H_kv * dh, d), W_o (d, H * dh), H_kv)`` read off the model's modules."""
    out = []
    if name == "bert":
        for block in model.bert.encoder.layer:
            out.append((block.attention.self.value.weight, block.attention.output.dense.weight, H))
    elif name == "gpt2":
        for block in model.transformer.h:  # Conv1D: y = x @ W, so nn.Linear weights are W.T
            out.append((block.attn.c_attn.weight[:, 2 * D:].T, block.attn.c_proj.weight.T, H))
    else:
        for block in model.model.layers:
            attn = block.self_attn
            out.append((attn.v_proj.weight, attn.o_proj.weight, attn.v_proj.weight.shape[0] // DH))
    return [(v.detach().double(), o.detach().double(), kv) for v, o, kv in out]


def ov_reference(model, name):
    """Per layer: ``[layer metrics, head 0 metrics, ...]``, each the six ``ov_`` metrics in float64."""
    refs = []
    for w_v, w_o, kv in value_output(model, name):
        group = H // kv
        heads_v = [w_v[(h // group) * DH:(h // group + 1) * DH] for h in range(H)]
        heads_o = [w_o[:, h * DH:(h + 1) * DH] for h in range(H)]
        mats = [o @ v for o, v in zip(heads_o, heads_v, strict=True)]
        layer = explicit(sum(mats), heads_o, heads_v)
        refs.append([layer, *(explicit(m, [o], [v]) for m, o, v in zip(mats, heads_o, heads_v, strict=True))])
    return refs


def explicit(m, heads_o, heads_v):
    sv = torch.linalg.svdvals(m)
    bound = max(float(torch.linalg.svdvals(o)[0] * torch.linalg.svdvals(v)[0])
                for o, v in zip(heads_o, heads_v, strict=True))
    return {"ov_symmetry": symmetry_score(m), "ov_directionality": directionality_score(m),
            "ov_spectral_norm": float(sv[0]), "ov_frobenius_norm": float(torch.linalg.norm(m)),
            "ov_stable_rank": float(sv.square().sum() / sv[0] ** 2), "ov_gain_bound": bound}


def near_reference(metric, got, want):
    if metric in ("ov_symmetry", "ov_directionality"):
        return abs(got - want) <= 1e-4
    return abs(got - want) <= 1e-4 * abs(want)


def close(a, b):
    # float32 weights scored along two paths (stacked live, per layer post hoc): the eigensolver
    # and the norms round differently with the stack size and the CPU's vector width, a few
    # ulp, which directionality's thresholds and stable rank's ratio amplify to ~3e-6
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


@pytest.mark.parametrize("name", list(MODELS), ids=list(MODELS))
def test_score_model_ov_equals_an_explicit_float64_reference_per_layer_and_head(name):
    model = perturbed(name)
    rows = attn_probe.score_model(model, per_head=True, pairs="ov")
    assert all(set(r) == {"group", "layer", "name", "head", *OV} for r in rows)  # OV alone: no W_qk keys
    refs = ov_reference(model, name)
    assert len(rows) == len(refs) * (1 + H)
    for row in rows:
        want = refs[row["layer"]][0 if row["head"] is None else 1 + row["head"]]
        for metric in OV:
            assert near_reference(metric, row[metric], want[metric]), (row["layer"], row["head"], metric,
                                                                        row[metric], want[metric])


def jsonl_at(run_dir, step):
    out = {}
    with open(run_dir / "attn_probe.jsonl") as f:
        for line in f:
            if '"run_header"' in line:  # a run header, not a row
                continue
            r = json.loads(line)
            if r.get("step") == step and "metric" in r:
                out[(r["group"], r["layer"], r["head"], r["metric"])] = r["value"]
    return out


@pytest.mark.parametrize("name", list(MODELS), ids=list(MODELS))
def test_live_score_model_checkpoint_cli_trajectory_and_gather_agree(name, tmp_path, capsys):
    torch.manual_seed(0)
    model = MODELS[name]().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    live_dir = tmp_path / "live"
    probe = attn_probe.watch(model, optimizer=opt, log_dir=str(live_dir), every=1, per_head=True,
                             pairs=[QKPair(), OVPair()])
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 40, (4, 12), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    probe.close()
    live = jsonl_at(live_dir, 3)

    rows = attn_probe.score_model(model, per_head=True, pairs=("qk", "ov"))
    metrics = [k for k in rows[0] if k not in ("group", "layer", "name", "head")]
    assert metrics == [*metrics_module.DEFAULT_METRICS, *OV]
    model.save_pretrained(tmp_path / "out" / "checkpoint-3")
    capsys.readouterr()
    assert main(["score", str(tmp_path / "out" / "checkpoint-3"), "--per-head", "--json",
                 "--pair", "qk", "--pair", "ov"]) == 0
    cli_rows = json.loads(capsys.readouterr().out)
    assert main(["score", str(tmp_path / "out"), "--per-head", "--json", "--pair", "ov",
                 "--trajectory", str(tmp_path / "traj")]) == 0
    traj_rows = json.loads(capsys.readouterr().out)
    traj = jsonl_at(tmp_path / "traj", 3)
    gathered = gather_scores(model, attn_probe.find_attention(model), per_head=True, pairs=("qk", "ov"))

    assert len(cli_rows) == len(traj_rows) == len(gathered) == len(rows) == 2 * (1 + H)
    assert {k[3] for k in traj} == set(OV) and all(r["step"] == 3 for r in traj_rows)
    for i, row in enumerate(rows):
        key = (row["group"], row["layer"], row["head"])
        for other in (cli_rows[i], traj_rows[i], gathered[i]):
            assert (other["group"], other["layer"], other["head"]) == key
        for metric in metrics:
            b = row[metric]
            assert close(live[(*key, metric)], b), ("live", key, metric, live[(*key, metric)], b)
            assert close(cli_rows[i][metric], b), ("cli", key, metric, cli_rows[i][metric], b)
            assert close(gathered[i][metric], b), ("gather", key, metric, gathered[i][metric], b)
            if metric.startswith("ov_"):
                assert close(traj_rows[i][metric], b) and close(traj[(*key, metric)], b), ("trajectory", key, metric)
    # the trajectory reads back like a live run, ov_ metrics included
    df = attn_probe.load_trajectory(tmp_path / "traj")
    assert set(df["metric"]) == set(OV) and set(df["step"]) == {3}


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    model = T5ForConditionalGeneration(T5Config(vocab_size=40, d_model=D, d_kv=8, d_ff=48, num_layers=1,
                                                num_heads=H))
    path = tmp_path_factory.mktemp("t5") / "checkpoint-1"
    model.save_pretrained(path)
    return model, path


def test_unsupported_architecture_fails_before_any_work_naming_the_model_type(t5_dir, tmp_path, capsys, monkeypatch):
    model, path = t5_dir
    with pytest.raises(UnsupportedModelError, match=r"model type 't5'.*OV pair cannot read"):
        attn_probe.score_model(model, pairs=("qk", "ov"))
    with pytest.raises(UnsupportedModelError, match="model type 't5'"):
        gather_scores(model, attn_probe.find_attention(model), pairs=["ov"])

    def no_reads(self, key):
        raise AssertionError(f"read {key} before the pair check")

    monkeypatch.setattr(CheckpointWeights, "get", no_reads)
    with pytest.raises(CheckpointError, match="model type 't5'"):
        score_checkpoint(path, pairs=("qk", "ov"))
    capsys.readouterr()
    for extra in ([], ["--json"], ["--trajectory", str(tmp_path / "run")]):
        assert main(["score", str(path), "--pair", "ov", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("attn-probe score: error: ") and "\n" not in err and "Traceback" not in err
        assert "model type 't5'" in err and "OV pair" in err and "supported-models" in err
    assert not (tmp_path / "run").exists()  # no empty run left behind
    monkeypatch.undo()
    assert main(["score", str(path), "--json", "--metric", "symmetry"]) == 0  # W_qk alone still works


def test_pairs_option_defaults_narrowing_and_errors():
    model = perturbed("bert")
    default = attn_probe.score_model(model)
    assert [k for k in default[0] if k not in ("group", "layer", "name", "head")] == list(metrics_module.DEFAULT_METRICS)
    assert attn_probe.score_model(model, pairs="qk") == default
    assert attn_probe.score_model(model, pairs=[QKPair()]) == default
    both = attn_probe.score_model(model, pairs=("qk", "ov"), metrics=["spectral_norm", "symmetry"])
    assert all(set(r) == {"group", "layer", "name", "head", "spectral_norm", "symmetry", "ov_spectral_norm",
                          "ov_symmetry"} for r in both)
    mixed = attn_probe.score_model(model, pairs=["qk", OVPair(["frobenius_norm"])], metrics=["symmetry"])
    assert set(mixed[0]) - {"group", "layer", "name", "head"} == {"symmetry", "ov_frobenius_norm"}
    assert mixed[0]["ov_frobenius_norm"] == pytest.approx(
        attn_probe.score_model(model, pairs="ov")[0]["ov_frobenius_norm"], rel=1e-12)
    for bad, match in [(dict(pairs="vo"), "unknown pair 'vo'"), (dict(pairs=("ov", "ov")), "repeat"),
                       (dict(pairs=()), "at least one"), (dict(pairs=[OVPair()], metrics=["symmetry"]), "pair object"),
                       (dict(pairs=[OVPair(), OVPair()]), "same metric name"),
                       (dict(pairs="ov", metrics=["ov_symmetry"]), "--pair ov --metric symmetry"),
                       (dict(pairs="ov", metrics=["ov_gain_bound"]), "--pair ov --metric qk_bound")]:
        with pytest.raises(ValueError, match=match):
            attn_probe.score_model(model, **bad)
    with pytest.raises(TypeError, match="score pairs"):
        attn_probe.score_model(model, pairs=[3])


def test_checkpoint_reads_exactly_the_tensors_the_pairs_declare(tmp_path, monkeypatch):
    model = perturbed("bert")
    model.save_pretrained(tmp_path)
    read: list[str] = []
    original = CheckpointWeights.get
    monkeypatch.setattr(CheckpointWeights, "get", lambda self, key: read.append(key) or original(self, key))
    score_checkpoint(tmp_path, metrics=["symmetry"])
    assert read and all(k.endswith(("query.weight", "key.weight")) for k in read)
    read.clear()
    rows = score_checkpoint(tmp_path, pairs="ov", metrics=["symmetry"])
    assert sorted({k.split(".", 4)[-1] for k in read}) == ["attention.output.dense.weight",
                                                          "attention.self.value.weight"]
    assert [r["ov_symmetry"] for r in rows] == pytest.approx(
        [r["ov_symmetry"] for r in attn_probe.score_model(model, pairs="ov", metrics=["symmetry"])], abs=1e-6)


def test_cli_text_output_gguf_and_repeated_pair(tmp_path, capsys):
    perturbed("gpt2").save_pretrained(tmp_path / "ckpt")
    capsys.readouterr()
    assert main(["score", str(tmp_path / "ckpt"), "--pair", "ov", "--metric", "symmetry"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["group", "layer", "head", "ov_symmetry", "name"]
    assert "ov_symmetry " in out.splitlines()[-1]  # the summary
    assert main(["score", str(tmp_path / "ckpt"), "--pair", "ov", "--pair", "ov"]) == 2
    assert "repeat" in capsys.readouterr().err
    assert main(["score", str(tmp_path / "model.gguf"), "--pair", "ov"]) == 2  # before the file is opened
    err = capsys.readouterr().err
    assert "GGUF" in err and "W_qk only" in err


def test_gather_scores_reads_the_ov_weights_of_wrapped_layers():
    """The walk renames layers without wrapper segments; the OV weights are still found under their own names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = perturbed("llama-gqa")
    want = attn_probe.score_model(model, per_head=True, pairs=("qk", "ov"))
    for i, block in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(block)
    layers = attn_probe.find_attention(model)
    assert "_checkpoint_wrapped_module" in layers[0].name
    got = gather_scores(model, layers, per_head=True, pairs=("qk", "ov"))
    assert [r["name"] for r in got] == [r["name"] for r in want]  # names as in a single, unwrapped model
    for g, w in zip(got, want, strict=True):  # labels exactly, values to 1e-12 (approx rejects str values)
        assert g.keys() == w.keys()
        assert {k: v for k, v in g.items() if not isinstance(v, float)} == {
            k: v for k, v in w.items() if not isinstance(v, float)}
        assert {k: v for k, v in g.items() if isinstance(v, float)} == pytest.approx(
            {k: v for k, v in w.items() if isinstance(v, float)}, rel=1e-12, abs=1e-12)


def test_live_probe_with_named_pairs_reads_the_ov_weights_of_wrapped_layers(tmp_path):
    """``watch(pairs=("qk", "ov"))`` by name; layers renamed by the walk still find W_v/W_o."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = perturbed("llama-gqa")
    want = attn_probe.score_model(model, per_head=True, pairs=("qk", "ov"))
    for i, block in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(block)
    probe = attn_probe.watch(model, log_dir=str(tmp_path / "run"), per_head=True, pairs=("qk", "ov"),
                             metrics=("symmetry", "spectral_norm"))
    snap = probe.snapshot(1)
    probe.close(final_snapshot=False)
    got = {(r.layer, r.head, r.metric): r.value for r in snap.records}
    assert {m for _, _, m in got} == {"symmetry", "spectral_norm", "ov_symmetry", "ov_spectral_norm"}
    for row in want:
        for metric in ("symmetry", "spectral_norm", "ov_symmetry", "ov_spectral_norm"):
            value = got[(row["layer"], row["head"], metric)]
            assert abs(value - row[metric]) <= 1e-6 * max(1.0, abs(row[metric])), (row["layer"], row["head"], metric)
