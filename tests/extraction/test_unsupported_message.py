"""The unsupported-model message: the fix in the form of the call the user made, the fused-projection
hint by width, and ``attn-probe models`` (run here exactly as the message prints it)."""

from __future__ import annotations

import ast
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
