"""Built-in layouts of the stacks research code trains with: nanoGPT-style, timm and LitGPT attention.

Each model is scored without an adapter, and its layer scores must equal an explicit float64
computation from the module's *own* q/k: the attention module is run on the identity
(``x = I_d``, one token per basis vector, biases zeroed, rotary turned off), the ``q`` and ``k``
its forward hands to scaled-dot-product attention are captured (after the module's own split,
head reshape and GQA expansion), and ``M = sum_h q_h k_h^T`` (``q_h = W_q^h^T`` as ``d x dh``).

* nanoGPT: the verbatim-shaped ``CausalSelfAttention``/``Block``/``GPT`` of ``tests/third_party_layouts.py``
  (Karpathy's public architecture: same attribute names, same ``c_attn(x).split(n_embd, dim=2)``).
* timm: ``timm`` needs ``torchvision``, which does not install beside this machine's CPU torch, so
  ``Attention`` of ``tests/third_party_layouts.py`` is verbatim-shaped after
  ``timm.layers.attention.Attention`` (timm 1.0.31) and carries timm's module name, by which the real
  class is recognised.
* LitGPT: the real ``litgpt`` package (``GPT`` from a tiny ``Config``, GQA) when it imports; skipped
  otherwise (``pip install --no-deps litgpt``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from third_party_layouts import GPT, Attention, CausalSelfAttention, NanoConfig
from torch import nn

from attn_probe import score_model
from attn_probe.extraction import UnsupportedModelError, find_attention


# --------------------------------------------------------------------------- explicit float64 scores
def symmetry64(m: torch.Tensor) -> float:
    """<M, M^T>_F / ||M||_F^2 (the paper's 2r - 1)."""
    return float((m * m.T).sum() / (m * m).sum())


def directionality64(m: torch.Tensor, num_std: float = 2.0) -> float:
    """(R - C) / (R + C) from row and column norms above mean + 2 std (unbiased)."""
    def excess(norms: torch.Tensor) -> float:
        tau = norms.mean() + num_std * norms.std(unbiased=True)
        return float((norms[norms > tau] - tau).sum())

    r, c = excess(m.norm(dim=1)), excess(m.norm(dim=0))
    return 0.0 if r + c == 0 else (r - c) / (r + c)


class Capture:
    """Replaces ``F.scaled_dot_product_attention`` to keep the q and k a forward passes it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        original = F.scaled_dot_product_attention

        def sdpa(q, k, v, *args, **kwargs):
            self.calls.append((q.detach().clone(), k.detach().clone()))
            return original(q, k, v, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)


def own_matrix(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``M = sum_h q_h k_h^T`` in float64 from one identity-input call: ``q, k (1, H, d, dh)``."""
    q64, k64 = q[0].double(), k[0].double()
    assert q64.shape[0] == k64.shape[0], "keys are expanded to the query heads before attention"
    return torch.einsum("hid,hjd->ij", q64, k64)


def zero_biases(model: nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and p.dim() == 1 and "ln" not in name and "norm" not in name:
                p.zero_()


def assert_scores_equal_own(model: nn.Module, matrices: list[torch.Tensor]) -> None:
    rows = [r for r in score_model(model, metrics=("symmetry", "directionality")) if r["head"] is None]
    assert len(rows) == len(matrices)
    for row, m in zip(rows, matrices, strict=True):
        assert row["symmetry"] == pytest.approx(symmetry64(m), abs=1e-5), row["name"]
        assert row["directionality"] == pytest.approx(directionality64(m), abs=1e-5), row["name"]


# --------------------------------------------------------------------------- nanoGPT
def test_nanogpt_scores_equal_its_own_projections(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = GPT(NanoConfig())
    layers = find_attention(model)
    assert [(a.name, a.num_heads, a.num_kv_heads, a.head_dim) for a in layers] == [
        (f"transformer.h.{i}.attn", 4, 4, 8) for i in range(2)]
    zero_biases(model)
    capture = Capture(monkeypatch)
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn(torch.eye(32).unsqueeze(0))
    assert_scores_equal_own(model, [own_matrix(q, k) for q, k in capture.calls])


def test_nanogpt_equal_q_and_k_blocks_score_one() -> None:
    """W_q = W_k in every head (c_attn's q and k blocks equal) scores exactly 1: the q block is read as q."""
    torch.manual_seed(1)
    model = GPT(NanoConfig(n_layer=1))
    with torch.no_grad():
        w = model.transformer.h[0].attn.c_attn.weight
        w[32:64] = w[:32]
        w[64:] = torch.randn(32, 32) * 5  # v must not matter
    assert score_model(model)[0]["symmetry"] == pytest.approx(1.0, abs=1e-6)


def test_nanogpt_style_with_other_widths_is_not_guessed() -> None:
    """``c_attn`` wider than ``3 * n_embd`` (a GQA variant) is not read as nanoGPT's layout."""
    attn = CausalSelfAttention(NanoConfig())
    attn.c_attn = nn.Linear(32, 64)
    with pytest.raises(UnsupportedModelError):
        find_attention(nn.ModuleDict({"attn": attn}))


# --------------------------------------------------------------------------- timm
class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads=heads, qkv_bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm1(x))


def test_timm_attention_scores_equal_its_own_projections(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    model = nn.Sequential(*(ViTBlock(48, 6) for _ in range(3)))
    assert [(a.name, a.num_heads, a.head_dim) for a in find_attention(model)] == [
        (f"{i}.attn", 6, 8) for i in range(3)]
    zero_biases(model)
    capture = Capture(monkeypatch)
    with torch.no_grad():
        for block in model:
            block.attn(torch.eye(48).unsqueeze(0))
    assert len(capture.calls) == 3
    assert_scores_equal_own(model, [own_matrix(q, k) for q, k in capture.calls])


def test_an_attention_class_of_another_package_is_not_read_as_timm() -> None:
    class Attention(nn.Module):  # same shape, not timm's: no guess
        def __init__(self) -> None:
            super().__init__()
            self.num_heads = 2
            self.qkv = nn.Linear(16, 48)

    with pytest.raises(UnsupportedModelError):
        find_attention(nn.Sequential(Attention()))


# --------------------------------------------------------------------------- LitGPT (real package)
@pytest.mark.parametrize("n_query_groups", [4, 2, 1])
def test_litgpt_scores_equal_its_own_projections(n_query_groups: int) -> None:
    litgpt_model = pytest.importorskip("litgpt.model")
    from litgpt.config import Config

    torch.manual_seed(3)
    config = Config(n_layer=2, n_embd=32, n_head=4, n_query_groups=n_query_groups, head_size=8, block_size=64,
                    vocab_size=50, padded_vocab_size=50, rotary_percentage=1.0, bias=True)
    model = litgpt_model.GPT(config)
    layers = find_attention(model)
    assert [(a.name, a.num_heads, a.num_kv_heads, a.head_dim) for a in layers] == [
        (f"transformer.h.{i}.attn", 4, n_query_groups, 8) for i in range(2)]
    zero_biases(model)
    matrices = []
    for block in model.transformer.h:
        attn = block.attn
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        original = attn.scaled_dot_product_attention

        def capture(q, k, v, *args, _seen=seen, _original=original, **kwargs):
            _seen.append((q.detach().clone(), k.detach().clone()))  # after litgpt's repeat_interleave
            return _original(q, k, v, *args, **kwargs)

        attn.scaled_dot_product_attention = capture
        d, rope = 32, config.rope_n_elem
        cos, sin = torch.ones(1, d, rope), torch.zeros(1, d, rope)  # rotary off: apply_rope is the identity
        with torch.no_grad():
            attn(torch.eye(d).unsqueeze(0), cos, sin)
        del attn.scaled_dot_product_attention
        (q, k), = seen
        matrices.append(own_matrix(q, k))
    assert_scores_equal_own(model, matrices)
