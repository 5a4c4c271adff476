r"""Diagnose one demo configuration: does the model learn to use attention, and what does W_qk do?

A plain PyTorch loop over the demo's own pieces (``prepare_data``, ``build_model``,
``make_collator``, ``init_output_bias_to_unigram_``) with the Trainer's optimiser settings (AdamW,
no decay on biases and LayerNorm, linear warm-up and decay, gradient clipping at 1.0). Every
``--every`` steps it prints one JSON line:

* ``loss`` -- mean training loss since the last line (compare with ``unigram_entropy``);
* ``symmetry`` -- per-layer symmetry score of the layer-level W_qk, sorted; ``median``;
* ``directionality_median``;
* ``attention_entropy`` -- mean entropy (nats) of each layer's attention rows on 8 fixed blocks
  (``log(seq_len)`` for uniform attention; lower means the model attends selectively);
* ``hidden_cosine`` -- mean cosine similarity between the positions of the last layer's hidden
  states (near 1: every position carries the same vector -- rank collapse);
* ``qk_grad_norm`` -- mean norm of the W_q/W_k gradients over the interval;
* ``seconds`` -- wall time so far.

Used to choose the demo defaults (docs/reproducing-the-paper.md):

    python benchmarks/demo_dynamics_sweep.py --kind encoder --seed 1                  # demo defaults
    python benchmarks/demo_dynamics_sweep.py --kind decoder --arch bert --lr 1e-3 --warmup 30 --no-unigram-bias
    python benchmarks/demo_dynamics_sweep.py --kind decoder --decoder-objective paper-mlm   # the released code's decoder
    python benchmarks/demo_dynamics_sweep.py --arch bert --lr 1e-3 --warmup 100 --steps 6000 --every 250 \
        --hidden 128 --ffn 512                                   # post-LN, 4 x 128, 6000 steps
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attn_probe import demo, score_model  # noqa: E402
from attn_probe.tags import layer_stats  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    d = demo.DemoConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=demo.MODEL_KINDS, default="encoder")
    p.add_argument("--decoder-objective", choices=demo.DECODER_OBJECTIVES, default="causal",
                   help="causal (next token) or paper-mlm (the released code's MLM batches to the causal LM)")
    p.add_argument("--size", choices=list(demo.SIZES), default=d.size)
    p.add_argument("--arch", choices=list(demo.ARCHITECTURES), default=d.arch)
    p.add_argument("--layers", type=int, help="override the size's layer count")
    p.add_argument("--hidden", type=int, help="override the size's hidden width")
    p.add_argument("--heads", type=int, help="override the size's head count")
    p.add_argument("--ffn", type=int, help="override the size's feed-forward width")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--dropout", type=float, help="override every dropout probability")
    p.add_argument("--no-unigram-bias", dest="unigram_bias", action="store_false")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)

    size = a.size
    if any(v is not None for v in (a.layers, a.hidden, a.heads, a.ffn)):
        base = demo.SIZES[a.size]
        demo.SIZES["custom"] = tuple(
            v if v is not None else b for v, b in zip((a.layers, a.hidden, a.heads, a.ffn), base, strict=True)
        )
        size = "custom"
    cfg = demo.DemoConfig(size=size, vocab_size=a.vocab_size, seq_len=a.seq_len, seed=a.seed)
    tokenizer, blocks = demo.prepare_data(cfg)
    counts = torch.bincount(blocks.reshape(-1)).double()
    freq = counts[counts > 0] / counts.sum()
    print(
        json.dumps(
            {
                "config": vars(a),
                "dims": demo.SIZES[size],
                "blocks": list(blocks.shape),
                "unigram_entropy": round(float(-(freq * freq.log()).sum()), 3),
            }
        ),
        flush=True,
    )

    model = demo.build_model(
        a.kind, size, len(tokenizer), a.seq_len, pad_token_id=tokenizer.pad_token_id, seed=a.seed, arch=a.arch
    )
    if a.dropout is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = a.dropout
    if a.unigram_bias:
        demo.init_output_bias_to_unigram_(model, blocks)
    model.set_attn_implementation("eager")  # attention probabilities for the entropy
    collator = demo.make_collator(a.kind, tokenizer, a.decoder_objective)

    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
    )

    def lr_factor(step: int) -> float:  # transformers' linear schedule with warm-up
        if step < a.warmup:
            return step / max(1, a.warmup)
        return max(0.0, (a.steps - step) / max(1, a.steps - a.warmup))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    qk_params = [p for n, p in model.named_parameters() if n.endswith(("query.weight", "key.weight"))]
    generator = torch.Generator().manual_seed(a.seed)
    torch.manual_seed(a.seed)
    probe_batch = collator([{"input_ids": blocks[i]} for i in range(8)])

    losses: list[float] = []
    qk_grads: list[float] = []
    start = time.perf_counter()
    for step in range(a.steps + 1):
        if step % a.every == 0:
            rows = [r for r in score_model(model) if r["head"] is None]
            symmetry = sorted(r["symmetry"] for r in rows)
            model.eval()
            with torch.no_grad():
                out = model(**probe_batch, output_attentions=True, output_hidden_states=True)
            model.train()
            entropy = [float(-(att * att.clamp_min(1e-12).log()).sum(-1).mean()) for att in out.attentions]
            h = torch.nn.functional.normalize(out.hidden_states[-1], dim=-1)
            recent = losses[-a.every :] or [math.nan]
            grads = qk_grads[-a.every :] or [math.nan]
            print(
                json.dumps(
                    {
                        "step": step,
                        "loss": round(sum(recent) / len(recent), 4),
                        "symmetry": [round(s, 4) for s in symmetry],
                        "median": round(layer_stats(symmetry)["median"], 4),
                        "directionality_median": round(
                            layer_stats(r["directionality"] for r in rows)["median"], 4
                        ),
                        "attention_entropy": [round(e, 3) for e in entropy],
                        "hidden_cosine": round(float((h @ h.transpose(1, 2)).mean()), 3),
                        "qk_grad_norm": round(sum(grads) / len(grads), 6),
                        "seconds": round(time.perf_counter() - start, 1),
                    }
                ),
                flush=True,
            )
        if step == a.steps:
            break
        idx = torch.randint(len(blocks), (a.batch_size,), generator=generator).tolist()
        loss = model(**collator([{"input_ids": blocks[i]} for i in idx])).loss
        loss.backward()
        qk_grads.append(math.sqrt(sum(float(p.grad.norm()) ** 2 for p in qk_params)))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
