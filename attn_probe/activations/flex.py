"""Attention statistics of ``flex_attention`` calls (``torch.nn.attention.flex_attention``).

torchtitan 0.3's language models (compiled, see below) and torchtune (when packing) compute
attention with FlexAttention: a ``BlockMask`` (which key blocks each query block reads, and a ``mask_mod``
deciding the entries of partial blocks) and an optional ``score_mod`` applied to each logit.

**How the call is seen.** ``flex_attention`` runs its operator,
``torch.ops.higher_order.flex_attention``, under a compile: its own ``torch.compile(fullgraph=True)``
(eager flex compiles itself too, with the eager backend), a library's (torchtitan 0.3 compiles
``flex_attention`` with inductor) or the user's compile of the model.
:class:`~attn_probe.activations.sdpa.SdpaMode` is on the torch-function mode stack while a
watched model's counted forward runs, so its handler meets the operator while the compiler
traces it (``torch.compiler.is_compiling()`` is true there): the capture then computes the
statistics in that traced code (:func:`flex_stats`: tensor operations, ``mask_mod`` and
``score_mod`` called as flex's own tracing calls them), so they become part of the compiled graph
and run with it, whatever the backend. Layers of equal head counts share one graph: the running
layer is a 0-d tensor the layers' hooks set, not a constant. A graph from the eager backend then
calls the operator again, eagerly, which reaches the mode with real tensors: that call was
measured already (a per-step counter the graph raises says so) and passes. With no compile at
all (flex's debug switch) only the eager call comes, and the capture measures there, in plain
Python. Arguments: ``(query, key, value, score_mod, block_mask.as_tuple(), scale, kernel_options,
score_mod_buffers, mask_mod_buffers)``; at the eager call the modifiers are traced graphs that
take the tensors they close over as extra trailing arguments.

**Never into the forward.** The eager path catches everything (warned once, counted). Traced code
cannot warn; an exception there leaves the call unmeasured, and the due step warns that the layer
has no values. What tracing itself cannot handle would raise inside the compile: the traced code is
plain tensor arithmetic plus the modifiers, which flex has traced already.

**What is measured** (:func:`flex_stats`), per query head ``h`` (key head ``h // (H / H_kv)``
when the call has fewer key heads, flex's grouped-query attention), from the logits
``l = scale * q . k`` (``scale`` as flex received it, ``E ** -0.5`` by default):

- visible entries: those of the ``BlockMask``'s full blocks, and of its partial blocks where
  ``mask_mod(b, h, q_idx, kv_idx)`` is true (flex's own rule; the block tensors are read from
  ``BlockMask.as_tuple()`` by position: lengths first, ``kv_num_blocks, kv_indices,
  full_kv_num_blocks, full_kv_indices`` next, the block sizes and ``mask_mod`` last), less entries
  the ``score_mod`` sends to ``-inf``;
- ``max_logit`` / ``signed_max``: over visible entries of the content logits ``l``, before
  ``score_mod`` (as softcapping and additive biases are not applied for the other paths);
- ``entropy``: of ``softmax(score_mod(l))`` over the visible keys, the distribution the model uses.

``mask_mod`` and ``score_mod`` are evaluated over the ``(b, h, q_idx, kv_idx)`` grid with
``torch.vmap``, as flex's own ``create_mask`` does (any modifier flex accepts), ``C`` query rows
at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Tensor = torch.Tensor


def _flex_operator() -> Any:
    """``torch.ops.higher_order.flex_attention`` where this torch has it, else ``None``."""
    try:
        return getattr(torch.ops.higher_order, "flex_attention", None)
    except Exception:  # noqa: BLE001 - an older torch: no flex to measure
        return None


#: the operator intercepted (``None`` on a torch without FlexAttention)
FLEX = _flex_operator()


class FlexCall:
    """One flex call read as the statistics need it (see the module docstring)."""

    __slots__ = ("query", "key", "scale", "block", "mask_mod", "mask_buffers", "score_mod", "score_buffers")

    def __init__(self, args: tuple, kwargs: dict, heads: int) -> None:
        names = ("query", "key", "value", "score_mod", "block_mask", "scale", "kernel_options",
                 "score_mod_other_buffers", "mask_mod_other_buffers")
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        query, key, block = bound.get("query"), bound.get("key"), bound.get("block_mask")
        if not isinstance(query, Tensor) or not isinstance(key, Tensor) or query.dim() != 4 or key.dim() != 4:
            raise ValueError("flex_attention was called without 4D (batch, heads, length, dim) query and key")
        if query.shape[1] != heads:
            raise ValueError(f"flex_attention received {query.shape[1]} query heads, the layer has {heads} "
                             "(heads sharded by tensor parallelism are not measured)")
        if heads % key.shape[1]:
            raise ValueError(f"{heads} query heads are not a multiple of {key.shape[1]} key heads")
        if not isinstance(block, tuple) or len(block) < 9 or not callable(block[-1]):
            raise ValueError("flex_attention's block mask is not the BlockMask.as_tuple() layout this "
                             "version reads (lengths, kv blocks, ..., block sizes, mask_mod)")
        scale = bound.get("scale")
        self.query, self.key = query, key
        self.scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
        self.block = block
        self.mask_mod, self.score_mod = block[-1], bound.get("score_mod")
        self.mask_buffers = tuple(bound.get("mask_mod_other_buffers") or ())
        self.score_buffers = tuple(bound.get("score_mod_other_buffers") or ())


def _dense_blocks(num: Tensor | None, indices: Tensor | None, kv_blocks: int) -> Tensor | None:
    """``(B|1, H|1, Q blocks, KV blocks)`` bool: the kv blocks each query block lists."""
    if num is None or indices is None:
        return None
    listed = torch.arange(indices.shape[-1], device=indices.device) < num[..., None]
    cols = torch.where(listed, indices.long(), kv_blocks)  # unlisted slots land in a spare column
    dense = torch.zeros(*indices.shape[:-1], kv_blocks + 1, dtype=torch.bool, device=indices.device)
    return dense.scatter_(-1, cols, True)[..., :kv_blocks]


def _grid(fn: Callable, buffers: tuple, score: bool) -> Callable:
    """``fn`` applied over the full ``(b, h, q_idx, kv_idx)`` grid with ``torch.vmap``, as flex's own
    ``create_mask`` does, so any modifier flex accepts (written for scalar indices) works: called
    ``(score?, b (B,), h (H,), q (C,), kv (L_k,))``, it returns ``(B, H, C, L_k)``."""
    lead = (0,) if score else ()
    extra = (None,) * len(buffers)
    grid = fn
    for axis in (3, 2, 1, 0):  # kv innermost, as flex's own vmap over the grid
        dims = [None, None, None, None]
        dims[axis] = 0
        grid = torch.vmap(grid, in_dims=lead + tuple(dims) + extra, out_dims=0)
    return grid


def flex_visible(call: FlexCall) -> Callable[[int, int], Tensor]:
    """``visible(r0, r1)``: ``(B|1, H|1, r1 - r0, L_k)`` bool, the entries flex computes for query rows ``r0:r1``."""
    k_len = call.key.shape[2]
    device = call.query.device
    q_block, kv_block = int(call.block[-3]), int(call.block[-2])
    kv_blocks = -(-k_len // kv_block)
    partial = _dense_blocks(call.block[2], call.block[3], kv_blocks)
    full = _dense_blocks(call.block[4], call.block[5], kv_blocks)
    batch, heads = call.query.shape[0], call.query.shape[1]
    b, h = torch.arange(batch, device=device), torch.arange(heads, device=device)
    kv = torch.arange(k_len, device=device)
    kv_of = kv // kv_block
    mask_mod = _grid(call.mask_mod, call.mask_buffers, score=False)

    def visible(r0: int, r1: int) -> Tensor:
        q = torch.arange(r0, r1, device=device)
        q_of = q // q_block
        keep = mask_mod(b, h, q, kv, *call.mask_buffers).to(torch.bool)
        if partial is not None:
            keep = keep & partial[:, :, q_of][:, :, :, kv_of]
        if full is not None:
            keep = keep | full[:, :, q_of][:, :, :, kv_of]
        return keep

    return visible


def flex_stats(call: FlexCall, *, query_valid: Tensor | None = None,
               chunk_elements: int = 2 ** 22) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per query head ``(max |l|, sum of row entropies, counted tokens, max l)`` of one flex call
    (:func:`~attn_probe.activations.statistics.logit_stats`'s four ``(H,)`` tensors; float64 for
    float64 inputs, float32 otherwise; ``-inf`` maxima where nothing is counted)."""
    query, key = call.query.detach(), call.key.detach()
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    query, key = query.to(dtype), key.to(dtype)
    if key.shape[1] != heads:
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
    key_t = key.transpose(-1, -2)
    visible = flex_visible(call)
    device = query.device
    b, h = torch.arange(batch, device=device), torch.arange(heads, device=device)
    kv = torch.arange(k_len, device=device)
    score_mod = None if call.score_mod is None else _grid(call.score_mod, call.score_buffers, score=True)
    top = torch.full((heads,), -torch.inf, dtype=dtype, device=device)
    signed = top.clone()
    ent = torch.zeros(heads, dtype=dtype, device=device)
    tok = torch.zeros(heads, dtype=dtype, device=device)
    rows = max(1, chunk_elements // max(1, batch * heads * k_len))
    for r0 in range(0, q_len, rows):
        r1 = min(q_len, r0 + rows)
        logits = call.scale * (query[:, :, r0:r1] @ key_t)  # (B, H, C, L_k)
        keep = visible(r0, r1).expand(logits.shape)
        scores = logits
        if score_mod is not None:
            q = torch.arange(r0, r1, device=device)
            scores = score_mod(logits, b, h, q, kv, *call.score_buffers).to(dtype)
            keep = keep & (scores > -torch.inf)
        valid = keep.any(-1)  # (B, H, C): rows with a visible key
        if query_valid is not None:
            valid = valid & query_valid[:, None, r0:r1].to(device)
            keep = keep & valid[..., None]
        top = torch.maximum(top, logits.abs().masked_fill(~keep, -torch.inf).amax(dim=(0, 2, 3)))
        signed = torch.maximum(signed, logits.masked_fill(~keep, -torch.inf).amax(dim=(0, 2, 3)))
        logp = torch.log_softmax(scores.masked_fill(~keep, -torch.inf), dim=-1)
        row = -(logp.exp() * logp.masked_fill(~keep, 0)).sum(-1)
        ent += row.masked_fill(~valid, 0).sum(dim=(0, 2))
        tok += valid.sum(dim=(0, 2)).to(dtype)
    return top, ent, tok, signed


__all__ = ["FLEX", "FlexCall", "flex_stats", "flex_visible"]
