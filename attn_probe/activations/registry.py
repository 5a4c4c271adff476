"""The attention-function registry glue: transformers' ``AttentionInterface.get_interface``, wrapped.

:mod:`attn_probe.activations.statistics` measures attention logits from the q and k an attention
function receives; this module is how those calls reach it. While a capture exists,
``AttentionInterface.get_interface`` is wrapped: for a measured implementation name
(:data:`FAMILIES`) it returns the function transformers resolved (for ``eager`` the module's
own default) behind a check of one tuple, the armed captures (:func:`arm`/:func:`disarm`);
an unwatched module gets exactly that function. Nothing is written into the model, its config
or the registry's mappings. For ``torch.compile``, the instances the watched forwards call
(``ALL_ATTENTION_FUNCTIONS``) also get ``get_interface`` as an instance attribute while a capture
exists, so that code compiled before attach is not reused (:func:`_shadow`).
:func:`unavailable_reason` says which models cannot be read this way (the forward's source must
call ``get_interface(``; the module's ``_attn_implementation`` must be measured and not
overridden locally).

The contract with a capture (:class:`attn_probe.activations.statistics.AttentionCapture`): it has
``index`` (attention module -> layer index) and ``observe(i, family, module, query, key,
attention_mask, args, kwargs)``, called for every call of a watched module while it is armed.

Layering: this module imports no other module of attn_probe, and ``transformers`` only when a
capture is made (``import attn_probe`` stays light); it sits beside the measured statistics in
the import graph (``tests/test_import_graph.py``), below the stages that use it.
"""

from __future__ import annotations

import importlib
import inspect
import threading
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

if TYPE_CHECKING:
    from ..extraction.base import AttentionLayer

#: implementation name -> how its masks read; anything else is not measured
FAMILIES = {
    "eager": "eager",
    "sdpa": "sdpa",
    "flash_attention_2": "flash",
    "flash_attention_3": "flash",
    "flash_attention_4": "flash",
}

#: the wrappers' one flag: the armed captures (a tuple replaced, never mutated, on arm/disarm;
#: under torch.compile a guard on it, so a compiled forward has one variant unarmed, one armed)
_ARMED: tuple[Any, ...] = ()
_LOCK = threading.Lock()

def _forward_owner(cls: type) -> type:
    for klass in cls.__mro__:
        if "forward" in vars(klass):
            return klass
    return cls


def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(_forward_owner(cls).forward)
    except (OSError, TypeError):
        return ""


def _observe(family: str, module: nn.Module, query: Tensor, key: Tensor,
             attention_mask: Tensor | None, args: tuple, kwargs: dict) -> None:
    for capture in _ARMED:
        i = capture.index.get(module)
        if i is not None:
            capture.observe(i, family, module, query, key, attention_mask, args, kwargs)


def _wrap(fn: Callable, family: str) -> Callable:
    """``fn`` (what transformers resolved) behind the armed check: a new closure per call, no
    cache (a cache's state would be one more thing a compiled forward guards on)."""

    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        if _ARMED:
            _observe(family, module, query, key, attention_mask, args, kwargs)
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    wrapper.__name__ = f"attn_probe_{family}_wrapper"
    wrapper.__qualname__ = wrapper.__name__
    return wrapper


def _get_interface(self, attn_implementation: str, default: Callable) -> Callable:
    """``AttentionInterface.get_interface`` while a capture exists: the function transformers
    resolves (the registered one, or the module's own ``default`` for ``eager``), wrapped
    when its name is measured; anything else is returned as is."""
    fn = _ORIGINAL[0](self, attn_implementation, default)  # set before the first patch, never removed
    family = FAMILIES.get(attn_implementation) if attn_implementation in _USERS else None
    if family is None or not callable(fn):
        return fn
    return _wrap(fn, family)


#: implementation name -> number of captures measuring it
_USERS: dict[str, int] = {}
#: transformers' own ``get_interface``, kept from the first patch on (a one-element list)
_ORIGINAL: list[Callable] = []


