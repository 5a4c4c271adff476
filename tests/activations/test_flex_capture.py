"""max_logit and entropy of modules that call ``flex_attention`` (torchtitan 0.3, torchtune when
packing), against a float64 reference recomputed from the q/k each call received with masks and
score modifiers written out explicitly (not through flex or the module's mask_mod): a causal
``BlockMask``, a per-batch document mask with a sliding window (closing over a tensor), a tanh
softcap and an ALiBi-style ``score_mod``, a mask_mod written for scalar indices (a table lookup), grouped-query attention (``enable_gqa``); outputs equal to an unwatched copy's.

torch 2.13's flex has no backward on CPU, so only the head trains: the attention modules are
frozen while the forward runs with gradients on (a counted forward for the probe).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import attn_probe
from tests.activations.sdpa_stacks import HEADS, D, NanoCausalSelfAttention, Net, TitanAttention
from tests.activations.test_attention_health_live import Records

flex = pytest.importorskip("torch.nn.attention.flex_attention")

STEPS, B, T, BLOCK, WINDOW, CAP = 2, 2, 16, 4, 5, 2.0
DOCS = torch.tensor([[0] * 6 + [1] * 10, [0] * 11 + [1] * 5])
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def _causal(b, h, q, kv):
    return q >= kv


def _document_window(b, h, q, kv):
    return (DOCS[b, q] == DOCS[b, kv]) & (q >= kv) & (q - kv < WINDOW)


ALLOWED = (torch.rand(T, T, generator=torch.Generator().manual_seed(9)) < 0.5) | torch.eye(T, dtype=torch.bool)


def _causal_document(b, h, q, kv):
    return (DOCS[b, q] == DOCS[b, kv]) & (q >= kv)


def _table(b, h, q, kv):
    """Written for scalar indices (``ALLOWED[q][kv]``): right under flex's vmap, wrong if broadcast."""
    return ALLOWED[q][kv]


def _softcap(score, b, h, q, kv):
    return CAP * torch.tanh(score / CAP)


def _alibi(score, b, h, q, kv):
    return score + SLOPES[h] * (kv - q)


CASES = {  # name: (mask_mod, score_mod, grouped-query)
    "causal": (_causal, None, False),
    "document_window": (_document_window, None, False),
    "softcap": (_causal, _softcap, False),
    "alibi": (_document_window, _alibi, False),
    "gqa": (_causal, None, True),
    "table": (_table, _softcap, False),
    "gqa_documents": (_causal_document, None, True),
}


def _reference_mask(case: str) -> torch.Tensor:
    """``(B, 1, T, T)`` visible entries, written out without the mask_mod."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    causal = (j <= i).expand(B, T, T)
    if CASES[case][0] is _causal:
        return causal[:, None]
    if CASES[case][0] is _table:
        return ALLOWED.expand(B, 1, T, T)
    same = DOCS[:, :, None] == DOCS[:, None, :]
    if CASES[case][0] is _causal_document:
        return (causal & same)[:, None]
    return (causal & same & (i - j < WINDOW))[:, None]


def _reference_scores(case: str, logits: torch.Tensor) -> torch.Tensor:
    score = CASES[case][1]
    if score is _softcap:
        return CAP * torch.tanh(logits / CAP)
    if score is _alibi:
        i, j = torch.arange(T)[:, None].double(), torch.arange(T)[None, :].double()
        return logits + SLOPES.double()[None, :, None, None] * (j - i)
    return logits


class FlexNano(NanoCausalSelfAttention):
    """nanoGPT's attention with ``flex_attention`` in place of sdpa; keeps float64 copies of the q and k it passes."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case, self.calls = case, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.c_attn(x).split(self.n_embd, dim=2))
        self.calls.append((q.detach().double(), k.detach().double(), torch.is_grad_enabled()))
        mask_mod, score_mod, _ = CASES[self.case]
        y = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=_block_mask(mask_mod))
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


_TITAN_FLEX: list = []


