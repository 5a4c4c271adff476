"""What the collective protocol costs per training step (not a test; prints one JSON line on rank 0).

``OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 tests/distributed_workers/bench_agreement.py``

On a 2-process FSDP2 run (gloo, CPU) of the workers' tiny BERT, per call, median of 5 batches:

* ``agreement_us``: one agreement (MIN all-reduce of 5 int64 on the probe's gloo group);
* ``on_update_callable_us``: ``probe.on_update()`` with a user schedule that says no (one
  agreement: what a callable schedule costs at every step);
* ``on_update_builtin_us``: ``probe.on_update()`` with ``every=10**9`` on a step that is not due
  (no agreement);
* ``surgery_check_per_layer_us``: the model-surgery identity check, per attention layer.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from shard_worker import bert  # noqa: E402

from attn_probe.live.probe import Probe  # noqa: E402


def per_call(fn, n: int = 500, batches: int = 5) -> float:
    times = []
    for _ in range(batches):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - start) / n)
    return statistics.median(times) * 1e6


def main() -> None:
    dist.init_process_group("gloo")
    from torch.distributed.fsdp import fully_shard

    model = bert()
    for layer in model.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    rank = dist.get_rank()
    log_dir = tempfile.mkdtemp()
    callable_probe = Probe(model, log_dir=log_dir + "/a", every=lambda step: False, is_main_process=rank == 0)
    builtin_probe = Probe(model, log_dir=log_dir + "/b", every=10**9, is_main_process=rank == 0)
    builtin_probe.step = 1  # never due again
    vote = [1, 1, 1, 7, -7]
    result = {
        "agreement_us": per_call(lambda: callable_probe.decision.agreement.min(vote)),
        "on_update_callable_us": per_call(callable_probe.on_update),
        "on_update_builtin_us": per_call(builtin_probe.on_update),
        "surgery_check_per_layer_us": per_call(callable_probe.measurement.surgery.changed_layers) / len(callable_probe.layers),
        "layers": len(callable_probe.layers),
    }
    callable_probe.close(final_snapshot=False)
    builtin_probe.close(final_snapshot=False)
    if rank == 0:
        print(json.dumps({k: round(v, 1) for k, v in result.items()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
