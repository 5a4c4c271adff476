"""The unsupported-model message: the fix in the form of the call the user made, the fused-projection
hint by width, and ``attn-probe models`` (run here exactly as the message prints it)."""

from __future__ import annotations

import ast
import math
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import attn_probe
from attn_probe.extraction import UnsupportedModelError, find_attention, unregister_adapter
from attn_probe.extraction.architectures import FUSED_LAYOUTS

ROOT = Path(__file__).resolve().parents[2]


class CustomAttention(nn.Module):
    """Separate projections with names attn_probe does not know."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.num_heads = heads
        self.my_q, self.my_k, self.my_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.my_v(x)


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([CustomAttention() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def fused_model(d: int, out: int) -> nn.Module:
    attn = nn.Module()
    attn.mixer = nn.Linear(d, out)  # a name with neither q nor k in it
    attn.out = nn.Linear(d, d)
    return nn.ModuleDict({"attn": attn})


def message(call) -> str:
    with pytest.raises(UnsupportedModelError) as info:
        call()
    return str(info.value)


def suggested_pairs(text: str) -> list[tuple[str, str]]:
    """The ``qk_names`` pairs the message proposes."""
    return ast.literal_eval(re.search(r"qk_names.{0,4}?(\[\(.*?\)\])", text).group(1))


def test_find_attention_form_and_no_repository_path() -> None:
    text = message(lambda: find_attention(Custom()))
    assert "attn_probe.find_attention(model, qk_names=[('my_q', 'my_k')])" in text
    assert "`attn-probe models`" in text and "docs/" not in text


def test_watch_shows_find_kwargs_and_the_printed_form_works(tmp_path: Path) -> None:
    model = Custom()
    text = message(lambda: attn_probe.watch(model, log_dir=str(tmp_path / "a"), every=1))
    assert "attn_probe.watch(model, ..., find_kwargs={\"qk_names\": [('my_q', 'my_k')]})" in text
    probe = attn_probe.watch(model, log_dir=str(tmp_path / "b"), every=1,
                             find_kwargs={"qk_names": suggested_pairs(text)})
    try:
        assert [a.name for a in find_attention(model, qk_names=suggested_pairs(text))] == ["blocks.0", "blocks.1"]
    finally:
        probe.close()


def test_score_model_form() -> None:
    text = message(lambda: attn_probe.score_model(Custom()))
    assert "attn_probe.score_model(model, qk_names=[('my_q', 'my_k')])" in text


def test_trainer_attach_and_callback_forms(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from attn_probe.integrations.transformers import AttnProbeCallback

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = Trainer(model=Custom(), args=args)
    text = message(lambda: attn_probe.attach(trainer, every=1))
    assert "attn_probe.attach(trainer, ..., find_kwargs={\"qk_names\": [('my_q', 'my_k')]})" in text
    text = message(lambda: Trainer(model=Custom(), args=args, callbacks=[AttnProbeCallback(every=1)]))
    assert "AttnProbeCallback(..., find_kwargs={\"qk_names\": [('my_q', 'my_k')]})" in text


@pytest.mark.parametrize("d, out, width", [(16, 48, "16 -> 48 = 3 x 16"), (32, 48, "32 -> 48 = 32 + 2 x 8")],
                         ids=["mha", "gqa"])
def test_fused_hint_by_width_whatever_the_name(d: int, out: int, width: str) -> None:
    text = message(lambda: find_attention(fused_model(d, out)))
    assert f"'mixer' looks like a fused q/k/v projection (attn.mixer: {width})" in text
    assert "register_adapter" in text


def test_no_fused_hint_for_other_widths() -> None:
    assert "looks like a fused" not in message(lambda: find_attention(fused_model(16, 64)))


def test_nanogpt_without_head_count_gets_the_hint() -> None:
    """A ``c_attn`` block that states no ``n_head``/``n_embd`` cannot be split: the hint names it."""
    attn = nn.Module()
    attn.c_attn, attn.c_proj = nn.Linear(16, 48), nn.Linear(16, 16)
    text = message(lambda: find_attention(nn.ModuleDict({"attn": attn})))
    assert "'c_attn' looks like a fused q/k/v projection (attn.c_attn: 16 -> 48 = 3 x 16)" in text


def models_command(text: str) -> list[str]:
    """The command the message prints, with the venv's console script."""
    argv = shlex.split(re.search(r"`(attn-probe [^`]*)`", text).group(1))
    script = Path(sys.executable).parent / argv[0]
    assert script.exists(), f"console script {script} not installed"
    return [str(script), *argv[1:]]


