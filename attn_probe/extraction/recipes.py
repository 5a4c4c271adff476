"""The ``register_adapter`` calls the unsupported-model message prints, for layouts no rule reads.

Two kinds of module are named by :func:`~attn_probe.extraction.find_attention`'s message with a
call that, run as printed (after ``import attn_probe``, before the probe's call), makes them
readable:

* a fused q/k/v projection child named like one (``qkv`` in its name: ``to_qkv``, ``qkv``,
  ``Wqkv``), whatever the class of the module holding it: its rows read as ``[q | k | v]``, each
  block head-major (``q, k, v = to_qkv(x).chunk(3, -1)``, then the heads split off), the head
  count from the module's own attribute (``heads``, ``num_heads``, ...);
* per-head parameters ``W_Q``/``W_K`` of shape ``[heads, d_model, d_head]`` used as
  ``q = x @ W_Q[h]`` (TransformerLens' ``Attention``; ``_W_K`` with fewer key heads in its
  ``GroupedQueryAttention``, whose keys are ``repeat_interleave``-d, so query head ``h`` meets key
  head ``h // (H / H_kv)``).

The calls name the class, the child or parameters and the sizes found, and reach the helpers
through ``attn_probe.extraction`` so that nothing else needs importing.
"""

from __future__ import annotations

import re

from torch import nn

from .heads import stated_head_counts
from .projections import projection

_Q_PARAM = re.compile(r"_?w_?q", re.IGNORECASE)
_K_PARAM = re.compile(r"_?w_?k", re.IGNORECASE)


def fused_qkv_recipe(module: nn.Module, path: str) -> tuple[str, str | None] | None:
    """``(description, call)`` for the first child of ``module`` named like a fused q/k/v projection
    (``qkv`` in its name, an output divisible by 3), else ``None``; ``call`` is ``None`` when the
    module states no head count that divides the projection."""
    for name, child in module.named_children():
        if "qkv" not in name.lower():
            continue
        proj = projection(child, name)
        if proj is None or proj.out_features % 3:
            continue
        d, out = proj.in_features, proj.out_features
        where = f"{path}.{name}" if path else name
        description = f"'{name}' looks like a fused q/k/v projection ({where}: {d} -> {out} = 3 x {out // 3})"
        heads, _ = stated_head_counts(module)
        if not heads or (out // 3) % heads:
            return description, None
        head_dim = out // 3 // heads
        call = (
            "attn_probe.register_adapter(lambda module, path, config: "
            "attn_probe.extraction.architectures.contiguous_qkv(attn_probe.extraction.architectures."
            f"child_projection(module, path, {name!r}), {heads}, {heads}, {head_dim}) "
            f"if type(module).__name__ == {type(module).__name__!r} else None)"
        )
        return description, call
    return None


def per_head_params_recipe(module: nn.Module, path: str) -> tuple[str, str] | None:
    """``(description, call)`` for a module holding per-head query and key parameters ``W_Q``,
    ``W_K`` (or ``_W_K``) of shape ``[heads, d_model, d_head]``, else ``None``."""
    params = dict(module.named_parameters(recurse=False))
    q_name = next((n for n, p in params.items() if _Q_PARAM.fullmatch(n) and p.dim() == 3), None)
    k_name = next((n for n, p in params.items() if _K_PARAM.fullmatch(n) and p.dim() == 3), None)
    if q_name is None or k_name is None:
        return None
    (heads, d, head_dim), (kv, k_d, k_dim) = params[q_name].shape, params[k_name].shape
    if (k_d, k_dim) != (d, head_dim) or heads % kv:
        return None
    description = (
        f"{path or '<root>'} holds per-head parameters {q_name} {[heads, d, head_dim]} and "
        f"{k_name} {[kv, d, head_dim]} ([heads, d_model, d_head], q = x @ {q_name}[h])"
    )
    q_full, k_full = f"path + '.{q_name}'", f"path + '.{k_name}'"
    call = (
        "attn_probe.register_adapter(lambda module, path, config: attn_probe.extraction.QKLayout("
        f"({q_full}, {k_full}), {heads}, {kv}, {head_dim}, {d}, lambda get: (get({q_full}).transpose(1, 2), "
        f"get({k_full}).transpose(1, 2))) if type(module).__name__ == {type(module).__name__!r} else None)"
    )
    return description, call


__all__ = ["fused_qkv_recipe", "per_head_params_recipe"]
