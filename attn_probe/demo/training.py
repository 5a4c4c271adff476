"""One model's training: the Hugging Face ``Trainer`` with the probe, progress display and resume."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .data import BlockDataset, build_model, init_output_bias_to_unigram_, make_collator
from .host import keep_freed_memory
from .presets import DemoConfig
from .results import ModelResult


def _logged_losses(log_history: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
    """``(step, loss)`` of the Trainer's training logs (restored from the checkpoint on resume)."""
    return [(int(e["step"]), float(e["loss"])) for e in log_history if "loss" in e and "step" in e]


def logging_steps(cfg: DemoConfig) -> int:
    """Steps between the Trainer's loss logs; each logged loss is the mean over those steps."""
    return max(1, min(cfg.every, 10))


def _duration(seconds: float) -> str:
    """``42 s``, ``8 min 05 s``, ``1 h 02 min``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def eta_seconds(done: int, total: int, elapsed: float) -> float | None:
    """Seconds left at the mean rate so far (``done`` of ``total`` steps in ``elapsed`` s); None before a step."""
    if done <= 0 or elapsed <= 0:
        return None
    return (total - done) * elapsed / done


def _progress_callback(kind: str, position: int, stream: Any = None) -> Any:
    """One progress display per model, in place of the Trainer's (which prints every log's dict).

    On a terminal: a ``tqdm`` bar named after the model at line ``position`` (bars of models
    trained at the same time stack; tqdm shows the time left). Otherwise one line at every tenth
    of training, with the loss logged at that step, the time so far and the time left at the
    mean rate so far. A line waits for the step's log (the Trainer logs after the step's end).
    """
    import sys

    from transformers import TrainerCallback

    stream = sys.stderr if stream is None else stream

    class DemoProgress(TrainerCallback):
        def __init__(self) -> None:
            self.bar: Any = None
            self.loss: float | None = None
            self.next_line = 0
            self.due: tuple[int, int] | None = None  # (step, max_steps) of a line waiting for its log
            self.start = time.perf_counter()
            self.first_step = 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()
            self.first_step = state.global_step
            if stream.isatty():
                from tqdm.auto import tqdm

                self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc=f"{kind:<7}",
                                position=position, leave=True, dynamic_ncols=True, file=stream)
            self.next_line = state.global_step + max(1, state.max_steps // 10)

        def _line(self) -> None:
            step, total = self.due
            self.due = None
            elapsed = time.perf_counter() - self.start
            left = eta_seconds(step - self.first_step, total - self.first_step, elapsed)
            loss = "" if self.loss is None else f", loss {self.loss:.3f}"
            eta = "" if left is None or step >= total else f", about {_duration(left)} left"
            print(f"{kind}: step {step:,}/{total:,}{loss}, {_duration(elapsed)}{eta}", file=stream, flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.loss = float(logs["loss"])
                if self.bar is not None:
                    self.bar.set_postfix(loss=f"{self.loss:.3f}", refresh=False)
                if self.due is not None:
                    self._line()

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)
            elif state.global_step >= self.next_line or state.global_step == state.max_steps:
                self.next_line = state.global_step + max(1, state.max_steps // 10)
                if self.due is not None:  # the previous line's step had no log
                    self._line()
                self.due = (state.global_step, state.max_steps)

        def on_train_end(self, args, state, control, **kwargs):
            if self.due is not None:
                self._line()
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return DemoProgress()


def train_model(
    kind: str,
    tokenizer: Any,
    blocks: torch.Tensor,
    cfg: DemoConfig,
    run_dir: str | os.PathLike[str],
    *,
    callbacks: Sequence[Any] = (),
    probe: bool = True,
    model_hook: Callable[[Any], None] | None = None,
    position: int = 0,
    save_final: bool = True,
    keep_freed: bool = True,
) -> ModelResult:
    """Train one model with the Hugging Face ``Trainer`` and the one-line ``AttnProbeCallback``.

    ``model_hook(model)`` runs after initialisation and before training (used for
    ``--symmetric-init``). With ``save_final``, the trained model and the tokenizer are saved to
    ``run_dir/model`` (``config.json``, ``model.safetensors``, tokenizer files), which
    ``attn-probe score`` and ``attn-probe heatmap`` read. ``position``: the line of this
    model's progress bar. ``keep_freed``: train inside :class:`~attn_probe.demo.host.keep_freed_memory`
    (glibc keeps freed memory for reuse; False: the C library's defaults, to compare against).
    """
    from transformers import PrinterCallback, ProgressCallback, Trainer, TrainingArguments

    import attn_probe

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(
        kind,
        cfg.size,
        len(tokenizer),
        cfg.seq_len,
        pad_token_id=tokenizer.pad_token_id,
        seed=cfg.seed,
        arch=cfg.arch,
    )
    if cfg.unigram_bias:
        init_output_bias_to_unigram_(model, blocks)
    if cfg.symmetric_init:
        attn_probe.symmetric_init_(model)
    if model_hook is not None:
        model_hook(model)
    all_callbacks = [*callbacks, *cfg.extra_callbacks]
    resume_from = last_checkpoint(run_dir / "trainer") if cfg.resume else None
    if resume_from is not None and checkpoint_step(resume_from) >= cfg.steps:
        # finished already: the Trainer would train one step past max_steps (transformers 5.23)
        return _finished_run(kind, model, tokenizer, run_dir, resume_from, save_final)
    if probe:
        from torch.utils.tensorboard import SummaryWriter
        from transformers.integrations import TensorBoardCallback

        from attn_probe.core import DEFAULT_METRICS

        # loss and learning rate go into the same TensorBoard run as the scores; on resume,
        # TensorBoard drops the earlier run's events from the checkpoint's step on
        purge = checkpoint_step(resume_from) if resume_from else None
        all_callbacks[:0] = [
            # the demo prints one TensorBoard command, for all its runs (run.py); with W_qk's
            # update rate since the previous snapshot (docs/scores.md, "The update rate")
            attn_probe.AttnProbeCallback(every=cfg.every, log_dir=str(run_dir), announce=False,
                                         metrics=[*DEFAULT_METRICS, "qk_update"]),
            TensorBoardCallback(tb_writer=SummaryWriter(log_dir=str(run_dir), purge_step=purge)),
        ]
    args = TrainingArguments(
        output_dir=str(run_dir / "trainer"),
        max_steps=cfg.steps,
        per_device_train_batch_size=cfg.batch_size,
        learning_rate=cfg.lr,
        warmup_steps=cfg.warmup,
        weight_decay=cfg.weight_decay,
        lr_scheduler_type="linear",
        logging_steps=logging_steps(cfg),
        save_strategy="steps" if cfg.save_every else "no",
        save_steps=cfg.save_every or 500,
        save_total_limit=2 if cfg.save_every else None,
        bf16=cfg.precision == "bf16",
        report_to="none",
        seed=cfg.seed,
        data_seed=cfg.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        disable_tqdm=True,  # the Trainer's own display prints every log; the demo's is a bar per model
        remove_unused_columns=False,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=BlockDataset(blocks),
        data_collator=make_collator(kind, tokenizer, cfg.decoder_objective),
        callbacks=all_callbacks,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if cfg.progress:
        trainer.add_callback(_progress_callback(kind, position))
    start = time.perf_counter()
    allocator = keep_freed_memory() if keep_freed else contextlib.nullcontext()
    with _no_hf_progress_bars(), allocator:  # "Writing model shards" at every checkpoint
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    seconds = time.perf_counter() - start
    rows = attn_probe.score_model(model)
    losses = _logged_losses(trainer.state.log_history)
    final = losses[-1][1] if losses else float("nan")
    model_dir = _save_final(trainer.save_model, tokenizer, run_dir) if save_final else None
    return ModelResult(kind, run_dir, final, losses, rows, seconds, resumed_from=resume_from, model_dir=model_dir)


def _save_final(save_model: Any, tokenizer: Any, run_dir: Path) -> Path:
    """The final model (``save_model(directory)``) and its tokenizer in ``run_dir/model``."""
    model_dir = run_dir / "model"
    with _no_hf_progress_bars():
        save_model(str(model_dir))
        tokenizer.save_pretrained(str(model_dir))
    return model_dir


def _finished_run(kind: str, model: Any, tokenizer: Any, run_dir: Path, checkpoint: Path,
                  save_final: bool) -> ModelResult:
    """The :class:`ModelResult` of a run whose last checkpoint is its last step: nothing to train."""
    import json

    import attn_probe

    with _no_hf_progress_bars():
        model = type(model).from_pretrained(str(checkpoint))
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    losses = _logged_losses(state.get("log_history", []))
    model_dir = _save_final(model.save_pretrained, tokenizer, run_dir) if save_final else None
    final = losses[-1][1] if losses else float("nan")
    return ModelResult(kind, run_dir, final, losses, attn_probe.score_model(model), 0.0, resumed_from=checkpoint,
                       model_dir=model_dir)


class _no_hf_progress_bars:
    """Within: no ``transformers`` progress bars (one per saved file); restored after."""

    def __enter__(self) -> None:
        from transformers.utils import logging as hf_logging

        self.enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()

    def __exit__(self, *exc: object) -> None:
        from transformers.utils import logging as hf_logging

        if self.enabled:
            hf_logging.enable_progress_bar()



def checkpoint_step(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[1])


def last_checkpoint(trainer_dir: Path) -> Path | None:
    """The Trainer's newest ``checkpoint-N`` folder under ``trainer_dir`` (None if there is none)."""
    if not trainer_dir.is_dir():
        return None
    found = [p for p in trainer_dir.iterdir() if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)]
    return max(found, key=checkpoint_step) if found else None