def test_models_command_as_printed_lists_the_registry_and_a_working_recipe() -> None:
    argv = models_command(message(lambda: find_attention(Custom())))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for fn in FUSED_LAYOUTS:
        assert f"\n  {fn.__name__.strip('_').removesuffix('_layout')}\n" in out
    for name in ("nanogpt", "timm", "litgpt", "torchtitan", "separate projections"):
        assert f"\n  {name}\n" in out
    flat = " ".join(out.split())
    assert "FusedQKVLinear" in flat and "torchtune LoRALinear/DoRALinear" in flat  # issue 38: both stacks named
    assert 'find_kwargs={"qk_names": [("my_q", "my_k")]}' in out
    # the adapter recipe, run as printed, makes a fused model readable
    code = textwrap.dedent(out[out.index("    from attn_probe import register_adapter"):out.index("  Other layouts")])
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102 - the printed recipe is what is tested

    class MyAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_heads, self.head_dim = 2, 8
            self.qkv = nn.Linear(16, 48)

    try:
        model = nn.Sequential(MyAttention())
        (layer,) = find_attention(model)
        w_q, w_k = layer.factors()
        weight = model[0].qkv.weight
        torch.testing.assert_close(w_q, weight[:16].reshape(2, 8, 16))
        torch.testing.assert_close(w_k, weight[16:32].reshape(2, 8, 16))
    finally:
        unregister_adapter(namespace["my_layout"])


def test_models_command_in_process() -> None:
    from attn_probe.cli import main

    assert main(["models", "--width", "60"]) == 0


class Mixer(nn.Module):
    """Attention by another name: no 'attn' in its class or path, projections named to_queries/to_keys."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.num_heads = heads
        self.to_queries, self.to_keys, self.to_values = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.to_out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.to_out(self.to_values(x))


class Feed(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.up, self.gate, self.down = nn.Linear(d, 4 * d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class MixerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.layers = nn.ModuleList([nn.ModuleDict({"mix": Mixer(), "ff": Feed()}) for _ in range(2)])


def test_candidates_by_shape_whatever_the_class_name() -> None:
    """A module named Mixer with to_queries/to_keys is listed by its shape (projections of the model's
    width), not the MLP beside it; the printed call, run as printed, finds both layers with the heads
    the module declares (on 7ce385c: 'Candidate modules: none' and a placeholder pair)."""
    model = MixerNet()
    text = message(lambda: find_attention(model))
    assert "layers.0.mix (Mixer: to_queries, to_keys, to_values, to_out)" in text
    assert "Feed" not in text and "Candidate modules: none" not in text
    call = re.search(r"(attn_probe\.find_attention\(model, qk_names=\[.*?\]\))", text).group(1)
    assert call == "attn_probe.find_attention(model, qk_names=[('to_queries', 'to_keys')])"
    layers = eval(call, {"attn_probe": attn_probe, "model": model})  # the call exactly as printed
    assert [(a.name, a.num_heads, a.head_dim) for a in layers] == [("layers.0.mix", 2, 8), ("layers.1.mix", 2, 8)]
    # the scores of the found pair equal an explicit computation from the module's own weights
    wq, wk = model.layers[1].mix.to_queries.weight, model.layers[1].mix.to_keys.weight
    m = (wq.T @ wk).detach().double()  # W_qk = W_q^T W_k in the input basis: bilinear form x^T W_qk y
    sym = (m + m.T) / 2
    want = float(torch.linalg.matrix_norm(sym) ** 2 - torch.linalg.matrix_norm((m - m.T) / 2) ** 2) / float(
        torch.linalg.matrix_norm(m) ** 2)
    row = [r for r in attn_probe.score_model(model, qk_names=[("to_queries", "to_keys")]) if r["layer"] == 1][0]
    assert row["symmetry"] == pytest.approx(want, abs=1e-5)


def test_unnamed_shapes_without_letters_guess_the_first_two_projections() -> None:
    """Projections with neither q nor k in their names: the first two of the model's width, in order."""
    model = nn.ModuleDict({"block": nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8), "c": nn.Linear(8, 8)})})
    text = message(lambda: find_attention(model))
    assert "block (ModuleDict: a, b, c)" in text
    assert "qk_names=[('a', 'b')]" in text


def test_unreadable_named_projections_are_named_not_the_head_count() -> None:
    """qk_names naming children attn_probe cannot read as projections: the message names the child and
    its class, instead of asking for a head count the module already states (issue 38)."""
    attn = nn.Module()
    attn.num_heads = 2
    attn.q_proj, attn.k_proj = nn.Conv1d(16, 16, 1), nn.Conv1d(16, 16, 1)
    text = message(lambda: find_attention(nn.ModuleDict({"attn": attn}), qk_names=[("q_proj", "k_proj")]))
    assert "attn.q_proj (Conv1d)" in text and "cannot read them as projections" in text
    assert "num_heads" not in text


