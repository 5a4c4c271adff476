"""A watched model (and its optimizer, and the probe's config) pickles, saves whole, deep-copies and
goes to a spawn child while the probe is attached; a copy never advances the original's probe; a
model saved whole while watched loads where attn_probe cannot be imported (issue 35, item 5).

The references are independent of the probe: the model's own outputs and parameters before
pickling, the steps read back from the trajectory file, a subprocess that cannot import attn_probe.
"""

from __future__ import annotations

import copy
import io
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import REPO, tiny_llama

import attn_probe
from attn_probe.live.config import ProbeConfig
from attn_probe.live.schedules import any_of, as_schedule, every, is_deterministic, log_spaced
from attn_probe.scoring.pairs import OVPair, QKPair

pytestmark = pytest.mark.timeout(600)

VOCAB, SEQ = 40, 8


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids).logits
    model.train(was)
    return out


def steps_written(log_dir) -> list[int]:
    with open(os.path.join(log_dir, "attn_probe.jsonl")) as f:
        rows = [json.loads(line) for line in f if '"run_header"' not in line]
    return sorted({r["step"] for r in rows})


def child_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Run in a spawn child: a training forward (the copied counting hook is called), then the logits."""
    model.train()
    model(input_ids=ids)
    return logits(model, ids)


def watched(log_dir) -> tuple[torch.nn.Module, attn_probe.Probe]:
    """A tiny Llama in training mode, its forwards counted by ``watch`` (no optimizer), every step."""
    model = tiny_llama()
    model.train()
    return model, attn_probe.watch(model, every=1, log_dir=str(log_dir), random_range=False)


def test_a_deep_copy_never_advances_the_original_probe(tmp_path) -> None:
    model, probe = watched(tmp_path / "run")
    teacher = copy.deepcopy(model)  # a teacher copy, run in training mode beside the student
    for i in range(6):
        model(input_ids=batch(i))
        teacher(input_ids=batch(i))
    assert probe.step == 5  # the step of the 6th forward: 5 forwards before it
    probe.close()
    assert steps_written(tmp_path / "run") == [0, 1, 2, 3, 4, 5, 6]  # 6 forwards, then close()'s step 6


def test_forward_counted_model_pickles_and_saves_whole_and_its_copies_stay_inert(tmp_path) -> None:
    model, probe = watched(tmp_path / "run")
    ids = batch(0)
    before = logits(model, ids)
    loaded = pickle.loads(pickle.dumps(model))
    assert torch.equal(logits(loaded, ids), before)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    assert torch.equal(logits(saved, ids), before)
    for i in range(3):
        loaded(input_ids=batch(i))
        saved(input_ids=batch(i))
    model(input_ids=ids)
    assert probe.step == 0
    probe.close()
    assert steps_written(tmp_path / "run") == [0, 1]


def test_armed_model_and_counted_optimizer_pickle_and_copies_stay_inert(tmp_path) -> None:
    """With an optimizer and ``attention_stats`` the capture's hooks sit on the model between an
    update and the due step's forward; the optimizer carries the counting hook."""
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = attn_probe.watch(model, optimizer=opt, every=1, attention_stats=True, random_range=False,
                             log_dir=str(tmp_path / "run"))
    ids = batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    assert probe.attention.capture.armed  # for step 2: the capture's hooks are on the model
    before = logits(model, ids)
    copied = copy.deepcopy(model)
    assert torch.equal(logits(pickle.loads(pickle.dumps(model)), ids), before)
    assert torch.equal(logits(copied, ids), before)
    copied_opt = pickle.loads(pickle.dumps(opt))
    copied_opt.step()  # the copy's counting hook is inert
    copy.deepcopy(opt).step()
    assert probe.step == 1
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert probe.step == 2
    probe.close()
    assert steps_written(tmp_path / "run") == [0, 1, 2]


