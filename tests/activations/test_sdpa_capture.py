"""max_logit and entropy of modules that call ``torch.nn.functional.scaled_dot_product_attention``
themselves (nanoGPT, timm, LitGPT, torchtune, torchtitan 0.2; modules shaped as theirs in
:mod:`sdpa_stacks`), against a float64 reference recomputed from the q/k each call received
(recorded by a separate wrapper); under torch.compile; and after an earlier compile in the process.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import attn_probe
from attn_probe.extraction import find_attention
from tests.activations.sdpa_stacks import STACKS, Net, Recorder, reference
from tests.activations.test_attention_health_live import Records

STEPS, B, T = 3, 2, 7


def _batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, T, 32, generator=g) * 2, torch.randn(B, T, 32, generator=g)


def _masks(net: Net) -> None:
    """torchtune: an additive float mask, causal, with the last key of row 1 padding."""
    pos = torch.arange(T)
    mask = torch.where(pos[None] <= pos[:, None], 0.0, -math.inf).expand(B, 1, T, T).clone()
    mask[1, :, :, -1] = -math.inf
    mask[1, :, -1, -1] = -math.inf
    mask[1, 0, :, 0] += 0.5  # a finite bias: in the entropy, not in max_logit
    for block in net.blocks:
        if hasattr(block.attn, "gqa"):
            block.attn.mask = mask




def _train(net: Net, tmp_path, run=None, every: int = 1, recorder: Recorder | None = None, eval_inside=True):
    """SGD steps; inside each step (after backward, before the update) an evaluation forward under
    no_grad on another batch, which must not count. Returns the sink and, per step, the calls."""
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    sink = Records()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = attn_probe.watch(net, optimizer=opt, every=every, attention_stats=True, per_head=True,
                                 sinks=[sink], metrics=("symmetry",), log_dir=str(tmp_path / "tb"))
        run = net if run is None else run
        per_step = {}
        for step in range(1, STEPS + 1):
            start = len(recorder.calls) if recorder is not None else 0
            x, y = _batches(step)
            (run(x) - y[..., :1]).pow(2).mean().backward()
            if eval_inside:
                net.eval()
                with torch.no_grad():
                    run(_batches(step + 50)[0] * 3)
                net.train()
            opt.step()
            opt.zero_grad()
            if recorder is not None:
                per_step[step] = recorder.calls[start:]
        probe.close()
    return sink, per_step, [str(w.message) for w in caught if "attn_probe" in str(w.message)]


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_per_head_values_equal_the_float64_reference(stack, monkeypatch, tmp_path):
    """Every step, every layer and head: max_logit and entropy equal the float64 reference of the
    training forwards' calls (the no_grad evaluation forward inside the step is left out)."""
    torch.manual_seed(0)
    net = Net(stack)
    _masks(net)
    assert len(find_attention(net)) == 2
    recorder = Recorder(monkeypatch)
    sink, per_step, messages = _train(net, tmp_path, recorder=recorder)
    assert not [m for m in messages if "not measured" in m or "skipped" in m], messages
    got_max, got_ent = sink.values("max_logit"), sink.values("entropy")
    assert sorted(got_max) == list(range(1, STEPS + 1))
    for step, calls in per_step.items():
        assert len(calls) == 4 and [c["grad"] for c in calls] == [True, True, False, False]
        for layer in range(2):
            top, ent = reference([c for c in calls[layer::2] if c["grad"]])
            for h in range(4):
                assert got_max[step][(layer, h)] == pytest.approx(float(top[h]), rel=1e-5), (step, layer, h)
                assert got_ent[step][(layer, h)] == pytest.approx(float(ent[h]), rel=1e-5), (step, layer, h)
            assert got_max[step][(layer, None)] == pytest.approx(float(top.max()), rel=1e-5)
            assert got_ent[step][(layer, None)] == pytest.approx(float(ent.mean()), rel=1e-5)
            # had the evaluation forward (another batch) counted, the values would differ
            all_top, all_ent = reference(calls[layer::2])
            assert max(float((all_top - top).abs().max()), float((all_ent - ent).abs().max())) > 1e-3