def printed_call(text: str) -> str:
    """The ``register_adapter`` call the message prints (between backticks)."""
    return re.search(r"`(attn_probe\.register_adapter\(.*?\))`", text).group(1)


class Mixing(nn.Module):
    """vit-pytorch's attention block under another name (no 'attn' in its class or path): one fused
    ``to_qkv`` chunked into q, k, v, each split into ``heads`` heads of ``dim_head`` (12, not d / heads)."""

    def __init__(self, dim: int = 16, heads: int = 2, dim_head: int = 12) -> None:
        super().__init__()
        self.heads, self.scale = heads, dim_head**-0.5
        self.to_qkv = nn.Linear(dim, heads * dim_head * 3, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(-3, -2) for t in self.to_qkv(x).chunk(3, dim=-1))
        self.scores = q @ k.transpose(-1, -2) * self.scale  # (B, H, N, N): the reference
        return self.to_out((self.scores.softmax(-1) @ v).transpose(-3, -2).flatten(-2))


class MixingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"mix": Mixing(), "ff": Feed()}) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer["mix"](x)
        return x


def test_a_fused_to_qkv_in_a_class_not_named_like_attention_gets_a_call_that_works() -> None:
    """Issue 44: the message names the module and its fused child, and the register_adapter call it
    prints, run as printed, reads both layers: their logits equal the module's own forward's."""
    torch.manual_seed(0)
    model = MixingNet()
    text = message(lambda: find_attention(model))
    assert "layers.0.mix (Mixing: to_qkv, to_out)" in text
    assert "'to_qkv' looks like a fused q/k/v projection (layers.0.mix.to_qkv: 16 -> 72 = 3 x 24)" in text
    adapter = eval(printed_call(text), {"attn_probe": attn_probe})  # noqa: S307 - the call exactly as printed
    try:
        layers = find_attention(model)
        assert [(a.name, a.num_heads, a.head_dim) for a in layers] == [("layers.0.mix", 2, 12), ("layers.1.mix", 2, 12)]
        x = torch.randn(1, 5, 16)
        with torch.no_grad():
            model(x)
            mix, layer = model.layers[1]["mix"], layers[1]
            inner = x + model.layers[0]["mix"](x)  # layer 1's input
            for h in range(2):
                ours = inner[0] @ layer.qk_matrix(head=h).float() @ inner[0].T * mix.scale
                torch.testing.assert_close(ours, mix.scores[0, h], rtol=1e-4, atol=1e-5)
    finally:
        unregister_adapter(adapter)


@pytest.mark.parametrize("kv_heads", [None, 2], ids=["Attention", "GroupedQueryAttention"])
def test_transformer_lens_refusal_lists_its_attention_and_prints_a_call_that_works(tmp_path: Path, kv_heads) -> None:
    """Issue 44: TransformerLens keeps W_Q/W_K as [heads, d_model, d_head] parameters, no projection
    module (a verbatim-shaped HookedTransformer: tests/third_party_layouts.py). The refusal lists its
    attention modules and prints a register_adapter call; run as printed, watch attaches and the
    logits from the factors equal the forward's own attention scores (GQA keys repeat_interleave-d).
    On 70bdcc9: 'Candidate modules: none' and a qk_names placeholder that fails."""
    from tests.third_party_layouts import HookedTransformer, TLConfig

    torch.manual_seed(0)
    cfg = TLConfig(n_key_value_heads=kv_heads)
    model = HookedTransformer(cfg)
    text = message(lambda: attn_probe.watch(model, log_dir=str(tmp_path / "a"), every=1))
    kind = "GroupedQueryAttention" if kv_heads else "Attention"
    assert f"blocks.0.attn ({kind}: parameters W_Q [4, 16, 8]" in text and "Candidate modules: none" not in text
    assert "my_q" not in text
    adapter = eval(printed_call(text), {"attn_probe": attn_probe})  # noqa: S307 - the call exactly as printed
    try:
        probe = attn_probe.watch(model, log_dir=str(tmp_path / "b"), every=1)
        probe.close()
        layers = find_attention(model)
        assert [(a.name, a.num_heads, a.num_kv_heads, a.head_dim) for a in layers] == [
            (f"blocks.{i}.attn", 4, kv_heads or 4, 8) for i in range(2)]
        seen = {}
        attn = model.blocks[1].attn
        attn.hook_attn_scores.register_forward_hook(lambda m, args, out: seen.update(scores=out))
        attn.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
        with torch.no_grad():
            model(torch.randint(0, cfg.d_vocab, (1, 6)))
            x = seen["x"][0]
            for h in range(4):
                ours = x @ layers[1].qk_matrix(head=h).float() @ x.T / math.sqrt(cfg.d_head)
                torch.testing.assert_close(ours, seen["scores"][0, h], rtol=1e-4, atol=1e-5)
    finally:
        unregister_adapter(adapter)
