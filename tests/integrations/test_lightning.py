"""The Lightning callback in real ``lightning.Trainer`` runs on CPU (tiny BERT and GPT-2 from configs).

References are independent of the callback: ``score_model`` on the final weights, the same run
without validation, Lightning's own scalars read back from the event file, a single-process run
for the DDP one.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import REPO, SEQ, VOCAB, RandomTokens, lines_by_run, tiny_model

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

import attn_probe  # noqa: E402
from attn_probe.lightning import AttnProbeCallback  # noqa: E402
from attn_probe.live.alerts import AlertRule  # noqa: E402

WEIGHT_METRICS = ("symmetry", "directionality", "spectral_norm", "frobenius_norm", "stable_rank")


def tiny_gpt2() -> torch.nn.Module:
    return tiny_model("gpt2", 0, vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def tiny_bert_no_dropout() -> torch.nn.Module:
    return tiny_model("bert", 0, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)


#: dropout-free: a validation loader draws its seed from torch's global generator, which would change the
#: training's dropout masks and so the run compared against
MODELS = {"bert": tiny_bert_no_dropout, "gpt2": tiny_gpt2}


class LitLM(L.LightningModule):
    """A transformers model trained on its own inputs; validation logs ``val_loss``."""

    def __init__(self, arch: str = "bert") -> None:
        super().__init__()
        self.model = MODELS[arch]()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(RandomTokens(), batch_size=4)


def fit(root: Path, callback: AttnProbeCallback, *, arch: str = "bert", validate: bool = True, max_steps: int = 4,
        ckpt_path: str | None = None, version: int | None = None, callbacks: tuple = (), **kw) -> tuple:
    torch.manual_seed(1)
    module = LitLM(arch)
    trainer = L.Trainer(
        callbacks=[callback, *callbacks], max_steps=max_steps, accumulate_grad_batches=2,
        val_check_interval=2, check_val_every_n_epoch=None, limit_val_batches=2 if validate else 0,
        num_sanity_val_steps=0, logger=TensorBoardLogger(str(root), version=version), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", deterministic=True,
        **{"enable_checkpointing": bool(callbacks), **kw})
    trainer.fit(module, loader(), loader() if validate else None, ckpt_path=ckpt_path)
    return trainer, module


def rows(log_dir: str) -> dict:
    """``{(step, layer, head, metric): value}`` from the run's trajectory (as the reader resolves it)."""
    df = attn_probe.load_trajectory(log_dir)
    return {(int(r.step), int(r.layer), None if pd.isna(r.head) else int(r.head), r.metric): float(r.value)
            for r in df.itertuples()}


def steps(table: dict) -> list[int]:
    return sorted({k[0] for k in table})


