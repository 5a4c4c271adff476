"""Measured attention logits and entropy (attn_probe.activations.statistics) against explicit references.

References are computed here from the models' own projections (and Llama's own rotary function)
on the attention inputs, with explicit causal/padding masks, and from eager attention's
probabilities (``output_attentions=True``); all in float64, compared to 1e-5.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

pytest.importorskip("transformers")

from helpers import tiny_model  # noqa: E402
from transformers import (  # noqa: E402
    BertModel,
    GPT2Model,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
)
from transformers.modeling_utils import AttentionInterface  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

import attn_probe.activations.statistics as stats_module  # noqa: E402
from attn_probe.activations.statistics import (  # noqa: E402
    AttentionCapture,
    combine,
    installed_wrappers,
    logit_bound_ratio,
    logit_stats,
    row_mask,
    unavailable_reason,
)
from attn_probe.extraction import find_attention  # noqa: E402

TOL = 1e-5
L = 9  # sequence length


def _llama(impl: str = "eager", seed: int = 0, **extra) -> LlamaModel:
    return tiny_model("llama", seed, cls=LlamaModel, impl=impl, intermediate_size=64, vocab_size=99,
                      max_position_embeddings=2048, initializer_range=0.4, **extra).double().eval()


def _bert(impl: str = "eager", seed: int = 0) -> BertModel:
    return tiny_model("bert", seed, cls=BertModel, impl=impl, model_kwargs=dict(add_pooling_layer=False),
                      vocab_size=99, max_position_embeddings=512, initializer_range=0.4, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0).double().eval()


def _gpt2(impl: str = "eager", seed: int = 0) -> GPT2Model:
    return tiny_model("gpt2", seed, cls=GPT2Model, impl=impl, n_positions=1024, bos_token_id=0, eos_token_id=0,
                      initializer_range=0.4, scale_attn_by_inverse_layer_idx=True,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).double().eval()


def _gemma2(impl: str = "eager", seed: int = 0):
    """Attention logit softcapping and a sliding window (layer 0)."""
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(seed)
    cfg = Gemma2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=64, vocab_size=99, sliding_window=3,
                       attn_logit_softcapping=2.0, query_pre_attn_scalar=6, initializer_range=0.4)
    model = Gemma2Model(cfg).double().eval()
    model.set_attn_implementation(impl)
    return model


def _gpt_oss(impl: str = "eager", seed: int = 0):
    """Attention sinks (``s_aux``) and a sliding window (layer 0)."""
    from transformers import GptOssConfig, GptOssModel

    torch.manual_seed(seed)
    cfg = GptOssConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=32, vocab_size=99, num_local_experts=2,
                       num_experts_per_tok=1, sliding_window=3, initializer_range=0.4)
    cfg._experts_implementation = "eager"  # the grouped-mm experts take no float64
    model = GptOssModel(cfg).double().eval()
    model.set_attn_implementation(impl)
    return model


def _t5(impl: str = "eager", seed: int = 0):
    """Relative position biases (``position_bias``), no scaling."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    cfg = T5Config(d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, vocab_size=99,
                   initializer_factor=8.0, dropout_rate=0.0)
    model = T5EncoderModel(cfg).double().eval()
    model.set_attn_implementation(impl)
    return model


BUILDERS = {"bert": _bert, "llama": _llama, "gpt2": _gpt2, "gemma2": _gemma2, "gpt_oss": _gpt_oss, "t5": _t5}
CAUSAL = {"bert": False, "llama": True, "gpt2": True, "gemma2": True, "gpt_oss": True, "t5": False}


def _batch(padding: bool = True, seed: int = 1, batch: int = 3,
           right: tuple[int, int] = (6, 3)) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right padding in rows 1 and 2 from positions ``right``; with ``batch=4`` left padding in
    row 3. Models whose eager attention upcasts to a float32 softmax get no query row that sees
    only padding (no left padding, short right padding under a sliding window): a float64 mask's
    minimum becomes -inf there, the row turns NaN, and the NaN reaches the real rows of the next
    layer in the model itself (the measurement masks it out; the reference probabilities cannot)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 99, (batch, L), generator=g)
    if not padding:
        return ids, None
    mask = torch.ones(batch, L, dtype=torch.long)
    mask[1, right[0]:] = 0  # right padding
    mask[2, right[1]:] = 0
    if batch > 3:
        mask[3, :4] = 0  # left padding
    return ids, mask


