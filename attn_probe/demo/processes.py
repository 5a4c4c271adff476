"""Training several models: one after the other in this process, or at the same time, one spawned process each."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .host import ThreadPlan
from .presets import DemoConfig
from .results import ModelResult
from .training import train_model


def describe_failure(exitcode: int | None, result_path: Path) -> str:
    import json

    if result_path.is_file():
        try:
            return str(json.loads(result_path.read_text())["error"])
        except (ValueError, KeyError):
            pass
    if exitcode is not None and exitcode < 0:
        import signal

        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "an unknown signal"
        return f"its process was killed by signal {-exitcode} ({name})"
    return f"its process exited with code {exitcode} without a result"


def _model_process(kind: str, tokenizer: Any, blocks: torch.Tensor, cfg: DemoConfig, run_dir: str,
                   threads: int, position: int, result_path: str) -> None:
    """The body of one model's process: train it, write its :class:`ModelResult` (or its error) as JSON."""
    import json
    import sys
    import traceback

    torch.set_num_threads(threads)
    try:
        r = train_model(kind, tokenizer, blocks, cfg, run_dir, position=position)
    except BaseException as exc:  # noqa: BLE001  (reported by the parent; the traceback goes to stderr)
        traceback.print_exc(file=sys.stderr)
        Path(result_path).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        raise SystemExit(1) from None
    Path(result_path).write_text(json.dumps(r.to_json()))


def _model_line(r: ModelResult) -> str:
    return (
        f"  {r.kind}: {r.seconds:.0f} s"
        + (f" (resumed from {r.resumed_from.name})" if r.resumed_from else "")
        + f", final loss {r.final_loss:.3f}, "
        f"median symmetry {r.median('symmetry'):+.3f}, directionality {r.median('directionality'):+.3f}"
    )


def _what(kind: str, cfg: DemoConfig) -> str:
    if kind == "encoder":
        return "masked LM, bidirectional"
    if cfg.decoder_objective == "paper-mlm":
        return "causal LM trained on the masked-LM collator's batches, as the paper's released code"
    return "causal LM"


def _train_one_after_another(cfg, tokenizer, blocks, root, plan, log):
    import sys
    import traceback

    torch.set_num_threads(plan.threads)
    results: dict[str, ModelResult] = {}
    failures: dict[str, str] = {}
    for kind in cfg.models:
        log(f"training the {kind} ({_what(kind, cfg)}) ...")
        try:
            results[kind] = train_model(kind, tokenizer, blocks, cfg, root / kind)
        except Exception as exc:  # noqa: BLE001  (reported; the next model still trains)
            traceback.print_exc(file=sys.stderr)
            failures[kind] = f"{type(exc).__name__}: {exc}"
            log(f"  {kind}: failed ({failures[kind]})")
            continue
        log(_model_line(results[kind]))
    return results, failures


def _train_at_once(cfg, tokenizer, blocks, root, plan, log):
    """One process per model (spawned), all at once; a failed process loses only its own model."""
    import json
    import multiprocessing
    import multiprocessing.connection
    import shutil
    import tempfile

    ctx = multiprocessing.get_context("spawn")
    child_cfg = dataclasses.replace(cfg, extra_callbacks=(), preset_reason=None)
    tmp = Path(tempfile.mkdtemp(prefix="attn_probe_demo_"))
    procs: dict[str, Any] = {}
    results: dict[str, ModelResult] = {}
    failures: dict[str, str] = {}
    try:
        for position, kind in enumerate(cfg.models):
            log(f"training the {kind} ({_what(kind, cfg)}) in its own process ...")
            procs[kind] = ctx.Process(
                target=_model_process,
                args=(kind, tokenizer, blocks, child_cfg, str(root / kind), plan.threads, position,
                      str(tmp / f"{kind}.json")),
                name=f"attn-probe-demo-{kind}",
            )
            procs[kind].start()
        waiting = dict(procs)
        while waiting:
            ready = multiprocessing.connection.wait([p.sentinel for p in waiting.values()])
            for kind in [k for k, p in waiting.items() if p.sentinel in ready]:
                p = waiting.pop(kind)
                p.join()
                path = tmp / f"{kind}.json"
                if p.exitcode == 0 and path.is_file():
                    results[kind] = ModelResult.from_json(json.loads(path.read_text()))
                    log(_model_line(results[kind]))
                else:
                    failures[kind] = describe_failure(p.exitcode, path)
                    log(f"  {kind}: failed ({failures[kind]})")
    finally:
        for p in procs.values():  # interrupted: stop the other processes too
            if p.is_alive():
                p.terminate()
            p.join()
        shutil.rmtree(tmp, ignore_errors=True)
    return {k: results[k] for k in cfg.models if k in results}, failures


def train_models(
    cfg: DemoConfig,
    tokenizer: Any,
    blocks: torch.Tensor,
    root: Path,
    plan: ThreadPlan,
    *,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, ModelResult], dict[str, str]]:
    """Train ``cfg.models`` into ``root/<kind>`` as ``plan`` says: ``(results, failures)``.

    At the same time (``plan.concurrent``): one spawned process per model, each with
    ``plan.threads`` torch threads; else one after the other in this process. A model that
    fails is reported in ``failures`` (kind -> why) and the others still train.
    """
    train = _train_at_once if plan.concurrent else _train_one_after_another
    return train(cfg, tokenizer, blocks, root, plan, log)
