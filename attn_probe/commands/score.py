"""``attn-probe score PATH... [--per-head] [--json] [--metric NAME] [--pair qk|ov] [--trajectory RUN_DIR] [--step N]``.

Scores saved checkpoints: one folder, several, or a Trainer output directory (every
``checkpoint-N`` in it). With ``--trajectory`` the scores are written as a run, at each
checkpoint's step, that ``attn-probe plot|summary|export`` read like a live run.
``--pair`` chooses the weight pairs as ``--metric`` chooses the metrics: ``qk`` (W_q W_k^T,
the default) and/or ``ov`` (W_o^h W_v^h, metrics prefixed ``ov_``).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths", metavar="PATH", nargs="+",
        help="checkpoint directory (config.json + model.safetensors, sharded, or pytorch_model.bin), "
             "several, a Trainer output dir (all its checkpoint-N folders), or a llama.cpp .gguf file",
    )
    parser.add_argument(
        "--trajectory", metavar="RUN_DIR",
        help="write the scores as a run (attn_probe.jsonl + TensorBoard events) at each checkpoint's step",
    )
    parser.add_argument("--step", type=int, metavar="N",
                        help="the step of a single checkpoint folder not named checkpoint-N")
    parser.add_argument("--per-head", action="store_true", help="also score every head's matrix (W_q^h W_k^hT, ...)")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON array")
    parser.add_argument("--paper", action="store_true",
                        help="with --json and one checkpoint folder: print {\"rows\": [...], \"paper\": {...}}, the "
                             "comparison with the paper's pretrained models the text output ends with")
    parser.add_argument(
        "--metric", action="append", dest="metrics", metavar="NAME",
        help="metric to compute, named without a pair prefix; repeatable; default all six "
             "(see docs/scores.md for the list)",
    )
    parser.add_argument(
        "--pair", action="append", dest="pairs", choices=("qk", "ov"), metavar="{qk,ov}",
        help="weight pair to score; repeatable: qk is W_q W_k^T (the default), ov the value-output "
             "circuit W_o^h W_v^h (metrics prefixed ov_); --pair qk --pair ov scores both",
    )
    parser.add_argument(
        "--num-std", type=_finite_float, default=2.0, metavar="X",
        help="directionality threshold: mean + X * std of the row/column norms (default 2)",
    )


def _fmt(value: Any, width: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'nan':>{width}}"
    return f"{value:>{width}.3f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per layer (and head): group, layer, head, one column per metric, module name."""
    from ..scoring.model import row_metrics

    metrics = row_metrics(rows)
    widths = [max(9, len(m)) for m in metrics]
    header = " ".join(f"{m:>{w}}" for m, w in zip(metrics, widths, strict=True))
    lines = [f"{'group':<8} {'layer':>5} {'head':>4} {header}  name"]
    for r in rows:
        head = "-" if r["head"] is None else str(r["head"])
        cells = " ".join(_fmt(r.get(m), w) for m, w in zip(metrics, widths, strict=True))
        lines.append(f"{r['group']:<8} {r['layer']:>5} {head:>4} {cells}  {r['name']}")
    return "\n".join(lines)


