"""attention_stats=True and alerts=[...] in the live probe, in real Trainer runs.

References are computed here from each attention module's input (a hook of the test's own on a
copy of the model as it was when the step began), its own q/k projections and Llama's own
rotary function, with explicit causal and padding masks, in float64.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaForCausalLM, Trainer, TrainerCallback  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from attn_probe import AttnProbeCallback  # noqa: E402
from attn_probe.activations.statistics import installed_wrappers  # noqa: E402
from attn_probe.extraction import find_attention  # noqa: E402
from attn_probe.live.alerts import AlertRule  # noqa: E402
from tests.helpers import make_args, tiny_model  # noqa: E402

L = 9
TOL = 1e-5


def _llama() -> LlamaForCausalLM:
    return tiny_model("llama", impl="sdpa", intermediate_size=64, vocab_size=99, max_position_embeddings=2048,
                      initializer_range=0.4).double()


class Data(torch.utils.data.Dataset):
    """Right padding of 0-3 tokens; ``same``: one sequence repeated (constant logits)."""

    def __init__(self, same: bool = False) -> None:
        self.same = same

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        j = 0 if self.same else i
        ids = torch.randint(1, 99, (L,), generator=torch.Generator().manual_seed(j))
        mask = torch.ones(L, dtype=torch.long)
        mask[L - j % 4:] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Records:
    """A sink keeping the snapshots."""

    def __init__(self) -> None:
        self.snapshots = []

    def start(self, run) -> None:
        pass

    def log(self, snapshot) -> None:
        self.snapshots.append(snapshot)

    def finish(self) -> None:
        pass

    def values(self, metric: str) -> dict[int, dict[tuple[int, int | None], float]]:
        out: dict[int, dict] = {}
        for snap in self.snapshots:
            for r in snap.records:
                if r.metric == metric:
                    out.setdefault(snap.step, {})[(r.layer, r.head)] = r.value
        return out


def _bert():
    return tiny_model("bert", vocab_size=99, max_position_embeddings=512, initializer_range=0.4,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).double()


def reference(model, ids, mask) -> dict[tuple[int, int | None], tuple[float, float]]:
    """(layer, head) -> (max |logit|, mean entropy) from the model's projections and (Llama) its
    rotary function; BERT: bidirectional, its query/key projections with their biases."""
    layers = find_attention(model)
    bert = type(model).__name__.startswith("Bert")
    seen, hooks = {}, []
    for i, layer in enumerate(layers):
        def hook(module, args, kwargs, i=i):
            seen[i] = (args[0] if args else kwargs["hidden_states"], kwargs.get("position_embeddings"))
        hooks.append(layer.module.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model.eval()(ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    B, n = ids.shape
    pad = mask.bool()
    visible = pad[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()
    if bert:
        visible = pad[:, None, None, :].expand(B, 1, n, n)
    out = {}
    for i, layer in enumerate(layers):
        x, rotary = seen[i]
        attn, H, Hkv, D = layer.module, layer.num_heads, layer.num_kv_heads, layer.head_dim
        with torch.no_grad():
            if bert:
                q = attn.query(x).view(B, n, H, D).transpose(1, 2)
                k = attn.key(x).view(B, n, Hkv, D).transpose(1, 2)
            else:
                q = attn.q_proj(x).view(B, n, H, D).transpose(1, 2)
                k = attn.k_proj(x).view(B, n, Hkv, D).transpose(1, 2)
                q, k = apply_rotary_pos_emb(q, k, *rotary)
            logits = q @ k.repeat_interleave(H // Hkv, dim=1).transpose(-1, -2) * D ** -0.5
        counted = visible & pad[:, None, :, None]
        head_max = torch.where(counted, logits.abs(), -math.inf).amax(dim=(0, 2, 3))
        p = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)
        row = -torch.where(p > 0, p * p.log(), 0.0).sum(-1)  # (B, H, n)
        q_valid = pad[:, None, :].expand_as(row)
        head_ent = (row * q_valid).sum(dim=(0, 2)) / q_valid.sum(dim=(0, 2))
        out[(i, None)] = (float(head_max.max()), float(head_ent.mean()))
        for h in range(H):
            out[(i, h)] = (float(head_max[h]), float(head_ent[h]))
    return out


class StepRecorder(TrainerCallback):
    """The weights when each step begins, the batches it trains on, whether the capture is armed."""

    def __init__(self, model) -> None:
        self.model = model
        self.weights: dict[int, dict] = {}
        self.batches: dict[int, list] = {}
        self.armed: dict[int, list[bool]] = {}
        self.probe_callback = None
        self.current = 0
        model.register_forward_pre_hook(self.record, with_kwargs=True)

    def on_step_begin(self, args, state, control, **kw):
        self.current = state.global_step + 1
        self.weights[self.current] = copy.deepcopy(self.model.state_dict())

    def record(self, module, args, kwargs):
        if module.training:
            self.batches.setdefault(self.current, []).append((kwargs["input_ids"].clone(),
                                                              kwargs["attention_mask"].clone()))
            probe = self.probe_callback.probe
            self.armed.setdefault(self.current, []).append(bool(probe.attention.capture.armed))


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_trainer_logs_max_logit_and_entropy_against_the_reference(tmp_path, arch):
    """Llama (rotary, grouped-query heads, causal) and BERT (q/k biases, bidirectional): every=2, gradient accumulation 2, per-head rows with qk_bound: the logged max_logit and
    entropy of steps 2 and 4 equal the reference on the weights and batches of those steps; the
    capture is armed in exactly the due steps' forwards; the ratio follows its definition; the
    registry is restored after training."""
    model = _llama() if arch == "llama" else _bert()
    recorder = StepRecorder(model)
    sink = Records()
    probe_cb = AttnProbeCallback(every=2, attention_stats=True, per_head=True, sinks=[sink],
                                 metrics=("symmetry", "qk_bound"), log_dir=str(tmp_path / "tb"))
    recorder.probe_callback = probe_cb
    args = make_args(tmp_path, 4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     learning_rate=1e-2, logging_steps=100)
    Trainer(model=model, args=args, train_dataset=Data(), callbacks=[recorder, probe_cb]).train()
    assert installed_wrappers() == {}
    assert recorder.armed == {1: [False, False], 2: [True, True], 3: [False, False], 4: [True, True]}
    max_logit, entropy = sink.values("max_logit"), sink.values("entropy")
    assert sorted(max_logit) == [2, 4] and sorted(entropy) == [2, 4]
    ratio, bound = sink.values("logit_bound_ratio"), sink.values("qk_bound")
    for step in (2, 4):
        ref_model = copy.deepcopy(model)
        ref_model.load_state_dict(recorder.weights[step])
        ids = torch.cat([b[0] for b in recorder.batches[step]])
        mask = torch.cat([b[1] for b in recorder.batches[step]])
        want = reference(ref_model, ids, mask)
        assert set(max_logit[step]) == set(want)
        for key, (m, e) in want.items():
            assert max_logit[step][key] == pytest.approx(m, rel=TOL, abs=TOL), (step, key)
            assert entropy[step][key] == pytest.approx(e, rel=TOL, abs=TOL), (step, key)
            if arch == "llama":
                assert 0 < ratio[step][key] < 1.5  # bias-free q/k: at most 1 up to the one-update offset
        # the ratio's definition, per head: max_logit / (qk_bound * ||x||^2 * s), one ||x|| per layer
        for layer in (0, 1):
            norm_sq = [max_logit[step][(layer, h)] / (ratio[step][(layer, h)] * bound[step][(layer, h)] * 8 ** -0.5)
                       for h in range(4)]
            assert norm_sq == pytest.approx([norm_sq[0]] * 4, rel=1e-9)


def test_unmeasurable_attention_warns_at_attach_and_weights_go_on(tmp_path):
    """GPT-2 with reorder_and_upcast_attn under eager computes attention itself: one warning at
    attach, the weight metrics are logged, no max_logit rows."""
    model = tiny_model("gpt2", None, n_embd=32, n_layer=2, n_head=4, vocab_size=99, n_positions=16,
                       reorder_and_upcast_attn=True, impl="eager")
    sink = Records()
    cb = AttnProbeCallback(every=1, attention_stats=True, sinks=[sink], log_dir=str(tmp_path / "tb"))

    class Plain(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            ids = torch.randint(1, 99, (L,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    with pytest.warns(RuntimeWarning, match="reorder_and_upcast_attn=True computes eager attention itself"):
        Trainer(model=model, args=make_args(tmp_path, 2), train_dataset=Plain(), callbacks=[cb]).train()
    assert sorted(sink.values("symmetry")) == [0, 1, 2]
    assert sink.values("max_logit") == {}


@pytest.mark.parametrize("stop", [True, False])
def test_alert_fires_at_the_right_step_and_stops_training(tmp_path, capfd, stop):
    """W_q is doubled at the start of every step (learning rate 0, one repeated batch), so the
    layer's max logit at step s is 2^s times the reference's at step 0; a rule above 2^3.5 times
    that fires at step 4 only, with one alert line and one callback call, and stops the Trainer
    there when asked."""
    model = _llama()
    base = reference(copy.deepcopy(model), *_same_batch(2))
    threshold = base[(0, None)][0] * 2 ** 3.5

    class Grow(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            with torch.no_grad():
                model.model.layers[0].self_attn.q_proj.weight.mul_(2.0)

    fired = []
    cb = AttnProbeCallback(every=1, attention_stats=True, log_dir=str(tmp_path / "tb"),
                           alerts=[AlertRule("max_logit", above=threshold, layers=(0,))],
                           alert_callback=fired.append, stop_on_alert=stop)
    args = make_args(tmp_path, 8, per_device_train_batch_size=2, learning_rate=0.0, logging_steps=100)
    trainer = Trainer(model=model, args=args, train_dataset=Data(same=True), callbacks=[Grow(), cb])
    trainer.train()
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("attn_probe alert")]
    assert len(lines) == 1 and re.match(r"attn_probe alert at step 4: max_logit = .* in self layer 0, all heads", lines[0])
    assert [(a.step, a.layer, a.head) for a in fired] == [(4, 0, None)]
    assert fired[0].value == pytest.approx(base[(0, None)][0] * 16, rel=TOL)
    assert trainer.state.global_step == (4 if stop else 8)


def _same_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    items = [Data(same=True)[i] for i in range(n)]
    return torch.stack([x["input_ids"] for x in items]), torch.stack([x["attention_mask"] for x in items])


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    from tests.tracker_servers import wandb_offline_env

    yield from wandb_offline_env(monkeypatch, tmp_path, WANDB_PROJECT="attn-probe-alerts", WANDB_LOG_MODEL="false",
                                 WANDB_WATCH="false")


def test_alert_reaches_the_wandb_run(tmp_path, capfd, wandb_offline):
    """report_to=["wandb"] (offline): the fired alert is an alert record of the Trainer's run file,
    with the alert line as its text."""
    import wandb

    from tests.tracker_servers import finished_wandb_records

    model = _llama()
    base = reference(copy.deepcopy(model), *_same_batch(2))

    class Grow(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            with torch.no_grad():
                model.model.layers[0].self_attn.q_proj.weight.mul_(2.0)

    cb = AttnProbeCallback(every=1, attention_stats=True, log_dir=str(tmp_path / "tb"),
                           alerts=[AlertRule("max_logit", above=base[(0, None)][0] * 2 ** 2.5, layers=(0,))])
    args = make_args(tmp_path / "out", 4, per_device_train_batch_size=2, learning_rate=0.0, logging_steps=100,
                     report_to=["wandb"])
    Trainer(model=model, args=args, train_dataset=Data(same=True), callbacks=[Grow(), cb]).train()
    assert "attn_probe alert at step 3" in capfd.readouterr().err
    trainer_run = wandb.run.id
    wandb.run.finish()
    alerts = [r.alert for r in finished_wandb_records(wandb_offline, run_id=trainer_run)
              if r.WhichOneof("record_type") == "alert"]
    assert [a.title for a in alerts] == ["attn_probe: max_logit in layer 0"]
    assert alerts[0].text.startswith("attn_probe alert at step 3: max_logit = ")


def test_alert_on_an_unknown_metric_is_an_error_at_attach(tmp_path):
    from attn_probe import Probe

    with pytest.raises(ValueError, match="alert on unknown metric 'max_logits'"):
        Probe(_llama(), alerts=[AlertRule("max_logits", above=1.0)], attention_stats=True, log_dir=str(tmp_path))
    assert installed_wrappers() == {}  # the failed attach left nothing registered


def test_plain_loop_watch_and_saved_config_unchanged(tmp_path):
    """watch(model, optimizer=...) with every=3: the capture is armed in the forwards of steps 3
    and 6 only (after the update before them), those steps' max_logit rows equal the reference
    on that step's weights, and save_pretrained writes the same config.json as without the probe."""
    import json

    import attn_probe

    model = _llama()
    model.save_pretrained(tmp_path / "before")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sink = Records()
    probe = attn_probe.watch(model, optimizer=opt, every=3, attention_stats=True, sinks=[sink],
                             log_dir=str(tmp_path / "tb"))
    ids, mask = _same_batch(2)
    armed, weights = [], {}
    for step in range(1, 7):
        weights[step] = copy.deepcopy(model.state_dict())
        armed.append(probe.attention.capture.armed)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(tmp_path / "after")
    probe.close()
    assert armed == [False, False, True, False, False, True]
    got = sink.values("max_logit")
    assert sorted(got) == [3, 6]
    for step in (3, 6):
        ref_model = _llama()
        ref_model.load_state_dict(weights[step])
        want = reference(ref_model, ids, mask)
        assert got[step][(0, None)] == pytest.approx(want[(0, None)][0], rel=TOL)
        assert got[step][(1, None)] == pytest.approx(want[(1, None)][0], rel=TOL)
    before = json.loads((tmp_path / "before" / "config.json").read_text())
    after = json.loads((tmp_path / "after" / "config.json").read_text())
    assert after == before


