"""The rows of docs/works-with.md that no other test runs: each stack used as its users do, with the
real package, a tiny model from its config class and a handful of CPU steps.

Every run must log a snapshot at each expected step, and the last one must equal
``attn_probe.score_model`` on the final weights (an independent, post-hoc scoring of the model the
run ended with); the torchtitan-style model is checked against an explicit float64 ``W_q^T W_k``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from torch import nn

import attn_probe

TOL = 1e-5


# --------------------------------------------------------------------------- helpers
def logged(log_dir: Any) -> list[dict]:
    """The snapshot rows of a run's ``attn_probe.jsonl`` (run headers left out)."""
    with open(os.path.join(str(log_dir), "attn_probe.jsonl")) as f:
        return [r for r in map(json.loads, f) if "run_header" not in r]


def steps(rows: list[dict]) -> list[int]:
    return sorted({r["step"] for r in rows})


def assert_last_equals_score_model(rows: list[dict], model: nn.Module, step: int) -> set[str]:
    """The layer rows logged at ``step`` equal ``score_model(model)`` for symmetry and
    directionality; returns the groups seen."""
    want = {(r["group"], r["layer"], m): r[m] for r in attn_probe.score_model(model)
            for m in ("symmetry", "directionality")}
    got = {(r["group"], r["layer"], r["metric"]): r["value"] for r in rows
           if r["step"] == step and r.get("head") is None and r["metric"] in ("symmetry", "directionality")}
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=TOL), key
    return {k[0] for k in want}


