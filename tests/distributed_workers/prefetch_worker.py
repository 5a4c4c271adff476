"""Worker for tests/distributed/test_prefetch.py: FSDP2 gathers run one layer ahead of the scoring.

Launched with ``torchrun --standalone --nproc_per_node 3 prefetch_worker.py ROOT``. Builds a
4-layer Llama whose W_q (16 x 20) and W_k (8 x 20) split unevenly over three ranks, keeps an
unsharded copy, shards it with ``fully_shard`` and records, through a wrapper around
``attn_probe.distributed.backends.dtensor_full`` (the documented seam where a DTensor gather is issued), when each gather is issued and how many other
layers' gathered tensors are still alive at that moment. Writes ``ROOT/rank<r>.json``:

* ``walk``: events of a plain :func:`iter_layer_params` walk (``issue <layer>``, ``yield <layer>``)
  and whether each yielded tensor equals the unsharded weight exactly;
* ``fault``: the same walk with ``rank0_only=False`` where rank 1's dry run of layer 2 raises;
* ``stop``: the same walk where rank 1 asks to stop before layer 2's gather;
* ``probe``: ``watch(model).snapshot()`` records against ``score_model`` of the unsharded copy;
* ``gather_scores``: rows against ``score_model`` of the unsharded copy;
* ``alive``: the most other layers alive when a gather was issued, over every walk.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

import attn_probe
from attn_probe import find_attention, score_model
from attn_probe.distributed import backends, gather_scores, iter_layer_params

LAYERS = 4


def model():
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=64, hidden_size=20, head_dim=4, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                      max_position_embeddings=32)
    torch.manual_seed(0)
    return LlamaModel(cfg)


def local_address(value) -> int:
    """Where this rank's shard of a DTensor parameter lives (the same for its ``detach()``)."""
    return value.to_local().data_ptr()


class Recorder:
    """Wraps ``backends.dtensor_full``: logs each issue and counts other layers' live gathered storages."""

    def __init__(self, owner: dict[int, str]) -> None:
        self.owner = owner
        self.events: list[str] = []
        self.live: list[tuple[str, StorageWeakRef]] = []
        self.alive = 0
        self.original = backends.dtensor_full

    def __call__(self, value, *args, **kwargs):
        layer = self.owner.get(local_address(value), "?")
        others = {name for name, ref in self.live if not ref.expired() and name != layer}
        self.alive = max(self.alive, len(others))
        out = self.original(value, *args, **kwargs)
        self.events.append(f"issue {layer}")
        self.live.append((layer, StorageWeakRef(getattr(out, "elem", out).untyped_storage())))
        return out

    def take(self) -> list[str]:
        events, self.events = self.events, []
        return events


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("WORKER_PG_TIMEOUT", "60"))))
    rank = dist.get_rank()
    from torch.distributed.fsdp import fully_shard

    net = model()
    plain = copy.deepcopy(net)
    for block in net.layers:
        fully_shard(block)
    fully_shard(net)
    layers = find_attention(net)
    names = [f"L{layer.layer}" for layer in layers]
    weights = {(n, p): dict(plain.named_parameters())[f"layers.{i}.self_attn.{p}_proj.weight"]
               for i, n in enumerate(names) for p in ("q", "k")}
    owner = {local_address(getattr(layer.module, f"{p}_proj").weight): n
             for layer, n in zip(layers, names, strict=True) for p in ("q", "k")}
    recorder = Recorder(owner)
    backends.dtensor_full = recorder
    report: dict = {}

    def walk(**kwargs) -> dict:
        events, exact = [], []
        for layer, get in iter_layer_params(net, layers, **kwargs):
            name = f"L{layer.layer}"
            events += recorder.take() + [f"yield {name}"]
            exact.append(all(torch.equal(get(param), weights[(name, p)])
                             for param, p in zip(layer.param_names, ("q", "k"), strict=True)))
        return {"events": events + recorder.take(), "exact": exact}

    report["walk"] = walk()

    def fail_on_rank1(layer, get):
        if rank == 1 and layer.layer == 2:
            raise RuntimeError("injected: rank 1 cannot prepare layer 2")

    report["fault"] = walk(rank0_only=False, check=fail_on_rank1)
    calls = iter(range(100))
    report["stop"] = walk(stop=lambda: rank == 1 and next(calls) >= 2)

    want = {(r["group"], r["layer"]): r for r in score_model(plain)} if rank == 0 else {}
    with tempfile.TemporaryDirectory() as tmp:
        probe = attn_probe.watch(net, log_dir=tmp, every=1000)
        snap = probe.snapshot(1)  # (watch took step 0 at attach)
        recorder.take()
        if rank == 0:
            got = {(r.group, r.layer, r.metric): r.value for r in snap.records if r.head is None}
            report["probe"] = max(abs(got[(g, la, m)] - row[m]) for (g, la), row in want.items()
                                  for m in ("symmetry", "directionality", "spectral_norm"))
        probe.close()
    rows = gather_scores(net, layers)
    recorder.take()
    if rank == 0:
        report["gather_scores"] = max(abs(r[m] - want[(r["group"], r["layer"])][m]) for r in rows
                                      for m in ("symmetry", "directionality"))
        report["gather_scores_layers"] = len(rows)
    report["alive"] = recorder.alive
    (root / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
