"""Which keys each query row sees: the masks attention functions receive, read as :data:`RowMask` s.

:func:`attn_probe.activations.statistics.logit_stats` forms the logits a few query rows at a time and asks
a :data:`RowMask` ``rows(r0, r1)`` which keys rows ``r0:r1`` see (``True`` = visible) and which
additive bias they get. :func:`row_mask` reads the arguments of transformers' attention functions
(eager, sdpa, flash); :func:`sdpa_row_mask` reads those of ``torch.nn.functional.scaled_dot_product_attention``
called directly (``attn_mask``, ``is_causal``). Pure functions: tensors in, closures out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

Tensor = torch.Tensor

#: (r0, r1) -> (allowed (B|1, H|1, r1 - r0, Lk) bool or None for all, additive bias or None)
RowMask = Callable[[int, int], "tuple[Tensor | None, Tensor | None]"]


class PlainRows:
    """The :data:`RowMask` of a call with no mask and no bias but, perhaps, causality: query row
    ``i`` sees keys ``j <= i + offset`` (``offset`` ``None``: every key). Called, it returns the
    boolean mask as any row mask does; :func:`attn_probe.activations.logits.logit_stats_impl`
    reads ``offset`` instead and forms no mask beyond each chunk's diagonal block."""

    __slots__ = ("offset", "k_len", "device")

    def __init__(self, offset: int | None, k_len: int, device: torch.device) -> None:
        self.offset = offset
        self.k_len = k_len
        self.device = device

    def __call__(self, r0: int, r1: int) -> tuple[Tensor | None, Tensor | None]:
        if self.offset is None:
            return None, None
        kpos = torch.arange(self.k_len, device=self.device)
        qpos = torch.arange(r0, r1, device=self.device)[:, None] + self.offset
        return (kpos[None] <= qpos)[None, None], None


