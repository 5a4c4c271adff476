"""Worker for tests/distributed/test_ov_sharded.py: the OV pair (with W_qk) on a sharded model, live and gathered.

Launched with ``torchrun --standalone --nproc_per_node 2 ov_shard_worker.py CASE[,CASE...] ROOT``;
a case is ``SETUP-MODEL`` (setup ``zero3``, ``fsdp1``, ``fsdp1_orig``, ``fsdp2``; model ``bert``
or ``llama``, the latter grouped-query), run one after the other in one process group. Per
case, in ``ROOT/CASE`` (rank 0 unless said otherwise):

* ``ref_init.pt``: the state dict before sharding (the weights of the step-0 snapshot);
* ``ref_step1.pt``: the full state dict after one training step, saved through the framework's
  own API (DeepSpeed's consolidated ZeRO-3 state dict, FSDP1 ``FULL_STATE_DICT``,
  ``get_model_state_dict`` for FSDP2);
* ``run/attn_probe.jsonl``: ``attn_probe.watch(..., pairs=("qk", "ov"), per_head=True)``,
  snapshots at step 0 (attach, before any forward) and step 1 (``probe.snapshot(1)``);
* ``gathered_step1.json``: ``gather_scores(..., per_head=True, pairs=("qk", "ov"))`` at step 1;
* ``error_rank<r>.txt`` (any rank): the traceback, if the case raised on that rank.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from shard_worker import batch, no_shm_build

import attn_probe
from attn_probe.distributed import gather_scores

PAIRS = ("qk", "ov")


def build(name: str) -> torch.nn.Module:
    """Tiny models, hidden 64, 4 heads of 16; Llama with 2 KV heads (grouped-query); no dropout."""
    torch.manual_seed(0)
    if name == "bert":
        from transformers import BertConfig, BertModel

        cfg = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        return BertModel(cfg, add_pooling_layer=False)
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=32)
    return LlamaModel(cfg)


def wrap(setup: str, model: torch.nn.Module, name: str):
    """``(probed module, engine or None, optimizer, full_state_dict())`` for one setup."""
    blocks = model.encoder.layer if name == "bert" else model.layers
    if setup == "zero3":
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                                               config=config)
        return engine.module, engine, None, engine._zero3_consolidated_16bit_state_dict
    if setup in ("fsdp1", "fsdp1_orig"):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(blocks[0])}), device_id=torch.device("cpu"),
                       use_orig_params=setup == "fsdp1_orig")

        def fsdp1_state() -> dict:
            cfg = FullStateDictConfig(rank0_only=True, offload_to_cpu=False)
            with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, cfg):
                return wrapped.state_dict()

        return wrapped, None, torch.optim.Adam(wrapped.parameters(), lr=0.01), fsdp1_state
    if setup == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return model, None, torch.optim.Adam(model.parameters(), lr=0.01), lambda: get_model_state_dict(model,
                                                                                                        options=options)
    raise SystemExit(f"unknown setup {setup}")


def run(case: str, out: Path) -> None:
    setup, name = case.split("-")
    rank = dist.get_rank()
    model = build(name)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "ref_init.pt")
    probed, engine, opt, full_state = wrap(setup, model, name)
    probe = attn_probe.watch(probed, log_dir=str(out / "run"), every=None, per_head=True, pairs=PAIRS)
    ids = batch(rank, 1)
    if engine is not None:
        engine.backward(engine(input_ids=ids).last_hidden_state.pow(2).mean())
        engine.step()
    else:
        probed(input_ids=ids).last_hidden_state.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    probe.snapshot(1)
    probe.close(final_snapshot=False)
    rows = gather_scores(probed, attn_probe.find_attention(probed), per_head=True, pairs=PAIRS)
    state = full_state()
    if rank == 0:
        (out / "gathered_step1.json").write_text(json.dumps(rows))
        torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, out / "ref_step1.pt")


def main() -> None:
    cases, root = sys.argv[1].split(","), Path(sys.argv[2])
    no_shm_build()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo",
                               timeout=timedelta(seconds=float(os.environ.get("WORKER_PG_TIMEOUT", "60"))))
    for case in cases:
        out = root / case
        out.mkdir(parents=True, exist_ok=True)
        try:
            run(case, out)
        except Exception:  # noqa: BLE001 - reported to the test; the next case still runs
            (out / f"error_rank{dist.get_rank()}.txt").write_text(traceback.format_exc())
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
