"""Import paths that moved, kept working until {REMOVED_IN} (issue 36: the top level regrouped).

Version 0.4 grouped the top-level modules by what they do (``live/``, ``scoring/``,
``activations/``, ``formats/``, ``sinks/``). A user's ``import attn_probe.probe`` or
``from attn_probe.config import ProbeConfig`` still works: :class:`MovedModuleFinder`, first on
``sys.meta_path`` while ``attn_probe`` is imported, answers each old name with the module at its
new place (the same module object, so classes, ``isinstance`` and pickles of old paths agree) and
warns once per old name with a ``DeprecationWarning`` that names the new path and the release
that removes the old one. Nothing in the package imports an old path (tests/test_import_graph.py).

``attn_probe.metrics`` and ``attn_probe.scores`` (deprecated in 0.3) live here as modules of their
own: they warn per name they are asked for, so this finder does not warn for them again.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

#: the release that removes the old paths (CHANGELOG.md, "Deprecated")
REMOVED_IN = "0.5.0"

#: old module (under ``attn_probe.``) -> its place since 0.4; a package maps its submodules too.
#: ``attn_probe.scoring`` became a package and serves the old module's names itself.
MOVED: dict[str, str] = {
    "probe": "live.probe",
    "config": "live.config",
    "schedules": "live.schedules",
    "counting": "live.counting",
    "asynchronous": "live.asynchronous",
    "resume_policy": "live.resume_policy",
    "images": "live.images",
    "alerts": "live.alerts",
    "stages.assembly": "sinks.assembly",
    "stages": "live.stages",
    "pairs": "scoring.pairs",
    "checkpoint": "scoring.checkpoint",
    "gguf": "scoring.gguf",
    "op_count": "core.op_count",
    "reference": "definitions",
    "attention_stats": "activations.statistics",
    "integrations.attention_functions": "activations.registry",
    "tags": "formats.tags",
    "logdir": "formats.logdir",
    "tracker_record": "sinks.tracker_record",
    "live_view": "sinks.live_view",
}

#: deprecated modules that live in this package and warn themselves
_SELF_WARNING = {"metrics": "_compat.metrics", "scores": "_compat.scores"}

_warned: set[str] = set()


def new_name(fullname: str) -> str | None:
    """The module that answers the old name ``fullname`` (``attn_probe.x...``), else None."""
    if not fullname.startswith("attn_probe."):
        return None
    rest = fullname[len("attn_probe."):]
    if rest in _SELF_WARNING:
        return "attn_probe." + _SELF_WARNING[rest]
    for place in MOVED.values():  # a module at its new place is found by the path finder
        if rest == place or rest.startswith(place + "."):
            return None
    for old in sorted(MOVED, key=len, reverse=True):
        if rest == old or rest.startswith(old + "."):
            return "attn_probe." + MOVED[old] + rest[len(old):]
    return None


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new place (imported once, under its new name)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec) -> ModuleType:
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import system set the alias's spec: give the real one back
        rest = self.old[len("attn_probe."):]
        if rest not in _SELF_WARNING and self.old not in _warned:
            _warned.add(self.old)
            warnings.warn(f"{self.old} moved to {self.new}; the old path is removed in {REMOVED_IN}",
                          DeprecationWarning, stacklevel=2)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds only the old names of moved modules; every other name goes to the next finder."""

    def find_spec(self, fullname: str, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(fullname, new))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): before the path finder, which would
    otherwise load a moved package's submodule a second time under its old name."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
