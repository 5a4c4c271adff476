"""Attention statistics under torch.compile: the values of an eager run, and the compiled graphs
of steps that are not due are those of a run without the probe.

References are eager runs on the same weights and batches (same seed, same data, same
optimizer), which the statistics tests check against the model's own projections. Graphs are
counted with torch._dynamo's counters (``unique_graphs``, ``graph_break``).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from test_attention_health_live import Data, Records  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer  # noqa: E402

import attn_probe  # noqa: E402
from attn_probe import AttnProbeCallback  # noqa: E402
from tests.helpers import make_args, tiny_model  # noqa: E402

L = 9


def _llama(impl: str = "eager") -> LlamaForCausalLM:
    return tiny_model("llama", impl=impl, intermediate_size=64, vocab_size=99, max_position_embeddings=2048,
                      initializer_range=0.4)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 99, (2, L), generator=g)
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, -3:] = 0
    return ids, mask


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _breaks() -> int:
    return int(sum(counters["graph_break"].values()))


def _plain_loop(backend: str | None, probe: bool, steps: int, every: int, tmp_path,
                impl: str = "eager") -> tuple[dict, list[int]]:
    """Train ``steps`` steps (SGD) on one batch; ``backend``: ``torch.compile(model, backend=...)``.
    Returns the logged max_logit/entropy rows per step and the graph count after each step."""
    torch._dynamo.reset()
    counters.clear()
    model = _llama(impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = Records()
    p = attn_probe.watch(model, optimizer=opt, every=every, attention_stats=True, per_head=True, sinks=[sink],
                         metrics=("symmetry",), log_dir=str(tmp_path / f"tb-{backend}-{probe}")) if probe else None
    run = torch.compile(model, backend=backend) if backend else model
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    graphs = []
    for _ in range(steps):
        run(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
        graphs.append(_graphs())
    if p is not None:
        p.close()
    return {m: sink.values(m) for m in ("max_logit", "entropy")}, graphs


def _assert_same(got: dict, want: dict, tol: float) -> None:
    for metric in ("max_logit", "entropy"):
        assert sorted(got[metric]) == sorted(want[metric]) and want[metric], metric
        for step, rows in want[metric].items():
            assert set(got[metric][step]) == set(rows) and len(rows) == 2 * 5  # 2 layers, layer + 4 heads
            for key, value in rows.items():
                assert math.isfinite(value)
                assert got[metric][step][key] == pytest.approx(value, rel=tol, abs=tol), (metric, step, key)


def test_aot_eager_values_and_graphs(tmp_path):
    """aot_eager, every=2 over 5 steps: every layer's and head's values equal the eager run's;
    non-due steps compile exactly the graphs of a compiled run without the probe (no graph
    break); the due steps add one compiled variant (the first one only), none after."""
    eager, _ = _plain_loop(None, True, 5, 2, tmp_path)
    bare, bare_graphs = _plain_loop("aot_eager", False, 5, 2, tmp_path)
    assert _breaks() == 0
    compiled, graphs = _plain_loop("aot_eager", True, 5, 2, tmp_path)
    assert _breaks() == 0
    _assert_same(compiled, eager, 1e-5)
    # step 1 (not due): the same graphs as without the probe; step 2 (due): one more; then none
    assert graphs[0] == bare_graphs[0] == 1
    assert graphs[1] == bare_graphs[1] + 1
    assert graphs[2:] == [graphs[1]] * 3 and bare_graphs[2:] == [bare_graphs[1]] * 3


def test_inductor_values():
    """The default backend (inductor) on a one-layer model, training-mode forwards (the backward
    is left out to keep the C++ compile short): a forward not armed, then an armed one; its
    values equal the eager capture's on the same weights and batch."""
    from attn_probe.activations.statistics import AttentionCapture
    from attn_probe.extraction import find_attention

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=32, vocab_size=99,
                                         initializer_range=0.4)).train()
    model.set_attn_implementation("sdpa")
    ids, mask = _batch()
    capture = AttentionCapture(model, find_attention(model))
    try:
        capture.arm()
        model(input_ids=ids, attention_mask=mask)
        capture.disarm()
        want = capture.collect()
        compiled = torch.compile(model)
        compiled(input_ids=ids, attention_mask=mask)
        assert _graphs() == 1
        capture.arm()
        compiled(input_ids=ids, attention_mask=mask)
        capture.disarm()
        got = capture.collect()
    finally:
        capture.close()
    assert _breaks() == 0 and _graphs() == 2
    torch.testing.assert_close(got.tokens, want.tokens)
    for a, b in zip(got.tables(), want.tables(), strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_trainer_torch_compile_values(tmp_path):
    """TrainingArguments(torch_compile=True) (backend aot_eager), every=2, gradient accumulation
    2: the logged values equal those of the same Trainer run without compile."""
    results = []
    for compile_ in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = _llama("sdpa")
        sink = Records()
        cb = AttnProbeCallback(every=2, attention_stats=True, per_head=True, sinks=[sink],
                               metrics=("symmetry",), log_dir=str(tmp_path / f"tb{compile_}"))
        extra = {"torch_compile": True, "torch_compile_backend": "aot_eager"} if compile_ else {}
        args = make_args(tmp_path / f"out{compile_}", 4, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, learning_rate=1e-2, logging_steps=100, **extra)
        Trainer(model=model, args=args, train_dataset=Data(), callbacks=[cb]).train()
        results.append({m: sink.values(m) for m in ("max_logit", "entropy")})
        if compile_:
            assert _graphs() >= 1 and _breaks() == 0
    assert sorted(results[0]["max_logit"]) == [2, 4]
    _assert_same(results[1], results[0], 1e-5)
