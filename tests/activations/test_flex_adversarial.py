"""Adversarial cases of the flex_attention statistics (:mod:`attn_probe.activations.flex`), eager flex
(the model not compiled): per head ``max_logit`` and entropy against a float64 reference written out
here from the q/k each call received, with the visible entries spelled out explicitly (never through
flex or the layer's ``mask_mod``); the model's outputs equal an unwatched twin's.

Cases: q_len != kv_len (lengths not multiples of the block size); BlockMasks depending on batch and
head, a broadcast BlockMask whose mask_mod depends on the head, a block-sparse ``from_kv_blocks``
mask, grouped-query heads with a per-head mask; ``and_masks``/``or_masks`` and
modifiers closing over a tensor and an int; a ``score_mod`` sending entries to ``-inf``; rows with no
visible key; block sizes ``(8, 4)``, 128 on short sequences, ``_compile=True``, no separate full
blocks; bf16 autocast; ``scale=``, ``return_lse``, ``return_aux``; a call whose head count is not the
layer's and a call without a block mask; sampled entropy at 300 and 600 rows.

Two cases check the eager rule where it differs from the kernels' block rule: eager flex
(``math_attention``, what every call outside an inductor graph runs) ignores the blocks and applies
``mask_mod`` on every entry, and so do the statistics of an eager call.

torch's flex has no backward on the CPU: the attention parameters are frozen, the forward runs with
gradients on (a counted forward).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch

import attn_probe
from tests.activations.sdpa_stacks import HEADS, D, NanoCausalSelfAttention, Net
from tests.activations.test_attention_health_live import Records

flex = pytest.importorskip("torch.nn.attention.flex_attention")

B, E = 2, D // HEADS
DOCS = torch.tensor([[0] * 9 + [1] * 15 + [2] * 16, [0] * 20 + [1] * 20])  # (B, 40) document ids
WINDOWS = torch.tensor([2, 5, 9, 40])  # per head
INT_WINDOW = 6


class FlexLayer(NanoCausalSelfAttention):
    """nanoGPT's projections; queries from the ``T`` input tokens, keys and values from ``prefix``
    fixed memory tokens followed by the input (``kv_len = prefix + T``); ``call(q, k, v)`` makes the
    flex call. Keeps float64 copies of the q and k passed."""

    def __init__(self, call, prefix: int = 0) -> None:
        super().__init__()
        self.call, self.calls, self.dtypes = call, [], []
        self.register_buffer("memory", torch.randn(1, prefix, D, generator=torch.Generator().manual_seed(7)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        src = torch.cat([self.memory.expand(b, -1, -1).to(x.dtype), x], 1)
        q = self.c_attn(x)[..., :c].view(b, t, HEADS, E).transpose(1, 2)
        k, v = (z.view(b, src.shape[1], HEADS, E).transpose(1, 2) for z in self.c_attn(src)[..., c:].split(c, -1))
        self.calls.append((q.detach().double(), k.detach().double()))
        self.dtypes.append(q.dtype)
        y = self.call(q, k, v)
        y = y[0] if isinstance(y, tuple) else y
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c).to(x.dtype))


def _net(call, prefix: int = 0) -> Net:
    torch.manual_seed(0)
    net = Net("nanogpt", layers=1)
    net.blocks[0].attn = FlexLayer(call, prefix)
    for name, p in net.named_parameters():
        p.requires_grad_(name.startswith("head."))
    return net


def _measure(call, x, *, prefix=0, entropy_rows=None, autocast=False):
    """One counted forward of a watched net and of its unwatched twin: (stats, calls, attn_probe
    warnings, capture failures); the outputs are checked equal."""
    from attn_probe.activations.statistics import AttentionCapture
    from attn_probe.extraction import find_attention

    net, twin = _net(call, prefix), _net(call, prefix)
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capture = AttentionCapture(net, find_attention(net), entropy_rows=entropy_rows)
        capture.arm()
        with amp():
            out = net(x)
        capture.disarm()
        stats = capture.collect()
        failures = list(capture.failures)
        capture.close()
    with amp():
        expected = twin(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    messages = [str(w.message) for w in caught if "attn_probe" in str(w.message)]
    _measure.dtypes = net.blocks[0].attn.dtypes
    return stats, net.blocks[0].attn.calls, messages, failures


def _reference(q, k, visible, scale=None, score=None):
    """Per head (max |l| over visible entries, sum of row entropies of softmax(score(l)), rows with a
    visible key); ``visible`` broadcasts to (B, H, Lq, Lk); entries ``score`` sends to -inf hidden."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = torch.einsum("bhid,bhjd->bhij", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = logits if score is None else score(logits)
    vis = visible.expand(logits.shape) & (s > -math.inf)
    rows = vis.any(-1)
    top = torch.where(vis, logits.abs(), -math.inf).amax(dim=(0, 2, 3))
    p = torch.softmax(torch.where(vis, s, -math.inf), dim=-1).nan_to_num(0.0)
    ent = -torch.where(vis, torch.special.xlogy(p, p), 0).sum(-1)
    return top, torch.where(rows, ent, 0).sum(dim=(0, 2)), rows.sum(dim=(0, 2)).double()


