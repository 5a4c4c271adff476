"""Worker for tests/distributed/test_collective_protocol.py: rank-local events must not break the collectives.

``torchrun --standalone --nproc_per_node 2 protocol_worker.py SETUP:CASE[,SETUP:CASE...] ROOT``
with SETUP ``fsdp1``, ``fsdp2`` or ``ddp``. Each case trains a fresh tiny BERT for ``STEPS`` optimizer
updates in a plain loop with ``attn_probe.watch(model, optimizer=opt, ...)`` on every rank, in
the same process group, one case after the other. Writes into ``ROOT/SETUP/CASE``:

* ``probe/attn_probe.jsonl`` (rank 0): what the probe logged;
* ``ref_<step>.pt`` (rank 0): the full state dict after each step, through the framework's own
  API (FSDP1 ``FULL_STATE_DICT``, ``get_model_state_dict``, DDP ``.module``);
* ``rank<r>.json`` (every rank): steps trained, the probe's state, collectives it issued.

Cases (each a fault on one rank only, or a schedule whose answer differs between ranks):

* ``raise1``: the schedule (a callable) raises on rank 1 at step 2;
* ``clock``: a wall-clock schedule "at most every 0.2 s"; rank 1 is late at odd steps, so the
  ranks' answers differ;
* ``oom``: ``torch.OutOfMemoryError`` on rank 1 at step 2 when memory for layer 1's gather is
  taken;
* ``timeout``: ``agreement_timeout=2``; rank 1 reaches step 3's agreement 3.5 s late;
* ``count``: a callable schedule firing every step; counts the ``torch.distributed`` calls the
  probe makes (none expected under DDP);
* ``builtin``: ``every=2`` (deterministic): the same count, agreements only on due steps;
* ``surgery``: after step 1, every rank replaces layer 0's ``attention.self`` by a fresh module
  (same seed on every rank; its parameters are plain tensors, not sharded);
* ``surgery1``: after training, rank 1 alone replaces that module (reading layer 0 locally where
  rank 0 gathers it), then every rank asks for one more snapshot (step 6): the plans differ.
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

sys.path.insert(0, str(Path(__file__).parent))
from shard_worker import batch, bert  # noqa: E402

import attn_probe  # noqa: E402
from attn_probe.distributed import backends  # noqa: E402
from attn_probe.live.probe import Probe  # noqa: E402

STEPS = 5


class AtMostEvery:
    """A wall-clock schedule: fire when ``seconds`` have passed since it last fired."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.last = seconds, None

    def __call__(self, step: int) -> bool:
        now = time.monotonic()
        if self.last is None or now - self.last >= self.seconds:
            self.last = now
            return True
        return False


class Collectives:
    """Count calls of ``torch.distributed`` collectives made while the probe runs."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
             "broadcast_object_list", "reduce_scatter_tensor", "barrier", "new_group", "monitored_barrier",
             "all_to_all", "gather", "scatter", "reduce")

    def __init__(self) -> None:
        self.inside = 0
        self.calls: dict[str, int] = {}
        self.saved: list[tuple[object, str, object]] = []

    def install(self) -> None:
        from torch.distributed import distributed_c10d

        for module in (dist, distributed_c10d):
            for name in self.NAMES:
                original = getattr(module, name, None)
                if original is None:
                    continue
                self.saved.append((module, name, original))
                setattr(module, name, self._wrap(name, original))
        for name in ("__init__", "snapshot", "on_update", "close"):
            original = getattr(Probe, name)
            self.saved.append((Probe, name, original))
            setattr(Probe, name, self._inside(original))

    def _wrap(self, name, original):
        def wrapper(*args, **kwargs):
            if self.inside:
                self.calls[name] = self.calls.get(name, 0) + 1
            return original(*args, **kwargs)

        return wrapper

    def _inside(self, original):
        def wrapper(*args, **kwargs):
            self.inside += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.inside -= 1

        return wrapper

    def uninstall(self) -> None:
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)


def wrap(setup: str, model):
    if setup == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if setup == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.bert.modeling_bert import BertLayer

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({BertLayer}), device_id=torch.device("cpu"))
    from torch.distributed.fsdp import fully_shard

    for layer in model.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    return model


def full_state_dict(setup: str, model) -> dict:
    if setup == "ddp":
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    if setup == "fsdp1":
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        cfg = FullStateDictConfig(rank0_only=True, offload_to_cpu=False)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def inject_gather_oom(rank: int, state: dict) -> list:
    """``OutOfMemoryError`` on rank 1 at step 2 when memory for layer 1's gather is taken."""

    def fail(layer_name: str) -> None:
        if rank == 1 and state["step"] == 2 and ".1." in f".{layer_name.replace(' ', '.')}.":
            raise torch.OutOfMemoryError("injected: out of memory for layer 1's gather on rank 1")

    original = backends.reserve_gather_memory  # the documented seam: the walk looks it up at every call

    def reserve(gather, *args, **kwargs):
        fail(" ".join(plan.layer.name for plan in gather.plans))
        return original(gather, *args, **kwargs)

    backends.reserve_gather_memory = reserve
    return [(backends, "reserve_gather_memory", original)]


