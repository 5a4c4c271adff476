"""Worker for tests/distributed/test_distributed.py: a Probe on an FSDP2 model whose image schedule raises.

``torchrun --standalone --nproc_per_node 2 probe_worker.py ROOT``. ``images_every`` raises at
step 0 and is evaluated on rank 0 only; the probe must still take part in the gathers there,
so that the next snapshot lines up on both ranks. Rank 0 writes ``ROOT/result.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from attn_probe import Probe


def images_every(step: int) -> bool:
    return 100 % step == 0  # ZeroDivisionError at step 0


def main() -> None:
    root = Path(sys.argv[1])
    timeout = timedelta(seconds=float(os.environ.get("WORKER_PG_TIMEOUT", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(Path(__file__).parent))
    from shard_worker import bert

    model = bert()
    for layer in model.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = Probe(model, log_dir=str(root / "run"), every=None, images_every=images_every,
                      is_main_process=rank == 0)
        first = probe.snapshot(0)  # rank 0: the schedule raises -> skipped, but the walk is done
        second = probe.snapshot(1)  # 100 % 1 == 0: images due
        probe.close(final_snapshot=False)
    dist.barrier()
    if rank == 0:
        (root / "result.json").write_text(json.dumps({
            "first": first is None,
            "second_layers": sorted({r.layer for r in second.records}) if second else None,
            "second_images": len(second.images) if second else None,
            "failures": probe.failures,
            "warned": any("ZeroDivisionError" in str(w.message) for w in caught),
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