def _check(stats, calls, messages, failures, visible, *, scale=None, score=None, heads=HEADS):
    assert not failures and not messages, (failures, messages)
    (q, k), = calls
    top, ent, rows = _reference(q, k, visible, scale, score)
    assert torch.isfinite(stats.max_logit[:heads]).all() and torch.isfinite(stats.entropy_sum[:heads]).all()
    assert stats.tokens[:heads].tolist() == rows.tolist()
    for h in range(heads):
        assert float(stats.max_logit[h]) == pytest.approx(float(top[h]), rel=1e-5), h
        assert float(stats.entropy_sum[h] / stats.tokens[h]) == pytest.approx(float(ent[h] / rows[h]), rel=1e-5), h
    if stats.scaling[0] is not None:
        assert stats.scaling[0] == pytest.approx(E ** -0.5 if scale is None else scale, rel=1e-12)


def _x(t: int, seed: int = 1, batch: int = B) -> torch.Tensor:
    return torch.randn(batch, t, D, generator=torch.Generator().manual_seed(seed)) * 2


def _ij(lq: int, lk: int, offset: int = 0):
    return torch.arange(lq)[:, None] + offset, torch.arange(lk)[None, :]


# ----------------------------------------------------------------------------- 1. q_len != kv_len
@pytest.mark.parametrize("t, prefix, block", [(24, 16, 16), (20, 17, 8), (13, 27, (8, 4))])
def test_queries_fewer_than_keys(t, prefix, block):
    """Queries at positions ``prefix ..``, causal over the memory and the input; the BlockMask built
    for (t, prefix + t), lengths not multiples of the block size."""
    def mask_mod(b, h, q, kv):
        return q + prefix >= kv

    mask = flex.create_block_mask(mask_mod, None, None, t, prefix + t, device="cpu", BLOCK_SIZE=block)
    out = _measure(lambda q, k, v: flex.flex_attention(q, k, v, block_mask=mask), _x(t), prefix=prefix)
    i, j = _ij(t, prefix + t, prefix)
    _check(*out, (j <= i)[None, None])


# ------------------------------------------------------------- 2. per batch and head; broadcast masks
def _per_batch_head(b, h, q, kv):
    return (DOCS[b, q] == DOCS[b, kv]) & (q >= kv) & (q - kv < WINDOWS[h])


def _explicit_batch_head(t: int) -> torch.Tensor:
    i, j = _ij(t, t)
    docs = DOCS[:, :t]
    same = docs[:, :, None] == docs[:, None, :]  # (B, T, T)
    window = (i - j)[None] < WINDOWS[:, None, None]  # (H, T, T)
    return same[:, None] & (j <= i)[None, None] & window[None]


def test_block_mask_per_batch_and_head():
    t = 40
    mask = flex.create_block_mask(_per_batch_head, B, HEADS, t, t, device="cpu", BLOCK_SIZE=8)
    out = _measure(lambda q, k, v: flex.flex_attention(q, k, v, block_mask=mask), _x(t))
    _check(*out, _explicit_batch_head(t))


def _head_window(b, h, q, kv):
    return (q >= kv) & (q - kv < WINDOWS[h])


def _flex_probabilities(q, k, block_mask):
    """The attention weights flex itself computes: its output for one-hot values."""
    lk = k.shape[2]
    eye = torch.eye(lk, dtype=q.dtype).expand(q.shape[0], k.shape[1], lk, lk)
    return flex.flex_attention(q, k, eye, block_mask=block_mask)


