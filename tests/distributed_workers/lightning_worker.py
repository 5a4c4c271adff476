"""A Lightning run with AttnProbeCallback: ``python lightning_worker.py OUT NPROC [stop|spawn]``.

``stop``: an alert rule that fires at step 0 with ``stop_on_alert``, every step scheduled; each
rank writes the step it stopped at to ``OUT/stopped_rank<R>.txt``. ``spawn``: ``strategy="ddp_spawn"``
(the callback, its config and its ``log_spaced`` schedule are pickled into each spawned rank).

NPROC=2: ``strategy="ddp"`` on 2 CPU processes (gloo; Lightning launches the second one), batch 2
per rank; NPROC=1: one process, batch 4 (the same sequences per step: a non-shuffling
DistributedSampler gives rank r the sequences r, r + 2, ...). SGD, linear in the gradient, so that
DDP's averaged gradient is the single process's. A dropout-free GPT-2, so both train
the same weights. Accumulation 2, validation every 2 batches, attention statistics on.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import SEQ, VOCAB, RandomTokens  # noqa: E402

from attn_probe.lightning import AttnProbeCallback  # noqa: E402
from attn_probe.live.alerts import AlertRule  # noqa: E402
from attn_probe.live.schedules import log_spaced  # noqa: E402


class LitGPT2(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)  # linear in the gradient: DDP's average = one batch


def main() -> None:
    out, nproc = sys.argv[1], int(sys.argv[2])
    stop, spawn = sys.argv[3:] == ["stop"], sys.argv[3:] == ["spawn"]
    batch = 4 // nproc
    options = (dict(every=1, stop_on_alert=True, alerts=[AlertRule("spectral_norm", above=0.0)]) if stop
               else dict(every=log_spaced(per_decade=2)) if spawn
               else dict(every=2, attention_stats=True, per_head=True))
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60),
                           start_method="spawn" if spawn else "popen") if nproc > 1 else "auto"
    trainer = L.Trainer(callbacks=[AttnProbeCallback(**options)], max_steps=4,
                        accumulate_grad_batches=2, val_check_interval=2, check_val_every_n_epoch=None,
                        limit_val_batches=2, num_sanity_val_steps=0, logger=TensorBoardLogger(out),
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=nproc, strategy=strategy,
                        use_distributed_sampler=False)

    def loader() -> torch.utils.data.DataLoader:
        # Lightning's own sampler would shuffle the training set under DDP: rank r takes sequences r, r + 2, ...
        sampler = torch.utils.data.DistributedSampler(RandomTokens(), num_replicas=nproc, rank=trainer.global_rank,
                                                      shuffle=False)
        return torch.utils.data.DataLoader(RandomTokens(), batch_size=batch, sampler=sampler)

    trainer.fit(LitGPT2(), loader(), loader())
    if stop:
        Path(out, f"stopped_rank{trainer.global_rank}.txt").write_text(str(trainer.global_step))


if __name__ == "__main__":
    main()
