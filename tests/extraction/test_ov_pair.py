"""The OV pair (W_o^h W_v^h) against the models' own forward passes, on every supported layout."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import (
    BertConfig,
    BertModel,
    BloomConfig,
    BloomModel,
    FalconConfig,
    FalconModel,
    GPT2Config,
    GPT2Model,
    GPTNeoXConfig,
    GPTNeoXModel,
    LlamaConfig,
    LlamaModel,
    MistralConfig,
    MistralModel,
    Qwen2Config,
    Qwen2Model,
    RobertaConfig,
    RobertaModel,
    RobertaPreLayerNormConfig,
    RobertaPreLayerNormModel,
    T5Config,
    T5Model,
)

import attn_probe
from attn_probe.definitions import directionality_score, symmetry_score
from attn_probe.extraction import UnsupportedModelError
from attn_probe.scoring.pairs import OVPair, QKPair, check_pairs

D, HEADS = 32, 4
SMALL = dict(vocab_size=40, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=48)

# model, the output projection of attention module `attn` (its input: heads flattened head-major)
MODELS = {
    "bert": (lambda: BertModel(BertConfig(**SMALL)),
             lambda model, attn, name: model.get_submodule(name[: -len("self")] + "output.dense")),
    "roberta": (lambda: RobertaModel(RobertaConfig(**SMALL)),
                lambda model, attn, name: model.get_submodule(name[: -len("self")] + "output.dense")),
    "roberta-preln": (lambda: RobertaPreLayerNormModel(RobertaPreLayerNormConfig(**SMALL)),
                      lambda model, attn, name: model.get_submodule(name[: -len("self")] + "output.dense")),
    "llama-gqa": (lambda: LlamaModel(LlamaConfig(**SMALL, num_key_value_heads=2)), lambda m, a, n: a.o_proj),
    "mistral-gqa": (lambda: MistralModel(MistralConfig(**SMALL, num_key_value_heads=1)), lambda m, a, n: a.o_proj),
    "qwen2": (lambda: Qwen2Model(Qwen2Config(**SMALL, num_key_value_heads=2)), lambda m, a, n: a.o_proj),
    "gpt2-conv1d": (lambda: GPT2Model(GPT2Config(vocab_size=40, n_embd=D, n_layer=2, n_head=HEADS)),
                    lambda m, a, n: a.c_proj),
    "neox-interleaved": (lambda: GPTNeoXModel(GPTNeoXConfig(**SMALL)), lambda m, a, n: a.dense),
    "bloom": (lambda: BloomModel(BloomConfig(vocab_size=40, hidden_size=D, n_layer=2, n_head=HEADS)),
              lambda m, a, n: a.dense),
    "falcon-interleaved": (lambda: FalconModel(FalconConfig(**_falcon(), multi_query=False,
                                                            new_decoder_architecture=False)),
                           lambda m, a, n: a.dense),
    "falcon-multi-query": (lambda: FalconModel(FalconConfig(**_falcon(), multi_query=True,
                                                            new_decoder_architecture=False)),
                           lambda m, a, n: a.dense),
    "falcon-grouped": (lambda: FalconModel(FalconConfig(**_falcon(), new_decoder_architecture=True, num_kv_heads=2)),
                       lambda m, a, n: a.dense),
}


def _falcon():
    return dict(vocab_size=40, hidden_size=D, num_hidden_layers=2, num_attention_heads=HEADS)


def build(name):
    torch.manual_seed(0)
    model = MODELS[name][0]()
    with torch.no_grad():  # biases and non-trivial scales, so a bias or layout slip shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def forward_reference(model, name):
    """Per layer: the explicit float64 W_ov (layer, every head) and each head's W_o^h, W_v^h, read off the
    model's own forward pass at sequence length 1 (attention weight 1), independently of attn_probe.

    The attention module's input is replaced by the basis vectors e_1..e_d and 0; the output
    projection's input (the heads' values, flattened head-major) is captured and, per head,
    masked to that head's block; its output minus the output at 0 is W_o (mask . W_v e_i).
    """
    model = model.double()
    refs = {layer.name: _layer_reference(model, layer, MODELS[name][1](model, layer.module, layer.name))
            for layer in attn_probe.find_attention(model)}
    model.float()
    return refs


def _layer_reference(model, layer, out_proj):
    basis = torch.cat([torch.eye(D, dtype=torch.float64), torch.zeros(1, D, dtype=torch.float64)])[:, None]
    state = {"mask": None}

    def replace_input(module, args, kwargs):
        if args:
            return (basis, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": basis}

    def mask_heads(module, args):
        state["values"] = args[0].detach().clone()
        return (args[0] * state["mask"],)

    def capture(module, args, output):
        state["out"] = output.detach()

    handles = [layer.module.register_forward_pre_hook(replace_input, with_kwargs=True),
               out_proj.register_forward_pre_hook(mask_heads),
               out_proj.register_forward_hook(capture)]
    dh = layer.head_dim
    try:
        ids = torch.zeros(D + 1, 1, dtype=torch.long)
        matrices, values = [], None
        for head in [None, *range(layer.num_heads)]:
            mask = torch.zeros(layer.num_heads * dh, dtype=torch.float64)
            if head is None:
                mask[:] = 1
            else:
                mask[head * dh:(head + 1) * dh] = 1
            state["mask"] = mask
            with torch.no_grad():
                model(input_ids=ids)
            out = state["out"].reshape(D + 1, D)
            matrices.append((out[:D] - out[D]).T)  # column i = W_ov e_i
            if head is None:
                v = state["values"].reshape(D + 1, -1)
                values = (v[:D] - v[D]).T  # (H * dh, d): row block h = W_v^{g(h)}
    finally:
        for h in handles:
            h.remove()
    w_o = (out_proj.weight.T if hasattr(out_proj, "nf") else out_proj.weight).detach().double()  # (d, H * dh)
    heads_o = [w_o[:, h * dh:(h + 1) * dh] for h in range(layer.num_heads)]
    heads_v = [values[h * dh:(h + 1) * dh] for h in range(layer.num_heads)]
    return matrices, heads_o, heads_v


def explicit_metrics(m, w_os, w_vs):
    sv = torch.linalg.svdvals(m)
    bound = max(float(torch.linalg.svdvals(o)[0] * torch.linalg.svdvals(v)[0]) for o, v in zip(w_os, w_vs, strict=True))
    return {"ov_symmetry": symmetry_score(m), "ov_directionality": directionality_score(m),
            "ov_spectral_norm": float(sv[0]), "ov_frobenius_norm": float(torch.linalg.norm(m)),
            "ov_stable_rank": float(sv.square().sum() / sv[0] ** 2), "ov_gain_bound": bound}


def assert_metric(name, got, want, where):
    if name in ("ov_symmetry", "ov_directionality"):
        assert abs(got - want) <= 1e-4, (where, name, got, want)
    else:
        assert abs(got - want) <= 1e-4 * abs(want), (where, name, got, want)


@pytest.mark.parametrize("name", list(MODELS), ids=list(MODELS))
def test_ov_metrics_equal_the_models_own_value_and_output_maps(name):
    model = build(name)
    pair = OVPair()
    layers = attn_probe.find_attention(model)
    scored = {}
    for layer in layers:
        a, b = pair.factors(layer, layer.params.__getitem__)
        scored[layer.name] = pair.score(layer, a, b, per_head=True, num_std=2.0).cpu()
    refs = forward_reference(model, name)
    for layer in layers:
        matrices, heads_o, heads_v = refs[layer.name]
        table = scored[layer.name]
        for col, m in enumerate(matrices):
            head = None if col == 0 else col - 1
            w_os, w_vs = (heads_o, heads_v) if head is None else ([heads_o[head]], [heads_v[head]])
            want = explicit_metrics(m, w_os, w_vs)
            for i, metric in enumerate(pair.metrics):
                assert_metric(metric, float(table[i, col]), want[metric], (layer.name, head))


def test_ov_pair_in_the_live_probe_gathers_its_parameters_and_writes_prefixed_metrics(tmp_path):
    model = build("llama-gqa")
    probe = attn_probe.watch(model, log_dir=str(tmp_path / "run"), every=None, per_head=True,
                             pairs=[QKPair(), OVPair()])
    seen = []
    original = probe.measurement.param_names  # the documented seam: what the walk gathers per layer
    probe.measurement.param_names = lambda layer: seen.append(original(layer)) or original(layer)
    snap = probe.snapshot(1)
    probe.close(final_snapshot=False)
    assert any("v_proj" in n for names in seen for n in names) and any("o_proj" in n for names in seen for n in names)
    metrics = {r.metric for r in snap.records}
    assert metrics == set(attn_probe.core.DEFAULT_METRICS) | {"ov_symmetry", "ov_directionality", "ov_spectral_norm",
                                                              "ov_frobenius_norm", "ov_stable_rank", "ov_gain_bound"}
    assert ("self", "ov_spectral_norm", "max") in snap.stats and ("self", "ov_symmetry", "max") not in snap.stats
    with open(tmp_path / "run" / "attn_probe.jsonl") as f:
        written = {json.loads(line).get("metric") for line in f if '"run_header"' not in line}
    assert "ov_gain_bound" in written and "qk_bound" in written and "ov_qk_bound" not in written
    refs = forward_reference(model, "llama-gqa")
    for layer in attn_probe.find_attention(model):
        matrices, heads_o, heads_v = refs[layer.name]
        want = explicit_metrics(matrices[0], heads_o, heads_v)
        got = {r.metric: r.value for r in snap.records if r.layer == layer.layer and r.head is None}
        for metric, value in want.items():
            assert_metric(metric, got[metric], value, layer.name)


def test_an_architecture_without_known_ov_layout_raises_a_clear_error():
    model = T5Model(T5Config(vocab_size=40, d_model=D, d_kv=8, d_ff=48, num_layers=1, num_heads=HEADS))
    layers = attn_probe.find_attention(model)
    with pytest.raises(UnsupportedModelError, match="OV pair cannot read .*supported-models"):
        check_pairs([QKPair(), OVPair()], layers)
    check_pairs([QKPair()], layers)  # W_qk alone is fine


def test_ov_metric_names_and_narrowing():
    pair = OVPair(["symmetry", "spectral_norm"])
    assert pair.metrics == ("ov_symmetry", "ov_spectral_norm")
    assert OVPair().metrics == ("ov_symmetry", "ov_directionality", "ov_spectral_norm", "ov_frobenius_norm",
                               "ov_stable_rank", "ov_gain_bound")  # per head sigma(W_o^h) sigma(W_v^h)
    with pytest.raises(ValueError, match="unknown metric"):
        OVPair(["ov_symmetry"])
    assert math.isfinite(float(OVPair(["frobenius_norm"]).score(
        None, torch.randn(2, 3, 5), torch.randn(1, 3, 5), per_head=False, num_std=2.0)[0, 0]))


def test_every_ov_metric_the_pair_writes_that_bounds_or_measures_size_gets_a_max_tag():
    """The OV pair renames its qk_bound to ov_gain_bound; it is still a magnitude (TensorBoard max tag)."""
    from attn_probe.formats.tags import stats_for
    from attn_probe.scoring.pairs import OVPair

    names = OVPair().metrics
    assert "ov_gain_bound" in names and "ov_qk_bound" not in names
    for name in names:
        bare = name.removeprefix("ov_")
        want_max = bare in ("spectral_norm", "frobenius_norm", "stable_rank", "gain_bound")
        assert ("max" in stats_for(name)) == want_max, name