def test_broadcast_block_mask_with_a_head_dependent_mask_mod():
    """``create_block_mask(B=None, H=None)`` evaluates the mask_mod for head 0 only: the blocks it
    marks full or empty are wrong for the other heads. Eager flex (``math_attention``, the
    implementation every non-inductor call runs) ignores the blocks and evaluates ``mask_mod`` per
    real (b, h) on every entry; the reference is therefore what flex itself computed (checked here
    against its own output with one-hot values), the per-head windows written out."""
    t = 40
    mask = flex.create_block_mask(_head_window, None, None, t, t, device="cpu", BLOCK_SIZE=8)
    i, j = _ij(t, t)
    per_head = ((j <= i)[None] & ((i - j)[None] < WINDOWS[:, None, None]))[None]  # (1, H, T, T)
    stats, calls, messages, failures = _measure(
        lambda q, k, v: flex.flex_attention(q, k, v, block_mask=mask), _x(t))
    (q, k), = calls
    probs = _flex_probabilities(q, k, mask)
    assert torch.equal(probs > 0, per_head.expand(probs.shape))  # flex: mask_mod of the real head everywhere
    # the block rule differs for the heads whose windows cross head 0's blocks
    blocks = flex.create_mask(_head_window, 1, 1, t, t, device="cpu")  # head 0's visibility
    assert not torch.equal(per_head, blocks.expand(per_head.shape))
    _check(stats, calls, messages, failures, per_head)


def test_block_sparse_mask_from_kv_blocks():
    """A BlockMask given by its blocks alone (public ``BlockMask.from_kv_blocks``, ``noop_mask``): each
    query block lists kv blocks {its own, block 0}. flex's kernels read those blocks only; eager flex
    (``math_attention``) evaluates ``mask_mod`` on every entry and attends everything (checked
    against its own one-hot output), the reference for an eager call."""
    t, blk = 32, 8
    n = t // blk
    num = torch.where(torch.arange(n) == 0, 1, 2)  # query block i lists [i, 0]; the rest of a row unused
    kv_indices = torch.tensor([[0, 1, 2, 3], [1, 0, 2, 3], [2, 0, 1, 3], [3, 0, 1, 2]], dtype=torch.int32)
    mask = flex.BlockMask.from_kv_blocks(num.int()[None, None], kv_indices[None, None], BLOCK_SIZE=blk,
                                         mask_mod=flex.noop_mask, seq_lengths=(t, t))
    stats, calls, messages, failures = _measure(lambda q, k, v: flex.flex_attention(q, k, v, block_mask=mask), _x(t))
    (q, k), = calls
    everything = torch.ones(1, 1, t, t, dtype=torch.bool)
    assert (_flex_probabilities(q, k, mask) > 0).all()  # eager flex attended every entry
    _check(stats, calls, messages, failures, everything)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_heads_with_a_per_head_mask(kv_heads):
    """``enable_gqa`` with a mask_mod depending on the query head (the ``h`` flex passes)."""
    t = 32
    mask = flex.create_block_mask(_per_batch_head, B, HEADS, t, t, device="cpu", BLOCK_SIZE=8)
    out = _measure(lambda q, k, v: flex.flex_attention(q, k[:, :kv_heads], v[:, :kv_heads], block_mask=mask,
                                                       enable_gqa=True), _x(t))
    stats, calls, messages, failures = out
    (q, k), = calls
    _check(stats, [(q, k[:, :kv_heads])], messages, failures, _explicit_batch_head(t))


# ------------------------------------------------------------------- 3. composed masks and closures
def _causal(b, h, q, kv):
    return q >= kv


def _same_doc(b, h, q, kv):  # closes over a tensor
    return DOCS[b, q] == DOCS[b, kv]


def _int_window(b, h, q, kv):  # closes over a Python int
    return q - kv < INT_WINDOW


def _prefix(b, h, q, kv):
    return kv < 5


