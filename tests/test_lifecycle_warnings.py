"""Calls that cannot measure anything say so instead of doing nothing silently."""

from __future__ import annotations

import warnings

import pytest
import torch
from trainer_fixtures import RandomTokens, make_args, tiny_bert
from transformers import Trainer

import attn_probe


def test_snapshot_after_close_warns_once_and_writes_nothing(tmp_path):
    model = tiny_bert()
    probe = attn_probe.watch(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), log_dir=str(tmp_path),
                             every=None)
    probe.close()
    rows = (tmp_path / "attn_probe.jsonl").read_text()
    with pytest.warns(RuntimeWarning, match=r"snapshot\(\) on a closed probe measures nothing"):
        assert probe.snapshot(step=5) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probe.snapshot(step=6) is None  # once
    assert (tmp_path / "attn_probe.jsonl").read_text() == rows


def test_attach_after_train_warns(tmp_path):
    trainer = Trainer(model=tiny_bert(), args=make_args(tmp_path, 2), train_dataset=RandomTokens())
    trainer.train()
    with pytest.warns(RuntimeWarning, match=r"already trained \(2 optimizer steps\).*score_model"):
        attn_probe.attach(trainer, every=1)


def test_attach_before_train_is_silent(tmp_path):
    trainer = Trainer(model=tiny_bert(), args=make_args(tmp_path, 2), train_dataset=RandomTokens())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        attn_probe.attach(trainer, every=1)