def _ddp_worker(rank: int, port: int, out: str) -> None:
    """One rank of a 2-process gloo DDP run: watch() a DDP-wrapped Llama, train 2 steps on this
    rank's rows (uneven: 3 and 1), save rank 0's logged activation values."""
    import datetime
    import json
    import os

    import torch.distributed as dist

    import attn_probe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    model = _llama()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
    sink = Records()
    probe = attn_probe.watch(ddp, optimizer=opt, every=2, attention_stats=True, per_head=True,
                             sinks=[sink], log_dir=f"{out}/tb")
    ids, mask = _mixed_batch()
    rows = slice(0, 3) if rank == 0 else slice(3, 4)
    for _ in range(2):
        ddp(input_ids=ids[rows], attention_mask=mask[rows], labels=ids[rows]).loss.backward()
        opt.step()
        opt.zero_grad()
    probe.close()
    if rank == 0:
        values = {m: {f"{k[0]},{k[1]}": v for k, v in sink.values(m).get(2, {}).items()}
                  for m in ("max_logit", "entropy")}
        with open(f"{out}/rank0.json", "w") as f:
            json.dump(values, f)
    dist.destroy_process_group()


def _mixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    items = [Data()[i] for i in range(4)]
    return torch.stack([x["input_ids"] for x in items]), torch.stack([x["attention_mask"] for x in items])


