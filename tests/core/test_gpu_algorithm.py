"""The GPU algorithm of the scoring core, run on CPU tensors through its switch: the batched
repeated-squaring chain against float64 ``svdvals``/``eigvalsh`` references (rounding in float32
and float64, clustered top spectra, ill-conditioned factors), the one-chain batching of a
stack's eigenvalue problems, the stack budget, and the operation count of one synchronous
``probe.snapshot()`` (flat in the layer count, within the budget of issue 21)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading

import pytest
import torch
from helpers import tiny_model
from test_core_paths import check_table, factors

import attn_probe
from attn_probe import core
from attn_probe.core import (
    DEFAULT_METRICS,
    gpu_algorithm_on_cpu,
    lambda_max_by_squaring,
    score_factor_stack,
    spectra,
)
from attn_probe.core.op_count import count_ops, is_view_op, snapshot_op_count
from attn_probe.scoring import pairs as pairs_module

CPU = torch.device("cpu")


def spectrum(values, m, seed, dtype=torch.float64):
    """Symmetric PSD ``m x m`` with eigenvalues ``values`` (random eigenvectors), in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))[0]
    c = (u * values) @ u.T
    return ((c + c.T) / 2).to(dtype)


def bound(m):
    """The documented underestimate of lambda_max: ln(m) / 2^s relative."""
    return math.log(max(m, 2)) / 2**core.SQUARINGS


# ---------------------------------------------------------------------------------- the chain
@pytest.mark.parametrize("chain", [torch.float64, torch.float32], ids=["fp64-chain", "fp32-chain"])
@pytest.mark.parametrize("gap", [1e-1, 1e-4, 1e-7, 0.0])
def test_chain_with_clustered_top_spectra(chain, gap):
    m = 256
    rest = torch.linspace(0.0, 0.999, m - 3, dtype=torch.float64)  # a dense spectrum up to the top
    values = torch.cat([torch.tensor([1.0, 1.0 - gap, 1.0 - 2 * gap], dtype=torch.float64), rest])
    c = spectrum(values, m, seed=3)
    want = float(torch.linalg.eigvalsh(c)[-1])
    got = float(lambda_max_by_squaring(c, dtype=chain))
    rounding = 1e-13 if chain == torch.float64 else 1e-5
    assert want * (1 - bound(m) - rounding) <= got <= want * (1 + rounding)
    assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("cond", [1e2, 1e6, 1e12])
def test_chain_on_products_of_ill_conditioned_factors(dtype, cond):
    """``G_B G_A`` from factors with singular values spread over ``cond``: sigma_max(A^T B) at 1e-4."""
    gen = torch.Generator().manual_seed(int(math.log10(cond)))
    r, d = 48, 160

    def factor():
        u = torch.linalg.qr(torch.randn(r, r, generator=gen, dtype=torch.float64))[0]
        v = torch.linalg.qr(torch.randn(d, r, generator=gen, dtype=torch.float64))[0]
        s = torch.logspace(0, -math.log10(cond), r, dtype=torch.float64)
        return (u * s) @ v.T  # (r, d), sigma_max 1, sigma_min 1 / cond

    a, b = factor(), factor()
    want = float(torch.linalg.svdvals(a.T @ b)[0])
    a32, b32 = a.to(dtype), b.to(dtype)
    c = (b32 @ b32.T) @ (a32 @ a32.T)
    for chain in (torch.float64, torch.float32):
        got = math.sqrt(float(lambda_max_by_squaring(c, dtype=chain)))
        assert got == pytest.approx(want, rel=1e-4), chain


def test_chain_stays_in_range_for_large_and_flat_spectra():
    """A flat spectrum of a large problem: the top eigenvalue is 1/m after each renormalisation."""
    for dtype in (torch.float32, torch.float64):
        for m in (2, 64, 512):
            c = torch.eye(m, dtype=torch.float64) * 3.0
            assert float(lambda_max_by_squaring(c, dtype=dtype)) == pytest.approx(3.0, rel=1e-6)
            every = core.renormalise_every(m, dtype)
            assert (1 / m) ** (2**every) >= torch.finfo(dtype).tiny  # the documented condition
    batch = torch.stack([torch.zeros(4, 4), torch.full((4, 4), math.nan), torch.eye(4)]).double() * 1e30
    got = lambda_max_by_squaring(batch)
    assert got[0] == 0 and math.isnan(got[1]) and float(got[2]) == pytest.approx(1e30, rel=1e-12)


def test_padding_to_one_chain_changes_no_value(monkeypatch):
    """Zero padding adds zero eigenvalues: one padded chain or one chain per size, same values."""
    q, k = factors((8, 2, 16, 96), seed=7)
    queries, keys = torch.stack([q, 3 * q, q.flip(0)]), torch.stack([k, k, 2 * k])
    chains = []
    real = core.lambda_max_by_squaring
    monkeypatch.setattr(spectra, "lambda_max_by_squaring", lambda c, *a, **kw: chains.append(c.shape) or real(c, *a, **kw))
    with gpu_algorithm_on_cpu():
        monkeypatch.setattr(spectra, "PAD_FREE_WORK", 0)
        split = score_factor_stack(queries, keys, per_head=True)
        assert sorted(s[-1] for s in chains) == [16, 32]  # head_dim and the layer's r = 2 x 16
        chains.clear()
        monkeypatch.setattr(spectra, "PAD_FREE_WORK", 1 << 40)
        padded = score_factor_stack(queries, keys, per_head=True)
        # one chain for everything: the layer problems (3) and per head M_h (24), Q_h (24), K_g (6)
        assert chains == [torch.Size([3 + 24 + 24 + 6, 32, 32])]
    torch.testing.assert_close(padded, split, rtol=1e-6, atol=1e-9)
    for i in range(3):
        check_table(padded[i], queries[i], keys[i])