def test_and_masks_or_masks_and_closures():
    t = 40
    mask_mod = flex.or_masks(flex.and_masks(_causal, _same_doc, _int_window), _prefix)
    mask = flex.create_block_mask(mask_mod, B, None, t, t, device="cpu", BLOCK_SIZE=8)
    out = _measure(lambda q, k, v: flex.flex_attention(q, k, v, block_mask=mask), _x(t))
    i, j = _ij(t, t)
    docs = DOCS[:, :t]
    same = docs[:, :, None] == docs[:, None, :]
    visible = ((j <= i) & (i - j < INT_WINDOW) & same) | (j < 5)
    _check(*out, visible[:, None])


def test_int_closure_made_per_call():
    """A mask_mod made by a factory per window (a closure over a local int), two windows in two
    layers' worth of calls: each call's own window."""
    t = 32

    def window(w):
        return lambda b, h, q, kv: (q >= kv) & (q - kv < w)

    for w in (3, 11):
        mask = flex.create_block_mask(window(w), None, None, t, t, device="cpu", BLOCK_SIZE=8)
        out = _measure(lambda q, k, v, mask=mask: flex.flex_attention(q, k, v, block_mask=mask), _x(t, seed=w))
        i, j = _ij(t, t)
        _check(*out, ((j <= i) & (i - j < w))[None, None])


# ----------------------------------------------------------------------- 4. score_mod sends to -inf
def _causal_score(score, b, h, q, kv):
    return torch.where(q >= kv, score, -float("inf"))


def test_score_mod_minus_inf_with_a_full_block_mask():
    """A full (non-causal) BlockMask and a score_mod hiding the future: the hidden entries count in
    neither max_logit nor the entropy (checked to matter: counting them changes some head's max)."""
    t = 32
    mask = flex.create_block_mask(flex.noop_mask, None, None, t, t, device="cpu", BLOCK_SIZE=8)
    out = _measure(lambda q, k, v: flex.flex_attention(q, k, v, score_mod=_causal_score, block_mask=mask), _x(t))
    i, j = _ij(t, t)
    (q, k), = out[1]
    everything, _, _ = _reference(q, k, torch.ones(1, 1, t, t, dtype=torch.bool))
    causal, _, _ = _reference(q, k, (j <= i)[None, None])
    assert (everything > causal * (1 + 1e-4)).any()  # the -inf entries would change max_logit
    _check(*out, torch.ones(1, 1, t, t, dtype=torch.bool),
           score=lambda z: torch.where(j <= i, z, -math.inf))


def test_score_mod_and_mask_mod_together_with_a_bias():
    """A biasing score_mod (finite) on top of a mask: the entropy is of the biased scores, max_logit of
    the raw logits; entries the score_mod sends to -inf in an otherwise visible row are dropped."""
    t = 24

    def score_mod(score, b, h, q, kv):
        return torch.where((q - kv) % 4 == 3, -float("inf"), score + 0.5 * h - 0.1 * (q - kv))

    mask = flex.create_block_mask(_causal, None, None, t, t, device="cpu", BLOCK_SIZE=8)
    out = _measure(lambda q, k, v: flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask), _x(t))
    i, j = _ij(t, t)
    hh = torch.arange(HEADS).double()[None, :, None, None]
    _check(*out, (j <= i)[None, None],
           score=lambda z: torch.where((i - j) % 4 == 3, -math.inf, z + 0.5 * hh - 0.1 * (i - j)))


# --------------------------------------------------------------------- 5. rows with no visible key
def test_rows_without_a_visible_key():
    """mask_mod hides every key of rows q % 5 == 3 (whole blocks empty for some of them with block 1
    on the query side), and score_mod hides every key of row 0: those rows are not counted, no NaN."""
    t = 30

    def mask_mod(b, h, q, kv):
        return (q % 5 != 3) & (q >= kv)

    def score_mod(score, b, h, q, kv):
        return torch.where(q == 0, -float("inf"), score)

    for block in (8, (1, 8)):
        mask = flex.create_block_mask(mask_mod, None, None, t, t, device="cpu", BLOCK_SIZE=block)
        stats, calls, messages, failures = _measure(
            lambda q, k, v, mask=mask: flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask), _x(t))
        i, j = _ij(t, t)
        visible = ((i % 5 != 3) & (j <= i) & (i != 0))[None, None]
        assert not torch.isnan(stats.max_logit).any() and not torch.isnan(stats.entropy_sum).any()
        assert stats.tokens.tolist() == [float(B * (t - 6 - 1))] * HEADS
        _check(stats, calls, messages, failures, visible)