@pytest.mark.timeout(400)
def test_two_process_gloo_ddp_logs_one_process_values(tmp_path):
    """The values rank 0 logs at step 2 of a 2-process gloo DDP run equal the reference of one
    process on the concatenated batch with the weights after one update (max over ranks,
    token-weighted entropy)."""
    import json
    import multiprocessing
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_ddp_worker, args=(rank, port, str(tmp_path))) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=240)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]
    got = json.loads((tmp_path / "rank0.json").read_text())
    # one process: the same first update on the whole batch (DDP averages the ranks' gradients
    # of their mean losses, so the reference takes one SGD step on the mean of the two losses)
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids, mask = _mixed_batch()
    losses = [model(input_ids=ids[r], attention_mask=mask[r], labels=ids[r]).loss for r in (slice(0, 3), slice(3, 4))]
    ((losses[0] + losses[1]) / 2).backward()
    opt.step()
    want = reference(model, ids, mask)
    assert len(got["max_logit"]) == len(want)
    for (layer, head), (m, e) in want.items():
        key = f"{layer},{head}"
        assert got["max_logit"][key] == pytest.approx(m, rel=TOL), key
        assert got["entropy"][key] == pytest.approx(e, rel=TOL), key


def test_a_failed_combination_warns_and_stops_measuring(tmp_path):
    """A group whose all-reduce raises (here: a group object gloo rejects): one warning naming
    the step, no activation rows from then on, the weight metrics go on."""
    import attn_probe

    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sink = Records()
    probe = attn_probe.watch(model, optimizer=opt, every=1, attention_stats=True, sinks=[sink],
                             log_dir=str(tmp_path / "tb"))
    probe.attention.group = object()  # not a process group: torch.distributed raises
    ids, mask = _same_batch(2)
    with pytest.warns(RuntimeWarning, match="combining the attention statistics over ranks failed at step 1"):
        for _ in range(3):
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    probe.close()
    assert sink.values("max_logit") == {}
    assert sorted(sink.values("symmetry")) == [0, 1, 2, 3]
    assert installed_wrappers() == {}
