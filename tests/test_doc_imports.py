"""Every import path the docs and docstrings name works in a fresh process (issue 44, item 3).

The paths are read from README.md, docs/*.md and the docstrings of every module, class and
function in ``attn_probe/``: ``from attn_probe... import X`` statements (run as written),
``import attn_probe.x`` and dotted references ``attn_probe.x.y`` (the name ``y`` of the module
``attn_probe.x``, or a module itself). One interpreter tries them all, each from a package state
as fresh as a new process's: every ``attn_probe`` module is dropped from ``sys.modules`` (and
``sys.meta_path`` restored) before each path, so that an earlier path cannot hide a later one's
failure (``from attn_probe.scoring import score_model`` failed only when nothing had imported
``attn_probe.scoring.model`` before it). A path that fails there is tried again alone in a new
interpreter, and only a failure that a new interpreter confirms fails the test.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: ``from attn_probe.x import a, b as c`` or ``from attn_probe.x import (a, b)``
FROM_IMPORT = re.compile(
    r"\bfrom (attn_probe(?:\.\w+)*) import "
    r"(\([^)]*\)|\w+(?:\s+as\s+\w+)?(?:[ \t]*,[ \t]*\w+(?:\s+as\s+\w+)?)*)"
)
#: ``import attn_probe.x.y``
PLAIN_IMPORT = re.compile(r"(?<![\w.])import (attn_probe(?:\.\w+)+)")
#: a dotted reference ``attn_probe.x.y``, not inside a path (``/``), a file name (``.attn_probe.lock``)
#: or a string literal (``"attn_probe.detached_hook"``, an audit event's name)
DOTTED = re.compile(r"(?<![\w./\"'<-])attn_probe(?:\.\w+)+")
#: names that end a file's name, not a module's: ``attn_probe.jsonl``
FILE_SUFFIXES = {"jsonl", "json", "lock", "csv", "py", "md", "png", "txt"}
#: names written as placeholders in the docs (``from attn_probe.x import NAME``)
PLACEHOLDERS = {"NAME"}


def documents() -> dict[str, str]:
    """Text to read paths from: README.md, docs/*.md, and each docstring of the package."""
    texts = {"README.md": (ROOT / "README.md").read_text(encoding="utf-8")}
    for doc in sorted((ROOT / "docs").glob("*.md")):
        texts[str(doc.relative_to(ROOT))] = doc.read_text(encoding="utf-8")
    for path in sorted((ROOT / "attn_probe").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        nodes = [
            tree,
            *(
                n
                for n in ast.walk(tree)
                if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            ),
        ]
        docstrings = [doc for node in nodes if (doc := ast.get_docstring(node, clean=False))]
        if docstrings:
            texts[str(path.relative_to(ROOT))] = "\n\n".join(docstrings)
    return texts


def named_imports(text: str) -> list[tuple[str, str]]:
    """``("statement", code)`` for each import statement and ``("dotted", name)`` for each
    dotted reference in ``text``."""
    found: list[tuple[str, str]] = []
    for match in FROM_IMPORT.finditer(text):
        names = [n.strip() for n in match.group(2).strip("()").replace("\n", " ").split(",") if n.strip()]
        names = [n for n in names if n.split()[0] not in PLACEHOLDERS]
        if names:
            found.append(("statement", f"from {match.group(1)} import {', '.join(names)}"))
    for match in PLAIN_IMPORT.finditer(text):
        found.append(("statement", f"import {match.group(1)}"))
    text = PLAIN_IMPORT.sub("", FROM_IMPORT.sub("", text))  # their module paths are checked by the statements
    for match in DOTTED.finditer(text):
        name = match.group(0)
        if name.rsplit(".", 1)[1] not in FILE_SUFFIXES:
            found.append(("dotted", name))
    return found


RUNNER = r'''
import importlib, json, sys, traceback

def resolve(dotted):
    """The object a dotted reference names: the longest module prefix, then its attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if not (error.name and (name + ".").startswith(error.name + ".")):
                raise  # a module of the prefix exists and failed to import: not a shorter prefix

            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)

items = json.loads(sys.stdin.read())
meta_path = list(sys.meta_path)
results = []
for kind, code in items:
    for module in [m for m in sys.modules if m == "attn_probe" or m.startswith("attn_probe.")]:
        del sys.modules[module]
    sys.meta_path[:] = meta_path
    try:
        if kind == "statement":
            exec(code, {})
        else:
            resolve(code)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing and missing != "attn_probe" and not missing.startswith("attn_probe."):
            results.append([kind, code, "needs " + missing])  # an optional dependency not installed here
        else:
            results.append([kind, code, "".join(traceback.format_exception_only(error)).strip()[-500:]])
    except BaseException as error:  # RecursionError included: report it, go on with the next path
        results.append([kind, code, "".join(traceback.format_exception_only(error)).strip()[-500:]])
    else:
        results.append([kind, code, None])
print(json.dumps(results))
'''


def run(items: list[tuple[str, str]]) -> list[list]:
    out = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(items),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_reader_finds_the_paths_it_must():
    found = {item for text in documents().values() for item in named_imports(text)}
    # one of each kind, from a docstring, a doc and the README
    assert ("statement", "from attn_probe.scoring import score_model") in found
    assert ("statement", "from attn_probe.lightning import AttnProbeCallback") in found
    assert ("dotted", "attn_probe.core.op_count.count_ops") in found
    assert ("dotted", "attn_probe.watch") in found
    assert not [item for item in found if item[1].endswith((".jsonl", ".lock"))]
    multi = named_imports("from attn_probe.extraction import (\n    QKLayout,\n    register_adapter,\n)\n")
    assert multi == [("statement", "from attn_probe.extraction import QKLayout, register_adapter")]


def test_the_runner_reports_a_broken_path():
    # the runner itself: a missing name and a missing module are failures, a present one is not
    got = run(
        [
            ("statement", "from attn_probe.core import no_such_name"),
            ("dotted", "attn_probe.no_such_module.x"),
            ("dotted", "attn_probe.core.op_count.count_ops"),
        ]
    )
    assert got[0][2] and "no_such_name" in got[0][2]
    assert got[1][2] and got[2][2] is None


def test_every_import_path_the_docs_name_works_in_a_fresh_process():
    where: dict[tuple[str, str], list[str]] = {}
    for doc, text in documents().items():
        for item in named_imports(text):
            where.setdefault(item, []).append(doc)
    items = sorted(where)
    assert len(items) > 50, len(items)  # the reader still finds the docs' paths
    failed = [(kind, code) for kind, code, error in run(items) if error and not error.startswith("needs ")]
    # confirm each failure alone, in a new interpreter
    confirmed = []
    for kind, code in failed:
        ((_, _, error),) = run([(kind, code)])
        if error and not error.startswith("needs "):
            confirmed.append(f"{code}  (named in {', '.join(sorted(set(where[kind, code])))}): {error}")
    assert not confirmed, "\n".join(confirmed)
