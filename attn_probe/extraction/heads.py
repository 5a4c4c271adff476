"""Head counts of an attention module: what it states (its attributes, its config) and the check
that a layout's counts agree with them. Part of the architecture knowledge (:mod:`attn_probe.extraction`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import QKLayout, UnsupportedModelError


def first_int(*values: Any) -> int | None:
    """The first positive ``int`` among ``values`` (not a ``bool``), else ``None``."""
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


_HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "d_kv", "key_value_proj_dim", "dim_per_head",
                   "dim_head")
_NUM_HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "n_heads_q", "heads", "nheads")
_CONFIG_HEAD_ATTRS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads")


def _int_attr(obj: Any, names: tuple[str, ...]) -> int | None:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def infer_head_dim(attn: nn.Module, config: Any, q_out: int, k_out: int) -> int | None:
    """Head size from the attention module, then the model config, then ``q_out / num_heads``."""
    head_dim = _int_attr(attn, _HEAD_DIM_ATTRS)
    if head_dim is None:
        num_heads = _int_attr(attn, _NUM_HEADS_ATTRS)
        if num_heads:
            head_dim = q_out // num_heads
    if head_dim is None and config is not None:
        head_dim = _int_attr(config, ("head_dim", "d_kv", "attention_head_size"))
        if head_dim is None:
            n = _int_attr(config, _CONFIG_HEAD_ATTRS)
            if n:
                head_dim = q_out // n
    if head_dim and q_out % head_dim == 0 and k_out % head_dim == 0:
        return head_dim
    return None


_KV_HEADS_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads")


def _config_count(config: Any, name: str) -> int | None:
    """``config.<name>`` when it is the config's own field (not an alias such as BART's
    ``num_attention_heads -> encoder_attention_heads``, which may not describe this module)."""
    if config is None or name in (getattr(type(config), "attribute_map", None) or {}):
        return None
    try:
        return first_int(getattr(config, name, None))
    except Exception:  # noqa: BLE001 - per-layer heterogeneous configs refuse global reads
        return None


def stated_head_counts(attn: nn.Module) -> tuple[int | None, int | None]:
    """``(query heads, KV heads)`` the attention module states (its attributes, then its own
    ``config``), ``None`` where it states nothing."""
    config = getattr(attn, "config", None)
    heads = _int_attr(attn, _NUM_HEADS_ATTRS) or _config_count(config, "num_attention_heads")
    kv = _int_attr(attn, _KV_HEADS_ATTRS)
    groups = first_int(getattr(attn, "num_key_value_groups", None))
    if kv is None and groups and heads and heads % groups == 0:
        kv = heads // groups
    if kv is None:
        kv = _config_count(config, "num_key_value_heads")
    return heads, kv


def check_head_counts(attn: nn.Module, path: str, layout: QKLayout) -> QKLayout:
    """``layout`` if its head counts agree with those ``attn`` states, else
    :class:`UnsupportedModelError`: a wrong count pairs queries with the wrong keys silently."""
    heads, kv = stated_head_counts(attn)
    if (heads is None or heads == layout.num_heads) and (kv is None or kv == layout.num_kv_heads):
        return layout
    raise UnsupportedModelError(
        f"{path} ({type(attn).__name__}): attn_probe read {layout.num_heads} query heads and "
        f"{layout.num_kv_heads} KV heads of size {layout.head_dim} from its projections, but the module "
        f"states num_attention_heads={heads}, num_key_value_heads={kv}; the projections hold something "
        "else besides the per-head queries/keys (e.g. a gate) in a layout attn_probe does not know. "
        "Describe it with attn_probe.register_adapter(fn) (`attn-probe models` prints the recipe)."
    )
