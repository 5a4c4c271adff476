"""x-transformers' grouped-query attention pairs query head ``h`` with key head ``h % kv_heads`` (issue 44,
finding 1): its ``Attend`` tiles the keys (``repeat(k, 'b kvh n d -> b (r kvh) n d')``), where every other
layout repeats each key head for a run of query heads (``h // (H / Hkv)``).

The pairing is never assumed here: it is read from the forward's own logits. For each query head ``h`` the
key head ``g`` is the one whose ``scale * (x W_q[h]^T)(x W_k[g]^T)^T`` equals the logits the forward kept
(x-transformers' ``qk_similarities``), ``x`` the input its ``to_q`` received. With rotary embeddings only the
diagonal ``q_i . k_i`` is compared (the same rotation on both sides cancels). The float64 reference is then
``M_h = W_q[h]^T W_k[g]`` from the module's weights, and attn_probe's per-head and layer scores must equal its
symmetry, directionality and Frobenius norm to 1e-5.

The real package is installed apart (``pip install --target DIR --no-deps x-transformers einops loguru einx
torch-einops-utils frozendict``, ``PYTHONPATH=DIR``); the verbatim-shaped module of
``tests/third_party_layouts.py`` runs everywhere.
"""

from __future__ import annotations

import pytest
import torch
from third_party_layouts import XTransformersAttention
from torch import nn

from attn_probe import score_model
from attn_probe.extraction import find_attention
from tests.extraction.test_research_layouts import directionality64, symmetry64

TOL = 1e-5


def forward_pairing(attn: nn.Module, x: torch.Tensor, sim: torch.Tensor, diagonal: bool = False) -> list[int]:
    """The key head each query head meets in the forward: the one ``g`` whose logits, from ``x`` and the
    module's ``to_q``/``to_k`` weights, equal the forward's ``sim (B, H, N, N)`` (its diagonal only when
    ``diagonal``: rotary-invariant); exactly one must fit."""
    heads, kv = attn.heads, attn.kv_heads
    x, sim = x.detach().double(), sim.detach().double()
    q = (x @ attn.to_q.weight.detach().double().T).unflatten(-1, (heads, -1))  # (B, N, H, dh)
    k = (x @ attn.to_k.weight.detach().double().T).unflatten(-1, (kv, -1))
    scale = q.shape[-1] ** -0.5
    pairing = []
    for h in range(heads):
        own = sim[:, h].diagonal(dim1=-2, dim2=-1) if diagonal else sim[:, h]
        errors = []
        for g in range(kv):
            mine = torch.einsum("bid,bjd->bij", q[:, :, h], k[:, :, g]) * scale
            mine = mine.diagonal(dim1=-2, dim2=-1) if diagonal else mine
            errors.append(float((mine - own).abs().max() / own.abs().max()))
        fits = [g for g, e in enumerate(errors) if e < 1e-9]
        assert len(fits) == 1 and (kv == 1 or min(e for e in errors if e >= 1e-9) > 1e-3), (h, errors)
        pairing.append(fits[0])
    return pairing


def reference(attn: nn.Module, pairing: list[int]) -> list[torch.Tensor]:
    """``M_h = W_q[h]^T W_k[pairing[h]]`` in float64, from the module's weights."""
    wq = attn.to_q.weight.detach().double().unflatten(0, (attn.heads, -1))  # (H, dh, d)
    wk = attn.to_k.weight.detach().double().unflatten(0, (attn.kv_heads, -1))
    return [wq[h].T @ wk[g] for h, g in enumerate(pairing)]


def assert_scores_equal_reference(
    model: nn.Module, attns: list[nn.Module], pairings: list[list[int]]
) -> None:
    layers = find_attention(model)
    assert [a.module for a in layers] == attns
    rows = score_model(
        model, per_head=True, dtype=torch.float64, metrics=("symmetry", "directionality", "frobenius_norm")
    )
    for layer, attn, pairing in zip(layers, attns, pairings, strict=True):
        per_head = reference(attn, pairing)
        mine = {r["head"]: r for r in rows if r["name"] == layer.name}
        assert sorted(mine, key=lambda h: -1 if h is None else h) == [None, *range(attn.heads)]
        for head, m in [(None, sum(per_head)), *enumerate(per_head)]:
            row = mine[head]
            assert row["symmetry"] == pytest.approx(symmetry64(m), abs=TOL), (layer.name, head)
            assert row["directionality"] == pytest.approx(directionality64(m), abs=TOL), (layer.name, head)
            assert row["frobenius_norm"] == pytest.approx(float(m.norm()), rel=TOL), (layer.name, head)
        assert torch.allclose(
            layer.qk_matrix().double(), sum(per_head), atol=1e-12 * float(sum(per_head).abs().max())
        )