def _titan_compiled_flex():
    """``flex_attention`` compiled as torchtitan 0.3's ``FlexAttention`` compiles it (once, at class
    level: inductor with ``max_autotune`` and ``coordinate_descent_tuning``)."""
    if not _TITAN_FLEX:
        _TITAN_FLEX.append(torch.compile(flex.flex_attention, options={
            "max_autotune": True, "coordinate_descent_tuning": True, "triton.cudagraphs": False}))
    return _TITAN_FLEX[0]


class FlexTitan(TitanAttention):
    """torchtitan's ``wq/wk/wv`` attention with fewer key heads, ``flex_attention(..., enable_gqa=True)``;
    ``compiled``: flex compiled as torchtitan 0.3 does (:func:`_titan_compiled_flex`)."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case, self.calls, self.compiled = case, [], False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q, k, v = (w(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        self.calls.append((q.detach().double(), k.detach().double(), torch.is_grad_enabled()))
        attend = _titan_compiled_flex() if self.compiled else flex.flex_attention
        y = attend(q, k, v, block_mask=_block_mask(CASES[self.case][0]), enable_gqa=True)
        return self.wo(y.transpose(1, 2).contiguous().view(bs, seqlen, -1))


_MASKS: dict = {}


def _block_mask(mask_mod):
    if mask_mod not in _MASKS:
        batch = B if mask_mod in (_document_window, _causal_document) else None
        _MASKS[mask_mod] = flex.create_block_mask(mask_mod, batch, None, T, T, device="cpu", BLOCK_SIZE=BLOCK)
    return _MASKS[mask_mod]


def _net(case: str) -> Net:
    torch.manual_seed(0)
    net = Net("nanogpt")
    for block in net.blocks:
        block.attn = FlexTitan(case) if CASES[case][2] else FlexNano(case)
    for name, p in net.named_parameters():
        p.requires_grad_(name.startswith("head."))
    return net


def _reference(case: str, calls: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head (max |q.k / sqrt(E)| over visible entries, mean entropy of softmax(score_mod) over them)."""
    visible = _reference_mask(case)
    top, ent, rows = None, 0.0, 0.0
    for q, k, _ in calls:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
        vis = visible.expand(logits.shape)
        p = torch.softmax(torch.where(vis, _reference_scores(case, logits), -math.inf), dim=-1)
        head_top = torch.where(vis, logits.abs(), -math.inf).amax(dim=(0, 2, 3))
        top = head_top if top is None else torch.maximum(top, head_top)
        ent = ent - torch.where(vis, torch.special.xlogy(p, p), 0).sum(dim=(0, 2, 3))
        rows = rows + vis.any(-1).sum(dim=(0, 2)).double()
    return top, ent / rows


def _train(net: Net, tmp_path, run=None, **options):
    """Head-only SGD steps, each with an evaluation forward under no_grad inside it (not counted).
    Returns the sink, the training outputs and the attn_probe warnings."""
    opt = torch.optim.SGD(net.head.parameters(), lr=0.05)
    sink, outs = Records(), []
    run = net if run is None else run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = attn_probe.watch(net, optimizer=opt, every=1, attention_stats=True, per_head=True,
                                 sinks=[sink], metrics=("symmetry",), log_dir=str(tmp_path / "tb"), **options)
        for step in range(1, STEPS + 1):
            x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(step)) * 2
            out = run(x)
            out.pow(2).mean().backward()
            with torch.no_grad():
                run(torch.randn(B, T, D, generator=torch.Generator().manual_seed(50 + step)) * 3)
            opt.step()
            opt.zero_grad()
            outs.append((x, out.detach()))
        probe.close()
    return sink, outs, [str(w.message) for w in caught if "attn_probe" in str(w.message)]


