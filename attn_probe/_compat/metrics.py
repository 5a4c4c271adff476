"""Deprecated: the scoring core moved to :mod:`attn_probe.core` (issue 30).

``from attn_probe.metrics import NAME`` still gives the core's public ``NAME``, with one
``DeprecationWarning`` per process; import it from ``attn_probe.core`` (or ``attn_probe``).
This module is removed in 0.5.0.
"""

from __future__ import annotations

from typing import Any

from .. import core
from ..isolation import safe_warn

__all__ = list(core.__all__)

#: the release that removes this module (CHANGELOG.md, "Deprecated")
REMOVED_IN = "0.5.0"

_warned = False


def __getattr__(name: str) -> Any:
    global _warned
    if name not in core.__all__:
        raise AttributeError(f"module 'attn_probe.metrics' has no attribute {name!r}")
    if not _warned:
        _warned = True
        safe_warn(f"attn_probe.metrics is deprecated and removed in {REMOVED_IN}: import {name} from attn_probe.core",
                  DeprecationWarning)
    return getattr(core, name)
