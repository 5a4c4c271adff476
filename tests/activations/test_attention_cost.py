"""The cheap paths of the attention statistics (attn_probe.activations.logits) against references.

The plain path (no mask, or causal with an offset: no boolean mask of the chunk) must give the
general path's values on the same call; with entropy sampling on (``entropy_rows``), ``max_logit``
and the signed max must still equal explicit float64 references over every counted entry, and the
sampled entropy must lie within the Hoeffding bound of the exact one (explicit q/k, and a small
Llama's training forward against eager attention's own probabilities).
"""

from __future__ import annotations

import math

import pytest
import torch

from attn_probe.activations.logits import entropy_error_bound, sample_rows
from attn_probe.activations.masks import PlainRows, sdpa_row_mask
from attn_probe.activations.statistics import logit_stats


def _reference(q, k, scaling, offset):
    """float64 (max |l|, entropy per row, counted rows mask, signed max) with explicit causal masks."""
    H, Hkv, Lq, Lk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    logits = torch.einsum("bhqd,bhkd->bhqk", q.double() * scaling, k.double().repeat_interleave(H // Hkv, 1))
    visible = torch.ones(Lq, Lk, dtype=torch.bool)
    if offset is not None:
        visible = torch.arange(Lk)[None] <= torch.arange(Lq)[:, None] + offset
    counted = visible.any(-1)
    top = logits.abs().masked_fill(~visible, -math.inf)[:, :, counted].amax(dim=(0, 2, 3))
    signed = logits.masked_fill(~visible, -math.inf)[:, :, counted].amax(dim=(0, 2, 3))
    p = torch.softmax(logits.masked_fill(~visible, -math.inf), -1)
    rows = -torch.where(p > 0, p * p.log(), 0.0).sum(-1)  # (B, H, Lq)
    return top, rows, counted, signed


@pytest.mark.parametrize("Lq, Lk, offset", [(70, 70, 0), (40, 90, 50), (90, 40, -50), (33, 33, None)])
@pytest.mark.parametrize("chunk", [1, 2 * 4 * 90 * 7, 1 << 22])
def test_plain_path_equals_the_general_path_and_the_reference(Lq, Lk, offset, chunk):
    gen = torch.Generator().manual_seed(Lq + Lk)
    q, k = torch.randn(2, 4, Lq, 8, generator=gen) * 2, torch.randn(2, 2, Lk, 8, generator=gen) * 2
    plain = logit_stats(q, k, 0.3, PlainRows(offset, Lk, q.device), chunk_elements=chunk)
    called = PlainRows(offset, Lk, q.device)  # the same mask, given as an explicit boolean mask

    def general(r0, r1):
        return called(r0, r1)

    other = logit_stats(q, k, 0.3, general, chunk_elements=chunk)
    for a, b in zip(plain, other, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    top, rows, counted, signed = _reference(q, k, 0.3, offset)
    torch.testing.assert_close(plain[0].double(), top, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(plain[3].double(), signed, rtol=1e-6, atol=1e-6)
    assert plain[2].tolist() == [2.0 * int(counted.sum())] * 4
    torch.testing.assert_close(plain[1].double(), rows[:, :, counted].sum(dim=(0, 2)), rtol=1e-5, atol=1e-4)


def test_sdpa_without_a_mask_reads_as_plain_rows():
    rows = sdpa_row_mask(None, True, 5, 5, torch.device("cpu"))
    assert isinstance(rows, PlainRows) and rows.offset == 0
    assert torch.equal(rows(1, 3)[0][0, 0], torch.ones(5, 5, dtype=torch.bool).tril()[1:3])


@pytest.mark.parametrize("offset", [0, None])
def test_sampled_entropy_keeps_max_logit_exact(offset):
    """entropy_rows=64 on 1,000 query rows: max |l| and the signed max equal the float64 reference
    (float64 inputs: the same arithmetic to rounding); the entropy is within Hoeffding's bound."""
    L, m_rows = 1000, 64
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, L, 16, generator=gen, dtype=torch.float64) * 1.5
    k = torch.randn(2, 2, L, 16, generator=gen, dtype=torch.float64) * 1.5
    top, ent, count, signed = logit_stats(q, k, 0.25, PlainRows(offset, L, q.device), entropy_rows=m_rows,
                                          chunk_elements=2 * 4 * L * 50)
    ref_top, rows, counted, ref_signed = _reference(q, k, 0.25, offset)
    torch.testing.assert_close(top, ref_top, rtol=1e-12, atol=0)
    torch.testing.assert_close(signed, ref_signed, rtol=1e-12, atol=0)
    assert count.tolist() == [2.0 * L] * 4  # the count is that of every row
    exact = rows.mean(dim=(0, 2))
    start, stride = sample_rows(0, L, m_rows)
    m = len(range(start, L, stride))
    assert stride > 1 and m >= m_rows // 2
    # the sample is exactly the systematic one (an independent average of the reference rows)
    torch.testing.assert_close(ent / count, rows[:, :, start::stride].mean(dim=(0, 2)), rtol=1e-10, atol=1e-10)
    error = (ent / count - exact).abs()
    assert (error <= entropy_error_bound(L, m)).all(), (error, entropy_error_bound(L, m))
    assert (error > 0).any()  # the sample was used (not every row)


def test_entropy_rows_leaves_short_calls_exact():
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 40, 8, generator=gen), torch.randn(1, 2, 40, 8, generator=gen)
    rows = PlainRows(0, 40, q.device)
    for a, b in zip(logit_stats(q, k, 0.5, rows, entropy_rows=40), logit_stats(q, k, 0.5, rows), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="entropy_rows"):
        logit_stats(q, k, 0.5, rows, entropy_rows=0)


def test_entropy_error_bound():
    assert entropy_error_bound(2048, 256, 0.01) == pytest.approx(math.log(2048) * math.sqrt(math.log(200) / 512))


def test_sampled_entropy_on_a_llama_training_forward():
    """A small float64 Llama (sdpa, 600 positions, no padding), one training forward measured with
    the default entropy_rows (256: a sample) and with None (every row): max_logit of both equals the
    float64 reference from the model's own projections, the exact entropy equals eager attention's
    probabilities' and the sampled one is within Hoeffding's bound of it."""
    pytest.importorskip("transformers")
    from test_attention_stats import _llama, _reference

    from attn_probe.activations.statistics import AttentionCapture
    from attn_probe.extraction import find_attention

    L = 600
    model = _llama("sdpa")
    ids = torch.randint(1, 99, (2, L), generator=torch.Generator().manual_seed(2))
    tables = {}
    for rows in (256, None):
        capture = AttentionCapture(model, find_attention(model), entropy_rows=rows)
        capture.arm()
        model(ids).last_hidden_state.sum().backward()  # a training forward (gradients on)
        capture.disarm()
        tables[rows] = capture.collect().tables()
        capture.close()
    model.set_attn_implementation("eager")
    reference = _reference("llama", model, ids, None)
    start, stride = sample_rows(0, L, 256)
    bound = entropy_error_bound(L, len(range(start, L, stride)))
    for (ref_max, ref_ent), sampled, exact in zip(reference, tables[256], tables[None], strict=True):
        torch.testing.assert_close(sampled[0], ref_max, rtol=1e-6, atol=1e-6)  # rotary in float32
        torch.testing.assert_close(exact[0], ref_max, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sampled[0], exact[0], rtol=0, atol=0)  # the same entries, all of them
        torch.testing.assert_close(exact[1], ref_ent, rtol=1e-5, atol=1e-5)
        assert ((sampled[1] - ref_ent).abs() <= bound).all()
        assert not torch.equal(sampled[1], exact[1])  # the sample was used
