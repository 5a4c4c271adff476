"""Worker for tests/live/test_alert_ranks.py: ``stop_on_alert`` and ``async_scoring`` in a real DDP ``Trainer``.

``torchrun --standalone --nproc_per_node 2 alert_worker.py OUT CASE [CASE ...]`` runs each case
in turn (one Trainer each, gloo, CPU) and writes ``OUT/<case>_rank<r>.json``: the step each rank
stopped at, the alerts this rank evaluated, the snapshots skipped, the probe's failures, the
warnings and the wall time. Every case uses a tiny Llama trained with learning rate 0 on one
repeated sequence; a callback doubles layer 0's ``W_q`` at the start of every step, so layer 0's
``max_logit`` and ``W_q W_kᵀ`` norms double per step whatever the rank:

- ``logit``: ``max_logit`` growing x3 within 2 steps (fires at step 3 from the combined values);
- ``weights``: ``frobenius_norm`` growing x3 within 2 steps (fires at step 2 on rank 0 only);
- ``step0``: ``frobenius_norm`` above 0 (fires on the snapshot at step 0);
- ``async``: ``async_scoring`` and ``attention_stats`` with rank 0's scoring held 1.5 s per
  snapshot (the documented seam ``Measurement.score_stacked``), no rule: most snapshots are
  skipped on rank 0 while rank 1's scorer is never busy;
- ``async_stop``: ``async_scoring``, ``attention_stats``, the ``step0`` rule with ``stop_on_alert``
  and the scoring held 0.3 s: the stop found when the step-0 snapshot is delivered, steps later
  on rank 0 alone, is shared at the next snapshot.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from attn_probe import AttnProbeCallback
from attn_probe.live.alerts import AlertRule
from attn_probe.live.stages.measurement import Measurement

STEPS = 8
hold = {"seconds": 0.0}
AGREEMENT_TIMEOUT = 30.0  # seconds: a stall in a collective of the probe would show as a wait this long


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=99))
    model.set_attn_implementation("sdpa")
    return model


class Same(torch.utils.data.Dataset):
    """One sequence repeated: every rank's batch is the same."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, 99, (9,), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "labels": ids.clone()}


class Grow(TrainerCallback):
    """Doubles layer 0's W_q at the start of every step (learning rate 0: nothing else changes)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model

    def on_step_begin(self, args, state, control, **kwargs):
        with torch.no_grad():
            self.model.model.layers[0].self_attn.q_proj.weight.mul_(2.0)


#: seconds rank 0 holds each asynchronous snapshot's scoring, per case
HOLD = {"async": 1.5, "async_stop": 0.3}

CASES = {
    "logit": dict(attention_stats=True, stop_on_alert=True,
                  alerts=[AlertRule("max_logit", growth=3.0, within=2, layers=(0,))]),
    "weights": dict(stop_on_alert=True, alerts=[AlertRule("frobenius_norm", growth=3.0, within=2, layers=(0,))]),
    "step0": dict(stop_on_alert=True, alerts=[AlertRule("frobenius_norm", above=0.0)]),
    "async": dict(attention_stats=True, async_scoring=True),
    "async_stop": dict(attention_stats=True, async_scoring=True, stop_on_alert=True,
                       alerts=[AlertRule("frobenius_norm", above=0.0)]),
}


def run(case: str, out: Path, rank: int) -> dict:
    hold["seconds"] = HOLD.get(case, 0.0)
    model = llama()
    args = TrainingArguments(output_dir=str(out / case), use_cpu=True, per_device_train_batch_size=2,
                             max_steps=STEPS if case != "async_stop" else 3 * STEPS, learning_rate=0.0,
                             report_to=[], save_strategy="no",
                             logging_strategy="no", ddp_backend="gloo", ddp_timeout=60, disable_tqdm=True)
    callback = AttnProbeCallback(every=1, log_dir=str(out / case / "probe"), agreement_timeout=AGREEMENT_TIMEOUT,
                                 **CASES[case])
    seen: dict = {}

    class Keep(TrainerCallback):  # after the probe's callback: its state before on_train_end closes it
        def on_step_end(self, args, state, control, **kwargs):
            probe = callback.probe
            seen["skipped"] = probe.skipped_snapshots
            seen["failures"] = probe.failures
            seen["fired"] = [[a.step, a.metric, a.layer, a.head] for a in getattr(probe.alerting, "fired", [])]
            seen["stop_requested"] = probe.stop_requested

    trainer = Trainer(model=model, args=args, train_dataset=Same(), callbacks=[Grow(model), callback, Keep()])
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return {"global_step": trainer.state.global_step, "elapsed": time.monotonic() - start, **seen,
            "warnings": [str(w.message).splitlines()[0] for w in caught if "attn_probe" in str(w.message)]}


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    rank = int(os.environ["RANK"])
    if rank == 0:  # rank 0 alone scores the weights: hold each snapshot's scoring there
        original = Measurement.score_stacked

        def slow(self, layers, stacks):
            if self.scorer is not None:
                time.sleep(hold["seconds"])
            return original(self, layers, stacks)

        Measurement.score_stacked = slow
    for case in cases:
        result = run(case, out, rank)
        (out / f"{case}_rank{rank}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    if dist.is_initialized():  # an orderly teardown
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
