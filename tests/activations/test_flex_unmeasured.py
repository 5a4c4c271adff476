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
    assert any("blocks.0.attn" in m and "FlexAttention inside the model's own torch.compile" in m
               for m in said), said
