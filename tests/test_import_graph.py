"""The package's import graph, read with ``ast``: layered, one way, no circle.

Data flows one way, ``model -> extraction -> pairs -> scoring core -> probe stages -> probe ->
integrations -> watch``, with the sinks beside the core. :data:`LAYERS` lists the layers,
lowest first; a module may import (at top level or inside a function) only modules of its own
layer or a lower one, and the graph has no circle at all. ``if TYPE_CHECKING:`` imports are
not counted (they never run). A module missing from :data:`LAYERS` fails the test: place a new
module in its layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attn_probe"

#: lowest first; an entry names a module or a package (all its modules, unless listed themselves)
LAYERS: list[tuple[str, ...]] = [
    # leaves: stdlib, torch, numpy only
    ("isolation", "schedules", "logdir", "live_view", "formats", "asynchronous", "hooks", "counting",
     "extraction.base", "resume_policy", "baselines.paper"),
    # architecture knowledge
    ("extraction", "intervention"),
    # the maths: the independent reference definitions (imports nothing of the package); the
    # scoring core, by job: algorithm choices, eigenvalue solvers, products, formulas, entry points
    ("reference", "core.algorithm"),
    ("core.spectra",),
    ("core.products", "core.update"),
    ("core.formulas",),
    ("core", "tags", "alerts"),
    # what a score is compared with: the paper's trajectories (a stdlib leaf, above) and the
    # random-matrix range of a layer's shape (scored by the core)
    ("baselines",),
    # measured attention quantities; the attention-function registry glue they read through
    # (integrations.attention_functions: transformers' get_interface wrapped, imports no module of
    # the package, so it sits here rather than with the rest of integrations/)
    ("integrations.attention_functions", "attention_stats"),
    # scored weight pairs
    ("pairs",),
    # post-hoc scoring, the heatmaps quantity; the sinks (plain data in, files and trackers out);
    # what scores are compared with (the paper's trajectories, the random-matrix range: core only)
    ("scoring", "images", "sinks", "tracker_record", "baselines"),
    # the walk over (sharded) layers, checkpoints, GGUF, the options; the snapshot assembly; the
    # qk_update pair (a pair with a memory, named by the options)
    ("distributed", "checkpoint", "gguf", "config", "stages.assembly", "stages.update"),
    # the live probe's other stages
    ("stages",),
    # the façade
    ("probe",),
    # the Trainer callback, Accelerate
    ("integrations",),
    # attn_probe.watch
    ("watching",),
    # what users run: the package's names, the CLI, reading runs back, the demo
    ("attn_probe", "__main__", "cli", "commands", "analysis", "demo", "op_count", "lightning"),
    # deprecated import paths (issue 30): nothing in the package may import them
    ("metrics", "scores"),
]

#: (importer, imported) edges allowed to run against the layers, each with the reason
EXEMPT: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts) or "attn_probe"] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports, skipping ``if TYPE_CHECKING:`` blocks."""
    package = name if path.name == "__init__.py" else (name.rpartition(".")[0] if "." in name else "")
    package = "" if package == "attn_probe" else package
    found: set[str] = set()

    def resolve(target: str) -> None:
        target = target.removeprefix("attn_probe.") if target != "attn_probe" else target
        if target in modules and target != name:
            found.add(target)

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            for alias in node.names:
                if alias.name == "attn_probe" or alias.name.startswith("attn_probe."):
                    resolve(alias.name)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, *([node.module] if node.module else [])]) or "attn_probe"
            elif node.module and (node.module == "attn_probe" or node.module.startswith("attn_probe.")):
                target = node.module
            else:
                return
            named = [f"{target}.{alias.name}" if target != "attn_probe" else alias.name for alias in node.names]
            if not all(n in modules for n in named):  # names of the package itself, not only its modules
                resolve(target)
            for n in named:  # ``from . import tags``: a module (its package is already importing)
                resolve(n)

    Visitor().visit(ast.parse(path.read_text(), str(path)))
    return found


def _layer(name: str) -> int:
    """The layer of ``name``: its own entry, else its nearest listed package."""
    candidates = [name] + [name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)]
    for candidate in candidates:
        for rank, layer in enumerate(LAYERS):
            if candidate in layer:
                return rank
    raise AssertionError(f"attn_probe.{name} has no layer: add it to LAYERS in {__file__}")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_reader_finds_the_imports_it_must(graph):
    # the parser itself, on edges known to exist (top level, relative, function-local)
    assert "stages.measurement" in graph["probe"]
    assert "scoring" in graph["distributed.walk"]
    assert "sinks.tensorboard" in graph["stages.outputs"]  # a function-local import
    assert "extraction.base" in graph["extraction.architectures"]


def test_every_module_has_a_layer(graph):
    for name in graph:
        _layer(name)


def test_no_import_runs_from_a_lower_layer_to_a_higher_one(graph):
    upward = [f"attn_probe.{a} (layer {_layer(a)}) imports attn_probe.{b} (layer {_layer(b)})"
              for a, targets in graph.items() for b in sorted(targets)
              if _layer(b) > _layer(a) and (a, b) not in EXEMPT]
    assert not upward, "\n".join(upward)


def test_no_import_circle(graph):
    edges = {a: {b for b in targets if (a, b) not in EXEMPT} for a, targets in graph.items()}
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_the_exemptions_are_real_edges(graph):
    # an exemption whose edge is gone must be deleted, so that the edge cannot come back unseen
    for a, b in EXEMPT:
        assert b in graph.get(a, set()), f"EXEMPT lists {a} -> {b}, which no longer exists: remove it"


def test_the_reference_and_the_core_share_nothing(graph):
    """The reference the core is tested against imports no module of the package, and the core
    none of the reference: a bug in a shared formula could not pass the comparison unseen."""
    assert graph["reference"] == set()
    core = {name for name in graph if name == "core" or name.startswith("core.")}
    assert core and all("reference" not in graph[name] and "scores" not in graph[name] for name in core)


def test_nothing_imports_the_deprecated_paths(graph):
    users = sorted(a for a, targets in graph.items() if targets & {"metrics", "scores"} and a not in {"metrics", "scores"})
    assert not users, users


def _private_imports(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """``from <package module> import _name`` in ``name``: another module's private name."""
    package = name if path.name == "__init__.py" else (name.rpartition(".")[0] if "." in name else "")
    package = "" if package == "attn_probe" else package
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".") if package else []
            base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            target = ".".join([*base, *([node.module] if node.module else [])]) or "attn_probe"
        elif node.module and node.module.startswith("attn_probe"):
            target = node.module.removeprefix("attn_probe.") if node.module != "attn_probe" else "attn_probe"
        else:
            continue
        found += [f"attn_probe.{name} imports {target}.{a.name}" for a in node.names
                  if a.name.startswith("_") and not a.name.startswith("__")]
    return found


#: private imports left for the issue 30 phase 2 (their modules were being changed elsewhere), with the reason
PRIVATE_EXEMPT: dict[str, str] = {
}


def test_no_module_imports_another_modules_private_names():
    modules = _modules()
    found = [line for name, path in sorted(modules.items()) for line in _private_imports(name, path, modules)]
    assert set(PRIVATE_EXEMPT) <= set(found), "an exempted private import is gone: remove it from PRIVATE_EXEMPT"
    found = [line for line in found if line not in PRIVATE_EXEMPT]
    assert not found, "\n".join(found)