def _check(case: str, net: Net, sink: Records, messages: list[str]) -> None:
    assert not [m for m in messages if "not measured" in m or "skipped" in m or "nothing" in m], messages
    got_max, got_ent = sink.values("max_logit"), sink.values("entropy")
    assert sorted(got_max) == list(range(1, STEPS + 1))
    for layer, block in enumerate(net.blocks):
        calls = block.attn.calls
        assert [c[2] for c in calls] == [True, False] * STEPS
        for step in range(1, STEPS + 1):
            train = calls[2 * (step - 1):2 * step - 1]
            top, ent = _reference(case, train)
            for h in range(HEADS):
                assert got_max[step][(layer, h)] == pytest.approx(float(top[h]), rel=1e-5), (step, layer, h)
                assert got_ent[step][(layer, h)] == pytest.approx(float(ent[h]), rel=1e-5), (step, layer, h)
            # had the no_grad evaluation forward counted, the values would differ
            both_top, both_ent = _reference(case, calls[2 * (step - 1):2 * step])
            assert max(float((both_top - top).abs().max()), float((both_ent - ent).abs().max())) > 1e-3


@pytest.mark.parametrize("case", sorted(CASES))
def test_per_head_values_equal_the_float64_reference(case, tmp_path):
    net, twin = _net(case), _net(case)
    sink, outs, messages = _train(net, tmp_path)
    _check(case, net, sink, messages)
    torch.testing.assert_close(outs[0][1], twin(outs[0][0]).detach(), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_under_the_users_compile_when_opted_in(backend, tmp_path):
    """With ``attention_flex_compiled=True`` the user's ``torch.compile`` of the model traces the
    statistics into its graph: the same values as the float64 reference."""
    net, twin = _net("alibi"), _net("alibi")
    torch._dynamo.reset()
    # fullgraph: a graph break in the traced statistics (which the compiler would otherwise
    # answer by splitting the graph, with a warning) fails the test
    sink, outs, messages = _train(net, tmp_path, run=torch.compile(net, backend=backend, fullgraph=True),
                                  attention_flex_compiled=True)
    _check("alibi", net, sink, messages)
    torch.testing.assert_close(outs[0][1], twin(outs[0][0]).detach(), rtol=0, atol=0 if backend != "inductor" else 1e-5)


def test_flex_compiled_as_torchtitan_compiles_it_when_opted_in(tmp_path):
    """Issue 44 (2), without torchtitan: flex compiled as torchtitan 0.3 compiles it (inductor,
    ``max_autotune``), q/k/v transposed from ``(B, L, H, E)``, GQA, causal documents. With
    ``attention_flex_compiled=True`` the step raised ``InductorError`` (the statistics' ``bmm``
    in inductor's CPU template); now its values equal the float64 reference."""
    net, twin = _net("gqa_documents"), _net("gqa_documents")
    for block in net.blocks:
        block.attn.compiled = True
    torch._dynamo.reset()
    sink, outs, messages = _train(net, tmp_path, attention_flex_compiled=True)
    _check("gqa_documents", net, sink, messages)
    torch.testing.assert_close(outs[0][1], twin(outs[0][0]).detach(), rtol=0, atol=1e-5)


def test_users_compile_by_default_traces_nothing_of_the_probe(monkeypatch, tmp_path):
    """By default nothing of the statistics is traced into a compiled graph: a statistics function
    the compiler cannot trace (a graph break inside flex's operator, which fails the compile) leaves
    the user's compiled forward running and untouched; the due step warns that flex ran inside a
    compiled graph and names the option."""
    from attn_probe.activations import flex_capture

    def untraceable(*args, **kwargs):
        torch._dynamo.graph_break()
        raise AssertionError("the statistics of a flex call inside a compiled graph ran by default")

    monkeypatch.setattr(flex_capture, "flex_stats", untraceable)
    net, twin = _net("causal"), _net("causal")
    torch._dynamo.reset()
    sink, outs, messages = _train(net, tmp_path, run=torch.compile(net, backend="inductor"))
    torch.testing.assert_close(outs[0][1], twin(outs[0][0]).detach(), rtol=0, atol=1e-5)
    assert sink.values("max_logit") == {}
    missing = [m for m in messages if "not measured at step 1" in m]
    assert len(missing) == 1 and "inside a torch.compile graph" in missing[0] \
        and "attention_flex_compiled=True" in missing[0], messages
    assert not [m for m in messages if "skipped" in m], messages


def test_sampled_entropy_exact_maxima(tmp_path):
    """Above ``entropy_rows`` query rows the entropy is the mean over every ``t``-th row from the
    documented start (within Hoeffding's bound of the exact mean); ``max_logit`` stays exact."""
    from attn_probe.activations.logits import entropy_error_bound
    from attn_probe.activations.statistics import AttentionCapture
    from attn_probe.extraction import find_attention

    net = _net("document_window")
    m = 5
    capture = AttentionCapture(net, find_attention(net), entropy_rows=m)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(4))
    capture.arm()
    net(x)
    capture.disarm()
    stats = capture.collect()
    capture.close()
    visible = _reference_mask("document_window")
    stride = -(-T // m)
    for layer, block in enumerate(net.blocks):
        q, k, _ = block.attn.calls[-1]
        logits = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
        vis = visible.expand(logits.shape)
        p = torch.softmax(torch.where(vis, logits, -math.inf), dim=-1)
        rows = -torch.where(vis, torch.special.xlogy(p, p), 0).sum(-1)  # (B, H, T)
        start = (layer * 2654435761 + T * 40503) % stride  # the documented start, seeded by the layer
        sample = rows[:, :, start::stride].mean(dim=(0, 2))
        exact = rows.mean(dim=(0, 2))
        top = torch.where(vis, logits.abs(), -math.inf).amax(dim=(0, 2, 3))
        for h in range(HEADS):
            got_ent = float(stats.entropy_sum[layer * HEADS + h] / stats.tokens[layer * HEADS + h])
            assert got_ent == pytest.approx(float(sample[h]), rel=1e-5), (layer, h)
            assert abs(got_ent - float(exact[h])) <= entropy_error_bound(T, len(range(start, T, stride)))
            assert float(stats.max_logit[layer * HEADS + h]) == pytest.approx(float(top[h]), rel=1e-6)
        assert stats.tokens[layer * HEADS:(layer + 1) * HEADS].tolist() == [float(B * T)] * HEADS
    assert not torch.allclose(sample.double(), exact.double())  # the sample is not the whole


def test_block_mask_layout_checked_against_the_public_api(monkeypatch, tmp_path):
    """The reader finds each field of ``BlockMask.as_tuple()`` by identity and checks its visible
    entries against ``create_mask``; on a torch whose tuple is laid out otherwise (simulated by
    swapping two fields) flex calls are warned not measured, never misread, and the outputs are
    untouched."""
    from attn_probe.activations import flex as reader

    positions = reader.block_mask_reader()
    mask = flex.create_block_mask(_causal, 1, 1, 40, 24, device="cpu", BLOCK_SIZE=(8, 4))
    as_tuple = mask.as_tuple()
    assert as_tuple[positions["kv_indices"]] is mask.kv_indices
    assert as_tuple[positions["full_kv_indices"]] is mask.full_kv_indices
    assert (as_tuple[positions["q_block"]], as_tuple[positions["kv_block"]]) == (8, 4)
    assert as_tuple[positions["mask_mod"]] is _causal

    original = flex.BlockMask.as_tuple

    def swapped(self, flatten: bool = True):  # fields in another order: found where they are
        fields = list(original(self, flatten))
        i, j = positions["kv_num_blocks"], positions["full_kv_num_blocks"]
        fields[i], fields[j] = fields[j], fields[i]
        return tuple(fields)

    def copied(self, flatten: bool = True):  # fields that are not the BlockMask's own: not read
        return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in original(self, flatten))

    monkeypatch.setattr(flex.BlockMask, "as_tuple", swapped)
    moved = reader._find_positions()
    assert (moved["kv_num_blocks"], moved["full_kv_num_blocks"]) == \
        (positions["full_kv_num_blocks"], positions["kv_num_blocks"])
    monkeypatch.setattr(flex.BlockMask, "as_tuple", copied)
    monkeypatch.setattr(reader, "_READER", None)
    with pytest.raises(RuntimeError, match="not found once"):
        reader.block_mask_reader()
    net, twin = _net("causal"), _net("causal")
    sink, outs, messages = _train(net, tmp_path)
    assert sink.values("max_logit") == {}
    assert [m for m in messages if "as_tuple() layout could not be read" in m and "skipped" in m], messages
    torch.testing.assert_close(outs[0][1], twin(outs[0][0]).detach(), rtol=0, atol=0)
    monkeypatch.setattr(reader, "_READER", None)