def _attention_inputs(model, layers, ids, mask):
    """Each attention module's input hidden states, captured by a hook of the test's own."""
    seen, hooks = {}, []
    for i, layer in enumerate(layers):
        def hook(module, args, kwargs, i=i):
            seen[i] = (args[0] if args else kwargs["hidden_states"]).detach()
        hooks.append(layer.module.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
    for h in hooks:
        h.remove()
    return seen, out.attentions


def _reference_qk(arch, model, layer, x):
    """(q (B, H, L, D), k (B, H, L, D) repeated to query heads, scaling) from the model's projections."""
    B = x.shape[0]
    attn = layer.module
    H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    n = x.shape[1]
    if arch == "bert":
        q, k = attn.query(x), attn.key(x)
        scaling = D ** -0.5
    elif arch == "t5":
        q, k = attn.q(x), attn.k(x)
        scaling = 1.0
    elif arch == "gpt2":
        q, k, _ = attn.c_attn(x).split(32, dim=2)
        scaling = D ** -0.5 / (layer.layer + 1)  # scale_attn_by_inverse_layer_idx
    else:
        q, k = attn.q_proj(x), attn.k_proj(x)
        scaling = (model.config.query_pre_attn_scalar if arch == "gemma2" else D) ** -0.5
    q = q.view(B, n, H, D).transpose(1, 2)
    k = k.view(B, n, Hkv, D).transpose(1, 2)
    if arch not in ("bert", "gpt2", "t5"):
        rotary = apply_rotary_pos_emb if arch == "llama" else sys.modules[type(attn).__module__].apply_rotary_pos_emb
        cos, sin = model.rotary_emb(x, torch.arange(n)[None])
        q, k = rotary(q, k, cos, sin)
    return q, k.repeat_interleave(H // Hkv, dim=1), scaling


def _reference(arch, model, ids, mask, rows=slice(None)):
    """Per layer (max_logit (1 + H), entropy (1 + H)), explicit, over query positions ``rows``."""
    layers = find_attention(model)
    inputs, probs = _attention_inputs(model, layers, ids, mask)
    B, n = ids.shape
    pad = torch.ones(B, n, dtype=torch.bool) if mask is None else mask.bool()
    out = []
    for i, layer in enumerate(layers):
        visible = pad[:, None, None, :] & pad[:, None, :, None]
        if CAUSAL[arch]:
            visible = visible & torch.ones(n, n, dtype=torch.bool).tril()
        window = getattr(layer.module, "sliding_window", None)
        if window:
            visible = visible & (torch.arange(n)[None, :] > torch.arange(n)[:, None] - window)
        visible = visible[..., rows, :]
        with torch.no_grad():
            q, k, scaling = _reference_qk(arch, model, layer, inputs[i])
            logits = (q[..., rows, :] @ k.transpose(-1, -2)) * scaling
        head_max = torch.where(visible, logits.abs(), -math.inf).amax(dim=(0, 2, 3))
        p = probs[i].detach()[..., rows, :]
        row_entropy = -torch.where(p > 0, p * p.log(), 0.0).sum(-1)  # (B, H, rows)
        sink = 1 - p.sum(-1)  # gpt-oss: the probability left on the attention sink
        if arch == "gpt_oss":
            row_entropy = row_entropy - torch.where(sink > 0, sink * sink.log(), 0.0)
        q_valid = pad[:, None, rows].expand_as(row_entropy)
        head_ent = (row_entropy * q_valid).sum(dim=(0, 2)) / q_valid.sum(dim=(0, 2))
        out.append((torch.cat([head_max.amax()[None], head_max]), torch.cat([head_ent.mean()[None], head_ent])))
    return out


def _measure(model, ids, mask, **kwargs):
    """One no_grad forward measured (``training_only=False``: a reference pass, not training)."""
    kwargs.setdefault("training_only", False)
    capture = AttentionCapture(model, find_attention(model), **kwargs)
    try:
        capture.arm()
        with torch.no_grad():
            model(ids, attention_mask=mask)
        capture.disarm()
        assert capture.failures == [] and capture.missing() == []
        return capture.collect()
    finally:
        capture.close()


@pytest.mark.parametrize("arch", ["bert", "llama", "gpt2", "gemma2", "gpt_oss", "t5"])
@pytest.mark.parametrize("padding", [True, False], ids=["padded", "unpadded"])
def test_against_explicit_reference(arch, padding):
    """gemma2: max_logit is the logit before the softcap (it exceeds the cap of 2), entropy is of
    the capped softmax; gpt_oss: the sink is one more outcome of the entropy; both slide a
    window of 3 in layer 0; t5: max_logit without, entropy with the relative position bias."""
    model = BUILDERS[arch]("eager")
    ids, mask = _batch(padding, batch=4 if arch in ("bert", "gpt2", "gpt_oss", "t5") else 3,
                       right=(7, 8) if arch == "gemma2" else (6, 3))
    reference = _reference(arch, model, ids, mask)
    measured = _measure(model, ids, mask).tables()
    for (ref_max, ref_ent), table in zip(reference, measured, strict=True):
        torch.testing.assert_close(table[0], ref_max, atol=TOL, rtol=TOL)
        torch.testing.assert_close(table[1], ref_ent, atol=TOL, rtol=TOL)
    assert all(t[0, 0] > 1 for t in measured)  # logits large enough for the comparison to mean something


@pytest.mark.parametrize("arch", ["bert", "llama", "gpt2", "t5"])
@pytest.mark.parametrize("padding", [True, False], ids=["padded", "unpadded"])
def test_sdpa_equals_eager(arch, padding):
    ids, mask = _batch(padding, batch=4 if arch in ("bert", "gpt2", "t5") else 3)
    eager = _measure(BUILDERS[arch]("eager"), ids, mask).tables()
    sdpa = _measure(BUILDERS[arch]("sdpa"), ids, mask).tables()
    for a, b in zip(eager, sdpa, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)


def test_softcap_is_not_applied_to_max_logit():
    tables = _measure(_gemma2(), *_batch(right=(7, 8))).tables()
    assert max(t[0, 0].item() for t in tables) > 2.0  # the cap


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_decode_step_with_cache(impl):
    """One token after a cached prefill (q_len 1, keys from the cache), a padding hole: the last
    query row of the explicit reference on all ten tokens."""
    model = _llama(impl)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 99, (2, L + 1), generator=g)
    mask = torch.ones(2, L + 1, dtype=torch.long)
    mask[1, 2:5] = 0
    reference = _reference("llama", _llama("eager"), ids, mask, rows=slice(L, L + 1))
    with torch.no_grad():
        past = model(ids[:, :L], attention_mask=mask[:, :L], use_cache=True).past_key_values
    capture = AttentionCapture(model, find_attention(model), training_only=False)
    capture.arm()
    with torch.no_grad():
        model(ids[:, L:], attention_mask=mask, past_key_values=past, use_cache=True)
    capture.disarm()
    step = capture.collect()
    capture.close()
    assert step.tokens.tolist() == [2.0] * 8
    for (ref_max, ref_ent), table in zip(reference, step.tables(), strict=True):
        torch.testing.assert_close(table[0], ref_max, atol=TOL, rtol=TOL)
        torch.testing.assert_close(table[1], ref_ent, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_model_outputs_unchanged(impl):
    """Installed, armed or not, the capture changes nothing the model computes (bit for bit)."""
    model = _llama(impl)
    ids, mask = _batch()
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).last_hidden_state
        capture = AttentionCapture(model, find_attention(model))
        installed = model(ids, attention_mask=mask).last_hidden_state
        capture.arm()
        armed = model(ids, attention_mask=mask).last_hidden_state
        capture.close()
    assert torch.equal(plain, installed) and torch.equal(plain, armed)


def test_a_failing_measurement_warns_and_training_goes_on():
    """Heads sharded away (here: a layer record claiming 8 heads where the model has 4) skip that
    layer with one warning; the forward's result is unchanged and the other layer is measured."""
    import dataclasses

    model = _llama("sdpa")
    ids, mask = _batch()
    layers = find_attention(model)
    layers[1] = dataclasses.replace(layers[1], num_heads=8)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).last_hidden_state
    capture = AttentionCapture(model, layers, training_only=False)
    capture.arm()
    with pytest.warns(RuntimeWarning, match="layers.1.self_attn.*8 query heads|4 query heads"):
        with torch.no_grad():
            out = model(ids, attention_mask=mask).last_hidden_state
    capture.disarm()
    tables = capture.collect().tables()
    capture.close()
    assert torch.equal(out, plain)
    assert len(capture.failures) == 1 and "tensor parallelism" in capture.failures[0]
    assert torch.isfinite(tables[0]).all() and torch.isnan(tables[1]).all()


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_logits_are_formed_in_chunks(softcap):
    """No allocation exceeds one float32 chunk of ``chunk_elements`` (the full logits would be 32x)."""
    from torch.profiler import ProfilerActivity, profile

    B, H, Hkv, n = 2, 4, 2, 512
    q, k = torch.randn(B, H, n, 8), torch.randn(B, Hkv, n, 8)
    chunk = B * H * n * 16  # 16 query rows

    def causal(r0, r1):
        return (torch.arange(n)[None] <= torch.arange(r0, r1)[:, None])[None, None], None

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        chunked = logit_stats(q, k, 0.3, causal, softcap=softcap, chunk_elements=chunk)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= 4 * chunk
    whole = logit_stats(q, k, 0.3, causal, softcap=softcap, chunk_elements=B * H * n * n)
    for a, b in zip(chunked, whole, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_small_chunks_give_the_same_values():
    ids, mask = _batch()
    model = _llama()
    whole = _measure(model, ids, mask).tables()
    chunked = _measure(model, ids, mask, chunk_elements=1).tables()  # one query row at a time
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_gradient_accumulation_equals_one_forward_on_the_concatenated_batch():
    model = _llama("sdpa")
    ids, mask = _batch()
    whole = _measure(model, ids, mask)
    capture = AttentionCapture(model, find_attention(model), training_only=False)
    capture.arm()
    with torch.no_grad():
        model(ids[:1], attention_mask=mask[:1])
        model(ids[1:], attention_mask=mask[1:])
    capture.disarm()
    parts = capture.collect()
    capture.close()
    for a, b in zip(whole.tables(), parts.tables(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(parts.tokens, whole.tokens)


def test_combine_over_two_ranks_equals_one_process():
    """Each 'rank' measures its own micro-batch; reducing with max/sum gives the global batch."""
    model = _llama("sdpa")
    ids, mask = _batch()
    whole = _measure(model, ids, mask)
    ranks = [_measure(model, ids[:2], mask[:2]), _measure(model, ids[2:], mask[2:])]
    calls = []

    def reduce_with(other):
        def reduce(tensor, op):
            calls.append(op)
            mine = len([c for c in calls if c == op]) - 1
            theirs = [torch.cat([other.max_logit, other.input_norm, other.signed_max]),
                      torch.cat([other.entropy_sum, other.tokens])][0 if op == "max" else 1]
            assert mine == 0
            return torch.maximum(tensor, theirs) if op == "max" else tensor + theirs
        return reduce

    combined = combine(ranks[0], reduce_with(ranks[1]))
    assert calls == ["max", "sum"]
    for a, b in zip(whole.tables(), combined.tables(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(combined.input_norms(), whole.input_norms())
    torch.testing.assert_close(combined.signed_max, whole.signed_max, atol=1e-12, rtol=1e-12)


def _gloo_worker(rank: int, port: int, out: str) -> None:
    """One rank: measure its own micro-batch, combine over a real gloo group, save the tables."""
    import datetime
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    ids, mask = _batch()
    part = slice(0, 2) if rank == 0 else slice(2, 3)  # uneven micro-batches
    step = _measure(_llama("sdpa"), ids[part], mask[part])
    ops = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}

    def reduce(tensor, op):
        dist.all_reduce(tensor, op=ops[op])
        return tensor

    combined = combine(step, reduce)
    torch.save({"tables": combined.tables(), "norms": combined.input_norms()}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.timeout(400)
def test_combine_over_gloo_equals_one_process(tmp_path):
    import multiprocessing
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_gloo_worker, args=(rank, port, str(tmp_path))) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=180)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]
    ids, mask = _batch()
    whole = _measure(_llama("sdpa"), ids, mask)
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        for a, b in zip(whole.tables(), got["tables"], strict=True):
            torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(got["norms"], whole.input_norms())


@pytest.mark.timeout(300)
def test_trainer_step_with_gradient_accumulation(tmp_path):
    """In a real Trainer (2 micro-batches of 2 per step), armed at on_step_begin and disarmed at
    on_pre_optimizer_step, step 3's values equal one forward of that step's weights on the 4
    sequences it trained on."""
    import copy

    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=99,
                                         initializer_range=0.4)).double()
    model.set_attn_implementation("sdpa")

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            ids = torch.randint(1, 99, (L,), generator=torch.Generator().manual_seed(i))
            mask = torch.ones(L, dtype=torch.long)
            mask[L - i % 4:] = 0  # right padding of 0-3 tokens
            return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    capture = AttentionCapture(model, find_attention(model))
    seen, result = [], {}

    def record(module, args, kwargs):
        if capture.armed:
            seen.append((kwargs["input_ids"].clone(), kwargs["attention_mask"].clone()))

    model.register_forward_pre_hook(record, with_kwargs=True)

    class Arm(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 2:
                result["weights"] = copy.deepcopy(model.state_dict())
                capture.arm()

        def on_pre_optimizer_step(self, args, state, control, **kw):
            if capture.armed:
                capture.disarm()
                result["step"] = capture.collect()

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=1e-2, report_to="none",
                             save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
    Trainer(model=model, args=args, train_dataset=Data(), callbacks=[Arm()]).train()
    capture.close()
    assert len(seen) == 2
    reference_model = copy.deepcopy(model)
    reference_model.load_state_dict(result["weights"])
    ids = torch.cat([b[0] for b in seen])
    mask = torch.cat([b[1] for b in seen])
    reference = _measure(reference_model.eval(), ids, mask)
    torch.testing.assert_close(result["step"].tokens, reference.tokens)
    for a, b in zip(reference.tables(), result["step"].tables(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10)


def test_checkpointed_rerun_is_not_counted_twice():
    ids, mask = _batch()
    values = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=64, vocab_size=99,
                                             initializer_range=0.4)).double()
        model.set_attn_implementation("sdpa")
        if checkpointing:
            model.activation_checkpointing_enable()
        model.train()
        capture = AttentionCapture(model, find_attention(model))
        capture.arm()
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        capture.disarm()
        values.append(capture.collect())
        capture.close()
    torch.testing.assert_close(values[0].tokens, values[1].tokens)
    for a, b in zip(values[0].tables(), values[1].tables(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_input_norm_and_bound_ratio():
    """The largest input norm is over non-padding tokens; the ratio of a bias-free Llama is <= 1."""
    model = _llama()
    ids, mask = _batch()
    layers = find_attention(model)
    inputs, _ = _attention_inputs(model, layers, ids, mask)
    step = _measure(model, ids, mask)
    for i, layer in enumerate(layers):
        norms = torch.linalg.vector_norm(inputs[i], dim=-1)[mask.bool()]
        assert step.input_norms()[i].item() == pytest.approx(norms.max().item(), rel=1e-12)
        wq, wk = layer.factors()
        sq = torch.stack([torch.linalg.svdvals(w.double())[0] for w in wq])
        sk = torch.stack([torch.linalg.svdvals(w.double())[0] for w in wk]).repeat_interleave(2)
        head_bound = sq * sk
        bound = torch.cat([head_bound.amax()[None], head_bound])
        table = step.tables()[i]
        ratio = logit_bound_ratio(table[0], bound, step.input_norms()[i], step.scaling[i])
        expected = table[0] / (bound * norms.max() ** 2 * layer.head_dim ** -0.5)
        torch.testing.assert_close(ratio, expected, atol=1e-12, rtol=1e-12)
        assert (ratio > 0).all() and (ratio <= 1).all()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_not_due_forward_calls_only_the_wrapper(impl):
    """Unarmed, the only attn_probe code run in a forward is the flag checks: the wrapper's (and its
    creation), and the capture's hooks, which stay registered (issue 44: hooks registered per due
    step made torch.compile recompile at each one) and return at their first line."""
    model = _llama(impl)
    ids, mask = _batch()
    capture = AttentionCapture(model, find_attention(model), training_only=False)
    calls = []

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(stats_module.__file__.rsplit("/", 1)[0]):
            calls.append(frame.f_code.co_name)

    try:
        sys.setprofile(profiler)
        with torch.no_grad():
            model(ids, attention_mask=mask)
        sys.setprofile(None)
        # the model's pre-hook; per layer its pre-hook, the get_interface patch, the closure it makes,
        # the closure's flag check; the model's always-called hook
        assert calls == ["_enter", *["hook", "_get_interface", "_wrap", "wrapper"] * 2, "_exit"]  # nothing else
        capture.arm()
        sys.setprofile(profiler)
        with torch.no_grad():
            model(ids, attention_mask=mask)
        sys.setprofile(None)
        assert "logit_stats" in calls  # the profiler does see the measurement when armed
    finally:
        sys.setprofile(None)
        capture.close()


def test_registry_is_restored_and_reference_counted(tmp_path):
    """The registry's mapping is never written; get_interface is wrapped while any capture lives
    (reference-counted per implementation name) and transformers' own is back after the last."""
    before = dict(AttentionInterface._global_mapping)
    original = AttentionInterface.__dict__["get_interface"]
    eager_a, sdpa_b = _llama("eager"), _bert("sdpa")
    ids, mask = _batch()
    a = AttentionCapture(eager_a, find_attention(eager_a))
    b = AttentionCapture(sdpa_b, find_attention(sdpa_b))
    b2 = AttentionCapture(sdpa_b, find_attention(sdpa_b), training_only=False)
    assert installed_wrappers() == {"eager": 1, "sdpa": 2}
    assert AttentionInterface.__dict__["get_interface"] is not original
    b.close()
    b2.arm()
    with torch.no_grad():
        sdpa_b(ids, attention_mask=mask)
    b2.disarm()
    assert b2.missing() == []
    b2.close()
    assert installed_wrappers() == {"eager": 1}
    a.close()
    assert AttentionInterface._global_mapping == before
    assert AttentionInterface.__dict__["get_interface"] is original
    assert installed_wrappers() == {}


def test_config_json_unchanged(tmp_path):
    model = _llama("sdpa")
    model.save_pretrained(tmp_path / "before")
    ids, mask = _batch()
    capture = AttentionCapture(model, find_attention(model), training_only=False)
    capture.arm()
    with torch.no_grad():
        model(ids, attention_mask=mask)
    model.save_pretrained(tmp_path / "during")
    capture.close()
    before = json.loads((tmp_path / "before" / "config.json").read_text())
    during = json.loads((tmp_path / "during" / "config.json").read_text())
    assert before == during
    assert model.config._attn_implementation == "sdpa"


def test_unavailable_reasons():
    gpt2 = _gpt2("eager")
    gpt2.config.reorder_and_upcast_attn = True
    assert "reorder_and_upcast_attn" in unavailable_reason(find_attention(gpt2))
    with pytest.raises(ValueError, match="reorder_and_upcast_attn"):
        AttentionCapture(gpt2, find_attention(gpt2))
    # a module outside transformers' interface is measured from its scaled_dot_product_attention
    # calls (attn_probe.activations.sdpa); one that makes none is warned about at its first due step
    mha = torch.nn.Sequential(torch.nn.MultiheadAttention(16, 2))
    assert unavailable_reason(find_attention(mha)) is None
    llama = _llama("eager")
    assert unavailable_reason(find_attention(llama)) is None
    llama.config._attn_implementation_internal = "flex_attention"  # what set_attn_implementation records
    assert "flex_attention" in (unavailable_reason(find_attention(llama)) or "")
    assert installed_wrappers() == {}


def test_flash_masks_match_transformers_masks():
    """The flash-family mask (rebuilt from 2D padding, causal, sliding window, packing) equals
    transformers' own 4D mask for the same inputs."""
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        find_packed_sequence_indices,
        packed_sequence_mask_function,
        sdpa_mask,
        sliding_window_overlay,
    )

    module = torch.nn.Module()
    module.is_causal = True
    pad = torch.ones(2, L, dtype=torch.bool)
    pad[1, :2] = False  # left padding
    for window in (None, 3):
        fn = causal_mask_function if window is None else and_masks(causal_mask_function,
                                                                     sliding_window_overlay(window))
        expected = sdpa_mask(batch_size=2, q_length=L, kv_length=L, mask_function=fn, attention_mask=pad,
                             allow_is_causal_skip=False)
        rows = row_mask("flash", module, pad, {"sliding_window": window}, L, L, torch.device("cpu"))
        allowed, bias = rows(2, 7)
        assert bias is None
        assert torch.equal(allowed.expand(2, 1, 5, L), expected[:, :, 2:7])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    packed = find_packed_sequence_indices(position_ids)
    expected = sdpa_mask(batch_size=1, q_length=L, kv_length=L,
                         mask_function=and_masks(causal_mask_function, packed_sequence_mask_function(packed)),
                         allow_is_causal_skip=False)
    rows = row_mask("flash", module, None, {"position_ids": position_ids}, L, L, torch.device("cpu"))
    assert torch.equal(rows(0, L)[0], expected)
    cu = torch.tensor([0, 3, 5, 9])
    rows = row_mask("flash", module, None, {"cu_seq_lens_q": cu}, L, L, torch.device("cpu"))
    assert torch.equal(rows(0, L)[0], expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logit_stats_are_float32_under_the_callers_autocast(dtype):
    """Trainer/TRL ``bf16=True`` runs the step under autocast: the statistics still come from float32
    matmuls (max |l| within 1e-5 of float64), not from bf16 ones (about 0.3% off before the fix)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 33, 16, generator=gen) * 3
    k = torch.randn(2, 2, 33, 16, generator=gen) * 3
    scaling = 16 ** -0.5
    # the reference: explicit float64 logits, GQA by repeating k, all keys visible
    logits = torch.einsum("bhqd,bhkd->bhqk", q.double() * scaling, k.double().repeat_interleave(2, dim=1))
    ref_max = logits.abs().amax(dim=(0, 2, 3))
    p = torch.softmax(logits, -1)
    ref_ent = -(p * torch.log(p)).sum(-1).sum(dim=(0, 2))
    with torch.autocast("cpu", dtype=dtype):
        top, ent, count, top_signed = logit_stats(q, k, scaling)
    assert top.dtype == torch.float32
    assert torch.allclose(top.double(), ref_max, rtol=1e-5, atol=0)
    assert torch.allclose(top_signed.double(), logits.amax(dim=(0, 2, 3)), rtol=1e-5, atol=0)
    assert torch.allclose(ent.double(), ref_ent, rtol=1e-5, atol=0)
    assert count.tolist() == [2 * 33] * 4
