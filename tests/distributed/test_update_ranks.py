"""``qk_update`` is the same on 1 process and on 2 gloo ranks (issue 39, item 3).

Two real ``torchrun`` launches (``distributed_workers/update_worker.py``), each bounded by a timeout
that kills its process group: a tiny grouped-query Llama trained by SGD on one global batch, once
in a single process and once with every layer sharded by FSDP2 over 2 ranks (each holding half of
the batch). Rank 0 gathers and scores each layer; its ``qk_update`` rows must equal the single
process's, and both must equal an explicit float64 ``||dW_qk||_F / ||W_qk||_F`` of the single
process's q/k weights, the heads sliced here by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import launch

pytestmark = pytest.mark.timeout(600)

HEADS, KV, STEPS = 4, 2, 3


def rows(out: Path) -> dict[tuple[int, int, int | None], float]:
    with open(out / "run" / "attn_probe.jsonl") as fh:
        found = [json.loads(line) for line in fh if '"run_header"' not in line]
    return {(r["step"], r["layer"], r["head"]): r["value"] for r in found if r["metric"] == "qk_update"}


def matrices(wq: torch.Tensor, wk: torch.Tensor) -> list[torch.Tensor]:
    hd, group = wq.shape[0] // HEADS, HEADS // KV
    heads = [wq[h * hd:(h + 1) * hd].double().T @ wk[h // group * hd:(h // group + 1) * hd].double()
             for h in range(HEADS)]
    return [sum(heads), *heads]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    out = {}
    for nproc in (1, 2):
        out[nproc] = tmp_path_factory.mktemp(f"update_{nproc}")
        launch("update_worker.py", [str(out[nproc])], nproc, timeout=240)
    return out


def test_one_and_two_ranks_write_the_same_update_rate(runs: dict[int, Path]) -> None:
    single, sharded = rows(runs[1]), rows(runs[2])
    assert set(single) == set(sharded)
    assert {step for step, _, _ in single} == set(range(1, STEPS + 1))  # none at step 0
    assert len(single) == STEPS * 2 * (1 + HEADS)  # every layer and head
    for key, value in single.items():
        assert sharded[key] == pytest.approx(value, rel=1e-4), key
    saved = torch.load(runs[1] / "weights.pt")
    for (step, layer, head), value in single.items():
        now, before = matrices(*saved[step][layer]), matrices(*saved[step - 1][layer])
        col = 0 if head is None else 1 + head
        want = float(torch.linalg.norm(now[col] - before[col]) / torch.linalg.norm(before[col]))
        assert value == pytest.approx(want, rel=1e-4), (step, layer, head)
        assert want > 1e-4