def test_model_saved_whole_while_watched_loads_where_attn_probe_cannot_be_imported(tmp_path) -> None:
    model, probe = watched(tmp_path / "run")
    model(input_ids=batch(0))
    ids = batch(1)
    torch.save(model, tmp_path / "model.pt")
    torch.save({"ids": ids, "logits": logits(model, ids)}, tmp_path / "want.pt")
    probe.close()
    script = textwrap.dedent("""
        import sys

        class NoAttnProbe:  # attn_probe is not installed here
            def find_spec(self, name, path=None, target=None):
                if name == "attn_probe" or name.startswith("attn_probe."):
                    raise ImportError(f"No module named {name!r} (blocked by the test)")
                return None

        sys.meta_path.insert(0, NoAttnProbe())
        import torch
        try:
            import attn_probe  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("attn_probe is importable: the test proves nothing")
        model = torch.load(sys.argv[1], weights_only=False)
        want = torch.load(sys.argv[2], weights_only=True)
        model.eval()
        with torch.no_grad():
            got = model(input_ids=want["ids"]).logits
        assert torch.equal(got, want["logits"]), (got - want["logits"]).abs().max()
        model.train()
        model(input_ids=want["ids"])  # the saved hook is called: inert
        print("loaded", "attn_probe" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "model.pt"), str(tmp_path / "want.pt")],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "loaded False"


def test_copies_of_a_watched_model_compile_with_fullgraph(tmp_path) -> None:
    """Issue 44, finding 7: copies of a watched model (hooks of the counter, the attention capture's
    pre-, post- and always-called hooks) taken inside a due step's forward, after a due step and by
    pickling compile with ``torch.compile(fullgraph=True)``: no graph break, one graph, the outputs of
    an unwatched twin. (The inert hook was ``functools.partial(sys.audit, ...)``, which dynamo refuses
    to trace: "Attempted to call function marked as skipped".)"""
    from torch._dynamo.utils import counters

    from attn_probe.hooks import INERT
    from tests.activations.sdpa_stacks import Net

    torch.manual_seed(0)
    net = Net("nanogpt")
    twin = copy.deepcopy(net)  # never watched
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # the weights stay the twin's
    probe = attn_probe.watch(net, optimizer=opt, every=1, attention_stats=True, random_range=False,
                             log_dir=str(tmp_path / "run"))
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    copies = {}

    def take_inside(module, args, output) -> None:  # a global hook: the copies do not carry it
        if module is net.blocks[0]:
            copies.setdefault("inside", copy.deepcopy(net))

    taking = torch.nn.modules.module.register_module_forward_hook(take_inside)
    net(x).sum().backward()  # step 1, due: the copy is taken inside its forward (an EMA update's place)
    taking.remove()
    opt.step()
    opt.zero_grad()
    copies["after"] = copy.deepcopy(net)  # armed for step 2
    copies["pickled"] = pickle.loads(pickle.dumps(net))
    want = twin(x)
    for name, model in copies.items():
        hooks = [*model._forward_pre_hooks.values(), *model._forward_hooks.values(),
                 *model.blocks[0].attn._forward_pre_hooks.values(), *model.blocks[0].attn._forward_hooks.values()]
        assert hooks and all(hook is INERT for hook in hooks), (name, hooks)
        torch._dynamo.reset()
        counters.clear()
        out = torch.compile(model, backend="eager", fullgraph=True)(x)
        assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1, name
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch._dynamo.reset()
    assert probe.step == 1
    probe.close()


def test_a_spawn_child_gets_the_watched_model(tmp_path) -> None:
    model, probe = watched(tmp_path / "run")
    ids = batch(2)
    want = logits(model, ids)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply_async(child_logits, (model, ids)).get(timeout=300)
    assert torch.equal(got, want)
    assert probe.step == 0
    probe.close()


#: built-in schedules and, worked out by hand from their definitions, the steps below ``limit`` they fire at
SCHEDULES = [
    (every(5, offset=2), 20, [2, 7, 12, 17]),
    (log_spaced(per_decade=4, max_interval=1000), 60, [0, 1, 2, 3, 6, 10, 18, 32, 56]),
    (log_spaced(2, max_interval=40), 130, [0, 1, 3, 10, 32, 40, 80, 100, 120]),  # 10^(k/2) and 40's multiples
    (log_spaced(2, start=3), 40, [0, 3, 9, 30]),  # round(3 * 10^(k/2)): 3, 9.5, 30
    (any_of(every(4), every(6)), 13, [0, 4, 6, 8, 12]),
    (any_of(every(7), any_of(log_spaced(1), every(9, offset=1))), 30, [0, 1, 7, 10, 14, 19, 21, 28]),
]


@pytest.mark.parametrize("schedule, limit, fires", SCHEDULES, ids=[repr(s[0]) for s in SCHEDULES])
def test_built_in_schedules_pickle_and_fire_where_they_should(schedule, limit, fires) -> None:
    for back in (pickle.loads(pickle.dumps(schedule)), copy.deepcopy(schedule), schedule):
        assert back == schedule and hash(back) == hash(schedule) and repr(back) == repr(schedule)
        assert [t for t in range(limit) if back(t)] == fires
        assert is_deterministic(back)
    assert as_schedule(4) == every(4) and every(4) != every(4, offset=1) and every(4) != log_spaced(4)
    assert not is_deterministic(pickle.loads(pickle.dumps(any_of(schedule, odd_steps))))


def odd_steps(step: int) -> bool:
    """A schedule of the user's (module-level: it pickles by reference)."""
    return step % 2 == 1


def test_probe_config_pickles_equal_with_schedules_pairs_and_alerts(tmp_path) -> None:
    from attn_probe.live.alerts import AlertRule

    config = ProbeConfig(every=log_spaced(4, max_interval=100), images_every=any_of(every(50), log_spaced(2)),
                         pairs=("qk", "ov"), alerts=(AlertRule("symmetry", above=0.9),), per_head=True)
    back = pickle.loads(pickle.dumps(config))
    assert back == config and back.record() == config.record()
    assert back.record()["every"] == "log_spaced(per_decade=4, start=1, max_interval=100)"
    assert [type(p) for p in back.score_pairs()] == [QKPair, OVPair]
    # a config in use: the OV pair's layout cache holds the watched modules; a pickle leaves it out
    model = tiny_llama()
    probe = attn_probe.Probe(model, config, log_dir=str(tmp_path / "run"), random_range=False)
    probe.snapshot(0)
    used = pickle.loads(pickle.dumps(probe.config))
    assert used == probe.config and used.pairs[1]._layouts == {}
    probe.close()