def test_every_row_hidden():
    """No visible entry at all: nothing counted, no NaN, no failure, outputs untouched."""
    t = 16
    mask = flex.create_block_mask(lambda b, h, q, kv: q < 0, None, None, t, t, device="cpu", BLOCK_SIZE=8)
    stats, _, messages, failures = _measure(lambda q, k, v: flex.flex_attention(q, k, v, block_mask=mask), _x(t))
    assert not failures, failures
    assert stats.tokens.tolist() == [0.0] * HEADS
    assert not torch.isnan(stats.max_logit).any() and not torch.isnan(stats.entropy_sum).any()
    assert stats.entropy_sum.tolist() == [0.0] * HEADS


# ------------------------------------------------------------------------------- 6. block sizes
@pytest.mark.parametrize("block, compiled, separate", [((8, 4), False, True), (128, False, True), (16, True, True),
                                                       ((4, 8), False, False)])
def test_block_sizes(block, compiled, separate):
    t = 37
    mask = flex.create_block_mask(_per_batch_head, B, HEADS, t, t, device="cpu", BLOCK_SIZE=block,
                                  _compile=compiled, separate_full_blocks=separate)
    out = _measure(lambda q, k, v: flex.flex_attention(q, k, v, block_mask=mask), _x(t))
    _check(*out, _explicit_batch_head(t))


# ---------------------------------------------------------------------------------- 7. autocast
def test_autocast_bf16():
    """Under CPU bf16 autocast the projections give bf16 q/k: the statistics are float32 of what the
    call received (the float64 reference of those bf16 values)."""
    t = 32
    mask = flex.create_block_mask(_causal, None, None, t, t, device="cpu", BLOCK_SIZE=8)
    stats, calls, messages, failures = _measure(
        lambda q, k, v: flex.flex_attention(q, k, v, block_mask=mask), _x(t), autocast=True)
    assert _measure.dtypes == [torch.bfloat16]
    i, j = _ij(t, t)
    _check(stats, calls, messages, failures, (j <= i)[None, None])


# --------------------------------------------------------------------- 8. scale, lse, aux outputs
@pytest.mark.parametrize("extra", ["scale", "return_lse", "return_aux"])
def test_scale_lse_aux(extra):
    t, scale = 24, 0.37
    mask = flex.create_block_mask(_causal, None, None, t, t, device="cpu", BLOCK_SIZE=8)
    kwargs = {"scale": {"scale": scale}, "return_lse": {"return_lse": True, "scale": scale},
              "return_aux": {"return_aux": flex.AuxRequest(lse=True)}}[extra]  # max_scores: not on CPU
    out = _measure(lambda q, k, v: flex.flex_attention(q, k, v, block_mask=mask, **kwargs), _x(t))
    i, j = _ij(t, t)
    _check(*out, (j <= i)[None, None], scale=kwargs.get("scale"))


