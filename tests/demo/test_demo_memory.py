"""The demo's allocator setting (``demo.host.keep_freed_memory``, ``train_model(keep_freed=...)``) changes where memory comes from, not
what is trained: against the same training in a fresh process without it, the losses, the probe's
trajectory and the final weights are bit for bit equal."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from attn_probe import demo  # noqa: E402


def _train(kind: str, tokenizer, blocks, run_dir: str, keep_freed: bool, out: str) -> None:
    """One model in a fresh (spawned) process: losses, trajectory and weights saved for the parent."""
    torch.set_num_threads(1)
    # batch 8 x 64 tokens x vocab 200: activations above glibc's 128 KiB mmap threshold
    cfg = demo.DemoConfig(size="tiny", steps=8, batch_size=8, seq_len=64, every=1, vocab_size=200,
                          warmup=2, progress=False)
    result = demo.train_model(kind, tokenizer, blocks, cfg, run_dir, keep_freed=keep_freed)  # False: as before the setting
    Path(out).write_text(json.dumps({"losses": result.losses, "model": str(result.model_dir)}))


def _run(tmp_path: Path, kind: str, tokenizer, blocks, keep_freed: bool) -> tuple[dict, list[dict]]:
    run_dir = tmp_path / f"{kind}_{keep_freed}"
    out = tmp_path / f"{kind}_{keep_freed}.json"
    p = multiprocessing.get_context("spawn").Process(
        target=_train, args=(kind, tokenizer, blocks, str(run_dir), keep_freed, str(out)))
    p.start()
    p.join(timeout=600)
    if p.is_alive():
        p.terminate()
        p.join()
        pytest.fail("the training process did not finish in 600 s")
    assert p.exitcode == 0
    rows = [json.loads(line) for line in (run_dir / "attn_probe.jsonl").read_text().splitlines() if line.strip() and '"run_header"' not in line]
    return json.loads(out.read_text()), rows


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_keeping_freed_memory_trains_the_same_model(tmp_path, kind):
    texts = demo.load_texts(max_chars=60_000)
    tokenizer = demo.train_tokenizer(texts, vocab_size=200)
    blocks = demo.make_blocks(texts, tokenizer, 64)
    before, before_rows = _run(tmp_path, kind, tokenizer, blocks, keep_freed=False)
    after, after_rows = _run(tmp_path, kind, tokenizer, blocks, keep_freed=True)
    assert len(before["losses"]) == 8 and after["losses"] == before["losses"]
    assert {r["step"] for r in before_rows} == set(range(9))
    strip = [{k: v for k, v in r.items() if k not in ("time", "wall_time")} for r in before_rows]
    assert [{k: v for k, v in r.items() if k not in ("time", "wall_time")} for r in after_rows] == strip
    from safetensors.torch import load_file

    w0 = load_file(str(Path(before["model"]) / "model.safetensors"))
    w1 = load_file(str(Path(after["model"]) / "model.safetensors"))
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    assert not torch.equal(w0["lm_head.dense.weight"], _initial(kind, tokenizer)["lm_head.dense.weight"])


def _initial(kind: str, tokenizer) -> dict:
    model = demo.build_model(kind, "tiny", len(tokenizer), 64, pad_token_id=tokenizer.pad_token_id)
    return model.state_dict()