def word_tokenizer(n_words: int = 20) -> tuple[list[str], Any]:
    """A word-level fast tokenizer built here (nothing from the hub): [PAD]=0, [UNK]=1, [EOS]=2."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(n_words)]
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return words, PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                          eos_token="[EOS]")


def sentences(words: list[str], n: int, length: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(words[int(i)] for i in torch.randint(0, len(words), (length,), generator=g)) for _ in range(n)]


def tiny_llama(vocab: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=48, vocab_size=vocab,
                                        pad_token_id=0, eos_token_id=2, bos_token_id=None))


COMMON = dict(use_cpu=True, report_to="none", save_strategy="no", logging_steps=100, disable_tqdm=True,
              learning_rate=5e-2, seed=0)


# --------------------------------------------------------------------------- TRL
def test_trl_sft_trainer(tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    words, tokenizer = word_tokenizer()
    data = Dataset.from_list([{"text": s} for s in sentences(words, 16, 6)])
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=5, per_device_train_batch_size=4, max_length=16,
                     **COMMON)  # TRL's own defaults otherwise (bf16 autocast where available)
    trainer = SFTTrainer(model=tiny_llama(len(words) + 3), args=args, train_dataset=data,
                         processing_class=tokenizer)
    attn_probe.attach(trainer, every=2, log_dir=str(tmp_path / "probe"))
    trainer.train()
    rows = logged(tmp_path / "probe")
    assert steps(rows) == [0, 2, 4, 5]
    assert assert_last_equals_score_model(rows, trainer.model, 5) == {"self"}


def test_trl_grpo_trainer(tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    words, tokenizer = word_tokenizer()
    tokenizer.padding_side = "left"
    data = Dataset.from_list([{"prompt": s} for s in sentences(words, 8, 3)])

    def reward(completions: list[str], **kw: Any) -> list[float]:
        return [float(c.count("w1")) - 0.1 * len(c.split()) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                      num_generations=2, max_completion_length=4, **COMMON)
    trainer = GRPOTrainer(model=tiny_llama(len(words) + 3), reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer)
    attn_probe.attach(trainer, every=1, log_dir=str(tmp_path / "probe"))
    trainer.train()
    rows = logged(tmp_path / "probe")
    assert steps(rows) == [0, 1, 2]
    assert assert_last_equals_score_model(rows, trainer.model, 2) == {"self"}


# --------------------------------------------------------------------------- Seq2SeqTrainer
def test_seq2seq_trainer_with_generation_during_training(tmp_path):
    from transformers import (
        DataCollatorForSeq2Seq,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        T5Config,
        T5ForConditionalGeneration,
    )

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                                pad_token_id=0, eos_token_id=1))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(2, 40, (8,), generator=g).tolist(),
             "labels": torch.randint(2, 40, (4,), generator=g).tolist()} for _ in range(16)]

    class Pad:  # DataCollatorForSeq2Seq needs a tokenizer's pad(); this one pads with 0
        pad_token_id, padding_side, model_input_names = 0, "right", ["input_ids", "attention_mask"]

        def pad(self, features, **kw):
            n = max(len(f["input_ids"]) for f in features)
            ids = [f["input_ids"] + [0] * (n - len(f["input_ids"])) for f in features]
            mask = [[1] * len(f["input_ids"]) + [0] * (n - len(f["input_ids"])) for f in features]
            return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}

    evals = []

    def metrics(pred: Any) -> dict[str, float]:
        evals.append(pred.predictions.shape)
        return {"n": float(len(pred.predictions))}

    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=4,
                                    per_device_eval_batch_size=4, eval_strategy="steps", eval_steps=3,
                                    predict_with_generate=True, generation_max_length=5, **COMMON)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4],
                             data_collator=DataCollatorForSeq2Seq(Pad(), model=model), compute_metrics=metrics)
    attn_probe.attach(trainer, every=2, log_dir=str(tmp_path / "probe"))
    trainer.train()
    assert len(evals) == 2  # generation ran inside training, at steps 3 and 6
    rows = logged(tmp_path / "probe")
    assert steps(rows) == [0, 2, 4, 6]
    assert assert_last_equals_score_model(rows, trainer.model, 6) == {"encoder", "decoder", "cross"}


# --------------------------------------------------------------------------- sentence-transformers
def test_sentence_transformer_trainer(tmp_path):
    pytest.importorskip("sentence_transformers")
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
        losses,
    )
    from sentence_transformers.models import Pooling, Transformer  # the paths of 3.x (6.x still has them)
    from transformers import BertConfig, BertModel

    words, tokenizer = word_tokenizer()
    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=len(words) + 3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, max_position_embeddings=16, pad_token_id=0))
    local = tmp_path / "tiny-bert"  # a local model directory: models.Transformer loads by path, not from the hub
    bert.save_pretrained(local)
    tokenizer.save_pretrained(local)
    model = SentenceTransformer(modules=[Transformer(str(local), max_seq_length=16), Pooling(32)], device="cpu")
    a, b = sentences(words, 16, 5, seed=1), sentences(words, 16, 5, seed=2)
    data = Dataset.from_dict({"anchor": a, "positive": b})
    args = SentenceTransformerTrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4,
                                                per_device_train_batch_size=4, **COMMON)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                         loss=losses.MultipleNegativesRankingLoss(model))
    attn_probe.attach(trainer, every=2, log_dir=str(tmp_path / "probe"))
    trainer.train()
    rows = logged(tmp_path / "probe")
    assert steps(rows) == [0, 2, 4]
    assert assert_last_equals_score_model(rows, model, 4) == {"self"}


# --------------------------------------------------------------------------- torchtitan-style
class TitanAttention(nn.Module):
    """torchtitan's Llama attention naming: ``wq``/``wk``/``wv``/``wo``, ``n_heads`` (no bias)."""

    def __init__(self, dim: int = 32, n_heads: int = 4) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, d))


class TitanModel(nn.Module):
    def __init__(self, vocab: int = 30, dim: int = 32, n_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TitanAttention(dim) for _ in range(n_layers))
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.output(x)


def test_torchtitan_style_wq_wk_in_a_plain_loop(tmp_path):
    torch.manual_seed(0)
    model = TitanModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(0, 30, (4, 8), generator=torch.Generator().manual_seed(0))
    with attn_probe.watch(model, optimizer=opt, log_dir=str(tmp_path / "probe"), every=2):
        for _ in range(4):
            loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    rows = logged(tmp_path / "probe")
    assert steps(rows) == [0, 2, 4]
    for i, layer in enumerate(model.layers):  # explicit float64 M = W_q^T W_k of the final weights
        m = layer.wq.weight.detach().double().T @ layer.wk.weight.detach().double()
        want = float((m * m.T).sum() / (m * m).sum())
        (got,) = [r["value"] for r in rows if r["step"] == 4 and r["layer"] == i and r.get("head") is None
                  and r["metric"] == "symmetry"]
        assert got == pytest.approx(want, abs=TOL)
