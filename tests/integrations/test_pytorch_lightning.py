"""The Lightning callback with the older ``pytorch_lightning`` package (issue 38 item 2).

A real ``pytorch_lightning.Trainer`` fits a tiny GPT-2 in a subprocess, once where ``lightning`` cannot be
imported (a ``sys.meta_path`` blocker) and once where both packages are importable; then, in the same
logger version, a resume from the step-4 checkpoint. Read back with ``json`` and TensorBoard's own
``EventAccumulator`` (not the probe's readers): the probe's ``attn_probe.jsonl`` and its scalars sit in
the ``TensorBoardLogger``'s own run beside Lightning's ``train_loss``, one run id continues across the
resume, no ``runs/<time>_<host>`` directory appears beside it, and the last step's values equal
``score_model`` of the trained model. Skipped where ``pytorch_lightning`` is not installed (it is in the
``test`` extra; locally: ``pip install --target DIR --no-deps pytorch_lightning`` and DIR on PYTHONPATH).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, lines_by_run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None,
                                reason="pytorch_lightning is not installed")

CHILD = r'''
import importlib.abc, json, sys

if sys.argv[2] == "blocked":
    class NoLightning(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "lightning" or name.startswith("lightning."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, NoLightning())

sys.path.insert(0, sys.argv[3])  # tests/, for helpers
import torch
import pytorch_lightning as pl
from pytorch_lightning.loggers import TensorBoardLogger

import attn_probe
from attn_probe.lightning import AttnProbeCallback
from helpers import SEQ, VOCAB, RandomTokens, tiny_model


class LitLM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_model("gpt2", 0, vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(max_steps, ckpt_path=None):
    callback = AttnProbeCallback(every=2)
    trainer = pl.Trainer(callbacks=[callback], max_steps=max_steps, logger=TensorBoardLogger(root, version=0),
                         default_root_dir=root, log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    module = LitLM()
    trainer.fit(module, torch.utils.data.DataLoader(RandomTokens(), batch_size=4), ckpt_path=ckpt_path)
    return trainer, module, callback


root = sys.argv[1]
first, _, cb1 = fit(4)
first.save_checkpoint(root + "/step4.ckpt")
second, module, cb2 = fit(6, ckpt_path=root + "/step4.ckpt")
print("RESULT " + json.dumps({
    "lightning_loaded": "lightning" in sys.modules,
    "callback_base": type(cb2).__mro__[1].__module__,
    "logger_dirs": [first.logger.log_dir, second.logger.log_dir],
    "run_dirs": [cb1.run_log_dir, cb2.run_log_dir],
    "run_ids": [cb1.run_id, cb2.run_id],
    "global_step": second.global_step,
    "scores": attn_probe.score_model(module.model),
}))
'''


def run_child(tmp_path: Path, mode: str) -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = tmp_path / "root"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(script), str(root), mode, str(REPO / "tests")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


@pytest.mark.timeout(900)  # a child fits twice; 4.5 min each measured on 2 busy cores
@pytest.mark.parametrize("mode", ["blocked", "both"], ids=["pytorch_lightning-only", "both-packages"])
def test_pytorch_lightning_trainer_writes_into_its_tensorboard_logger_run(tmp_path: Path, mode: str) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = run_child(tmp_path, mode)
    if mode == "blocked":
        assert not out["lightning_loaded"] and out["callback_base"].startswith("pytorch_lightning.")
    else:
        assert out["callback_base"].startswith("lightning.")
    logger_dir = out["logger_dirs"][0]
    assert out["logger_dirs"] == [logger_dir, logger_dir] and out["run_dirs"] == [logger_dir, logger_dir]
    assert out["global_step"] == 6
    # no probe run of its own beside the logger's (the failure mode: <root>/runs/<time>_<host>)
    stray = [p for p in tmp_path.rglob("runs") if p.is_dir()]
    assert stray == [], stray
    # the trajectory: one run, continued by id across the resume
    path = Path(logger_dir) / "attn_probe.jsonl"
    headers = [json.loads(raw)["run_header"] for _, raw in lines_by_run(path) if b'"run_header"' in raw]
    assert {h["run_id"] for h in headers} == {out["run_ids"][0]} and out["run_ids"][1] == out["run_ids"][0]
    assert all('"integration": "pytorch_lightning.Trainer"' in json.dumps(h) for h in headers), headers
    records = [json.loads(raw) for _, raw in lines_by_run(path)]
    sym = {}
    for r in records:  # the last record of a step wins (the resumed step 4 is written again)
        if r.get("metric") == "symmetry" and r.get("head") is None:
            sym[(r["step"], r["layer"])] = r["value"]
    assert sorted({s for s, _ in sym}) == [0, 2, 4, 6]
    for row in out["scores"]:  # live values of the last step = post-hoc scoring of the trained model
        assert sym[(6, row["layer"])] == pytest.approx(row["symmetry"], abs=1e-5, rel=1e-5)
    # TensorBoard: the probe's scalars in the logger's own event files, beside Lightning's loss
    ea = EventAccumulator(logger_dir, size_guidance={"scalars": 0})
    ea.Reload()
    tags = ea.Tags()["scalars"]
    assert "train_loss" in tags
    tag = next(t for t in tags if "symmetry" in t)
    assert sorted({e.step for e in ea.Scalars(tag)}) == [0, 2, 4, 6]
