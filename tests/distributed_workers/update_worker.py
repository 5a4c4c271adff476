"""Worker for tests/distributed/test_update_ranks.py: ``qk_update`` on 1 process and on 2 FSDP2 ranks.

``torchrun --standalone --nproc_per_node N update_worker.py OUT`` trains a tiny grouped-query Llama
(seed 0, no dropout) for 3 SGD steps on one global batch of 4 sequences (each of 2 ranks holds
half of it; the gradients are averaged, so both runs make the same updates up to rounding), with
``attn_probe.watch(..., every=1, metrics=[..., "qk_update"], per_head=True)``. With 2 ranks every
layer is sharded (``fully_shard``): the probe gathers each layer and scores it on rank 0, one at a
time. Writes ``OUT/run/attn_probe.jsonl`` (rank 0), with 1 process also ``OUT/weights.pt``: the
q/k projection weights at every snapshot step, for the test's explicit float64 reference.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import attn_probe
from attn_probe.core import DEFAULT_METRICS

STEPS = 3


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("WORKER_PG_TIMEOUT", "60"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=32))
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
        ids = ids.chunk(world)[rank]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    probe = attn_probe.watch(model, optimizer=opt, log_dir=str(out / "run"), every=1, per_head=True,
                             metrics=[*DEFAULT_METRICS, "qk_update"], random_range=False, background=False)

    def weights() -> list:
        return [(lay.self_attn.q_proj.weight.detach().clone(), lay.self_attn.k_proj.weight.detach().clone())
                for lay in model.model.layers]

    saved = {0: weights()} if world == 1 else {}
    for _ in range(STEPS):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if world == 1:
            saved[probe.step] = weights()
    probe.close()
    if world == 1:
        torch.save(saved, out / "weights.pt")
    if probe.failures:
        raise SystemExit(f"rank {rank}: {probe.failures} probe failures")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
