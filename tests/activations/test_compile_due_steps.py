"""Issue 44, finding 4: under the user's ``torch.compile``, ten due steps of a model that calls
``scaled_dot_product_attention`` (or ``flex_attention``) itself add one compiled graph variant, at
the first due step, and no recompilation after it; the values stay those of a float64 reference.

Before the fix the capture registered its hooks anew at every due step, and dynamo guards on a
traced module's hook ids (``hook_id in module._forward_hooks_always_called``): every due step
recompiled (graphs 1, 2, 3, ... up to dynamo's recompile limit, then eager).

Graphs are counted by a backend of the test's own (each compiled graph calls it once; it runs the
graph as dynamo's ``eager`` backend does); recompilation is refused after the first due step by
``torch.compiler.set_stance("fail_on_recompile")`` (a recompile raises). References: the float64
statistics of the sdpa calls of a float64 copy of the model, run eagerly before each update
(:func:`tests.activations.sdpa_stacks.reference`), and for flex the q/k each call received.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

import attn_probe
from tests.activations.sdpa_stacks import NanoCausalSelfAttention, Net, Recorder, reference
from tests.activations.test_attention_health_live import Records

flex = pytest.importorskip("torch.nn.attention.flex_attention")

pytestmark = pytest.mark.timeout(900)

DUE, EVERY, B, T, D = 10, 2, 2, 7, 32


class Graphs:
    """A ``torch.compile`` backend that counts the graphs compiled, by the step that compiled them."""

    def __init__(self) -> None:
        self.step = 0
        self.compiled: list[int] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.compiled.append(self.step)
        return gm.forward


def _batch(step: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(B, length, D, generator=g), torch.randn(B, length, 1, generator=g)


def _run(
    net: torch.nn.Module,
    params,
    graphs: Graphs,
    log_dir,
    *,
    probe: bool,
    length: int = T,
    before_forward=None,
    **options,
):
    """``DUE * EVERY`` SGD steps of ``torch.compile(net, backend=graphs)``; after the first due step
    every recompilation raises. Returns the sink (``None`` without the probe) and the warnings."""
    torch._dynamo.reset()
    opt = torch.optim.SGD(params, lr=0.01)
    sink = Records()
    run = torch.compile(net, backend=graphs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = (
            attn_probe.watch(
                net,
                optimizer=opt,
                every=EVERY,
                attention_stats=True,
                per_head=True,
                sinks=[sink],
                metrics=("symmetry",),
                random_range=False,
                log_dir=str(log_dir),
                **options,
            )
            if probe
            else None
        )
        for step in range(1, DUE * EVERY + 1):
            graphs.step = step
            x, y = _batch(step, length)
            if before_forward is not None:
                before_forward(step, x)
            strict = step > EVERY  # after the first due step (step EVERY): no recompilation at all
            with torch.compiler.set_stance("fail_on_recompile") if strict else contextlib.nullcontext():
                (run(x) - y).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if p is not None:
            p.close()
    torch._dynamo.reset()
    return (sink if probe else None), [str(w.message) for w in caught if "attn_probe" in str(w.message)]


def test_ten_due_steps_of_an_sdpa_caller_add_one_graph_variant(monkeypatch, tmp_path):
    """nanoGPT's attention (its own ``F.scaled_dot_product_attention`` call), 20 steps, every 2."""
    torch.manual_seed(0)
    bare_net = Net("nanogpt")
    net = copy.deepcopy(bare_net)
    bare = Graphs()
    _run(bare_net, bare_net.parameters(), bare, tmp_path / "bare", probe=False)
    want: dict[int, list] = {}

    def reference_of(step: int, x: torch.Tensor) -> None:
        if step % EVERY:
            return
        twin = copy.deepcopy(net).double()  # the weights this step's forward sees, in float64
        with monkeypatch.context() as patch:
            recorder = Recorder(patch)
            twin(x.double())
        want[step] = [reference(recorder.calls[layer::2]) for layer in range(2)]

    graphs = Graphs()
    sink, messages = _run(
        net, net.parameters(), graphs, tmp_path / "probe", probe=True, before_forward=reference_of
    )
    assert bare.compiled == [1]
    assert graphs.compiled == [1, EVERY], (
        graphs.compiled
    )  # the bare graph, then one variant at the first due step
    assert not [m for m in messages if "not measured" in m or "skipped" in m], messages
    _check(sink, want, rel=1e-4)  # float32 model, float64 reference


def _check(sink: Records, want: dict[int, list], rel: float) -> None:
    """Every due step, layer and head: the logged values equal the reference's."""
    got_max, got_ent = sink.values("max_logit"), sink.values("entropy")
    assert sorted(got_max) == sorted(want) == list(range(EVERY, DUE * EVERY + 1, EVERY))
    for step, layers in want.items():
        for layer, (top, ent) in enumerate(layers):
            for h in range(4):
                assert got_max[step][(layer, h)] == pytest.approx(float(top[h]), rel=rel), (step, layer, h)
                assert got_ent[step][(layer, h)] == pytest.approx(float(ent[h]), rel=rel), (step, layer, h)


class FlexNano(NanoCausalSelfAttention):
    """nanoGPT's attention calling ``flex_attention`` with a causal ``BlockMask``; ``record`` (a list,
    set on the eager float64 twin only) keeps the q and k of each call."""

    record: list | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = (
            z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for z in self.c_attn(x).split(self.n_embd, dim=2)
        )
        if self.record is not None:
            self.record.append((q.detach().double(), k.detach().double(), True))
        y = flex.flex_attention(q, k, v, block_mask=CAUSAL[t])
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


CAUSAL: dict[int, object] = {}


def test_ten_due_steps_of_a_flex_caller_add_one_graph_variant(tmp_path):
    """The same with ``flex_attention`` (its statistics traced into the user's graph,
    ``attention_flex_compiled=True``); only the head trains (torch 2.13's flex has no backward on
    the CPU). Reference: the q and k of an eager float64 twin's calls, before each update."""
    from tests.activations.test_flex_capture import _reference

    length = 16
    CAUSAL[length] = flex.create_block_mask(
        lambda b, h, q, kv: q >= kv, None, None, length, length, device="cpu", BLOCK_SIZE=4
    )
    torch.manual_seed(0)
    net = Net("nanogpt")
    for block in net.blocks:
        block.attn = FlexNano()
    for name, p in net.named_parameters():
        p.requires_grad_(name.startswith("head."))
    want: dict[int, list] = {}

    def reference_of(step: int, x: torch.Tensor) -> None:
        if step % EVERY:
            return
        twin = copy.deepcopy(net).double()
        for block in twin.blocks:
            block.attn.record = []
        with torch.no_grad():
            twin(x.double())
        want[step] = [_reference("causal", block.attn.record) for block in twin.blocks]

    graphs = Graphs()
    sink, messages = _run(
        net,
        net.head.parameters(),
        graphs,
        tmp_path,
        probe=True,
        length=length,
        before_forward=reference_of,
        attention_flex_compiled=True,
    )
    assert graphs.compiled == [1, EVERY], graphs.compiled
    assert not [m for m in messages if "not measured" in m or "skipped" in m], messages
    _check(sink, want, rel=1e-4)
