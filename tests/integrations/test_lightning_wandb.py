"""Issue 44 finding 9: Lightning's ``WandbLogger`` gets the probe's values in a W&B run of the probe's
own, as the Trainer and Accelerate do; the logger's run holds exactly the user's rows.

Real ``lightning.Trainer`` runs with a ``WandbLogger(offline=True)``, read back from the ``.wandb``
files: the logger's run with the probe equals the same training without it (every row: keys,
values and W&B's ``_step``); the probe's run (``<run id>-attn_probe``, in the logger's group and
project) holds every snapshot, equal to ``attn_probe.jsonl``. Was: 41 rows instead of 20, the
probe's keys in 21 of them, ``_step`` moved.
"""

from __future__ import annotations

import pytest
import torch
from helpers import SEQ, VOCAB, RandomTokens, tiny_model
from tracker_servers import expected_metrics, finished_wandb_records, wandb_history, wandb_offline_env

L = pytest.importorskip("lightning")
pytest.importorskip("wandb")
from lightning.pytorch.loggers import WandbLogger  # noqa: E402

from attn_probe.lightning import AttnProbeCallback  # noqa: E402
from attn_probe.sinks.wandb import probe_run_id  # noqa: E402

STEPS = 20


class LitBert(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_model(
            "bert",
            0,
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    yield from wandb_offline_env(monkeypatch, tmp_path)


def fit(root, name: str, callbacks: list) -> str:
    import wandb

    torch.manual_seed(1)
    logger = WandbLogger(name=name, project="lightning-wandb", offline=True, save_dir=str(root), group="g44")
    trainer = L.Trainer(
        callbacks=callbacks,
        max_steps=STEPS,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        log_every_n_steps=1,
    )
    trainer.fit(LitBert(), torch.utils.data.DataLoader(RandomTokens(), batch_size=4))
    run_id = logger.experiment.id
    assert wandb.run is logger.experiment  # the logger's run is still the user's wandb.run
    wandb.finish()  # the logger leaves its run open
    return run_id


def test_wandb_logger_run_holds_only_the_users_rows(tmp_path, wandb_offline):
    reference = fit(wandb_offline / "ref", "ref", [])
    cb = AttnProbeCallback(every=1, log_dir=str(tmp_path / "probe"))
    user = fit(wandb_offline / "probe", "with-probe", [cb])

    def user_rows(root, run_id):
        return [
            {k: v for k, v in row.items() if k != "_timestamp" and k != "_runtime"}
            for row in wandb_history(root, run_id=run_id)
        ]

    want = user_rows(wandb_offline / "ref", reference)
    got = user_rows(wandb_offline / "probe", user)
    assert len(want) == STEPS and all("train_loss" in r for r in want)
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    assert [r["_step"] for r in got] == [r["_step"] for r in want]
    assert [r["train_loss"] for r in got] == pytest.approx([r["train_loss"] for r in want], rel=1e-6)
    assert not any(k.startswith("attn_probe") for r in got for k in r)

    probe_id = probe_run_id(user)
    history = wandb_history(wandb_offline / "probe", run_id=probe_id)
    snapshots = expected_metrics(tmp_path / "probe")
    assert sorted(snapshots) == list(range(STEPS + 1))
    probe = {int(r["attn_probe/step"]): r for r in history if "attn_probe/step" in r}
    assert sorted(probe) == sorted(snapshots)
    for step, values in snapshots.items():
        assert {k: probe[step][k] for k in values} == pytest.approx(values, rel=1e-6, abs=1e-9)
    record = next(
        r.run
        for r in finished_wandb_records(wandb_offline / "probe", run_id=probe_id)
        if r.WhichOneof("record_type") == "run"
    )
    assert (record.run_group, record.job_type, record.project) == ("g44", "attn_probe", "lightning-wandb")
