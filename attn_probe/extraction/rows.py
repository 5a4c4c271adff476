"""How a fused projection's rows split into per-head queries and keys, and the narrow class key
the fused layouts are recognised by. Part of the architecture knowledge
(:mod:`attn_probe.extraction.architectures`)."""

from __future__ import annotations

from torch import nn

from .base import ParamGetter, QKLayout, Tensor
from .projections import Projection


def class_is(attn: nn.Module, *names: str, module_suffix: str | None = None) -> bool:
    """Narrow key: the module's class (or a base class, for user subclasses) has one of
    ``names``, optionally defined in a Python module whose name ends with ``module_suffix``."""
    return any(
        cls.__name__ in names and (module_suffix is None or cls.__module__.endswith(module_suffix))
        for cls in type(attn).__mro__
    )


def contiguous_qkv(proj: Projection, num_heads: int, num_kv: int, head_dim: int) -> QKLayout | None:
    """Rows ``[q (H*dh) | k (Hkv*dh) | v (Hkv*dh)]``, each block head-major (GPT-2, Phi-3, MPT, ...)."""
    q_out, kv_out, d = num_heads * head_dim, num_kv * head_dim, proj.in_features
    if proj.out_features != q_out + 2 * kv_out or num_heads % num_kv:
        return None

    def split(get: ParamGetter) -> tuple[Tensor, Tensor]:
        w = proj.weight(get)
        return w[:q_out].reshape(num_heads, head_dim, d), w[q_out : q_out + kv_out].reshape(num_kv, head_dim, d)

    return QKLayout(proj.param_names, num_heads, num_kv, head_dim, d, split)


def interleaved_qkv(proj: Projection, num_heads: int, head_dim: int) -> QKLayout | None:
    """Rows grouped per head, ``(H, 3, dh)``: ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (GPT-NeoX, BLOOM, ...)."""
    d = proj.in_features
    if proj.out_features != 3 * num_heads * head_dim:
        return None

    def split(get: ParamGetter) -> tuple[Tensor, Tensor]:
        w = proj.weight(get).reshape(num_heads, 3, head_dim, d)
        return w[:, 0], w[:, 1]

    return QKLayout(proj.param_names, num_heads, num_heads, head_dim, d, split)


def grouped_qkv(proj: Projection, num_heads: int, num_kv: int, head_dim: int) -> QKLayout | None:
    """Rows grouped per KV head, ``(Hkv, H/Hkv + 2, dh)``: the group's queries, then its k, then its v
    (Falcon ``new_decoder_architecture``)."""
    d = proj.in_features
    if num_heads % num_kv or proj.out_features != (num_heads + 2 * num_kv) * head_dim:
        return None
    per = num_heads // num_kv

    def split(get: ParamGetter) -> tuple[Tensor, Tensor]:
        w = proj.weight(get).reshape(num_kv, per + 2, head_dim, d)
        return w[:, :per].reshape(num_heads, head_dim, d), w[:, per]

    return QKLayout(proj.param_names, num_heads, num_kv, head_dim, d, split)


def pair_qk(q: Projection, k: Projection, num_heads: int, num_kv: int, head_dim: int) -> QKLayout | None:
    """Separate query and key projections of ``num_heads`` / ``num_kv`` heads, each head-major."""
    d = q.in_features
    if (k.in_features != d or q.out_features != num_heads * head_dim or k.out_features != num_kv * head_dim
            or num_heads % num_kv):
        return None

    def split(get: ParamGetter) -> tuple[Tensor, Tensor]:
        return q.weight(get).reshape(num_heads, head_dim, d), k.weight(get).reshape(num_kv, head_dim, d)

    return QKLayout(q.param_names + k.param_names, num_heads, num_kv, head_dim, d, split)


__all__ = ["class_is", "contiguous_qkv", "interleaved_qkv", "grouped_qkv", "pair_qk"]