def _float_mask(mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """An additive float mask -> (visible, bias): visible above ``max(dtype min / 2, -1e30)``."""
    visible = mask > max(torch.finfo(mask.dtype).min / 2, -1e30)
    bias = mask.masked_fill(~visible, 0)
    return visible, bias


def _flash_segments(kwargs: Mapping, length: int, device: torch.device) -> Tensor | None:
    """Packed-sequence ids ``(1, length)`` from ``cu_seq_lens_q`` or packed ``position_ids``."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        bounds = torch.as_tensor(cu, device=device)[1:-1]
        return torch.bucketize(torch.arange(length, device=device), bounds, right=True)[None]
    pos = kwargs.get("position_ids")
    if pos is not None and pos.shape[0] == 1 and pos.shape[-1] == length and length > 1:
        return torch.cumsum((pos.reshape(1, -1) == 0).long(), dim=-1)
    return None


def row_mask(
    family: str,
    module: nn.Module,
    attention_mask: Tensor | None,
    kwargs: Mapping,
    q_len: int,
    k_len: int,
    device: torch.device,
) -> RowMask:
    """The visible keys of query rows, as the implementation ``family`` reads its arguments.

    ``eager``/``sdpa``: a 4D boolean (``True`` = visible) or additive float mask, its last
    ``k_len`` columns; ``None`` means all keys for eager and, for sdpa, causal (upper-left,
    keys cut to ``q_len``) when ``q_len > 1`` and the call is causal. ``flash``: causal
    bottom-right, the 2D padding mask's last ``k_len`` columns, ``sliding_window`` and packed
    sequences. ``position_bias`` (kwargs) is an additive bias.
    """
    causal_kw = kwargs.get("is_causal")
    causal = bool(causal_kw if causal_kw is not None else getattr(module, "is_causal", True))
    position_bias = kwargs.get("position_bias")
    offset = k_len - q_len

    if family in ("eager", "sdpa") and attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask[..., -q_len:, :k_len] if attention_mask.shape[-2] >= q_len else attention_mask

        def rows(r0: int, r1: int) -> tuple[Tensor | None, Tensor | None]:
            m = mask[..., r0:r1, :] if mask.shape[-2] > 1 else mask
            bias = position_bias[..., r0:r1, :k_len] if position_bias is not None else None
            if m.dtype == torch.bool:
                return m.to(device), bias
            visible, extra = _float_mask(m.to(device))
            return visible, extra if bias is None else bias + extra

        return rows

    if family == "flash":
        pad = attention_mask[:, -k_len:].to(device=device, dtype=torch.bool) if attention_mask is not None else None
        window = kwargs.get("sliding_window")
        segments = _flash_segments(kwargs, k_len, device) if q_len == k_len else None
        if pad is None and segments is None and (window is None or k_len <= window):
            return PlainRows(offset if causal else None, k_len, device)
        kpos = torch.arange(k_len, device=device)

        def rows(r0: int, r1: int) -> tuple[Tensor | None, Tensor | None]:
            qpos = torch.arange(r0, r1, device=device)[:, None] + offset
            allowed = torch.ones(r1 - r0, k_len, dtype=torch.bool, device=device)
            if causal:
                allowed = allowed & (kpos[None] <= qpos)
            if window is not None and k_len > window:
                allowed = allowed & ((qpos - kpos[None]).abs() < window)
            allowed = allowed[None, None]
            if segments is not None:
                allowed = allowed & (segments[:, None, r0:r1, None] == segments[:, None, None, :])
            if pad is not None:
                allowed = allowed & pad[:, None, None, :]
            return allowed, None

        return rows

    # eager/sdpa without a 4D mask
    sdpa_causal = family == "sdpa" and attention_mask is None and q_len > 1 and causal
    if position_bias is None:  # upper-left causal, which also cuts keys to q_len
        return PlainRows(0 if sdpa_causal else None, k_len, device)
    kpos = torch.arange(k_len, device=device)

    def rows(r0: int, r1: int) -> tuple[Tensor | None, Tensor | None]:
        bias = position_bias[..., r0:r1, :k_len] if position_bias is not None else None
        if not sdpa_causal:
            return None, bias
        qpos = torch.arange(r0, r1, device=device)[:, None]
        return (kpos[None] <= qpos)[None, None], bias  # upper-left, which also cuts keys to q_len

    return rows


def sdpa_row_mask(attn_mask: Tensor | None, is_causal: bool, q_len: int, k_len: int,
                  device: torch.device) -> RowMask:
    """The visible keys as ``torch.nn.functional.scaled_dot_product_attention`` reads its arguments.

    ``attn_mask`` broadcastable to ``(B, H, q_len, k_len)``: boolean (``True`` = takes part) or
    additive float (entries at or below ``max(dtype min / 2, -1e30)`` hidden, finite ones a
    bias); ``is_causal``: query ``i`` sees keys ``j <= i`` (upper-left, torch's
    ``ones(L, S).tril()``), combined with the mask when both are given (torch refuses that
    combination; then both are read as given).
    """
    mask = None
    if attn_mask is not None:
        mask = attn_mask.to(device)
        while mask.dim() < 4:
            mask = mask[None]
    if mask is None:
        return PlainRows(0 if is_causal else None, k_len, device)
    kpos = torch.arange(k_len, device=device)

    def rows(r0: int, r1: int) -> tuple[Tensor | None, Tensor | None]:
        allowed, bias = None, None
        if mask is not None:
            m = mask[..., r0:r1, :] if mask.shape[-2] > 1 else mask
            if m.dtype == torch.bool:
                allowed = m
            else:
                allowed, bias = _float_mask(m)
        if is_causal:
            causal = (kpos[None] <= torch.arange(r0, r1, device=device)[:, None])[None, None]
            allowed = causal if allowed is None else allowed & causal
        return allowed, bias

    return rows


__all__ = ["PlainRows", "RowMask", "row_mask", "sdpa_row_mask"]
