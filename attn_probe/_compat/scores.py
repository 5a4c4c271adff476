"""Deprecated: the reference definitions are :mod:`attn_probe.definitions` (issue 30).

``from attn_probe.scores import NAME`` still works, with one ``DeprecationWarning`` per
process: the definitions come from :mod:`attn_probe.definitions`, ``gram_is_cheaper`` from the
core (:mod:`attn_probe.core.algorithm`, where the path choice lives now). This module is removed
in 0.5.0.
"""

from __future__ import annotations

from typing import Any

from .. import definitions as reference
from ..core import algorithm
from ..isolation import safe_warn

_NAMES = (*reference.__all__, "gram_is_cheaper")
__all__ = list(_NAMES)

#: the release that removes this module (CHANGELOG.md, "Deprecated")
REMOVED_IN = "0.5.0"

_warned = False


def __getattr__(name: str) -> Any:
    global _warned
    if name not in _NAMES:
        raise AttributeError(f"module 'attn_probe.scores' has no attribute {name!r}")
    if not _warned:
        _warned = True
        new_path = "attn_probe.core" if name == "gram_is_cheaper" else "attn_probe.definitions"
        safe_warn(f"attn_probe.scores is deprecated and removed in {REMOVED_IN}: import {name} from {new_path}",
                  DeprecationWarning)
    return getattr(algorithm if name == "gram_is_cheaper" else reference, name)