# -------------------------------------------------------------------------------- 9. bad input
def test_head_count_not_the_layers():
    """The call splits each head in two (8 heads of 4): not measured, warned once with the reason,
    counted; the forward runs untouched."""
    t = 16
    mask = flex.create_block_mask(_causal, None, None, t, t, device="cpu", BLOCK_SIZE=8)

    def call(q, k, v):
        b, h, n, e = q.shape
        q, k, v = (z.reshape(b, h, n, 2, e // 2).transpose(2, 3).reshape(b, 2 * h, n, e // 2) for z in (q, k, v))
        y = flex.flex_attention(q, k, v, block_mask=mask)
        return y.reshape(b, h, 2, n, e // 2).transpose(2, 3).reshape(b, h, n, e)

    stats, _, messages, failures = _measure(call, _x(t))
    assert stats.tokens.tolist() == [0.0] * HEADS
    assert len(failures) == 1 and "8 query heads" in failures[0], failures
    assert len(messages) == 1 and "skipped" in messages[0] and "8 query heads" in messages[0], messages


def test_without_a_block_mask():
    """No block_mask: flex builds its own one-block mask (noop mask_mod): every entry visible."""
    t = 24
    out = _measure(lambda q, k, v: flex.flex_attention(q, k, v), _x(t), prefix=5)
    _check(*out, torch.ones(1, 1, t, t + 5, dtype=torch.bool))


def test_without_a_block_mask_with_a_score_mod():
    t = 24
    out = _measure(lambda q, k, v: flex.flex_attention(q, k, v, score_mod=_causal_score), _x(t))
    i, j = _ij(t, t)
    _check(*out, torch.ones(1, 1, t, t, dtype=torch.bool), score=lambda z: torch.where(j <= i, z, -math.inf))


def test_through_watch_with_every_row(tmp_path):
    """The same values through ``attn_probe.watch`` (``attention_entropy_rows=None``), q_len != kv_len."""
    t, prefix = 24, 16

    def mask_mod(b, h, q, kv):
        return (q + prefix >= kv) & (DOCS[b, q + prefix] == DOCS[b, kv])

    mask = flex.create_block_mask(mask_mod, B, None, t, prefix + t, device="cpu", BLOCK_SIZE=16)
    net, twin = (_net(lambda q, k, v: flex.flex_attention(q, k, v, block_mask=mask), prefix) for _ in range(2))
    opt = torch.optim.SGD(net.head.parameters(), lr=0.05)
    sink, x = Records(), _x(t)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = attn_probe.watch(net, optimizer=opt, every=1, attention_stats=True, per_head=True, sinks=[sink],
                                 metrics=("symmetry",), log_dir=str(tmp_path / "tb"), attention_entropy_rows=None)
        out = net(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        probe.close()
    torch.testing.assert_close(out.detach(), twin(x).detach(), rtol=0, atol=0)
    messages = [str(w.message) for w in caught if "attn_probe" in str(w.message)]
    assert not [m for m in messages if "not measured" in m or "skipped" in m], messages
    (q, k), = net.blocks[0].attn.calls
    i, j = _ij(t, prefix + t, prefix)
    same = DOCS[:, prefix:prefix + t][:, :, None] == DOCS[:, None, :prefix + t]  # query i sits at prefix + i
    top, ent, rows = _reference(q, k, ((j <= i)[None] & same)[:, None])
    got_max, got_ent = sink.values("max_logit")[1], sink.values("entropy")[1]
    for h in range(HEADS):
        assert got_max[(0, h)] == pytest.approx(float(top[h]), rel=1e-5), h
        assert got_ent[(0, h)] == pytest.approx(float(ent[h] / rows[h]), rel=1e-5), h


# --------------------------------------------------------------------------- 10. entropy sampling
@pytest.mark.parametrize("t", [300, 600])
def test_sampled_entropy_long_rows(t):
    """Default entropy_rows (256): max_logit and counted rows exact; entropy the documented sample's
    mean, within Hoeffding's bound of the exact mean."""
    from attn_probe.activations.logits import DEFAULT_ENTROPY_ROWS, entropy_error_bound

    mask = flex.create_block_mask(_causal, None, None, t, t, device="cpu")
    stats, calls, messages, failures = _measure(
        lambda q, k, v: flex.flex_attention(q, k, v, block_mask=mask), _x(t, batch=1),
        entropy_rows=DEFAULT_ENTROPY_ROWS)
    assert not failures and not messages, (failures, messages)
    (q, k), = calls
    logits = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(E)
    i, j = _ij(t, t)
    vis = (j <= i)[None, None].expand(logits.shape)
    p = torch.softmax(torch.where(vis, logits, -math.inf), dim=-1)
    rows = -torch.where(vis, torch.special.xlogy(p, p), 0).sum(-1)  # (1, H, T)
    stride = -(-t // DEFAULT_ENTROPY_ROWS)
    start = (t * 40503) % stride  # the documented start, layer 0
    sample, exact = rows[:, :, start::stride].mean(dim=(0, 2)), rows.mean(dim=(0, 2))
    top = torch.where(vis, logits.abs(), -math.inf).amax(dim=(0, 2, 3))
    assert stats.tokens.tolist() == [float(t)] * HEADS
    for h in range(HEADS):
        got = float(stats.entropy_sum[h] / stats.tokens[h])
        assert float(stats.max_logit[h]) == pytest.approx(float(top[h]), rel=1e-5), h
        assert got == pytest.approx(float(sample[h]), rel=1e-5), h
        assert abs(got - float(exact[h])) <= entropy_error_bound(t, len(range(start, t, stride)))
    assert not torch.allclose(sample, exact)
