"""Tiny model, data and TrainingArguments shared by the Trainer tests (test_callback, test_faults)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import BertConfig, BertForMaskedLM, TrainingArguments

VOCAB, SEQ = 50, 12


def tiny_bert(seed: int = 0, layers: int = 2) -> BertForMaskedLM:
    torch.manual_seed(seed)
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers,
                                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=SEQ))


class RandomTokens(torch.utils.data.Dataset):
    """64 fixed random sequences (seeded by index), labels = inputs."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def make_args(out: Any, steps: int, **kw: Any) -> TrainingArguments:
    """CPU, batch 8, lr 5e-3, no checkpoints, no reporting unless ``report_to=`` says so."""
    base = dict(output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, learning_rate=5e-3,
                report_to="none", logging_steps=2, save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
    base.update(kw)
    return TrainingArguments(**base)
