"""Shared test helpers: tiny models from config classes, random tokens, Trainer arguments,
``torchrun`` launches, and the explicit float64 reference of every metric.

One place for what several test files use (``from helpers import tiny_model, ...``); test
modules import each other only within one folder. Nothing downloads: every model is built by
:func:`tiny_model` from its config class with a seed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import BertForMaskedLM, LlamaForCausalLM, TrainingArguments

from attn_probe.core import is_magnitude
from attn_probe.definitions import directionality_score, symmetry_score

VOCAB, SEQ = 50, 12


# --------------------------------------------------------------------------- tiny models
#: per architecture: the config class, the default model class (names in ``transformers``) and the
#: tiny shape :func:`tiny_model` gives unless told otherwise; ``seq`` is the position count
TINY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bert": ("BertConfig", "BertForMaskedLM",
             dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=SEQ)),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=48, max_position_embeddings=16)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
}


def tiny_model(arch: str, seed: int | None = 0, *, cls: Any = None, impl: str | None = None,
               model_kwargs: dict[str, Any] | None = None, **config: Any) -> Any:
    """The one builder of the tests' tiny models: ``arch``'s config class with :data:`TINY`'s shape,
    updated by ``config`` (config-class keyword arguments), random weights from ``seed``.

    ``seed`` seeds torch's global generator first (``None``: leave it as it is); ``cls`` is the
    model class (a class, a ``transformers`` class name, or any callable taking the config; default:
    :data:`TINY`'s), called as ``cls(config, **model_kwargs)``; ``impl`` is set with
    ``set_attn_implementation``. Nothing downloads.
    """
    import transformers

    config_name, default_cls, shape = TINY[arch]
    if seed is not None:
        torch.manual_seed(seed)
    model_cls = getattr(transformers, cls or default_cls) if cls is None or isinstance(cls, str) else cls
    model = model_cls(getattr(transformers, config_name)(**{**shape, **config}), **(model_kwargs or {}))
    if impl is not None:
        model.set_attn_implementation(impl)
    return model


def tiny_bert(seed: int | None = 0, layers: int = 2, hidden: int = 32, heads: int = 4, *, vocab: int = VOCAB,
              seq: int = SEQ, intermediate: int | None = None, cls: type = BertForMaskedLM) -> Any:
    """A BERT of ``layers`` layers, ``hidden`` wide with ``heads`` heads (``cls``: the head class);
    :func:`tiny_model` with ``intermediate`` defaulting to ``2 * hidden``."""
    return tiny_model("bert", seed, cls=cls, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=intermediate or 2 * hidden,
                      max_position_embeddings=seq)


def tiny_llama(seed: int | None = 0, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2, *,
               vocab: int = 40, seq: int = 16, intermediate: int = 48, cls: type = LlamaForCausalLM) -> Any:
    """A Llama with grouped-query heads (``kv_heads`` key/value heads), like :func:`tiny_bert`."""
    return tiny_model("llama", seed, cls=cls, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                      max_position_embeddings=seq)


class RandomTokens(torch.utils.data.Dataset):
    """64 fixed random sequences (seeded by index), labels = inputs."""

    def __init__(self, vocab: int = VOCAB, seq: int = SEQ) -> None:
        self.vocab, self.seq = vocab, seq

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def make_args(out: Any, steps: int, **kw: Any) -> TrainingArguments:
    """CPU, batch 8, lr 5e-3, no checkpoints, no reporting unless ``report_to=`` says so."""
    base = dict(output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, learning_rate=5e-3,
                report_to="none", logging_steps=2, save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
    base.update(kw)
    return TrainingArguments(**base)


def train_probed(args: TrainingArguments, resume: Any = None, data: Any = None, **options: Any) -> list[str]:
    """Train a :func:`tiny_bert` under ``args`` with a probe attached (``every=1``, ``options``),
    resumed from ``resume`` if given; returns the messages of the attn_probe warnings it gave."""
    import warnings

    from transformers import Trainer

    import attn_probe

    trainer = Trainer(model=tiny_bert(), args=args, train_dataset=data or RandomTokens())
    attn_probe.attach(trainer, **{"every": 1, **options})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return [str(w.message) for w in caught if "attn_probe" in str(w.message)]


def lines_by_run(path: Any) -> list[tuple[str | None, bytes]]:
    """``[(run id, raw line)]`` of a trajectory file, each line under the run header before it
    (``None`` before the first header), read with ``json`` alone."""
    import json

    out, run = [], None
    with open(path, "rb") as f:
        for line in f:
            record = json.loads(line)
            if record.get("run_header"):
                run = record["run_header"]["run_id"]
            out.append((run, line))
    return out


# --------------------------------------------------------------------------- multi-process runs
REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "distributed_workers"
LAUNCH_TIMEOUT = 240  # seconds per torchrun launch (they take ~20-40 s on 2 idle cores)


def launch(script: str, args: list[str], nproc: int, timeout: float = LAUNCH_TIMEOUT) -> float:
    """Run ``torchrun`` on a worker of ``tests/distributed_workers`` in its own session; kill the
    whole group and fail on timeout or error. Returns the wall time in seconds."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WORKER_PG_TIMEOUT": "60",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(WORKERS / script), *args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(REPO), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: the group we started
        output, _ = proc.communicate()
        pytest.fail(f"{script} {args} did not finish within {timeout} s (hang?)\n{output[-4000:]}")
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        pytest.fail(f"{script} {args} exited with {proc.returncode}\n{output[-6000:]}")
    return elapsed


# --------------------------------------------------------------------------- references
def reference(m: torch.Tensor, qs: list[torch.Tensor], ks: list[torch.Tensor]) -> dict[str, float]:
    """Every metric of the explicit float64 matrix ``m``; ``qk_bound`` from the heads' factors."""
    sv = torch.linalg.svdvals(m)
    return {
        "symmetry": symmetry_score(m),
        "directionality": directionality_score(m),
        "spectral_norm": float(sv[0]),
        "frobenius_norm": float(torch.linalg.norm(m)),
        "stable_rank": float(sv.square().sum() / sv[0] ** 2),
        "qk_bound": max(float(torch.linalg.svdvals(q)[0] * torch.linalg.svdvals(k)[0])
                        for q, k in zip(qs, ks, strict=True)),
    }


def assert_matches(got: dict, want: dict, where: Any) -> None:
    """``got`` equals :func:`reference`'s ``want``: magnitudes to 1e-4 relative, scores to 1e-4 absolute."""
    for metric, value in want.items():
        if is_magnitude(metric):
            assert got[metric] == pytest.approx(value, rel=1e-4), (where, metric)
        else:
            assert got[metric] == pytest.approx(value, abs=1e-4), (where, metric)


def stop_process_group(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """Stop a server started with ``start_new_session=True`` and its children (TensorBoard's data
    server): SIGTERM to the group, SIGKILL if it has not gone within ``timeout`` seconds."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
