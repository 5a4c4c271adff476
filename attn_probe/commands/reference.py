"""``attn-probe reference [--family NAME] [--all]``: the paper's numbers a score is compared with.

Lists the paper's table of pretrained models (:mod:`attn_probe.baselines.pretrained`: one row per
distinct set of values, with the other names and the table's faults) and the paper's from-scratch
training runs that ``attn-probe plot --reference NAME`` draws (:mod:`attn_probe.baselines.paper`).

:func:`paper_context` and :func:`format_paper_context` are the block ``attn-probe score`` prints
after a checkpoint's scores: its medians beside the nearest rows of its kind and family and beside
the random range of its shape.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

#: rows of the paper's table shown beside a scored checkpoint
NEAREST = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", metavar="NAME", help="only this family of the pretrained table (bert, gpt2, llama, ...)")
    parser.add_argument("--all", action="store_true",
                        help="all 80 rows as released (default: one row per distinct set of values, other names listed)")


def _cell(median: float, below: float, above: float) -> str:
    return f"{median:+.2f} [{median - below:+.2f}, {median + above:+.2f}]"


def run(args: argparse.Namespace) -> int:
    from ..baselines.paper import paper_final, paper_runs
    from ..baselines.pretrained import KINDS, pretrained_family, pretrained_row, pretrained_rows
    from ..cli import CommandError

    if args.family is not None:
        try:
            rows = pretrained_family(args.family, distinct=not args.all)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
    else:
        # by kind, family and size (the CSV's order is the released tables' two-column layout)
        rows = sorted(pretrained_rows(distinct=not args.all),
                      key=lambda r: (KINDS.index(r.kind), r.family, r.layers is None, (r.layers or 0) * (r.width or 0) ** 2))
    print(f"The paper's pretrained models ({len(rows)} rows): median [q25, q75] across layers "
          "(Saponati et al., ICML 2025; docs/scores.md says how the released table's faults are treated)")
    print(f"  {'model':<40} {'kind':<8} {'family':<10} {'L x d':>11}  {'symmetry':<21} {'directionality':<21} notes")
    for r in rows:
        notes = [f"also {', '.join(r.aliases)}"] if r.aliases and not args.all else []
        notes += list(r.faults)
        if not args.all:  # the faults of the names folded into this row (llama3.2-8b's under llama3.2-1b)
            notes += [f"{alias}: {fault}" for alias in r.aliases for fault in pretrained_row(alias).faults
                      if not fault.startswith("identical values")]
        print(f"  {r.name:<40} {r.kind:<8} {r.family:<10} {r.shape_text():>11}  "
              f"{_cell(r.symmetry, r.symmetry_below, r.symmetry_above):<21} "
              f"{_cell(r.directionality, r.directionality_below, r.directionality_above):<21} {'; '.join(notes)}".rstrip())
    if args.family is not None:
        return 0
    print()
    print("The paper's training runs (`attn-probe plot --reference NAME`): median [q25, q75] at step 200,000")
    for run_ in paper_runs():
        cells = [paper_final(run_, m) for m in ("symmetry", "directionality")]
        print(f"  {run_.name:<30} symmetry {cells[0].median:+.2f} [{cells[0].q25:+.2f}, {cells[0].q75:+.2f}]  "
              f"directionality {cells[1].median:+.2f} [{cells[1].q25:+.2f}, {cells[1].q75:+.2f}]  ({run_.describe()})")
    return 0


def paper_context(path: str | Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A scored checkpoint beside the paper: per group its layer count, width, median symmetry and
    directionality and the random range of its shape; and the nearest rows of the paper's table
    (:func:`attn_probe.baselines.pretrained.nearest_pretrained`) of the checkpoint's kind and family
    (from ``config.json``'s ``model_type``, ``is_decoder`` and ``is_encoder_decoder``)."""
    from ..baselines.pretrained import kind_and_family, nearest_pretrained
    from ..baselines.random_range import LayerShape, random_range
    from ..scoring.checkpoint import open_checkpoint, summarize_rows

    config = json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    kind, family = kind_and_family(config.get("model_type"), is_decoder=bool(config.get("is_decoder")),
                                   is_encoder_decoder=bool(config.get("is_encoder_decoder")),
                                   architectures=config.get("architectures") or ())
    layers, _ = open_checkpoint(path)
    groups = []
    for entry in summarize_rows(rows):
        mine = [lay for lay in layers if lay.group == entry["group"]]
        if not mine:
            continue
        shape = LayerShape(int(mine[0].hidden_size), int(mine[0].head_dim), int(mine[0].num_heads),
                           int(mine[0].num_kv_heads))
        found = random_range(shape, per_head=False)
        groups.append({
            "group": entry["group"], "layers": entry["layers"], "width": shape.d_model, "shape": shape.describe(),
            "symmetry": entry.get("symmetry_median"), "directionality": entry.get("directionality_median"),
            "random": {"draws": found.draws, "note": found.note,
                       **{k: getattr(found, k) for k in ("symmetry", "symmetry_sd", "directionality",
                                                         "directionality_sd")}},
        })
    depth, width = (groups[0]["layers"], groups[0]["width"]) if groups else (None, None)
    nearest = [{"name": r.name, "kind": r.kind, "family": r.family, "layers": r.layers, "width": r.width,
                "symmetry": r.symmetry, "symmetry_q25": round(r.symmetry - r.symmetry_below, 4),
                "symmetry_q75": round(r.symmetry + r.symmetry_above, 4), "directionality": r.directionality,
                "directionality_q25": round(r.directionality - r.directionality_below, 4),
                "directionality_q75": round(r.directionality + r.directionality_above, 4),
                "aliases": list(r.aliases), "faults": list(r.faults)}
               for r in nearest_pretrained(kind, family, depth, width, n=NEAREST)]
    return {"kind": kind, "family": family, "groups": groups, "nearest": nearest}


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float as ``None`` (the trajectory file's rule), at any depth."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _num(value: Any, spec: str) -> str:
    return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_paper_context(context: dict[str, Any]) -> str:
    """The block ``attn-probe score`` prints: one line per group, its random range, the nearest rows."""
    family = context["family"] or "no family of the paper's table"
    if context["family"] and context["nearest"] and all(r["family"] != context["family"] for r in context["nearest"]):
        family += f" (no {context['kind']} of this family in the table: the nearest {context['kind']}s)"
    lines = [f"beside the paper's pretrained models ({context['kind'] or 'kind unknown'}, {family}; "
             "`attn-probe reference` lists them), median across layers:"]
    lines.append(f"  {'':<34} {'L x d':>11}  {'symmetry':>15}  {'directionality':>15}")
    for g in context["groups"]:
        r = g["random"]
        lines.append(f"  {'this model (' + g['group'] + ')':<34} {str(g['layers']) + ' x ' + str(g['width']):>11}  "
                     f"{_num(g['symmetry'], '+.2f'):>15}  {_num(g['directionality'], '+.2f'):>15}")
        lines.append(f"  {'random W_qk, mean ± sd':<34} {'':>11}  "
                     f"{_num(r['symmetry'], '+.3f') + ' ± ' + _num(r['symmetry_sd'], '.3f'):>15}  "
                     f"{_num(r['directionality'], '+.2f') + ' ± ' + _num(r['directionality_sd'], '.2f'):>15}"
                     + (f"  ({r['note']})" if r["note"] else ""))
    for row in context["nearest"]:
        shape = f"{row['layers']} x {row['width']}" if row["layers"] else "?"
        flag = "  (!) " + "; ".join(row["faults"]) if row["faults"] else ""
        lines.append(f"  {row['name']:<34} {shape:>11}  {row['symmetry']:>+15.2f}  {row['directionality']:>+15.2f}{flag}")
    if not context["nearest"]:
        lines.append("  (the paper's table has no model of this kind)")
    return "\n".join(lines)