def test_unwatched_modules_and_outputs_are_untouched(tmp_path):
    """A watched model's outputs and gradients equal an unwatched copy's on due steps; an unwatched
    module calling sdpa inside the step is not measured (values only for the two watched layers)."""
    torch.manual_seed(1)
    net = Net("nanogpt")
    twin = Net("nanogpt")
    twin.load_state_dict(net.state_dict())
    other = STACKS["timm"]()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    sink = Records()
    probe = attn_probe.watch(net, optimizer=opt, every=1, attention_stats=True, sinks=[sink],
                             metrics=("symmetry",), log_dir=str(tmp_path / "tb"))
    x, _ = _batches(1)
    for _ in range(2):
        out = net(x)
        out.sum().backward()
        other(x).sum().backward()
        opt.step()
        opt.zero_grad()
    probe.close()
    ref = twin(x)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert {key for step in sink.values("max_logit").values() for key in step} == {(0, None), (1, None)}


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def test_compiled_values_and_graphs(tmp_path):
    """torch.compile (aot_eager), every=2 over 3 steps (due: 2): the values equal the eager run's,
    step 1 compiles the graphs of a run without the probe, no graph break."""
    results = {}
    for name, probe in (("eager", True), ("bare", False), ("compiled", True)):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(2)
        net = Net("torchtune_gqa")
        run = net if name == "eager" else torch.compile(net, backend="aot_eager")
        if probe:
            sink, _, messages = _train(net, tmp_path / name, run=run, every=2, eval_inside=False)
            assert not [m for m in messages if "not measured" in m or "skipped" in m], messages
            results[name] = (sink.values("max_logit"), sink.values("entropy"))
        else:
            opt = torch.optim.SGD(net.parameters(), lr=0.05)
            x, y = _batches(1)
            (run(x) - y[..., :1]).pow(2).mean().backward()
            opt.step()
            results[name] = _graphs()
        if name == "compiled":
            assert sum(counters["graph_break"].values()) == 0
            graphs = _graphs()
    eager, compiled = results["eager"], results["compiled"]
    assert sorted(eager[0]) == sorted(compiled[0]) == [2]
    for want, got in zip(eager, compiled, strict=True):
        assert set(got[2]) == set(want[2]) and len(want[2]) == 10
        for key, value in want[2].items():
            assert got[2][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert results["bare"] == 1 and graphs == 2  # step 1: the bare graph; the due step: one more variant


def test_compile_after_an_earlier_compile_in_the_process(tmp_path):
    """A model of the same class compiled (and run) before the probe attached, then a watched one
    compiled: the due steps still get every row (the probe's mode on the stack is guarded by the
    compiler, so the old code is not reused), no 'not measured' warning. (For models measured
    through transformers' interface: tests/activations/test_attention_missing.py, warned.)"""
    def make():
        return Net("nanogpt")

    def loss(run):
        return run(_batches(1)[0]).pow(2).mean()

    torch._dynamo.reset()
    loss(torch.compile(make(), backend="aot_eager")).backward()
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = Records()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = attn_probe.watch(model, optimizer=opt, every=1, attention_stats=True, sinks=[sink],
                                 metrics=("symmetry",), log_dir=str(tmp_path / "tb"))
        run = torch.compile(model, backend="aot_eager")
        for _ in range(2):
            loss(run).backward()
            opt.step()
            opt.zero_grad()
        probe.close()
    torch._dynamo.reset()
    messages = [str(w.message) for w in caught if "attn_probe" in str(w.message)]
    assert not [m for m in messages if "not measured" in m], messages
    rows = sink.values("max_logit")
    assert sorted(rows) == [1, 2] and all(len(r) == 2 for r in rows.values())
    assert all(math.isfinite(v) for r in rows.values() for v in r.values())
