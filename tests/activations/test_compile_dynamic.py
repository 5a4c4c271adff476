"""The sdpa statistics traced into a user's ``torch.compile(dynamic=True)`` graph (symbolic sequence
lengths): the compiled forward runs at every length, including one above ``entropy_rows`` (the
sampled path), and each due step's per-head values equal those of the same model run eagerly
(the eager path is checked against float64 references in ``test_sdpa_capture.py``)."""

from __future__ import annotations

import pytest
import torch

from attn_probe.activations.statistics import AttentionCapture
from attn_probe.extraction import find_attention
from tests.activations.sdpa_stacks import D, Net

LENGTHS = (16, 300, 24)


def _steps(run, net) -> list:
    capture = AttentionCapture(net, find_attention(net))
    out = []
    for i, length in enumerate(LENGTHS):
        x = torch.randn(2, length, D, generator=torch.Generator().manual_seed(i))
        capture.arm()
        y = run(x)
        capture.disarm()
        stats = capture.collect()
        out.append((y.detach(), stats.max_logit.clone(), stats.entropy_sum / stats.tokens, stats.tokens.clone()))
    capture.close()
    return out


def test_dynamic_shapes_compile_and_match_the_eager_values():
    torch.manual_seed(0)
    net = Net("nanogpt")
    eager = _steps(net, net)
    torch._dynamo.reset()
    compiled = _steps(torch.compile(net, backend="aot_eager", dynamic=True, fullgraph=True), net)
    for length, (y0, mx0, ent0, tok0), (y1, mx1, ent1, tok1) in zip(LENGTHS, eager, compiled, strict=True):
        torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
        assert tok1.tolist() == tok0.tolist() == [2.0 * length] * len(tok0), length
        assert mx1.tolist() == pytest.approx(mx0.tolist(), rel=1e-5), length
        assert ent1.tolist() == pytest.approx(ent0.tolist(), rel=1e-5), length