# --------------------------------------------------------------------------- the real torchtitan 0.3
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


@pytest.mark.parametrize("opted_in", [True, False])
def test_real_torchtitan_03_flex_compiled_by_torchtitan(opted_in, tmp_path) -> None:
    """torchtitan 0.3's ``FlexAttention`` runs ``flex_attention`` through its own class-level
    ``torch.compile`` (inductor). With ``attention_flex_compiled=True`` the statistics are traced
    into that graph: per head against the float64 reference of the q/k after RoPE (a forward hook
    on ``rope``), GQA 8/2, its ``scaling``. By default flex's operator runs inside that graph and
    nothing of the probe is traced there: not measured, warned once with the option."""
    config_utils = pytest.importorskip("torchtitan.models.common.config_utils")
    from torchtitan.models.common import ComplexRoPE

    torch.manual_seed(3)
    cfg = config_utils.make_gqa_config(
        dim=D, n_heads=8, n_kv_heads=2, wqkv_param_init={"weight": torch.nn.init.normal_},
        wo_param_init={"weight": torch.nn.init.normal_}, inner_attention=config_utils.get_attention_config("flex"),
        rope=ComplexRoPE.Config(dim=4, max_seq_len=64), fuse_qkv=True)
    net = _Titan(cfg)
    for name, p in net.named_parameters():
        p.requires_grad_(name.startswith("head."))
    calls: list = [[], []]
    for n, layer in enumerate(net.layers):
        attn = layer["attention"]
        attn.rope.register_forward_hook(
            lambda _m, _a, out, n=n: calls[n].append((out[0].detach().double().transpose(1, 2),
                                                      out[1].detach().double().transpose(1, 2),
                                                      torch.is_grad_enabled())))
    mask = flex.create_block_mask(_causal, None, None, T, T, device="cpu", BLOCK_SIZE=BLOCK)
    opt = torch.optim.SGD(net.head.parameters(), lr=0.05)
    sink = Records()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = attn_probe.watch(net, optimizer=opt, every=1, attention_stats=True, per_head=True, sinks=[sink],
                                 metrics=("symmetry",), log_dir=str(tmp_path / "tb"),
                                 attention_flex_compiled=opted_in)
        for step in range(1, STEPS + 1):
            x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(step))
            net(x, mask).pow(2).mean().backward()
            with torch.no_grad():
                net(torch.randn(B, T, D, generator=torch.Generator().manual_seed(50 + step)) * 3, mask)
            opt.step()
            opt.zero_grad()
        probe.close()
    messages = [str(w.message) for w in caught if "attn_probe" in str(w.message)]
    if not opted_in:
        assert sink.values("max_logit") == {}
        missing = [m for m in messages if "not measured at step 1" in m]
        assert len(missing) == 1 and "attention_flex_compiled=True" in missing[0], messages
        return
    assert not [m for m in messages if "not measured" in m or "skipped" in m], messages
    got_max, got_ent = sink.values("max_logit"), sink.values("entropy")
    scale = net.layers[0]["attention"].scaling
    for layer in range(2):
        assert [c[2] for c in calls[layer]] == [True, False] * STEPS
        for step in range(1, STEPS + 1):
            q, k, _ = calls[layer][2 * (step - 1)]
            k = k.repeat_interleave(4, dim=1)
            logits = torch.einsum("bhid,bhjd->bhij", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
            vis = _reference_mask("causal").expand(logits.shape)
            p = torch.softmax(torch.where(vis, logits, -math.inf), dim=-1)
            top = torch.where(vis, logits.abs(), -math.inf).amax(dim=(0, 2, 3))
            ent = -torch.where(vis, torch.special.xlogy(p, p), 0).sum(dim=(0, 2, 3)) / (B * T)
            for h in range(8):
                assert got_max[step][(layer, h)] == pytest.approx(float(top[h]), rel=1e-5), (step, layer, h)
                assert got_ent[step][(layer, h)] == pytest.approx(float(ent[h]), rel=1e-5), (step, layer, h)


def _titan_llama3():
    """torchtitan 0.3's Llama 3 (``Llama3Model``, flex inner attention: compiled by torchtitan with
    inductor and ``max_autotune``), tiny: 2 layers, dim 32, GQA 4/2; built from its public configs
    as its ``llama3_configs`` entries are. Only the final norm and the head train (flex has no
    backward on the CPU)."""
    config_utils = pytest.importorskip("torchtitan.models.common.config_utils")
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    dim, init = 32, {"weight": torch.nn.init.normal_}
    layer = Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=dim), ffn_norm=RMSNorm.Config(normalized_shape=dim),
        attention=config_utils.make_gqa_config(
            dim=dim, n_heads=4, n_kv_heads=2, wqkv_param_init=init, wo_param_init=init,
            inner_attention=config_utils.get_attention_config("flex"), rope=ComplexRoPE.Config(dim=8, max_seq_len=64),
            fuse_qkv=True),
        feed_forward=config_utils.make_ffn_config(dim=dim, hidden_dim=64, w1_param_init=init, w2w3_param_init=init))
    cfg = Llama3Model.Config(dim=dim, vocab_size=64, tok_embeddings=Embedding.Config(num_embeddings=64, embedding_dim=dim),
                             norm=RMSNorm.Config(normalized_shape=dim),
                             lm_head=Linear.Config(in_features=dim, out_features=64), layers=[layer, layer])
    torch.manual_seed(5)
    model = cfg.build()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("norm.", "lm_head.")))
    return model


