"""The OV pair (``pairs=("qk", "ov")``) on sharded models: DeepSpeed ZeRO-3, FSDP1 (flat and
``use_orig_params``) and FSDP2, for a BERT (output projection in the sibling ``output.dense``) and
a grouped-query Llama.

One real ``torchrun`` gloo launch with 2 processes on CPU (``distributed_workers/ov_shard_worker.py``),
bounded by a timeout that kills its process group, so a hang fails the test. Rank 0's values (the
live probe at step 0 and step 1, and ``gather_scores`` at step 1) are compared with float64
references formed here from the unsharded weights: the state dict before sharding, and the full
state dict the worker saved through the framework's own API after one training step. The
per-head matrices are sliced by hand (``W_ov^h = W_o[:, h] W_v[g(h)]``,
``W_qk^h = W_q[h]^T W_k[g(h)]``), not through attn_probe's extraction.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed_workers"))
from helpers import (  # noqa: E402  (explicit float64 metrics)
    assert_matches,
    launch,  # noqa: E402
    reference,
)

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, {"bert": 4, "llama": 2}, 16, 2
CASES = ["zero3-bert", "zero3-llama", "fsdp1-bert", "fsdp1-llama", "fsdp1_orig-bert", "fsdp2-bert", "fsdp2-llama"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ov_sharded")
    launch("ov_shard_worker.py", [",".join(CASES), str(out)], 2, timeout=180)
    return out


def projections(state: dict, model: str, layer: int) -> tuple[torch.Tensor, ...]:
    """``W_q, W_k, W_v, W_o`` (``nn.Linear`` ``(out, in)``) of one layer, float64, by state-dict name."""
    if model == "bert":
        p = f"encoder.layer.{layer}.attention."
        names = ("self.query", "self.key", "self.value", "output.dense")
    else:
        p = f"layers.{layer}.self_attn."
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
    return tuple(state[f"{p}{n}.weight"].double() for n in names)


def expected(state: dict, model: str, layer: int) -> list[dict[str, float]]:
    """``[layer, head 0, ...]``: the twelve metrics (W_qk's, then ``ov_``) of explicit float64 matrices."""
    w_q, w_k, w_v, w_o = projections(state, model, layer)
    dh, group = HEAD_DIM, HEADS // KV_HEADS[model]
    q = [w_q[h * dh:(h + 1) * dh] for h in range(HEADS)]  # (dh, d)
    k = [w_k[h // group * dh:(h // group + 1) * dh] for h in range(HEADS)]
    v = [w_v[h // group * dh:(h // group + 1) * dh] for h in range(HEADS)]
    o = [w_o[:, h * dh:(h + 1) * dh] for h in range(HEADS)]  # (d, dh): the columns reading head h
    qk = [q[h].T @ k[h] for h in range(HEADS)]
    ov = [o[h] @ v[h] for h in range(HEADS)]

    def both(heads: list[int]) -> dict[str, float]:
        out = reference(sum(qk[h] for h in heads), [q[h] for h in heads], [k[h] for h in heads])
        ov_metrics = reference(sum(ov[h] for h in heads), [o[h] for h in heads], [v[h] for h in heads])
        return {**out, **{("ov_gain_bound" if m == "qk_bound" else "ov_" + m): x for m, x in ov_metrics.items()}}

    return [both(list(range(HEADS))), *(both([h]) for h in range(HEADS))]


def live(run_dir: Path, step: int) -> dict[tuple[int, int | None], dict[str, float]]:
    values: dict[tuple[int, int | None], dict[str, float]] = {}
    with open(run_dir / "attn_probe.jsonl") as f:
        for line in f:
            if '"run_header"' in line:  # a run header, not a row
                continue
            r = json.loads(line)
            if r.get("step") == step and "metric" in r and not r["metric"].startswith("random_"):  # not the range
                values.setdefault((r["layer"], r["head"]), {})[r["metric"]] = r["value"]
    return values


def check(got: dict[tuple[int, int | None], dict[str, float]], state: dict, model: str, where: str) -> None:
    assert set(got) == {(layer, head) for layer in range(LAYERS) for head in (None, *range(HEADS))}, where
    for layer in range(LAYERS):
        for col, want in enumerate(expected(state, model, layer)):
            head = None if col == 0 else col - 1
            assert set(got[(layer, head)]) == set(want), (where, layer, head)
            assert_matches(got[(layer, head)], want, (where, layer, head))


@pytest.mark.parametrize("case", CASES)
def test_ov_and_qk_on_rank0_equal_float64_references_from_the_unsharded_weights(root: Path, case: str) -> None:
    out = root / case
    errors = sorted(out.glob("error_rank*.txt"))
    assert not errors, "\n".join(f"{e.name}:\n{e.read_text()}" for e in errors)
    model = case.split("-")[1]
    init = torch.load(out / "ref_init.pt", weights_only=True)
    step1 = torch.load(out / "ref_step1.pt", weights_only=True)
    # the training step moved the OV weights: the step-1 comparison is not the step-0 one again
    assert not torch.equal(projections(init, model, 0)[3], projections(step1, model, 0)[3])
    check(live(out / "run", 0), init, model, f"{case} live step 0")
    check(live(out / "run", 1), step1, model, f"{case} live step 1")
    rows = json.loads((out / "gathered_step1.json").read_text())
    gathered = {(r["layer"], r["head"]): {k: v for k, v in r.items() if k not in ("group", "layer", "name", "head")}
                for r in rows}
    assert len(gathered) == len(rows), case
    check(gathered, step1, model, f"{case} gather_scores step 1")


def test_a_bert_output_projection_it_cannot_read_is_refused_when_the_probe_is_built(tmp_path: Path) -> None:
    """The BERT layout reads W_o from a module (not a weight's shape); one it cannot read raises at attach."""
    peft = pytest.importorskip("peft")
    from transformers import BertConfig, BertModel

    import attn_probe
    from attn_probe.extraction import UnsupportedModelError

    cfg = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128)
    model = peft.get_peft_model(BertModel(cfg), peft.LoraConfig(r=2, target_modules=["dense"]))
    with pytest.raises(UnsupportedModelError, match=r"attention\.output\.dense.*PEFT.*a PEFT LoRA wrapper"):
        attn_probe.watch(model, log_dir=str(tmp_path / "run"), every=None, pairs=("qk", "ov"))
    assert not (tmp_path / "run").exists()  # refused before step 0: nothing written
    attn_probe.watch(model, log_dir=str(tmp_path / "qk"), every=None, pairs=("qk",)).close()  # W_qk alone is read
