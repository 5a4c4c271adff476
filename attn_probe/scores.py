"""Deprecated: the reference definitions are :mod:`attn_probe.reference` (issue 30).

``from attn_probe.scores import NAME`` still works, with one ``DeprecationWarning`` per
process: the definitions come from :mod:`attn_probe.reference`, ``gram_is_cheaper`` from the
core (:mod:`attn_probe.core.algorithm`, where the path choice lives now).
"""

from __future__ import annotations

from typing import Any

from . import reference
from .core import algorithm
from .isolation import safe_warn

_NAMES = (*reference.__all__, "gram_is_cheaper")
__all__ = list(_NAMES)

_warned = False


def __getattr__(name: str) -> Any:
    global _warned
    if name not in _NAMES:
        raise AttributeError(f"module 'attn_probe.scores' has no attribute {name!r}")
    if not _warned:
        _warned = True
        safe_warn("attn_probe.scores is deprecated: import from attn_probe.reference", DeprecationWarning)
    return getattr(algorithm if name == "gram_is_cheaper" else reference, name)