def test_gpu_algorithm_on_bf16_weights_matches_float64_references():
    q, k = factors((8, 2, 32, 256), seed=5)
    q16, k16 = q.bfloat16(), k.bfloat16()
    with gpu_algorithm_on_cpu():
        table = score_factor_stack(torch.stack([q16, q16]), torch.stack([k16, -k16]), per_head=True)
    for i, sign in enumerate((1, -1)):
        check_table(table[i], q16.double(), sign * k16.double())


def test_the_switch_by_environment_variable():
    code = ("import torch; from attn_probe import core as metrics; from attn_probe.scoring import pairs; d = torch.device('cpu'); "
            "print(metrics.gpu_algorithm(d), metrics.lanczos_threshold(d), pairs.stack_budget(d) == pairs.STACK_BYTES)")
    env = {**os.environ, core.GPU_ALGORITHM_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "inf", "True"]
    env[core.GPU_ALGORITHM_ENV] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "384", "False"]


def test_stack_budget_per_algorithm():
    assert pairs_module.stack_budget(CPU) == pairs_module.CPU_STACK_BYTES
    with gpu_algorithm_on_cpu():
        assert pairs_module.stack_budget(CPU) == pairs_module.STACK_BYTES
    per_layer = pairs_module.stack_layer_bytes((8, 32, 256), (2, 32, 256), torch.bfloat16, torch.float32)
    assert per_layer == 2 * (2 + 4) * (8 + 2) * 32 * 256  # Gram paths: no d x d product formed


# ------------------------------------------------------------------------------ operation count
def test_op_counter_counts_kernels_not_views():
    x = torch.ones(4, 5)
    with count_ops() as ops:
        y = x.T[1:].unsqueeze(0)  # views: nothing
        z = x @ x.T  # mm
        z.add_(1)  # in place: counted
        torch.add(x, 1, out=torch.empty(4, 5))  # empty + add.out
    assert ops.total == 4 and ops.by_op["mm"] == 1 and ops.by_op["add_"] == 1, ops
    assert y.shape == (1, 4, 4)
    assert is_view_op(torch.ops.aten.transpose.int) and not is_view_op(torch.ops.aten.add_.Tensor)
    with count_ops() as ops:  # another thread's ops are not the calling thread's
        t = threading.Thread(target=lambda: x @ x.T)
        t.start()
        t.join()
    assert ops.total == 0


def _llama(layers, d=256, heads=8, kv=2):
    return tiny_model("llama", vocab_size=64, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=64, max_position_embeddings=64)


def snapshot_ops(layers, per_head, tmp_path, gpu=True):
    """Non-view ATen ops of one synchronous probe.snapshot() (default metrics), after a warm-up one."""
    model = _llama(layers)
    probe = attn_probe.watch(model, log_dir=str(tmp_path / f"{layers}-{per_head}-{gpu}"), every=None,
                             per_head=per_head, async_scoring=False)
    try:
        if gpu:
            with gpu_algorithm_on_cpu():
                probe.snapshot(1)
                return snapshot_op_count(probe, 2).total
        probe.snapshot(1)
        return snapshot_op_count(probe, 2).total
    finally:
        probe.close(final_snapshot=False)


#: issue 21's budget on a Llama-shaped model (d 256, 8/2 heads), 16 layers, for both algorithms
BUDGET = {False: 460, True: 610}


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu-algorithm", "cpu-algorithm"])
@pytest.mark.parametrize("per_head", [False, True], ids=["layer-rows", "per-head"])
def test_snapshot_op_count_is_flat_in_the_layer_count_and_within_budget(per_head, gpu, tmp_path):
    """The whole snapshot, on either algorithm: all layers of one shape in one stack (the CPU
    algorithm's 256 MiB budget holds these 32 layers too), so the count does not grow with the
    layers; the budget allows 1.25x from 16 to 32 layers."""
    counts = {layers: snapshot_ops(layers, per_head, tmp_path, gpu=gpu) for layers in (2, 16, 32)}
    assert counts[16] <= BUDGET[per_head], counts
    assert counts[32] <= 1.25 * counts[16], counts
    assert counts[2] == counts[16] == counts[32], counts  # flat: nothing per layer


def test_the_core_counts_the_same_for_every_stack_size():
    """score_factor_stack alone on the GPU algorithm: the same ops for 2, 16 and 32 layers (one
    layer: a few reshapes stay views), with and without grouped heads, per head too."""
    for shape in [(8, 2, 32, 256), (4, 4, 16, 64)]:
        for per_head in (False, True):
            totals = {}
            for layers in (1, 2, 16, 32):
                q, k = factors(shape, seed=layers)
                queries, keys = q.expand(layers, *q.shape).clone(), k.expand(layers, *k.shape).clone()
                with gpu_algorithm_on_cpu(), count_ops() as ops:
                    score_factor_stack(queries, keys, DEFAULT_METRICS, per_head=per_head)
                totals[layers] = ops.total
                assert not any("eig" in name or "svd" in name for name in ops.by_op), ops.by_op
            assert totals[1] <= totals[2] == totals[16] == totals[32], (shape, per_head, totals)


def test_bench_snapshot_build_initialises_buffers():
    """to_empty leaves buffers (rotary inv_freq) uninitialised: build() copies them from a real model."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_snapshot.py"
    spec = importlib.util.spec_from_file_location("bench_snapshot", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = bench.build("cpu-32x256", CPU, torch.float32)
    reference = dict(AutoModelForCausalLM.from_config(bench.SHAPES["cpu-32x256"]()).named_buffers())
    buffers = dict(model.named_buffers())
    assert buffers and set(buffers) == set(reference)
    for name, buf in buffers.items():
        assert torch.equal(buf, reference[name]), name
