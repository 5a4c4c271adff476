"""The GPU paths, where a GPU is present (skipped elsewhere): the core on CUDA against float64
references, no host synchronisation inside it, bf16 Gram products with float32 output, the
stack budget from the free memory, the operation count beside the profiler's kernel count, and
the asynchronous mode on CUDA streams.

Run on a GPU machine with ``python -m pytest -q tests/core/test_cuda.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_model
from test_core_paths import check_table, factors  # explicit float64 references
from transformers import LlamaConfig, LlamaForCausalLM

import attn_probe
from attn_probe import core
from attn_probe.core import DEFAULT_METRICS, score_factor_stack, score_factors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = [(4, 4, 8, 32), (6, 3, 4, 16), (3, 3, 64, 40), (8, 4, 32, 256), (4, 4, 32, 128), (16, 4, 64, 1024)]
IDS = ["gram", "gqa", "explicit", "gqa-gram-lanczos", "explicit-lanczos", "gqa-1024"]


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_core_on_cuda_matches_references(shape):
    q, k = factors(shape, seed=sum(shape))
    table = score_factors(q.cuda(), k.cuda(), per_head=True)
    assert table.device.type == "cuda"
    check_table(table.cpu(), q, k)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_no_host_synchronisation_inside_the_core(shape):
    q, k = factors(shape, seed=1)
    queries = torch.stack([q, 2 * q]).cuda()
    keys = torch.stack([k, k]).cuda()
    score_factor_stack(queries, keys, per_head=True)  # first use: the out_dtype feature test runs once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        table = score_factor_stack(queries, keys, per_head=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert table.shape == (2, len(DEFAULT_METRICS), 1 + shape[0])


def test_no_dense_eigensolver_runs_on_cuda(monkeypatch):
    calls = []
    for name in ("eigh", "eigvalsh"):
        real = getattr(torch.linalg, name)
        monkeypatch.setattr(torch.linalg, name, lambda *a, _real=real, _n=name, **kw: calls.append(_n) or _real(*a, **kw))
    q, k = factors((8, 4, 32, 256), seed=3)
    score_factors(q.cuda(), k.cuda(), per_head=True)
    assert calls == []
    assert not core.host_eigensolver(torch.device("cuda"))


def test_bf16_weights_on_cuda_match_float64_references():
    q, k = factors((8, 2, 64, 512), seed=5)
    q16, k16 = q.bfloat16(), k.bfloat16()
    table = score_factors(q16.cuda(), k16.cuda(), per_head=True)  # float32 compute of the stored bf16 values
    check_table(table.cpu(), q16.double(), k16.double())


def test_bf16_gram_products_use_float32_output_where_supported():
    device = torch.device("cuda")
    supported = core.gram_out_dtype_supported(device)
    q, k = factors((4, 4, 32, 256), seed=6)
    seen = []
    real = torch.bmm

    def spy(*args, **kwargs):
        seen.append((args[0].dtype, kwargs.get("out_dtype")))
        return real(*args, **kwargs)

    torch.bmm = spy
    try:
        table = score_factors(q.bfloat16().cuda(), k.bfloat16().cuda(), per_head=True)
    finally:
        torch.bmm = real
    check_table(table.cpu(), q.bfloat16().double(), k.bfloat16().double())
    assert ((torch.bfloat16, torch.float32) in seen) == supported
    assert torch.get_float32_matmul_precision() == "highest"  # no global flag changed


def test_stack_budget_comes_from_the_free_memory():
    from attn_probe.scoring import pairs

    free, _ = torch.cuda.mem_get_info()
    budget = pairs.stack_budget(torch.device("cuda"))
    assert 0 < budget <= pairs.STACK_BYTES
    assert budget <= free * pairs.FREE_MEMORY_SHARE * 1.05 + (64 << 20)


def test_op_count_on_cuda_equals_the_gpu_algorithm_on_cpu(tmp_path):
    """The device-independent count (GPU algorithm on CPU tensors) is the count on CUDA, float32
    weights, up to the host transfers (no-ops on CPU); bf16 adds the two half-precision copies
    that enter the Gram products."""
    from attn_probe.core.op_count import snapshot_op_count

    counts = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=256, num_hidden_layers=16,
                                             num_attention_heads=8, num_key_value_heads=2, intermediate_size=64,
                                             max_position_embeddings=64)).to(device)
        probe = attn_probe.watch(model, log_dir=str(tmp_path / device), every=None)
        with core.gpu_algorithm_on_cpu():
            probe.snapshot(1)
            counts[device] = snapshot_op_count(probe, 2).total
        probe.close(final_snapshot=False)
    assert counts["cpu"] <= counts["cuda"] <= counts["cpu"] + 2, counts


def _llama():
    return tiny_model("llama", vocab_size=64, hidden_size=128, num_hidden_layers=4, intermediate_size=256,
                      max_position_embeddings=32).cuda()


def _jsonl(path):
    out = {}
    for line in open(path):
        if '"run_header"' in line:  # a run header, not a row
            continue
        rec = json.loads(line)
        if "metric" in rec:
            out[(rec["step"], rec["layer"], rec.get("head"), rec["metric"])] = rec["value"]
    return out


def test_async_mode_on_cuda_equals_the_synchronous_mode(tmp_path):
    runs = {}
    for mode in (False, True):
        model = _llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator(device="cuda").manual_seed(0)
        probe = attn_probe.watch(model, log_dir=str(tmp_path / str(mode)), every=1, optimizer=opt,
                                 per_head=True, async_scoring=mode)
        probe.flush()  # the attach snapshot is scored before step 1 comes due (else step 1 is skipped)
        for _ in range(4):
            ids = torch.randint(0, 64, (4, 16), device="cuda", generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()  # the probe's copies must see this update and not the next one
            opt.zero_grad()
            probe.flush()
        probe.close()
        runs[mode] = _jsonl(tmp_path / str(mode) / "attn_probe.jsonl")
    assert set(runs[True]) == set(runs[False]) and len(runs[False]) > 0
    for key, value in runs[False].items():
        assert abs(runs[True][key] - value) <= 1e-6 * max(1.0, abs(value)), key


def test_async_snapshot_reads_the_weights_of_its_step_while_training_goes_on(tmp_path):
    """No flush between steps: training overwrites the weights while the worker scores."""
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator(device="cuda").manual_seed(1)
    probe = attn_probe.watch(model, log_dir=str(tmp_path / "run"), every=1, optimizer=opt, async_scoring=True)
    want = {}
    for step in range(1, 7):
        ids = torch.randint(0, 64, (4, 16), device="cuda", generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        want[step] = {(r["layer"], m): r[m] for r in attn_probe.score_model(model) for m in DEFAULT_METRICS}
    probe.close()
    got = _jsonl(tmp_path / "run" / "attn_probe.jsonl")
    logged = sorted({key[0] for key in got} & set(want))
    assert logged  # some steps may have been skipped while one was scored
    for step in logged:
        for (layer, metric), value in want[step].items():
            assert abs(got[(step, layer, None, metric)] - value) <= 1e-5 * max(1.0, abs(value)), (step, layer, metric)
