"""Benchmark: what ``import attn_probe`` costs every later import in the same process (issue 44).

Run from the repository root::

    python benchmarks/bench_import_overhead.py                # 300 modules, best of 5
    python benchmarks/bench_import_overhead.py --modules 200 --repeats 7

Each measurement is a fresh interpreter that imports the same standard-library modules one after
another and reports the CPU time (``time.process_time``) they took, and the CPU time of
``importlib.util.find_spec`` for as many names that do not exist (each asks every finder on
``sys.meta_path``; best of 5 loops within the interpreter). Before timing, both kinds look up one
absent name, so that the finder of every ``sys.path`` entry exists and has read its directory
(importing attn_probe does that as a side effect, which would otherwise favour it). Two kinds of
interpreter alternate, and which goes first alternates too, so that both see the same load:

* ``with``: ``import attn_probe`` first;
* ``without``: instead, the standard-library modules ``import attn_probe`` itself loads, so that
  both start from the same modules and the only difference is attn_probe (its modules and
  anything it installs: import hooks, path entries).

The modules are the first N public standard-library modules and submodules (sorted by name)
that neither kind has loaded before the timed loop and that import cleanly (one may load a later
one: that later import is then a lookup in ``sys.modules``, in both kinds); a few with side
effects (a browser, a GUI) are left out. The script prints the best (smallest) of the repeats
for each kind and the ratio with/without.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

#: importing these opens a browser or a window, prints, or is slow to import for unrelated reasons
SKIP = {
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "pydoc",
    "ensurepip",
    "venv",
    "lib2to3",
    "test",
    "msilib",
    "winreg",
    "winsound",
    "msvcrt",
    "_winapi",
    "nt",
    "__phello__",
}

CHILD = r"""
import json, sys, time, importlib, importlib.util
args = json.loads(sys.argv[1])
if args["with"]:
    import attn_probe
else:
    for name in args["preload"]:
        importlib.import_module(name)
importlib.util.find_spec("attn_probe_bench_prime")  # every sys.path entry's finder made and its listing read
start = time.process_time()
for name in args["modules"]:
    importlib.import_module(name)
imports = time.process_time() - start
absent = float("inf")
for _ in range(5):  # nothing is cached for an absent name: the loop repeats, its best is kept
    start = time.process_time()
    for i in range(len(args["modules"])):
        importlib.util.find_spec(f"attn_probe_bench_absent_{i}")
    absent = min(absent, time.process_time() - start)
print(json.dumps({"imports": imports, "absent": absent, "meta_path": [type(f).__name__ for f in sys.meta_path]}))
"""

PROBE = r"""
import json, sys, importlib
before = set(sys.modules)
import attn_probe
loaded = sorted(m for m in set(sys.modules) - before if not m.startswith("attn_probe"))
ok = []
already = set(sys.modules)
for name in json.loads(sys.argv[1]):
    if name in already:
        continue
    try:
        importlib.import_module(name)
    except Exception:
        continue
    ok.append(name)
print(json.dumps({"preload": loaded, "importable": ok}))
"""


def run(code: str, payload: object) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(payload)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def stdlib_names() -> list[str]:
    """Public standard-library modules, submodules of its packages included (``email.mime.text``),
    found on disk without importing them."""
    import pkgutil
    import sysconfig
    from pathlib import Path

    def public(name: str) -> bool:
        parts = name.split(".")
        return (
            parts[0] in sys.stdlib_module_names
            and parts[0] not in SKIP
            and not any(p.startswith("_") or p in ("test", "tests") for p in parts)
        )

    def walk(path: Path, prefix: str):
        for info in pkgutil.iter_modules([str(path)]):
            name = prefix + info.name
            if public(name):
                yield name
                if info.ispkg:
                    yield from walk(path / info.name, name + ".")

    return sorted(
        {*filter(public, sys.stdlib_module_names), *walk(Path(sysconfig.get_paths()["stdlib"]), "")}
    )


def choose_modules(count: int) -> tuple[list[str], list[str]]:
    """The standard-library modules ``import attn_probe`` loads, and ``count`` others that import cleanly."""
    candidates = stdlib_names()
    probe = run(PROBE, candidates)
    preload = [m for m in probe["preload"] if "." not in m]  # top-level names: they import their own parts
    modules = probe["importable"]
    if len(modules) < count:
        raise SystemExit(
            f"only {len(modules)} standard-library modules import cleanly here, asked for {count}"
        )
    return preload, modules[:count]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--modules", type=int, default=300, help="standard-library modules imported (default 300)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="fresh interpreters of each kind; best kept")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)

    preload, modules = choose_modules(args.modules)
    best: dict[str, dict[str, float]] = {}
    meta_path: dict[str, list[str]] = {}
    for repeat in range(args.repeats):
        for kind in ("with", "without") if repeat % 2 else ("without", "with"):
            got = run(CHILD, {"with": kind == "with", "preload": preload, "modules": modules})
            meta_path[kind] = got["meta_path"]
            for key in ("imports", "absent"):
                best.setdefault(kind, {})[key] = min(best.get(kind, {}).get(key, float("inf")), got[key])

    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{len(modules)} standard-library modules, best of {args.repeats} fresh interpreters each (CPU time)"
    )
    print(f"# sys.meta_path with attn_probe:    {meta_path['with']}")
    print(f"# sys.meta_path without attn_probe: {meta_path['without']}")
    print(f"{'measure':<32}{'without (ms)':>14}{'with (ms)':>12}{'ratio':>8}")
    rows = {}
    for key, label in (
        ("imports", f"import {len(modules)} modules"),
        ("absent", f"find_spec of {len(modules)} absent"),
    ):
        without, with_ = best["without"][key] * 1e3, best["with"][key] * 1e3
        rows[key] = {"without_ms": without, "with_ms": with_, "ratio": with_ / without}
        print(f"{label:<32}{without:>14.1f}{with_:>12.1f}{with_ / without:>8.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"modules": len(modules), "repeats": args.repeats, "results": rows, "meta_path": meta_path},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
