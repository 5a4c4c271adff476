"""Worker for tests/distributed/test_distributed.py: train a tiny sharded model, snapshot scores on rank 0.

Launched with ``torchrun --standalone --nproc_per_node N shard_worker.py SETUP[,SETUP...] ROOT``;
setups run one after the other in the same process group. Writes into ``ROOT/SETUP``:

* ``scores_<tag>.json`` (rank 0 only): rows from :func:`attn_probe.distributed.gather_scores`;
* ``ref_<tag>.pt`` (rank 0 only): the full state dict saved through the framework's own API
  (DDP ``.module``, FSDP1 ``FULL_STATE_DICT``, ``get_model_state_dict`` for DTensor,
  DeepSpeed's consolidated ZeRO-3 state dict) for an independent single-process reference;
* ``rank<r>.json`` (every rank): how many layers that rank received, for the rank-0-only check.

Snapshots: ``init`` (before any forward), ``step1``; ``inject0`` (rank 0's factor reading of
layer 0 raises), ``inject1`` (rank 1 holds a different layer list); ``final`` after step 2.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from attn_probe import find_attention
from attn_probe.distributed import all_ranks_ok, gather_scores, iter_layer_factors, sharding_kind, world_info
from attn_probe.extraction import AttentionLayer
from attn_probe.scoring.model import score_layer


def bert_config():
    """The tiny BERT shared by the distributed workers (no dropout: ranks stay comparable)."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def bert():
    from transformers import BertModel

    torch.manual_seed(0)
    return BertModel(bert_config(), add_pooling_layer=False)


def llama():
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return LlamaModel(cfg)


def no_shm_build() -> None:
    """Skip DeepSpeed's JIT build of its CPU shared-memory all-reduce (slow, needs a compiler).

    With ``DS_ACCELERATOR=cpu`` DeepSpeed compiles ``deepspeed_shm_comm`` on first use; without
    it DeepSpeed falls back to plain ``torch.distributed`` (gloo) collectives.
    """
    import importlib

    # (``deepspeed.comm.torch`` as an attribute is the torch package re-exported by deepspeed.comm)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 64, (2, 8), generator=g)


def main() -> None:
    setups, root = sys.argv[1].split(","), Path(sys.argv[2])
    timeout = timedelta(seconds=float(os.environ.get("WORKER_PG_TIMEOUT", "60")))
    if any(s.startswith("zero") for s in setups):
        import deepspeed

        no_shm_build()
        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    for setup in setups:
        out = root / setup
        out.mkdir(parents=True, exist_ok=True)
        run(setup, out)
    dist.barrier()
    dist.destroy_process_group()


def run(setup: str, out: Path) -> None:
    start = time.time()
    rank = dist.get_rank()
    model = llama() if setup == "fsdp_tp" else bert()
    ref_model = model  # what to take the state dict from
    engine = None

    if setup == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif setup in ("fsdp1", "fsdp1_orig", "fsdp1_inner"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.bert.modeling_bert import BertLayer

        model = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({BertLayer}),
            device_id=torch.device("cpu"),
            use_orig_params=setup == "fsdp1_orig",
        )
    elif setup == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
    elif setup == "fsdp_tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = {
            "q_proj": ColwiseParallel(),
            "k_proj": ColwiseParallel(),
            "v_proj": ColwiseParallel(),
            "o_proj": RowwiseParallel(),
        }
        for layer in model.layers:
            parallelize_module(layer.self_attn, mesh["tp"], plan)
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif setup in ("zero2", "zero3"):
        import deepspeed

        zero = {"stage": int(setup[-1])}
        if setup == "zero3":
            zero["stage3_param_persistence_threshold"] = 0
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        model = engine.module  # what a Trainer callback receives: parameters carry ds_*
    else:
        raise SystemExit(f"unknown setup {setup}")
    if engine is None:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    received = {}

    def full_state_dict() -> dict:
        if setup == "ddp" or setup == "zero2":
            return {k: v.clone() for k, v in ref_model.state_dict().items()}
        if setup.startswith("fsdp1"):
            from torch.distributed.fsdp import FullStateDictConfig, StateDictType
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            cfg = FullStateDictConfig(rank0_only=True, offload_to_cpu=False)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                return model.state_dict()
        if setup in ("fsdp2", "fsdp_tp"):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        return engine._zero3_consolidated_16bit_state_dict()

    def snapshot(tag: str, layers: list[AttentionLayer], save_ref: bool = True) -> None:
        rows = gather_scores(probed, layers, per_head=True)
        received[tag] = sum(1 for _ in iter_layer_factors(probed, layers))
        if rank == 0:
            (out / f"scores_{tag}.json").write_text(json.dumps(rows))
        if save_ref:
            sd = full_state_dict()
            if rank == 0:
                torch.save({k: v.detach().cpu() for k, v in sd.items()}, out / f"ref_{tag}.pt")

    def train_step(step: int) -> None:
        ids = batch(rank, step)
        if engine is not None:
            loss = engine(input_ids=ids).last_hidden_state.pow(2).mean()
            engine.backward(loss)
            engine.step()
        else:
            loss = model(input_ids=ids).last_hidden_state.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()

    # fsdp1_inner: the probe is (wrongly) given the module inside the FSDP root
    probed = model.module if setup == "fsdp1_inner" else model
    layers = find_attention(probed)
    snapshot("init", layers)  # before the first forward (FSDP1 lazy init)
    train_step(1)
    snapshot("step1", layers)

    # injected error 1: rank 0 cannot read layer 0 (non-collective part)
    original = AttentionLayer.factors

    def broken(self, get=None):
        if rank == 0 and self.layer == 0:
            raise RuntimeError("injected")
        return original(self, get)

    AttentionLayer.factors = broken
    try:
        snapshot("inject0", layers, save_ref=False)
    finally:
        AttentionLayer.factors = original
    # injected error 2: rank 1 lost its layer list (e.g. its extraction failed)
    snapshot("inject1", layers if rank != 1 else layers[:1], save_ref=False)

    train_step(2)
    snapshot("final", layers)
    # every rank receives the full factors with rank0_only=False
    rows_here = []
    for layer, query, key in iter_layer_factors(probed, layers, rank0_only=False):
        rows_here += score_layer(layer, query, key, per_head=True)
    (out / f"scores_all_rank{rank}.json").write_text(json.dumps(rows_here))
    agreed = [all_ranks_ok(True), all_ranks_ok(rank != 1)]
    info = world_info()
    local_numel = None  # FSDP1 flat parameters: the per-weight views outside summon are not safe to read
    if setup not in ("fsdp1", "fsdp1_inner"):
        query = layers[0].module.get_submodule(layers[0].param_names[0].rsplit(".", 2)[-2]).weight
        local_numel = (query.to_local() if hasattr(query, "to_local") else query.data).numel()
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "received": received,
                "kind": sharding_kind(probed),
                "world": [info.rank, info.world_size],
                "seconds": time.time() - start,
                "local_query_numel": local_numel,
                "all_ranks_ok": agreed,
            }
        )
    )


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