def _interface_class():
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface


#: id -> (an AttentionInterface instance, ``_get_interface`` bound to it): made once per instance and
#: kept, so that attaching again passes the guards of code compiled under an earlier capture
_METHODS: dict[int, tuple[Any, Callable]] = {}
#: ids of the instances whose ``get_interface`` is shadowed now (see :func:`_shadow`)
_SHADOWED: set[int] = set()


def _interfaces(modules: Sequence[nn.Module]) -> list[Any]:
    """The AttentionInterface instances ``modules``' forwards call: the ``ALL_ATTENTION_FUNCTIONS``
    of their forward's module (a model may declare its own, e.g. Doge), and transformers' global one."""
    cls = _interface_class()
    found = [importlib.import_module("transformers.modeling_utils").ALL_ATTENTION_FUNCTIONS]
    for module in modules:
        forward = inspect.unwrap(vars(_forward_owner(type(module))).get("forward"))  # past decorators
        candidate = getattr(forward, "__globals__", {}).get("ALL_ATTENTION_FUNCTIONS")
        if isinstance(candidate, cls) and all(candidate is not f for f in found):
            found.append(candidate)
    return found


def _shadow(instances: Sequence[Any]) -> None:
    """Give each instance ``get_interface`` as an instance attribute (the wrapping
    :func:`_get_interface`, bound), under :data:`_LOCK`.

    Why: ``torch.compile`` reuses a frame compiled before the capture existed (an earlier model of
    the same class in the process) as long as its guards pass, and torch 2.13's guards on
    ``ALL_ATTENTION_FUNCTIONS.get_interface(...)`` do not cover the class attribute that
    :func:`acquire` replaces (no guard on ``AttentionInterface.__dict__['get_interface']``): the old
    code kept calling transformers' attention function unwrapped (0 statistic rows). They do
    cover what attribute lookup must check, that the instance's ``__dict__`` has no
    ``get_interface`` (a ``DICT_CONTAINS`` guard): shadowing it there fails that guard, the frame
    is traced again, through the wrapper. Only public names are touched (the public
    ``ALL_ATTENTION_FUNCTIONS`` object, its public method name); an instance attribute someone else
    set is left alone. Tried and not enough: a module-level flag read by the wrapper (code compiled
    before never read it, so never guards on it); the hooks the capture adds to the model (hooks
    run as frames of their own, the forward's cached code is still reused). Not done: writing into
    the model (``forward``) or into transformers' mappings (``register``), which the design avoids,
    and ``torch.compiler.reset()``, which drops every compiled frame of the process."""
    for instance in instances:
        key = id(instance)
        if key not in _METHODS:
            _METHODS[key] = (instance, types.MethodType(_get_interface, instance))
        if key in _SHADOWED or "get_interface" in vars(instance):
            continue
        instance.get_interface = _METHODS[key][1]
        _SHADOWED.add(key)


def _unshadow() -> None:
    """Remove the instance attributes :func:`_shadow` set (those still ours), under :data:`_LOCK`."""
    for key in _SHADOWED:
        instance, method = _METHODS[key]
        if vars(instance).get("get_interface") is method:
            del instance.get_interface
    _SHADOWED.clear()


def acquire(names: Sequence[str], modules: Sequence[nn.Module] = ()) -> None:
    """Measure the implementation ``names`` (one more user each); ``modules``: the watched attention
    modules, whose AttentionInterface instances are shadowed for ``torch.compile`` (:func:`_shadow`)."""
    with _LOCK:
        cls = _interface_class()
        current = cls.__dict__.get("get_interface")
        if not _ORIGINAL:
            _ORIGINAL.append(current)
        if current is _ORIGINAL[0]:  # else ours is still in place, or inside someone's patch over it
            cls.get_interface = _get_interface
        for name in names:
            _USERS[name] = _USERS.get(name, 0) + 1
        if _USERS:
            _shadow(_interfaces(modules))


