"""Gathering q/k across processes: DDP, FSDP1, FSDP2, FSDP+TP, DeepSpeed ZeRO-2/3, Trainer.

Real multi-process gloo runs on CPU (``torchrun --standalone``), each bounded by a timeout
that kills the whole process group: a hang fails the test. The reference is always
:func:`attn_probe.score_model` on a fresh single-process model loaded with the full state
dict the worker saved through the framework's own API (not through attn_probe).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import WORKERS, launch

from attn_probe import find_attention, score_model
from attn_probe.distributed import (
    all_ranks_ok,
    canonical_name,
    gather_bytes,
    gather_scores,
    is_main_process,
    iter_layer_factors,
    sharding_kind,
    world_info,
)

pytestmark = pytest.mark.timeout(900)  # whole-file bound; every launch below has its own

sys.path.insert(0, str(WORKERS))
import shard_worker  # noqa: E402  (tiny model builders shared with the workers)

TOL = 1e-5

# setup -> (launch group, sharding_kind, number of processes)
SETUPS = {
    "ddp": ("torch", "local", 2),
    "fsdp1": ("torch", "fsdp1", 2),
    "fsdp1_orig": ("torch", "fsdp1", 2),
    "fsdp1_inner": ("torch", "fsdp1", 2),  # probe given the module inside the FSDP root
    "fsdp2": ("torch", "dtensor", 2),
    "zero2": ("deepspeed", "local", 2),
    "zero3": ("deepspeed", "zero3", 2),
    "fsdp_tp": ("tp", "dtensor", 4),
}
GROUPS = {g: [s for s, v in SETUPS.items() if v[0] == g] for g in ("torch", "deepspeed", "tp")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """Launch each group once (lazily) and return the directory of a setup."""
    done: dict[str, Path] = {}

    def get(setup: str) -> Path:
        group, _, nproc = SETUPS[setup]
        if group not in done:
            root = tmp_path_factory.mktemp(f"dist_{group}")
            launch("shard_worker.py", [",".join(GROUPS[group]), str(root)], nproc)
            done[group] = root
        return done[group] / setup

    return get


def _model(setup: str):
    return shard_worker.llama() if setup == "fsdp_tp" else shard_worker.bert()


def reference_rows(setup: str, ref_file: Path) -> dict:
    model = _model(setup)
    state = torch.load(ref_file, weights_only=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if "weight" in k and "buffer" not in k]
    return keyed(score_model(model, per_head=True))


def keyed(rows: list[dict]) -> dict:
    return {
        (r["group"], r["layer"], r["name"], r["head"]): (r["symmetry"], r["directionality"]) for r in rows
    }


def assert_close(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, values in want.items():
        assert got[key] == pytest.approx(values, abs=TOL), key


def scores(out: Path, tag: str) -> dict:
    return keyed(json.loads((out / f"scores_{tag}.json").read_text()))


# --------------------------------------------------------------------------- multi-process
@pytest.mark.parametrize("setup", list(SETUPS))
def test_scores_equal_single_process(runs, setup: str) -> None:
    out = runs(setup)
    for tag in ("init", "step1", "final"):
        if setup == "fsdp1_inner" and tag == "init":
            # not the FSDP root and no forward yet: lazy init cannot be run safely -> skipped
            assert scores(out, tag) == {}
            continue
        assert_close(scores(out, tag), reference_rows(setup, out / f"ref_{tag}.pt"))
    # training moved the weights: reading stale or initial weights would be caught
    init = reference_rows(setup, out / "ref_init.pt")
    final = scores(out, "final")
    assert max(abs(init[k][0] - final[k][0]) for k in init) > 1e-3


@pytest.mark.parametrize("setup", list(SETUPS))
def test_rank0_only_receives_all_ranks_on_request_and_weights_sharded(runs, setup: str) -> None:
    out = runs(setup)
    _, kind, nproc = SETUPS[setup]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    assert [r["world"] for r in ranks] == [[r, nproc] for r in range(nproc)]
    assert {r["kind"] for r in ranks} == {kind}
    assert ranks[0]["received"]["final"] == 2
    assert all(v == 0 for r in ranks[1:] for v in r["received"].values())
    assert [r["all_ranks_ok"] for r in ranks] == [[True, False]] * nproc  # rank 1 said "not ok"
    # rank0_only=False: every rank gets the full factors and the single-process scores
    want = reference_rows(setup, out / "ref_final.pt")
    for r in range(nproc):
        assert_close(keyed(json.loads((out / f"scores_all_rank{r}.json").read_text())), want)
    full = 32 * 32  # W_q of the tiny models: (hidden, hidden)
    local = [r["local_query_numel"] for r in ranks]
    if kind == "local":
        assert local == [full] * nproc
    elif local[0] is not None:  # None: FSDP1 flat parameters, no per-weight view outside summon
        assert min(local) < full, "the test model was not sharded"


@pytest.mark.parametrize("setup", list(SETUPS))
def test_injected_errors_skip_but_never_hang(runs, setup: str) -> None:
    out = runs(setup)
    _, kind, _ = SETUPS[setup]
    want = reference_rows(setup, out / "ref_step1.pt")
    # rank 0 failed to read layer 0: that layer is skipped, layer 1 is still right
    inject0 = scores(out, "inject0")
    assert {k[1] for k in inject0} == {1}
    assert_close(inject0, {k: v for k, v in want.items() if k[1] == 1})
    # rank 1 held a different layer list: a sharded snapshot is skipped on every rank
    inject1 = scores(out, "inject1")
    if kind == "local":
        assert_close(inject1, want)  # no collective involved; rank 0 reads its own weights
    else:
        assert inject1 == {}
    assert (out / "scores_final.json").exists()  # training and snapshots went on afterwards


# --------------------------------------------------------------------------- Trainer end to end
def _trajectory(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out: dict = {}
    for r in rows:
        key = (r["step"], r["group"], r["layer"], r["head"], r["metric"])
        assert key not in out, f"duplicate row {key}: more than one rank wrote"
        out[key] = r["value"]
    return out


@pytest.mark.parametrize("setup", ["ddp", "zero3"])
def test_trainer_callback_rank0_writes_single_process_scores(tmp_path: Path, setup: str) -> None:
    import trainer_worker  # imports transformers

    launch("trainer_worker.py", [setup, str(tmp_path), "inject"], 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["sinks"] == {"count": 2, "main": True}
    assert ranks[1]["sinks"] == {"count": 0, "main": False}
    assert ranks[0]["kind"] == ("zero3" if setup == "zero3" else "local")
    files = sorted(p.name for p in (tmp_path / "probe").iterdir())
    assert len([f for f in files if f.startswith("events.out.tfevents")]) == 1, files
    got = _trajectory(tmp_path / "probe" / "attn_probe.jsonl")
    # step 2: rank 0's scoring raised -> skipped; step 3 (ZeRO-3): rank 1's gather planning
    # raised -> skipped on every rank; under DDP rank 1 gathers nothing, so step 3 is kept
    expected_steps = {0, 1, 4} if setup == "zero3" else {0, 1, 3, 4}
    assert {k[0] for k in got} == expected_steps
    for step in expected_steps:
        model = trainer_worker.bert()
        model.load_state_dict(torch.load(tmp_path / f"ref_{step}.pt", weights_only=True))
        for row in score_model(model):
            for metric in ("symmetry", "directionality"):
                value = got[(step, row["group"], row["layer"], None, metric)]
                assert value == pytest.approx(row[metric], abs=TOL), (step, row["layer"], metric)


# --------------------------------------------------------------------------- single process
def _bert():
    return shard_worker.bert()


def test_single_process_yields_live_factors_without_collectives() -> None:
    model = _bert()
    layers = find_attention(model)
    got = list(iter_layer_factors(model, layers))
    assert [g[0].name for g in got] == [a.name for a in layers]
    for (_, q, k), a in zip(got, layers, strict=True):
        weight_q = model.get_submodule(a.name).query.weight
        weight_k = model.get_submodule(a.name).key.weight
        assert torch.equal(q.reshape(weight_q.shape), weight_q)
        assert torch.equal(k.reshape(weight_k.shape), weight_k)
        assert not q.requires_grad
    rows = gather_scores(model, layers, per_head=True)
    assert_close(keyed(rows), keyed(score_model(model, per_head=True)))


def test_world_helpers_without_process_group() -> None:
    info = world_info()
    assert (info.rank, info.world_size, info.distributed) == (0, 1, False)
    assert is_main_process()
    assert all_ranks_ok(True) is True and all_ranks_ok(False) is False
    assert sharding_kind(_bert()) == "local"


def test_canonical_name_strips_wrapper_segments() -> None:
    assert canonical_name("_fsdp_wrapped_module.encoder.layer.0._fsdp_wrapped_module.attention.self") == (
        "encoder.layer.0.attention.self"
    )
    assert canonical_name("model.layers.1._checkpoint_wrapped_module.self_attn") == "model.layers.1.self_attn"
    assert canonical_name("_orig_mod.h.0.attn") == "h.0.attn"
    assert canonical_name("my_fsdp_wrapped_module_x.attn") == "my_fsdp_wrapped_module_x.attn"


def test_gather_bytes_counts_query_and_key_weights() -> None:
    model = shard_worker.llama()  # grouped-query: 4 query heads, 2 key heads
    layers = find_attention(model)
    expected = sum(
        model.get_submodule(a.name).q_proj.weight.numel() + model.get_submodule(a.name).k_proj.weight.numel()
        for a in layers
    )
    assert gather_bytes(layers, element_size=2) == 2 * expected


def test_probe_walks_the_gathers_even_when_its_image_schedule_raises(tmp_path: Path) -> None:
    """A schedule error on rank 0 only must not leave the other rank alone in a collective."""
    launch("probe_worker.py", [str(tmp_path)], 2, timeout=120)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"first": True, "second_layers": [0, 1], "second_images": 2, "failures": 1,
                      "warned": True}