def grouped_would_differ(attn: nn.Module) -> bool:
    """The case tells the pairings apart: some head's grouped ``M_h`` is not its tiled one."""
    group = attn.heads // attn.kv_heads
    tiled = reference(attn, [h % attn.kv_heads for h in range(attn.heads)])
    grouped = reference(attn, [h // group for h in range(attn.heads)])
    return any(not torch.allclose(a, b) for a, b in zip(tiled, grouped, strict=True))


# --------------------------------------------------------------------------- verbatim-shaped (CI)
@pytest.mark.parametrize(("heads", "kv"), [(8, 2), (8, 4), (4, 1), (4, 4)])
def test_shaped_xtransformers_scores_equal_the_forwards_own_pairing(heads: int, kv: int) -> None:
    torch.manual_seed(heads + kv)
    model = nn.ModuleList([XTransformersAttention(32, heads=heads, kv_heads=kv) for _ in range(2)]).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    pairings = [forward_pairing(attn, x, attn(x)[1]) for attn in model]
    assert pairings[0] == [h % kv for h in range(heads)]
    assert grouped_would_differ(model[0]) == (1 < kv < heads)
    assert_scores_equal_reference(model, list(model), pairings)
    # the keys are tiled one per query head, as the forward does
    layers = find_attention(model)
    assert [(a.num_heads, a.num_kv_heads, a.head_dim) for a in layers] == [
        (heads, heads if kv < heads else kv, 8)
    ] * 2


# --------------------------------------------------------------------------- the real package
def _real_model(kv: int, rotary: bool, causal: bool) -> tuple[nn.Module, list[nn.Module]]:
    xt = pytest.importorskip("x_transformers")
    layers_cls = xt.Decoder if causal else xt.Encoder
    torch.manual_seed(kv + 10 * rotary)
    model = xt.TransformerWrapper(
        num_tokens=50,
        max_seq_len=16,
        attn_layers=layers_cls(
            dim=64, depth=2, heads=8, attn_kv_heads=kv, attn_dim_head=16, rotary_pos_emb=rotary
        ),
    ).double()
    attns = [m for m in model.modules() if type(m).__name__ == "Attention" and hasattr(m, "to_q")]
    assert len(attns) == 2
    return model, attns


@pytest.mark.parametrize(
    ("kv", "rotary", "causal"),
    [(2, False, False), (4, False, False), (1, False, False), (2, True, True)],
    ids=["kv2", "kv4", "kv1", "kv2-rotary-causal"],
)
def test_real_xtransformers_scores_equal_the_forwards_own_pairing(
    kv: int, rotary: bool, causal: bool
) -> None:
    model, attns = _real_model(kv, rotary, causal)
    inputs: dict[nn.Module, torch.Tensor] = {}
    hooks = [
        a.to_q.register_forward_pre_hook(lambda m, args, a=a: inputs.__setitem__(a, args[0])) for a in attns
    ]
    try:
        with torch.no_grad():
            _, intermediates = model(torch.randint(0, 50, (2, 12)), return_intermediates=True)
    finally:
        for hook in hooks:
            hook.remove()
    sims = [i.qk_similarities for i in intermediates.attn_intermediates]  # scaled q.k, before bias and mask
    pairings = [
        forward_pairing(a, inputs[a], sim, diagonal=rotary) for a, sim in zip(attns, sims, strict=True)
    ]
    assert pairings == [[h % kv for h in range(8)]] * 2
    assert grouped_would_differ(attns[0]) == (1 < kv < 8)
    assert_scores_equal_reference(model, attns, pairings)