def release(names: Sequence[str]) -> None:
    """One user less for each of ``names``; the last one restores ``get_interface``."""
    with _LOCK:
        for name in names:
            if name in _USERS:
                _USERS[name] -= 1
                if _USERS[name] <= 0:
                    del _USERS[name]
        if _USERS or not _ORIGINAL:
            return
        _unshadow()
        cls = _interface_class()
        if cls.__dict__.get("get_interface") is _get_interface:
            cls.get_interface = _ORIGINAL[0]  # else someone patched over it: ours passes through now


def installed_wrappers() -> dict[str, int]:
    """Implementation name -> number of captures measuring it (for tests and diagnostics)."""
    with _LOCK:
        return dict(_USERS)


# ---------------------------------------------------------------------------------------------
# Which models can be measured
# ---------------------------------------------------------------------------------------------

def arm(capture: Any) -> None:
    """Let the wrappers measure for ``capture`` (added to the armed tuple)."""
    global _ARMED
    with _LOCK:
        _ARMED = (*_ARMED, capture)


def disarm(capture: Any) -> None:
    """The wrappers pass straight through again for ``capture``."""
    global _ARMED
    with _LOCK:
        if capture in _ARMED:
            _ARMED = tuple(c for c in _ARMED if c is not capture)


# ---------------------------------------------------------------------------------------------
# Which models can be measured
# ---------------------------------------------------------------------------------------------


def calls_interface(module: nn.Module) -> bool:
    """Whether ``module``'s forward calls transformers' attention interface (its source says so)."""
    return "get_interface(" in _forward_source(type(module))


def implementation(module: nn.Module) -> str | None:
    """The attention implementation name transformers resolved for ``module`` (its config's)."""
    config = getattr(module, "config", None)
    return getattr(config, "_attn_implementation", None)


def unavailable_reason(layers: Sequence[AttentionLayer]) -> str | None:
    """``None`` if every layer's attention goes through transformers' attention interface in a
    way this module reads; otherwise one line saying why ``max_logit``/``entropy`` are unavailable.
    """
    if not layers:
        return "attention statistics are unavailable: no attention layers were found"
    try:
        modeling_utils = importlib.import_module("transformers.modeling_utils")
    except ImportError:
        return "attention statistics are unavailable: transformers is not installed"
    local = getattr(modeling_utils.ALL_ATTENTION_FUNCTIONS, "_local_mapping", {})
    for layer in layers:
        module = layer.module
        cls = type(module).__name__
        if module is None:
            return f"attention statistics are unavailable: {layer.name} has no module"
        if "get_interface(" not in _forward_source(type(module)):
            return (f"attention statistics are unavailable: {cls} ({layer.name}) does not call "
                    "transformers' attention interface (ALL_ATTENTION_FUNCTIONS.get_interface)")
        impl = implementation(module)
        if impl not in FAMILIES:
            return (f"attention statistics are unavailable: {cls} ({layer.name}) uses attention "
                    f"implementation {impl!r}; measured: {', '.join(FAMILIES)}")
        if impl in local:
            return (f"attention statistics are unavailable: {impl!r} is overridden locally in "
                    "transformers' ALL_ATTENTION_FUNCTIONS, which a registered wrapper cannot see")
        config = getattr(module, "config", None)
        if impl == "eager" and getattr(config, "reorder_and_upcast_attn", False):
            return (f"attention statistics are unavailable: {cls} with reorder_and_upcast_attn=True "
                    "computes eager attention itself, outside the attention interface")
    return None


# ---------------------------------------------------------------------------------------------
# The capture: one per watched model
# ---------------------------------------------------------------------------------------------

__all__ = ["FAMILIES", "acquire", "arm", "calls_interface", "disarm", "implementation", "installed_wrappers", "release",
           "unavailable_reason"]
