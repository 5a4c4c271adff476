"""The probe's hooks on a user's model or optimizer: callables that copy and pickle as inert builtins.

A hook registered with ``register_forward_pre_hook`` (and the other ``register_*_hook``) is
stored in the module's (or optimizer's) hook dicts, so it travels with every ``pickle.dumps``,
``torch.save(model)``, ``copy.deepcopy`` and spawn child of that object. A hook of the probe
wraps a bound method of the live probe: pickling it would pickle the probe (threads, locks,
files: it fails), and a deep copy of it would feed the copy's forwards into the original probe
(a teacher copy advancing the student's step counter).

:class:`ProbeHook` is what the probe registers instead. Called, it forwards to the probe. Copied
or pickled, it reduces to :data:`INERT`, ``contextlib.nullcontext.__exit__``: a plain Python
function of the standard library, ``def __exit__(self, *excinfo): pass``, so that

* the copy is inert: it accepts any arguments and returns ``None``, which every torch hook kind
  reads as "change nothing";
* the copy compiles: ``torch.compile`` traces that function like any other Python code (a
  teacher or EMA copy of a watched model compiles with ``fullgraph=True``, no graph break; the
  builtin ``sys.audit`` that earlier versions used is a function dynamo refuses to trace);
* the pickle names no attn_probe object (it names ``contextlib.nullcontext`` and ``__exit__``):
  a model saved whole while watched loads where attn_probe is not installed;
* the original's hooks are untouched: the probe goes on counting the original model alone.

The hook dict of the copy keeps its entry (torch offers no public way to leave one out of a
module's state); a copy never calls the probe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

__all__ = ["INERT", "ProbeHook"]

#: what a copied or unpickled probe hook is: a standard-library no-op that torch.compile traces
INERT = contextlib.nullcontext.__exit__


class ProbeHook:
    """``call`` as a hook of a model or optimizer; a copy or a pickle of it is :data:`INERT` (module docstring)."""

    __slots__ = ("call",)

    def __init__(self, call: Callable[..., Any]) -> None:
        self.call = call

    def __call__(self, *args: Any) -> Any:
        return self.call(*args)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # copy.copy, copy.deepcopy and every pickle protocol go through here; a function pickles by
        # its qualified name, so the pickle holds getattr(contextlib.nullcontext, "__exit__")
        return getattr, (contextlib.nullcontext, "__exit__")

    def __repr__(self) -> str:
        return f"ProbeHook({self.call!r})"
