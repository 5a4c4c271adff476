"""Worker for tests/extraction/test_peft_adapter_state.py: a live probe on an FSDP2-sharded PEFT LoRA Llama.

``torchrun --standalone --nproc_per_node 2 lora_shard_worker.py ROOT``. Two adapters are attached
before sharding; snapshots are taken with ``default`` active, after ``set_adapter("second")`` and
inside ``disable_adapter()``. Rank 0 writes the records of each to ``ROOT/snapshots.json``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from attn_probe import Probe
from attn_probe.scoring.pairs import QKPair

STATES = ("default", "second", "disabled")


def lora_llama():
    """The tiny Llama of ``shard_worker`` with two LoRA adapters on q/k (of other rank and alpha)."""
    import peft

    sys.path.insert(0, str(Path(__file__).parent))
    from shard_worker import llama

    model = peft.get_peft_model(
        llama(), peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj"], init_lora_weights=False)
    )
    torch.manual_seed(1)
    model.add_adapter(
        "second", peft.LoraConfig(r=2, lora_alpha=64, target_modules=["q_proj", "k_proj"], init_lora_weights=False)
    )
    return model.eval()


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("WORKER_PG_TIMEOUT", "60"))))
    rank = dist.get_rank()
    from torch.distributed.fsdp import fully_shard

    model = lora_llama()
    for layer in model.base_model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    probe = Probe(model, log_dir=str(root / "run"), every=None, per_head=True,
                  pairs=[QKPair(["symmetry", "spectral_norm"])], is_main_process=rank == 0)
    snapshots = {}
    for step, state in enumerate(STATES):
        if state == "second":
            model.set_adapter("second")
        if state == "disabled":
            with model.disable_adapter():
                snap = probe.snapshot(step)
        else:
            snap = probe.snapshot(step)
        if rank == 0:
            snapshots[state] = [[r.layer, r.head, r.metric, r.value] for r in snap.records]
    probe.close(final_snapshot=False)
    dist.barrier()
    if rank == 0:
        sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
        (root / "snapshots.json").write_text(json.dumps({"sharded": sharded, "snapshots": snapshots}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