def raw_steps(log_dir: str) -> list[int]:
    """Every step record in ``attn_probe.jsonl`` of the symmetry of layer 0 (a step written twice shows twice)."""
    with open(os.path.join(log_dir, "attn_probe.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r["step"] for r in recs if r.get("metric") == "symmetry" and r.get("layer") == 0 and r.get("head") is None]


def assert_final_equals_score_model(table: dict, model: torch.nn.Module, step: int) -> None:
    for row in attn_probe.score_model(model):
        for metric in WEIGHT_METRICS:
            assert table[(step, row["layer"], None, metric)] == pytest.approx(row[metric], abs=1e-5, rel=1e-5), metric


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_lightning_run_with_validation_and_accumulation(tmp_path, arch):
    """Snapshots at the due optimizer steps (accumulation 2) in the logger's one event stream, the last equal
    to score_model on the final weights; validation after every step leaves the attention statistics equal
    to the same run without validation."""
    trainer, module = fit(tmp_path / "val", AttnProbeCallback(every=2, attention_stats=True), arch=arch)
    log_dir = trainer.logger.log_dir
    assert trainer.global_step == 4
    table = rows(log_dir)
    assert steps(table) == [0, 2, 4] and raw_steps(log_dir) == [0, 2, 4]
    assert_final_equals_score_model(table, module.model, 4)

    # one event stream, Lightning's scalars and the probe's side by side
    events = [f for f in os.listdir(log_dir) if f.startswith("events.out.tfevents")]
    assert len(events) == 1, events
    ea = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    ea.Reload()
    tags = ea.Tags()["scalars"]
    assert "train_loss" in tags and "val_loss" in tags
    probe_tags = [t for t in tags if "symmetry" in t]
    assert probe_tags and all([e.step for e in ea.Scalars(t)] == [0, 2, 4] for t in probe_tags)

    # the same training without validation: the same weights, the same attention statistics
    trainer2, module2 = fit(tmp_path / "noval", AttnProbeCallback(every=2, attention_stats=True), arch=arch,
                            validate=False)
    other = rows(trainer2.logger.log_dir)
    attention = {k: v for k, v in table.items() if k[3] in ("max_logit", "entropy")}
    assert {k[0] for k in attention} == {2, 4}  # measured on the due steps' training batches
    for key, value in attention.items():
        assert other[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    for key, value in table.items():
        assert other[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_submodule_option_and_own_log_dir_without_tensorboard_logger(tmp_path):
    """module="model" watches the named submodule; without a TensorBoardLogger the probe writes log_dir=."""
    cb = AttnProbeCallback(every=2, module="model", log_dir=str(tmp_path / "probe"))
    torch.manual_seed(1)
    module = LitLM("gpt2")
    trainer = L.Trainer(callbacks=[cb], max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, loader())
    table = rows(str(tmp_path / "probe"))
    assert steps(table) == [0, 2]
    assert_final_equals_score_model(table, module.model, 2)
    with pytest.raises(ValueError, match="no such submodule"):
        AttnProbeCallback(module="nope").watched_model(module)


def test_other_loggers_get_the_values_and_async_scoring(tmp_path):
    """trackers: a CSVLogger beside the TensorBoardLogger gets the probe's values at the probe's steps through
    its log_metrics; async_scoring=True still ends on the final weights."""
    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(1)
    module = LitLM("gpt2")
    csv = CSVLogger(str(tmp_path / "csv"))
    trainer = L.Trainer(callbacks=[AttnProbeCallback(every=2, async_scoring=True)], max_steps=4,
                        logger=[TensorBoardLogger(str(tmp_path / "tb")), csv], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", log_every_n_steps=1)
    trainer.fit(module, loader())
    table = rows(trainer.loggers[0].log_dir)
    assert steps(table) == [0, 2, 4]
    assert_final_equals_score_model(table, module.model, 4)
    frame = pd.read_csv(os.path.join(csv.log_dir, "metrics.csv"))
    columns = [c for c in frame.columns if "symmetry" in c]
    assert columns, list(frame.columns)
    logged = frame.dropna(subset=[columns[0]])
    assert sorted(int(s) for s in logged["step"]) == [0, 2, 4]


def test_tensorboardx_writer_is_refused_in_one_line(tmp_path):
    """A TensorBoardLogger writing with tensorboardX (Lightning's fallback without the tensorboard package)
    is refused before step 0 in one line naming the way out (log_dir=)."""
    class TensorBoardXWriter:  # what tensorboardX.SummaryWriter is to the check: its module
        def flush(self) -> None:
            pass

        def close(self) -> None:
            pass

    TensorBoardXWriter.__module__ = "tensorboardX.writer"

    class XLogger(TensorBoardLogger):
        @property
        def experiment(self) -> object:
            return TensorBoardXWriter()

        def log_metrics(self, metrics: dict, step: int | None = None) -> None:
            pass

        def log_hyperparams(self, *args: object, **kwargs: object) -> None:
            pass

    trainer = L.Trainer(callbacks=[AttnProbeCallback(every=2)], max_steps=2, logger=XLogger(str(tmp_path)),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu")
    module = LitLM("gpt2")
    with pytest.raises(TypeError, match=r"tensorboardX.*log_dir=") as info:
        trainer.fit(module, loader())
    assert "\n" not in str(info.value)
    assert trainer.global_step == 0


@pytest.mark.parametrize("same_version", [False, True])
def test_resume_from_a_lightning_checkpoint_duplicates_no_step(tmp_path, capfd, same_version):
    """Interrupted after step 6, resumed from the step-4 checkpoint: no step twice. A new logger version
    continues after step 4 (the one line names both directories); the same version drops the rows
    after the resumed step and takes them again."""
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_epochs=1, save_top_k=-1,
                           save_on_train_epoch_end=True)
    first, _ = fit(tmp_path, AttnProbeCallback(every=2), validate=False, max_steps=6, callbacks=(ckpt,),
                   limit_train_batches=4)  # 2 optimizer steps per epoch: checkpoints at steps 2, 4, 6
    first_dir = first.logger.log_dir
    assert steps(rows(first_dir)) == [0, 2, 4, 6]
    path = [p for p in os.listdir(tmp_path / "ckpt") if "step=4" in p]
    assert len(path) == 1, os.listdir(tmp_path / "ckpt")
    capfd.readouterr()
    second, module = fit(tmp_path, AttnProbeCallback(every=2), validate=False, max_steps=8,
                         ckpt_path=str(tmp_path / "ckpt" / path[0]), version=0 if same_version else None,
                         limit_train_batches=4)
    err = capfd.readouterr().err
    assert second.global_step == 8
    second_dir = second.logger.log_dir
    if same_version:
        assert second_dir == first_dir
        assert raw_steps(second_dir).count(4) <= 2  # the interrupted run's row, then the resumed one
        table = rows(second_dir)
        assert steps(table) == [0, 2, 4, 6, 8]
        ea = EventAccumulator(second_dir, size_guidance={"scalars": 0})  # TensorBoard's view: the restart marker
        ea.Reload()
        tag = next(t for t in ea.Tags()["scalars"] if "symmetry" in t)
        assert [e.step for e in ea.Scalars(tag)] == [0, 2, 4, 6, 8]
    else:
        assert second_dir != first_dir
        table = rows(second_dir)
        assert steps(table) == [6, 8] and raw_steps(second_dir) == [6, 8]
        assert sorted(set(steps(rows(first_dir))) & set(steps(table))) == [6]  # the interrupted run's own step 6
        line = [ln for ln in err.splitlines() if ln.startswith("attn_probe: resumed at step 4")]
        assert len(line) == 1 and first_dir in line[0] and second_dir in line[0] and "after step 4" in line[0]
        ea = EventAccumulator(second_dir, size_guidance={"tensors": 0})  # the lineage, in the run header
        ea.Reload()
        text = ea.Tensors("attn_probe/config/text_summary")[0].tensor_proto.string_val[0].decode()
        header = json.loads(text.split("**configuration**\n\n```\n", 1)[1].split("\n```", 1)[0])
        assert (header["parent_run"], header["parent_step"]) == (first_dir, 4)
        (first_id,) = {run for run, _ in lines_by_run(os.path.join(first_dir, "attn_probe.jsonl"))}
        (second_header,) = [json.loads(line)["run_header"] for _, line in
                            lines_by_run(os.path.join(second_dir, "attn_probe.jsonl")) if b'"run_header"' in line]
        assert second_header["parent_run"] == first_id and second_header["run_id"] != first_id  # by id
    assert_final_equals_score_model(table, module.model, 8)


def test_resume_continues_its_own_run_by_id_and_keeps_another_run_in_the_same_log_dir(tmp_path):
    """Run A and then another run B write one ``log_dir=`` (B's rows after A's); A resumed from its
    step-4 checkpoint continues A (by the run id saved with the checkpoint), not the directory's
    last run: every line of B stays as it was, and A's rows after step 4 are taken again."""
    shared = str(tmp_path / "shared")
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_epochs=1, save_top_k=-1,
                           save_on_train_epoch_end=True)
    fit(tmp_path / "a", AttnProbeCallback(every=2, log_dir=shared), validate=False, max_steps=6, callbacks=(ckpt,),
        limit_train_batches=4)
    (path,) = [p for p in os.listdir(tmp_path / "ckpt") if "step=4" in p]
    (a_id,) = {run for run, _ in lines_by_run(os.path.join(shared, "attn_probe.jsonl"))}
    saved = torch.load(tmp_path / "ckpt" / path, weights_only=False)["callbacks"]
    assert [state["run_id"] for key, state in saved.items() if "AttnProbeCallback" in key] == [a_id]
    fit(tmp_path / "b", AttnProbeCallback(every=2, log_dir=shared), validate=False, max_steps=4,
        limit_train_batches=4)
    before = lines_by_run(os.path.join(shared, "attn_probe.jsonl"))
    b_lines = [line for run, line in before if run != a_id]
    assert b_lines and {run for run, _ in before} - {a_id}
    fit(tmp_path / "a", AttnProbeCallback(every=2, log_dir=shared), validate=False, max_steps=8,
        ckpt_path=str(tmp_path / "ckpt" / path), limit_train_batches=4)
    after = lines_by_run(os.path.join(shared, "attn_probe.jsonl"))
    assert [line for run, line in after if run not in (a_id, None)] == b_lines  # B byte for byte
    a_rows = [json.loads(line) for run, line in after if run == a_id and b'"run_header"' not in line]
    assert sorted({r["step"] for r in a_rows}) == [0, 2, 4, 6, 8]
    assert [r["step"] for r in a_rows if r["metric"] == "symmetry" and r["layer"] == 0 and r["head"] is None] \
        == [0, 2, 4, 6, 8]  # no step twice: A's stale rows from step 4 on were cut, then taken again


def test_fit_twice_on_one_trainer_is_one_run_with_each_step_once(tmp_path):
    """Issue 44 item 6: ``fit`` called again on the same Trainer (no checkpoint; Lightning keeps
    ``global_step`` and the logger) continues the callback's own run: one run id, read back by the
    project's loader as one run, each step once (the step-4 rows of the first fit are cut and taken
    again), and the last values are the model's own (score_model)."""
    torch.manual_seed(1)
    module = LitLM("bert")
    cb = AttnProbeCallback(every=2)
    trainer = L.Trainer(callbacks=[cb], max_epochs=1, limit_train_batches=4, limit_val_batches=0,
                        num_sanity_val_steps=0, logger=TensorBoardLogger(str(tmp_path)), log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        enable_checkpointing=False, deterministic=True)
    trainer.fit(module, loader())
    assert trainer.global_step == 4
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module, loader())
    assert trainer.global_step == 8
    log_dir = trainer.logger.log_dir
    runs = lines_by_run(os.path.join(log_dir, "attn_probe.jsonl"))
    assert {run for run, _ in runs} == {cb.run_id}
    assert raw_steps(log_dir) == [0, 2, 4, 6, 8]
    df = attn_probe.load_trajectory(log_dir)
    assert df["run"].nunique() == 1 and set(df["run_id"]) == {cb.run_id}
    table = rows(log_dir)
    assert steps(table) == [0, 2, 4, 6, 8]
    assert_final_equals_score_model(table, module.model, 8)


@pytest.mark.parametrize(("min_steps", "min_epochs", "stops_at"), [(None, None, 1), (3, 0, 3), (3, None, 8)])
def test_alert_stops_the_trainer(tmp_path, capfd, min_steps, min_epochs, stops_at):
    """stop_on_alert: a rule firing at step 0 sets trainer.should_stop at the next step; Lightning honours it
    once min_steps/min_epochs are met (min_steps alone makes Lightning set min_epochs=1: the end of the
    first epoch, 8 steps here)."""
    cb = AttnProbeCallback(every=1, stop_on_alert=True, alerts=[AlertRule("spectral_norm", above=0.0)])
    trainer, _ = fit(tmp_path, cb, validate=False, max_steps=10, min_steps=min_steps, min_epochs=min_epochs)
    assert trainer.global_step == stops_at
    err = capfd.readouterr().err
    assert "attn_probe: trainer.should_stop set at step 1" in err
    assert ("min_steps=3" in err) == (min_steps is not None)


def test_unsupported_model_fails_at_setup(tmp_path):
    class NoAttention(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self.lin(batch["input_ids"][:, :2].float()).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(callbacks=[AttnProbeCallback()], max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    with pytest.raises(attn_probe.UnsupportedModelError):
        trainer.fit(NoAttention(), loader())


def test_import_attn_probe_does_not_import_lightning():
    code = "import sys, attn_probe; assert 'lightning' not in sys.modules, 'imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "ok", out.stderr


def run_worker(out: Path, nproc: int, *extra: str, timeout: float = 240) -> None:
    """``tests/distributed_workers/lightning_worker.py`` in its own session; killed (the whole group) and failed
    after ``timeout`` seconds."""
    worker = REPO / "tests" / "distributed_workers" / "lightning_worker.py"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(worker), str(out), str(nproc), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=str(REPO), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # Lightning's launcher and the rank it started: the group we made
        output, _ = proc.communicate()
        pytest.fail(f"the Lightning run ({nproc} processes) did not finish in {timeout} s\n{output[-4000:]}")
    assert proc.returncode == 0, output[-6000:]


def test_ddp_two_processes_write_once_with_single_process_values(tmp_path):
    """strategy="ddp" on 2 CPU processes (gloo): one trajectory, written once, equal to a single process
    that trains on both ranks' batches (the DDP step averages the same gradients)."""
    run_worker(tmp_path / "ddp", 2)
    run_worker(tmp_path / "single", 1)
    ddp_runs = [p for p in (tmp_path / "ddp").rglob("attn_probe.jsonl")]
    assert len(ddp_runs) == 1, ddp_runs  # global zero only
    ddp_dir = str(ddp_runs[0].parent)
    assert raw_steps(ddp_dir) == [0, 2, 4]  # each step written once
    assert len([f for f in os.listdir(ddp_dir) if f.startswith("events.out.tfevents")]) == 1  # Lightning's stream
    single = rows(str(next((tmp_path / "single").rglob("attn_probe.jsonl")).parent))
    ddp = rows(ddp_dir)
    assert set(ddp) == set(single)
    for key, value in single.items():
        assert ddp[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_ddp_spawn_takes_a_log_spaced_schedule(tmp_path):
    """strategy="ddp_spawn" pickles the callback, its ProbeConfig and its log_spaced schedule into
    each rank (issue 35: a PicklingError before fit started): one trajectory, at the schedule's steps."""
    run_worker(tmp_path, 2, "spawn", timeout=480)
    runs = list(tmp_path.rglob("attn_probe.jsonl"))
    assert len(runs) == 1, runs  # global zero only
    assert raw_steps(str(runs[0].parent)) == [0, 1, 3, 4]  # log_spaced(2): 0, 1, 3 (10^0.5), then the last step


def test_ddp_alert_stops_every_rank_at_the_same_step(tmp_path):
    """stop_on_alert under strategy="ddp": both ranks stop after step 1 (a rank going on alone would hang in
    DDP's all-reduce until the timeout)."""
    run_worker(tmp_path, 2, "stop")
    assert sorted(p.read_text() for p in tmp_path.glob("stopped_rank*.txt")) == ["1", "1"]


class ManualTwoOptimizers(L.LightningModule):
    """Manual optimisation, GAN-style: one forward, then two optimizers (attention q/k vs the rest),
    each stepped once per batch; Lightning counts two optimizer steps per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = tiny_gpt2()
        self.batches: list[tuple[dict, dict]] = []  # (weights at the batch's start, batch)

    def training_step(self, batch: dict, batch_idx: int) -> None:
        first, second = self.optimizers()
        self.batches.append(({k: v.detach().clone() for k, v in self.model.state_dict().items()},
                             {k: v.detach().clone() for k, v in batch.items()}))
        loss = self.model(**batch).loss
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()

    def configure_optimizers(self):
        attn = [p for n, p in self.model.named_parameters() if ".attn." in n]
        rest = [p for n, p in self.model.named_parameters() if ".attn." not in n]
        return torch.optim.SGD(attn, lr=1e-2), torch.optim.SGD(rest, lr=1e-2)


def _gpt2_reference(weights: dict, batch: dict) -> dict[int, float]:
    """Layer -> max |logit| of GPT-2's causal attention on ``batch`` with ``weights``, from its own c_attn
    projection in float64 (the test's own computation)."""
    model = tiny_gpt2().double()
    model.load_state_dict(weights)
    inputs = {}
    hooks = [block.attn.register_forward_pre_hook(
        lambda m, args, kwargs, i=i: inputs.__setitem__(i, args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True) for i, block in enumerate(model.transformer.h)]
    with torch.no_grad():
        model.eval()(input_ids=batch["input_ids"])
    for h in hooks:
        h.remove()
    out = {}
    for i, block in enumerate(model.transformer.h):
        x = inputs[i].detach()
        B, n, d = x.shape
        with torch.no_grad():
            q, k, _ = block.attn.c_attn(x).split(d, dim=2)
        q = q.view(B, n, 4, d // 4).transpose(1, 2)
        k = k.view(B, n, 4, d // 4).transpose(1, 2)
        logits = (q @ k.transpose(-1, -2)) * (d // 4) ** -0.5
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        out[i] = float(torch.where(causal, logits.abs(), -math.inf).amax())
    return out


def test_manual_optimisation_with_two_optimizers_measures_each_batch(tmp_path):
    """automatic_optimization=False with two optimizers: global_step moves by 2 per batch. Each due
    step's max_logit is that batch's training forward, equal to an explicit float64 reference on the
    weights the batch started with (on 7ce385c: no max_logit at any step, no warning)."""
    torch.manual_seed(1)
    module = ManualTwoOptimizers()
    trainer = L.Trainer(callbacks=[AttnProbeCallback(every=1, attention_stats=True)], max_steps=6,
                        logger=TensorBoardLogger(str(tmp_path)), enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", enable_checkpointing=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, loader())
    assert trainer.global_step == 6 and len(module.batches) == 3
    table = rows(trainer.logger.log_dir)
    measured = sorted({k[0] for k in table if k[3] == "max_logit"})
    assert measured == [2, 4, 6]
    for step, (weights, batch) in zip(measured, module.batches, strict=True):
        want = _gpt2_reference({k: v.double() for k, v in weights.items()}, batch)
        for layer in (0, 1):
            assert table[(step, layer, None, "max_logit")] == pytest.approx(want[layer], rel=1e-5), (step, layer)
