"""Worker for tests/distributed/test_range_ranks.py: the random-matrix range and the agreement clock (issue 35).

``torchrun --standalone --nproc_per_node 2 range_worker.py OUT`` runs two cases in turn, each a
plain DDP loop (gloo, CPU) with ``agreement_timeout=3`` and ``stop_on_alert`` (a rule that never
fires: the ranks share a stop decision at every snapshot, an agreement bounded by 3 s), every 2
updates over 4 updates, and writes ``OUT/<case>_rank<r>.json`` (whether the probe disabled itself,
its step, the probe's warnings, the seconds ``watch`` took):

- ``range``: a Llama whose one attention layer is ``d = 2048`` with 32 heads of 64 and 8 KV heads:
  its random-matrix range takes several seconds on one CPU thread (more than the 3 s the ranks
  wait for each other), and the range is on (the default);
- ``stall``: a tiny Llama, no range; rank 0 sleeps 5 s in the user's loop before its second
  update, so the stop decision at step 2 times out: the probe disables itself and says so.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import attn_probe
from attn_probe.baselines import random_range
from attn_probe.live.alerts import AlertRule

AGREEMENT_TIMEOUT = 3.0
STEPS = 4
SHAPES = {
    "range": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=1,
                  intermediate_size=32, vocab_size=64),
    "stall": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  intermediate_size=48, vocab_size=64),
}


#: the range case's bound on drawn numbers: four times the probe's, so that computing the range takes
#: longer than AGREEMENT_TIMEOUT even on an idle machine (the probe's own bound took 2.2 s there)
RANGE_ENTRIES = 4 * random_range.PROBE_ENTRIES


def run(case: str, out: Path, rank: int) -> dict:
    torch.manual_seed(0)
    random_range.PROBE_ENTRIES = RANGE_ENTRIES  # the same on every rank: the draws stay identical
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=16, **SHAPES[case]))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        probe = attn_probe.watch(ddp, optimizer=opt, every=2, log_dir=str(out / case), agreement_timeout=AGREEMENT_TIMEOUT,
                                 stop_on_alert=True, alerts=[AlertRule("frobenius_norm", above=1e30)],
                                 random_range=case == "range")
        attach = time.monotonic() - start
        for step in range(STEPS):
            ddp(input_ids=ids, labels=ids).loss.backward()
            if case == "stall" and rank == 0 and step == 1:
                time.sleep(AGREEMENT_TIMEOUT + 2)  # the user's code is slow on rank 0 before update 2
            opt.step()
            opt.zero_grad()
        disabled = probe.disabled
        probe.close()
    return {"disabled": disabled, "step": probe.step, "attach_seconds": attach,
            "warnings": [str(w.message) for w in caught if "attn_probe" in str(w.message)]}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("WORKER_PG_TIMEOUT", "60"))))
    rank = dist.get_rank()
    for case in ("range", "stall"):
        result = run(case, out, rank)
        (out / f"{case}_rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
