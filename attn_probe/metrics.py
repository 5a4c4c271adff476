"""Deprecated: the scoring core moved to :mod:`attn_probe.core` (issue 30).

``from attn_probe.metrics import NAME`` still gives the core's public ``NAME``, with one
``DeprecationWarning`` per process; import it from ``attn_probe.core`` (or ``attn_probe``).
"""

from __future__ import annotations

from typing import Any

from . import core
from .isolation import safe_warn

__all__ = list(core.__all__)

_warned = False


def __getattr__(name: str) -> Any:
    global _warned
    if name not in core.__all__:
        raise AttributeError(f"module 'attn_probe.metrics' has no attribute {name!r}")
    if not _warned:
        _warned = True
        safe_warn("attn_probe.metrics is deprecated: import from attn_probe.core", DeprecationWarning)
    return getattr(core, name)
