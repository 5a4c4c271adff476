"""Attention statistics on CUDA (skipped without a GPU): sdpa equals eager, bf16 is close to the
float64 CPU reference, and the measured values do not depend on the device.

Run on a GPU machine with ``bash benchmarks/gpu_session.sh attention``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from helpers import tiny_model  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from attn_probe.activations.statistics import AttentionCapture  # noqa: E402
from attn_probe.extraction import find_attention  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model(impl: str, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    model = tiny_model("llama", impl=impl, hidden_size=64, num_attention_heads=8, intermediate_size=128, vocab_size=199,
                       max_position_embeddings=2048, initializer_range=0.2)
    return model.to(device=device, dtype=dtype).train()


def _batch(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 199, (3, 33), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    return ids, mask


def _measure(impl: str, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    """One training forward and backward measured; the tables on the CPU in float64."""
    model = _model(impl, dtype, device)
    ids, mask = _batch(device)
    capture = AttentionCapture(model, find_attention(model))
    try:
        capture.arm()
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        capture.disarm()
        assert capture.failures == [] and capture.missing() == []
        return [t.cpu() for t in capture.collect().tables()]
    finally:
        capture.close()


def test_sdpa_equals_eager_on_cuda():
    eager, sdpa = _measure("eager", torch.float32, "cuda"), _measure("sdpa", torch.float32, "cuda")
    for a, b in zip(eager, sdpa, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_cuda_float32_equals_cpu_float64():
    cpu, cuda = _measure("sdpa", torch.float64, "cpu"), _measure("sdpa", torch.float32, "cuda")
    for a, b in zip(cpu, cuda, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_bf16_on_cuda_close_to_the_float64_reference():
    """bf16 weights and activations (the model's own rounding): within bf16's resolution of the
    float64 values (logits formed in float32 from the bf16 q and k)."""
    cpu, bf16 = _measure("sdpa", torch.float64, "cpu"), _measure("sdpa", torch.bfloat16, "cuda")
    for a, b in zip(cpu, bf16, strict=True):
        torch.testing.assert_close(b, a, rtol=5e-2, atol=5e-2)
