"""Worker for tests/distributed/test_distributed.py: a real ``Trainer`` with :class:`AttnProbeCallback`.

``torchrun --standalone --nproc_per_node 2 trainer_worker.py SETUP OUT [inject]`` with SETUP
``ddp`` or ``zero3`` (DeepSpeed, ``DS_ACCELERATOR=cpu``). The probe logs to ``OUT/probe``; a
second callback saves the full weights at every step through the framework's own API
(``OUT/ref_<step>.pt``, rank 0) for a single-process reference. With ``inject``: rank 0's
scoring raises at step 2 and rank 1's gather planning raises at step 3.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import torch
from transformers import BertForMaskedLM, Trainer, TrainerCallback, TrainingArguments

import attn_probe.distributed as distributed
from attn_probe import AttnProbeCallback
from attn_probe.distributed import backends
from attn_probe.scoring.pairs import QKPair


def bert() -> BertForMaskedLM:
    from shard_worker import bert_config  # the workers' directory is on sys.path

    torch.manual_seed(0)
    return BertForMaskedLM(bert_config())


class Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (8,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


class SaveReference(TrainerCallback):
    """Full weights at every step, gathered with the framework's own API, written by rank 0."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def _save(self, state, model) -> None:
        params = list(model.parameters())
        if any(hasattr(p, "ds_id") for p in params):
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if state.is_world_process_zero:
            torch.save(sd, self.out / f"ref_{state.global_step}.pt")

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._save(state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._save(state, model)


def main() -> None:
    setup, out = sys.argv[1], Path(sys.argv[2])
    inject = len(sys.argv) > 3 and sys.argv[3] == "inject"
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no JIT build
    rank = int(os.environ["RANK"])
    ds = None
    if setup == "zero3":
        ds = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        per_device_train_batch_size=2,
        max_steps=4,
        learning_rate=5e-2,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        deepspeed=ds,
        ddp_backend="gloo",
        ddp_timeout=60,
        disable_tqdm=True,
    )
    state = {"step": 0}
    pairs = None
    if inject:
        original_plan = backends.plan_layer  # the documented seam: one layer's plan

        class FailingPair(QKPair):  # the documented hook: a pair with its own score, called per layer
            def score(self, *a, **k):
                if rank == 0 and state["step"] == 2:
                    raise RuntimeError("injected scoring error on rank 0")
                return super().score(*a, **k)

        def plan(*a, **k):
            if rank == 1 and state["step"] == 3:
                raise RuntimeError("injected gather error on rank 1")
            return original_plan(*a, **k)

        pairs = [FailingPair()]
        backends.plan_layer = plan

    class Step(TrainerCallback):  # registered first: the step the probe is about to snapshot
        def on_step_end(self, args, s, control, **kwargs):
            state["step"] = s.global_step

    callback = AttnProbeCallback(log_dir=str(out / "probe"), every=1, **({"pairs": pairs} if pairs else {}))
    trainer = Trainer(
        model=bert(), args=args, train_dataset=Data(), callbacks=[Step(), callback, SaveReference(out)]
    )
    sinks = {}

    class Record(TrainerCallback):
        def on_step_end(self, args, s, control, **kwargs):
            probe = callback.probe
            outputs = probe.outputs if probe is not None else None  # None off the main process: no sinks
            sinks["count"] = (len(outputs.sinks) if outputs is not None else 0) if probe is not None else None
            sinks["main"] = callback.probe.is_main_process if callback.probe is not None else None

    trainer.add_callback(Record())  # after the probe callback: runs while the probe is open
    trainer.train()
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "sinks": sinks,
                "kind": distributed.sharding_kind(trainer.model),
                "world": list(distributed.world_info()[:2]),
            }
        )
    )
    # an orderly teardown: exiting with a live gloo group can abort in its thread destructors
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