def format_summary(summary: list[dict[str, Any]]) -> str:
    """``group (n layers): metric med [q25, q75]  ...`` per group, for every metric."""

    def cell(entry: dict[str, Any], score: str) -> str:
        return (f"{entry[f'{score}_median']:.2f} "
                f"[{entry[f'{score}_q25']:.2f}, {entry[f'{score}_q75']:.2f}]")

    lines = ["median [q25, q75] across layers:"]
    for e in summary:
        n = e["layers"]
        metrics = [k[: -len("_median")] for k in e if k.endswith("_median")]
        cells = "  ".join(f"{m} {cell(e, m)}" for m in metrics)
        lines.append(f"  {e['group']:<8} ({n} layer{'s' if n != 1 else ''}): {cells}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ..formats.trajectory import encode_value
    from ..scoring.checkpoint import summarize_rows

    gguf = [p for p in args.paths if str(p).lower().endswith(".gguf")]
    if gguf:
        rows, many, checkpoints = _score_gguf(args, gguf), False, []
    else:
        rows, many, checkpoints = _score_checkpoints(args)
    # the text output ends with it, when the paper's two W_qk scores were computed
    wants_context = (args.paper or not args.json) and any("symmetry" in r or "directionality" in r for r in rows)
    context = _paper_context(checkpoints[0][1], rows) if wants_context and not gguf and not many else None
    if args.json:
        # NaN as null, the trajectory file's rule
        out: Any = [{k: encode_value(v) if isinstance(v, float) else v for k, v in r.items()} for r in rows]
        if args.paper:
            from .reference import json_safe

            out = {"rows": out, "paper": json_safe(context)}
        print(json.dumps(out, allow_nan=False))
        return 0
    if many:
        for step, _path in checkpoints:
            part = [{k: v for k, v in r.items() if k != "step"} for r in rows if r["step"] == step]
            print(f"step {step}:")
            print(format_summary(summarize_rows(part)))
        return 0
    print(format_table(rows))
    print()
    print(format_summary(summarize_rows(rows)))
    if context is not None:
        from .reference import format_paper_context

        print()
        print(format_paper_context(context))
    return 0


def _paper_context(path: Any, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """:func:`.reference.paper_context`, or ``None`` with a one-line note on stderr when it cannot be made."""
    import sys

    from ..scoring.checkpoint import CheckpointError
    from .reference import paper_context

    try:
        return paper_context(path, rows)
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"attn-probe score: no comparison with the paper: {exc}", file=sys.stderr)
        return None


def _score_gguf(args: argparse.Namespace, gguf: list[str]) -> list[dict[str, Any]]:
    """``attn-probe score model.gguf``: llama.cpp's format, architecture from its metadata."""
    import sys

    from ..analysis import error_message
    from ..cli import CommandError

    if args.pairs is not None and args.pairs != ["qk"]:
        raise CommandError(f"a GGUF file ({gguf[0]}) is scored for W_qk only: where W_v/W_o live and how W_o "
                           "splits per head is not read from GGUF files (drop --pair ov)")
    if len(args.paths) != 1 or args.trajectory is not None or args.step is not None:
        raise CommandError(f"a GGUF file ({gguf[0]}) is scored on its own, without --trajectory or --step")
    try:
        from ..scoring.gguf import GGUFError, score_gguf
    except ImportError as exc:  # pragma: no cover - the module imports gguf lazily
        raise CommandError(str(exc)) from None
    try:
        return score_gguf(args.paths[0], per_head=args.per_head, num_std=args.num_std, metrics=args.metrics,
                          progress=sys.stderr.isatty())
    except (GGUFError, ImportError, ValueError) as exc:
        raise CommandError(error_message(exc)) from None


def _score_checkpoints(args: argparse.Namespace) -> tuple[list[dict[str, Any]], bool, list[Any]]:
    import sys

    from ..analysis import error_message
    from ..cli import CommandError
    from ..scoring.checkpoint import (
        CheckpointError,
        check_layer_counts,
        find_checkpoints,
        score_checkpoint,
        write_checkpoint_trajectory,
    )

    try:
        checkpoints = find_checkpoints(args.paths, step=args.step)
        for _step, path in checkpoints:
            check_layer_counts(path)
        many = len(checkpoints) > 1 or args.trajectory is not None
        if args.trajectory is not None:
            rows = write_checkpoint_trajectory(checkpoints, args.trajectory, per_head=args.per_head,
                                               num_std=args.num_std, metrics=args.metrics, pairs=args.pairs,
                                               progress=sys.stderr.isatty())
            print(f"wrote {len(checkpoints)} step(s) to {args.trajectory}", file=sys.stderr)
        elif many:
            rows = []
            for step, path in checkpoints:
                rows += [{**r, "step": step} for r in score_checkpoint(
                    path, per_head=args.per_head, num_std=args.num_std, metrics=args.metrics, pairs=args.pairs)]
        else:
            rows = score_checkpoint(checkpoints[0][1], per_head=args.per_head, num_std=args.num_std,
                                    metrics=args.metrics, pairs=args.pairs)
    except CheckpointError as exc:
        raise CommandError(error_message(exc)) from None
    return rows, many, checkpoints
