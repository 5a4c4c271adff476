"""A model that calls ``flex_attention`` inside the user's own ``torch.compile`` of the model is not
measured (docs/scores.md says why; eager flex is, tests/activations/test_flex_capture.py), and the
armed capture must not harm it: its training forwards give the same outputs as an unwatched
copy's, and the due steps say once which layers were not measured, naming FlexAttention.

torch 2.13's flex has no backward on CPU, so only the head trains here: the attention modules
are frozen and their inputs need no gradient, while the forward still runs with gradients on
(a counted forward for the probe).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import attn_probe
from tests.activations.sdpa_stacks import Net, NanoCausalSelfAttention

flex = pytest.importorskip("torch.nn.attention.flex_attention")

B, T, D = 2, 16, 32


class FlexCausalSelfAttention(NanoCausalSelfAttention):
    """nanoGPT's attention with ``flex_attention`` and a causal ``BlockMask`` in place of sdpa."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.c_attn(x).split(self.n_embd, dim=2))
        y = flex.flex_attention(q, k, v, block_mask=_causal(t))
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


_MASKS: dict[int, object] = {}


def _causal(t: int):
    if t not in _MASKS:
        _MASKS[t] = flex.create_block_mask(lambda _b, _h, qi, ki: qi >= ki, None, None, t, t, device="cpu")
    return _MASKS[t]


def _net() -> Net:
    torch.manual_seed(0)
    net = Net("nanogpt")
    for block in net.blocks:
        block.attn = FlexCausalSelfAttention()
    for name, p in net.named_parameters():
        p.requires_grad_(name.startswith("head."))
    return net


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_an_armed_capture_leaves_compiled_flex_models_untouched_and_says_what_it_missed(backend, tmp_path) -> None:
    net, twin = _net(), _net()
    run = torch.compile(net, backend=backend)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = torch.optim.SGD(net.head.parameters(), lr=0.0)
        probe = attn_probe.watch(net, optimizer=opt, every=1, attention_stats=True, metrics=("symmetry",),
                                 log_dir=str(tmp_path / "tb"))
        outs = []
        for _ in range(2):
            out = run(x)
            out.sum().backward()
            opt.step()
            opt.zero_grad()
            outs.append(out.detach())
        probe.close()
    with torch.no_grad():
        ref = twin(x)
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    said = [str(w.message) for w in caught if "not measured" in str(w.message) or "measured nothing" in str(w.message)]
    assert said, [str(w.message) for w in caught]
    assert any("blocks.0.attn" in m and "FlexAttention under torch.compile" in m
               for m in said), said


def test_real_torchtitan_03_flex_compiled_by_torchtitan_is_warned_and_untouched(tmp_path) -> None:
    """torchtitan 0.3's ``FlexAttention`` runs ``flex_attention`` through its own ``torch.compile``
    (inductor, a class attribute): no eager call of flex's operator remains to measure. The due
    steps say so, naming FlexAttention under torch.compile, and the outputs equal an unwatched copy's."""
    config_utils = pytest.importorskip("torchtitan.models.common.config_utils")
    from torchtitan.models.common import ComplexRoPE

    def build() -> torch.nn.Module:
        torch.manual_seed(3)
        cfg = config_utils.make_gqa_config(
            dim=D, n_heads=8, n_kv_heads=2, wqkv_param_init={"weight": torch.nn.init.normal_},
            wo_param_init={"weight": torch.nn.init.normal_}, inner_attention=config_utils.get_attention_config("flex"),
            rope=ComplexRoPE.Config(dim=4, max_seq_len=64), fuse_qkv=True)
        model = _Titan(cfg)
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("head."))
        return model

    net, twin = build(), build()
    mask = flex.create_block_mask(lambda _b, _h, qi, ki: qi >= ki, None, None, T, T, device="cpu")
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(net.head.parameters(), lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = attn_probe.watch(net, optimizer=opt, every=1, attention_stats=True, metrics=("symmetry",),
                                 log_dir=str(tmp_path / "tb"))
        out = net(x, mask)
        out.sum().backward()
        opt.step()
        probe.close()
    with torch.no_grad():
        torch.testing.assert_close(out.detach(), twin(x, mask), rtol=0, atol=0)
    said = [str(w.message) for w in caught if "not measured" in str(w.message)]
    assert any("layers.0.attention" in m and "FlexAttention under torch.compile" in m for m in said), said


class _Titan(torch.nn.Module):
    """Two torchtitan 0.3 ``GQAttention`` layers (flex inner attention) with residuals and a head."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.ModuleDict({"attention": cfg.build()}) for _ in range(2)])
        self.head = torch.nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, mask) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer["attention"](x, mask)
        return self.head(x)