def replace_attention(model) -> None:
    """Model surgery: layer 0's self-attention becomes a fresh module (same on every rank)."""
    from shard_worker import bert_config
    from transformers.models.bert.modeling_bert import BertSelfAttention

    torch.manual_seed(123)
    model.encoder.layer[0].attention.self = BertSelfAttention(bert_config())


def run(setup: str, case: str, out: Path) -> None:
    start = time.monotonic()
    rank = dist.get_rank()
    out.mkdir(parents=True, exist_ok=True)
    model = wrap(setup, bert())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"step": 0}
    restore: list = []
    options: dict = {}
    if case == "raise1":
        def every(step: int) -> bool:
            if rank == 1 and step == 2:
                raise RuntimeError("injected: the schedule raised on rank 1")
            return True
    elif case == "clock":
        every = AtMostEvery(0.2)

        def late(optimizer, args, kwargs):  # rank 1 reaches the probe late at odd steps
            if rank == 1 and state["step"] % 2 == 1:
                time.sleep(0.15)

        opt.register_step_pre_hook(late)
    elif case == "oom":
        every = 1
        restore = inject_gather_oom(rank, state)
    elif case == "timeout":
        every = 1
        options["agreement_timeout"] = 2.0

        def stall(optimizer, args, kwargs):  # rank 1 is 3.5 s late for step 3's agreement
            if rank == 1 and state["step"] == 3:
                time.sleep(3.5)

        opt.register_step_pre_hook(stall)
    elif case in ("count", "surgery", "surgery1"):
        def every(step: int) -> bool:
            return True
    elif case == "builtin":
        every = 2
    else:
        raise SystemExit(f"unknown case {case}")
    counter = Collectives()
    if case in ("count", "builtin"):
        counter.install()

    def save_ref(step: int) -> None:
        sd = full_state_dict(setup, model)
        if rank == 0:
            torch.save({k: v.detach().cpu() for k, v in sd.items()}, out / f"ref_{step}.pt")

    save_ref(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = attn_probe.watch(model, optimizer=opt, log_dir=str(out / "probe"), every=every,
                                 is_main_process=rank == 0, **options)
        for step in range(1, STEPS + 1):
            state["step"] = step
            if step == 2 and case == "surgery":
                replace_attention(model)
            if case == "clock":
                time.sleep(0.05)
            loss = model(input_ids=batch(rank, step)).last_hidden_state.pow(2).mean()
            loss.backward()
            opt.step()  # the probe's hook: snapshot when due
            opt.zero_grad()
            save_ref(step)
        if case == "surgery1":  # (during training, FSDP2 itself would fail: rank 1 lacks gradients)
            if rank == 1:
                replace_attention(model)
            probe.snapshot(STEPS + 1)
        probe.close()
    counter.uninstall()
    for owner, name, original in restore:
        setattr(owner, name, original)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "seconds": time.monotonic() - start,
        "steps": state["step"],
        "failures": probe.failures,
        "disabled": bool(getattr(probe, "disabled", False)),
        "collectives": counter.calls,
        "warnings": [str(w.message).splitlines()[0] for w in caught if "attn_probe" in str(w.message)],
        "layers": [a.name for a in probe.layers],
    }))


def main() -> None:
    runs, root = [r.split(":") for r in sys.argv[1].split(",")], Path(sys.argv[2])
    timeout = timedelta(seconds=float(os.environ.get("WORKER_PG_TIMEOUT", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    for setup, case in runs:
        run(setup, case, root / setup / case)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