@pytest.mark.parametrize("fault", [None, "statistics raise in the graph", "tracing fails"])
def test_real_torchtitan_03_llama3_opt_in_never_raises(fault, monkeypatch, tmp_path) -> None:
    """Issue 44 (2): the real torchtitan 0.3 Llama 3 with its packed-document ``BlockMask``
    (``get_attention_masks``: causal within each document). With ``attention_flex_compiled=True``
    the training forward raised ``InductorError`` (the statistics' ``bmm`` in torchtitan's
    ``max_autotune`` graph). Now the step runs and the per-head values equal the float64 reference
    of the q/k after RoPE with the documents written out. Where the statistics fail inside the
    graph or cannot be traced into it (both forced here), the steps still run, their values are
    dropped, one warning is given and every failing step is counted."""
    from attn_probe.activations import flex as flex_module
    from attn_probe.activations import flex_capture

    model = _titan_llama3()
    if fault == "statistics raise in the graph":
        def broken(*args, **kwargs):
            raise RuntimeError("injected failure of the flex statistics")

        monkeypatch.setattr(flex_module, "chunk_stats", broken)
    elif fault == "tracing fails":
        def untraceable(*args, **kwargs):
            raise ValueError("injected failure while tracing the flex statistics")

        monkeypatch.setattr(flex_capture, "flex_stats", untraceable)
    calls: list = [[], []]
    for n, block in enumerate(model.layers.values()):
        block.attention.rope.register_forward_hook(
            lambda _m, _a, out, n=n: calls[n].append((out[0].detach().double().transpose(1, 2),
                                                      out[1].detach().double().transpose(1, 2))))
    positions = torch.cat([torch.cat([torch.arange(a), torch.arange(T - a)])[None] for a in (6, 11)])
    docs = torch.cumsum(positions == 0, dim=1)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = ((j <= i) & (docs[:, :, None] == docs[:, None, :]))[:, None]  # (B, 1, T, T), written out
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    sink = Records()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = attn_probe.watch(model, optimizer=opt, every=1, attention_stats=True, per_head=True, sinks=[sink],
                                 metrics=("symmetry",), log_dir=str(tmp_path / "tb"), attention_flex_compiled=True)
        for step in range(1, STEPS + 1):
            tokens = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(step))
            out = model(tokens, positions, attention_masks=model.get_attention_masks(positions))
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        failures = probe.failures
        probe.close()
    messages = [str(w.message) for w in caught if "attn_probe" in str(w.message)]
    if fault is not None:
        assert sink.values("max_logit") == {}
        skipped = [m for m in messages if "skipped" in m]
        assert len(skipped) == 1 and "flex_attention inside a compiled graph" in skipped[0], messages
        assert failures == STEPS, failures
        return
    assert failures == 0 and not [m for m in messages if "not measured" in m or "skipped" in m], messages
    got_max, got_ent = sink.values("max_logit"), sink.values("entropy")
    scale = model.layers["0"].attention.scaling
    for layer in range(2):
        assert len(calls[layer]) == STEPS
        for step in range(1, STEPS + 1):
            q, k = calls[layer][step - 1]
            k = k.repeat_interleave(2, dim=1)
            logits = torch.einsum("bhid,bhjd->bhij", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
            vis = visible.expand(logits.shape)
            p = torch.softmax(torch.where(vis, logits, -math.inf), dim=-1)
            top = torch.where(vis, logits.abs(), -math.inf).amax(dim=(0, 2, 3))
            ent = -torch.where(vis, torch.special.xlogy(p, p), 0).sum(dim=(0, 2, 3)) / (B * T)
            # the documents matter: causal attention over the whole row gives other values
            causal = torch.softmax(torch.where(j <= i, logits, -math.inf), dim=-1)
            assert float((-torch.special.xlogy(causal, causal).sum(dim=(0, 2, 3)) / (B * T) - ent).abs().max()) > 1e-3
            for h in range(4):
                assert got_max[step][(layer, h)] == pytest.approx(float(top[h]), rel=1e-5), (step, layer, h)
                assert got_ent[step][(layer, h)] == pytest.approx(float(ent[h]), rel=1e-5), (step, layer, h)


def test_flex_without_its_own_compile(monkeypatch, tmp_path):
    """flex's debug switch runs the operator without any compile: measured from the eager call alone
    (the path a graph from flex's own compile leaves to the traced statistics), the same values."""
    monkeypatch.setattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)  # torch's documented debug switch
    net = _net("softcap")
    sink, _, messages = _train(net, tmp_path)
    _check("softcap", net, sink, messages)


@pytest.mark.parametrize("how", ["flex's own compile", "no compile", "user's compile, opted in",
                                 "flex's own compile, opted in"])
def test_each_call_counts_once(how, monkeypatch):
    """Counted query rows per head equal B * T for one training forward: a call that a graph from
    flex's own compile measured is not measured again when that graph runs flex's operator."""
    from attn_probe.activations.statistics import AttentionCapture
    from attn_probe.extraction import find_attention

    if how == "no compile":
        monkeypatch.setattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    net = _net("causal")
    run = torch.compile(net, backend="eager") if how.startswith("user's compile") else net
    torch._dynamo.reset()
    capture = AttentionCapture(net, find_attention(net), flex_compiled=how.endswith("opted in"))
    for _ in range(2):  # the second step reuses the compiled graphs
        capture.arm()
        run(torch.randn(B, T, D))
        capture.disarm()
        stats = capture.collect()
        assert stats.tokens.tolist() == [float(B * T)] * (2 * HEADS), how
        assert stats.scaling == pytest.approx(((D // HEADS) ** -0.5,) * 2, rel=1e-12)
    capture.close()
