"""Attention statistics of ``flex_attention`` calls (``torch.nn.attention.flex_attention``).

torchtitan 0.3's language models and torchtune (when packing) compute attention with
FlexAttention: a ``BlockMask`` (which key blocks each query block reads, and a ``mask_mod``
deciding the entries of its partial blocks) and an optional ``score_mod`` applied to each logit.

**How the call is seen.** ``flex_attention`` runs its operator,
``torch.ops.higher_order.flex_attention``, under a compile: its own
``torch.compile(backend="eager", fullgraph=True)`` when called eagerly, a library's (torchtitan
0.3 compiles ``flex_attention`` with inductor) or the user's compile of the model.
:class:`~attn_probe.activations.sdpa.SdpaMode` is on the torch-function mode stack while a
watched model's counted forward runs, so it meets the operator twice in the eager case: while the
compiler traces it (``torch.compiler.is_compiling()``), and when the eager backend's graph runs
it with real tensors. The statistics are computed at that second, eager call, in plain Python
that catches everything (warned once, counted). flex's debug switch (no compile at all) gives
only the eager call, measured the same way.

**Inside a compiled graph** (inductor: torchtitan 0.3, or the user's ``torch.compile`` of the
model) no eager call comes. By default nothing of the probe is traced there beyond one counter
(so the due step can say that flex ran inside a compiled graph and was not measured): tracing
the statistics means tracing the user's ``mask_mod`` and ``score_mod`` under ``torch.vmap``,
and a compiler error there would be raised inside the user's forward, which the probe must
never cause. ``attention_flex_compiled=True`` opts in: :func:`flex_stats` is traced into the
graph with its arithmetic (the logits' matmul, every reduction) inside two opaque operators
(:func:`compiled_ops`), which run eagerly on the graph's tensors and which no backend lowers;
only the visible entries (``mask_mod`` under ``torch.vmap``, the blocks) and ``score_mod`` are
compiled. A failure inside the operators is kept, never raised into the graph, and one while
tracing leaves the call untraced; either drops the step's values, warned once and counted
(:func:`take_failures`). Layers of equal head counts share one graph (the running layer is a
0-d tensor the layers' hooks set).

**The BlockMask read.** The operator receives ``BlockMask.as_tuple()``, a positional tuple that is
not a documented contract. :func:`block_mask_reader` therefore finds each field by identity in the
tuple of a ``BlockMask`` it builds with the public ``create_block_mask``, and checks that the
visible entries it reconstructs from that tuple equal the public ``create_mask`` of the same
``mask_mod``; on a torch where either fails, flex calls are reported not measured (once, with
the reason) instead of misread.

**What is measured** (:func:`flex_stats`), per query head ``h`` (key head ``h // (H / H_kv)`` with
fewer key heads), from the logits ``l = scale * q . k`` (``scale`` as flex received it,
``E ** -0.5`` by default):

- visible entries: as flex computes them. An eager call (flex's own eager backend, its debug
  switch, inductor leaving the operator to run eagerly) runs flex's dense implementation, which
  evaluates ``mask_mod(b, h, q_idx, kv_idx)`` on every entry for the real ``(b, h)`` and ignores
  the blocks; flex's kernels, which the statistics traced into a compiled graph stand beside,
  read the ``BlockMask``'s full blocks whole and ``mask_mod`` inside its partial blocks only. The
  two agree for a ``BlockMask`` made from its ``mask_mod`` by ``create_block_mask`` for the real
  batch and heads; they differ for one broadcast over heads whose ``mask_mod`` depends on ``h``,
  or one given by its blocks (``BlockMask.from_kv_blocks``). Entries ``score_mod`` sends to
  ``-inf`` are hidden too (``score_mod`` is then evaluated on every entry);
- ``max_logit`` / signed max: exact, over every visible entry of the content logits ``l``, before
  ``score_mod`` (as softcapping and additive biases are left out on the other paths);
- ``entropy``: of ``softmax(score_mod(l))`` over the visible keys, the distribution the model
  uses; above ``entropy_rows`` query rows, averaged over a systematic sample of rows as
  :mod:`attn_probe.activations.logits` documents (not with a padding mask: every row then).

``mask_mod`` and ``score_mod`` are evaluated over the ``(b, h, q_idx, kv_idx)`` grid with
``torch.vmap``, as flex's own ``create_mask`` does (any modifier flex accepts, including one
written for scalar indices), ``C`` query rows at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .logits import HIDE, sample_rows

Tensor = torch.Tensor


def _flex_operator() -> Any:
    """``torch.ops.higher_order.flex_attention`` where this torch has it, else ``None``."""
    try:
        return getattr(torch.ops.higher_order, "flex_attention", None)
    except Exception:  # noqa: BLE001 - an older torch: no flex to measure
        return None


#: the operator intercepted (``None`` on a torch without FlexAttention)
FLEX = _flex_operator()

#: the fields read from ``BlockMask.as_tuple()``
FIELDS = ("q_len", "kv_len", "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_block", "kv_block", "mask_mod")

_READER: dict[str, int] | str | None = None  # positions of FIELDS, or why this torch's layout is not read


def _probe_mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    """A mask with empty, partial and full blocks at the block sizes of :func:`block_mask_reader`."""
    return (q >= kv) & (q - kv < 21)


def block_mask_reader() -> dict[str, int]:
    """Positions of :data:`FIELDS` in this torch's ``BlockMask.as_tuple()``, found and checked once
    per process (module docstring); raises ``RuntimeError`` with the reason where they cannot be."""
    global _READER
    if _READER is None:
        try:
            found = _find_positions()
        except Exception as exc:  # noqa: BLE001 - any failure means: do not read this layout
            found = repr(exc)
        _READER = found if isinstance(found, dict) else \
            f"this torch's BlockMask.as_tuple() layout could not be read ({found}); flex_attention is not measured"
    if isinstance(_READER, str):
        raise RuntimeError(_READER)
    return _READER


def _find_positions() -> dict[str, int] | str:
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    q_len, kv_len, q_block, kv_block = 48, 40, 16, 8  # distinct, so each int is found once
    mask = create_block_mask(_probe_mask_mod, 1, 1, q_len, kv_len, device="cpu", BLOCK_SIZE=(q_block, kv_block))
    if tuple(mask.BLOCK_SIZE) != (q_block, kv_block) or tuple(mask.seq_lengths) != (q_len, kv_len):
        return "BlockMask.BLOCK_SIZE / seq_lengths do not hold what create_block_mask was given"
    fields = mask.as_tuple()
    found: dict[str, int] = {}
    for name, value in (("kv_num_blocks", mask.kv_num_blocks), ("kv_indices", mask.kv_indices),
                        ("full_kv_num_blocks", mask.full_kv_num_blocks), ("full_kv_indices", mask.full_kv_indices),
                        ("mask_mod", mask.mask_mod)):
        hits = [i for i, x in enumerate(fields) if x is value]
        if len(hits) != 1:
            return f"BlockMask.{name} is not found once in as_tuple()"
        found[name] = hits[0]
    for name, value in (("q_len", q_len), ("kv_len", kv_len), ("q_block", q_block), ("kv_block", kv_block)):
        hits = [i for i, x in enumerate(fields) if type(x) is int and x == value]
        if len(hits) != 1:
            return f"BlockMask's {name} is not found once in as_tuple()"
        found[name] = hits[0]
    query = torch.zeros(1, 1, q_len, 1)
    key = torch.zeros(1, 1, kv_len, 1)
    call = FlexCall((query, key, key, None, fields, None, {}, (), ()), {}, 1, found)
    mine = flex_visible(call)(0, q_len)
    theirs = create_mask(_probe_mask_mod, 1, 1, q_len, kv_len, device="cpu")
    if mine.shape != theirs.shape or not torch.equal(mine, theirs):
        return "the entries read from BlockMask.as_tuple() differ from create_mask's"
    return found


class FlexCall:
    """One flex call read as the statistics need it (see the module docstring)."""

    __slots__ = ("query", "key", "scale", "block", "at", "blocks", "mask_mod", "mask_buffers", "score_mod",
                 "score_buffers")

    def __init__(self, args: tuple, kwargs: dict, heads: int, at: dict[str, int] | None = None, *,
                 blocks: bool = True) -> None:
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
        at = block_mask_reader() if at is None else at
        if not isinstance(block, tuple) or len(block) <= max(at.values()) or not callable(block[at["mask_mod"]]):
            raise ValueError("flex_attention's block mask is not the BlockMask.as_tuple() this torch builds")
        scale = bound.get("scale")
        self.query, self.key, self.block, self.at = query, key, block, at
        self.blocks = blocks  # the kernels' rule (blocks, mask_mod inside partial ones) or the eager one
        self.scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
        self.mask_mod, self.score_mod = block[at["mask_mod"]], bound.get("score_mod")
        self.mask_buffers = tuple(bound.get("mask_mod_other_buffers") or ())
        self.score_buffers = tuple(bound.get("score_mod_other_buffers") or ())

    def field(self, name: str) -> Any:
        return self.block[self.at[name]]


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
    """``visible(r0, r1)``: ``(B, H, r1 - r0, L_k)`` bool, the entries flex computes for query rows
    ``r0:r1``: with ``call.blocks`` the kernels' rule (full blocks, and ``mask_mod`` inside partial
    blocks), else flex's eager rule (``mask_mod`` on every entry, the blocks unused)."""
    k_len = call.key.shape[2]
    device = call.query.device
    q_block, kv_block = int(call.field("q_block")), int(call.field("kv_block"))
    kv_blocks = -(-k_len // kv_block)
    partial = _dense_blocks(call.field("kv_num_blocks"), call.field("kv_indices"), kv_blocks) if call.blocks else None
    full = _dense_blocks(call.field("full_kv_num_blocks"), call.field("full_kv_indices"), kv_blocks) \
        if call.blocks else None
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


def flex_stats(call: FlexCall, *, query_valid: Tensor | None = None, chunk_elements: int = 2 ** 22,
               entropy_rows: int | None = None, entropy_seed: int = 0,
               owner: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per query head ``(max |l|, sum of row entropies, counted rows, max l)`` of one flex call
    (:func:`~attn_probe.activations.statistics.logit_stats`'s four ``(H,)`` tensors; float64 for
    float64 inputs, float32 otherwise; ``-inf`` maxima where nothing is counted).

    ``owner``: traced into a compiled graph (``attention_flex_compiled``): the visible entries
    (``mask_mod`` under ``torch.vmap``, the blocks) and ``score_mod`` are traced, the logits'
    matmul and every reduction run inside the opaque operators of :func:`compiled_ops`, eagerly
    on the graph's real tensors (a compiler never lowers them; a failure there is kept for
    :func:`take_failures` of ``owner``, never raised into the graph). ``None``: plain eager code
    (may raise)."""
    query, key = call.query.detach(), call.key.detach()
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    batch, heads, q_len, _ = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    q = (query.to(dtype) * call.scale).unflatten(1, (kv_heads, heads // kv_heads))  # (B, Hkv, G, Lq, E)
    kt = key.to(dtype).unsqueeze(2).transpose(-1, -2)  # (B, Hkv, 1, E, Lk)
    visible = flex_visible(call)
    device = query.device
    b, h = torch.arange(batch, device=device), torch.arange(heads, device=device)
    kv = torch.arange(k_len, device=device)
    score_mod = None if call.score_mod is None else _grid(call.score_mod, call.score_buffers, score=True)
    if owner is None:
        chunk, logits_of = chunk_stats, _logits
    else:
        ops = compiled_ops()

        def chunk(*args: Any) -> tuple[Tensor, ...]:
            return ops.flex_chunk_stats(*args, owner)

        def logits_of(q_rows: Tensor, kt: Tensor) -> Tensor:
            return ops.flex_logits(q_rows, kt, owner)
    max_abs = torch.full((heads,), -math.inf, dtype=dtype, device=device)
    max_signed = max_abs.clone()
    ent, count = torch.zeros(heads, dtype=dtype, device=device), torch.zeros(heads, dtype=dtype, device=device)
    ent_rows = torch.zeros(heads, dtype=dtype, device=device)  # rows in the entropy sample
    start, stride = sample_rows(0, q_len, None if query_valid is not None else entropy_rows, entropy_seed)
    step = max(1, chunk_elements // max(1, batch * heads * k_len))
    for r0 in range(0, q_len, step):
        r1 = min(q_len, r0 + step)
        q_rows = q[..., r0:r1, :]
        keep = visible(r0, r1)
        s0 = r0 + (start - r0) % stride
        logits = scores = None
        if score_mod is not None:  # every entry: entries it sends to -inf are not visible
            logits = logits_of(q_rows, kt)
            scores = score_mod(logits, b, h, torch.arange(r0, r1, device=device), kv, *call.score_buffers).to(dtype)
        valid_rows = None if query_valid is None else query_valid[:, r0:r1].to(device=device, dtype=torch.bool)
        parts = chunk(q_rows, kt, logits, keep, scores, valid_rows, s0 - r0 if s0 < r1 else -1, stride)
        max_abs = torch.maximum(max_abs, parts[0])
        max_signed = torch.maximum(max_signed, parts[1])
        count = count + parts[2]
        ent = ent + parts[3]
        ent_rows = ent_rows + parts[4]
    if stride > 1:  # the sample's mean stands for every counted row of its head
        ent = ent * count / ent_rows.clamp(min=1)
    return max_abs, ent, count, max_signed


def _logits(q_rows: Tensor, kt: Tensor) -> Tensor:
    """``(B, H, C, Lk)`` logits of ``q_rows (B, Hkv, G, C, E)`` (scaled) and ``kt (B, Hkv, 1, E, Lk)``."""
    return torch.matmul(q_rows, kt).flatten(1, 2)


def chunk_stats(q_rows: Tensor, kt: Tensor, logits: Tensor | None, keep: Tensor, scores: Tensor | None,
                query_valid: Tensor | None, pick_start: int, pick_stride: int) -> tuple[Tensor, ...]:
    """One chunk of query rows of :func:`flex_stats`: per head ``(max |l|, max l, counted rows,
    entropy sum, entropy rows)``. ``logits`` (``None``: formed here from ``q_rows`` and ``kt``);
    ``keep (B, H, C, Lk)``: the visible entries; ``scores``: ``score_mod`` of the logits, or
    ``None``; ``query_valid (B, C)``: non-padding query rows; the entropy is taken on rows
    ``pick_start::pick_stride`` of the chunk (none when ``pick_start < 0``)."""
    if logits is None:
        logits = _logits(q_rows, kt)
    dtype = logits.dtype
    if scores is not None:
        keep = keep & (scores > -math.inf)
    valid = keep.any(-1)  # (B, H, C): rows with a visible key
    if query_valid is not None:
        valid = valid & query_valid[:, None].to(device=valid.device, dtype=torch.bool)
    hide = torch.where(keep, 0.0, -HIDE).to(dtype)  # hidden entries never a row's max (or, negated, min)
    high = torch.add(logits, hide).amax(-1)
    low = torch.sub(logits, hide).amin(-1)
    max_signed = high.masked_fill(~valid, -math.inf).amax(dim=(0, 2))
    max_abs = torch.maximum(high, -low).masked_fill(~valid, -math.inf).amax(dim=(0, 2))
    count = valid.sum(dim=(0, 2)).to(dtype)
    if pick_start < 0:
        zero = torch.zeros_like(count)
        return max_abs, max_signed, count, zero, zero.clone()
    pick = slice(pick_start, None, pick_stride)
    z = (logits if scores is None else scores)[:, :, pick].masked_fill(~keep[:, :, pick], -math.inf)
    sampled = valid[:, :, pick]
    z = z - torch.where(sampled, z.amax(-1), 0.0)[..., None]  # d = z - max z (0 for empty rows)
    p = torch.softmax(z, dim=-1)
    row = -torch.log(p.amax(-1)) - torch.nansum(p * z, dim=-1)  # hidden keys: 0 * -inf = NaN, dropped
    ent = torch.where(sampled, row, 0.0).sum(dim=(0, 2))
    return max_abs, max_signed, count, ent, sampled.sum(dim=(0, 2)).to(dtype)


# ----------------------------------------------------------------------------------- compiled graphs
#: owner -> messages of failures inside the opaque operators (read by :func:`take_failures`)
_FAILURES: dict[int, list[str]] = {}
_OPS: list[Any] = []  # the operators' namespace, once registered


def _failed(owner: int, exc: BaseException) -> None:
    messages = _FAILURES.setdefault(owner, [])
    if len(messages) < 8:  # the first few are kept: one is warned, every step it happens in is counted
        messages.append(f"{type(exc).__name__}: {exc}")


def trace_failed(owner: int, what: str) -> None:
    """Tracing a flex call's statistics into a compiled graph raised ``what`` (an exception's type
    name): kept for :func:`take_failures`. Traced by the compiler as a side effect of the graph,
    so it is kept at every run of that graph."""
    _FAILURES.setdefault(owner, []).append(f"{what} while tracing the statistics into the graph")


def take_failures(owner: int) -> list[str]:
    """The failures inside the compiled graphs' operators for ``owner`` since the last call."""
    return _FAILURES.pop(owner, [])


def _op_logits(q_rows: Tensor, kt: Tensor, owner: int) -> Tensor:
    try:
        with torch.no_grad():
            return _logits(q_rows, kt).clone()
    except Exception as exc:  # noqa: BLE001 - inside the user's compiled graph: kept, never raised
        _failed(owner, exc)
        return q_rows.new_zeros(_logits_shape(q_rows, kt))


def _logits_shape(q_rows: Tensor, kt: Tensor) -> tuple[int, ...]:
    return (q_rows.shape[0], q_rows.shape[1] * q_rows.shape[2], q_rows.shape[3], kt.shape[-1])


def _op_chunk(q_rows: Tensor, kt: Tensor, logits: Tensor | None, keep: Tensor, scores: Tensor | None,
              query_valid: Tensor | None, pick_start: int, pick_stride: int,
              owner: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    try:
        with torch.no_grad():
            return tuple(x.clone() for x in chunk_stats(q_rows, kt, logits, keep, scores, query_valid,
                                                        pick_start, pick_stride))
    except Exception as exc:  # noqa: BLE001 - inside the user's compiled graph: kept, never raised
        _failed(owner, exc)
        heads = q_rows.shape[1] * q_rows.shape[2]  # nothing counted from this chunk
        return (q_rows.new_full((heads,), -math.inf), q_rows.new_full((heads,), -math.inf),
                *(q_rows.new_zeros((heads,)) for _ in range(3)))


def _op_chunk_fake(q_rows: Tensor, kt: Tensor, logits: Tensor | None, keep: Tensor, scores: Tensor | None,
                   query_valid: Tensor | None, pick_start: int, pick_stride: int,
                   owner: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    heads = q_rows.shape[1] * q_rows.shape[2]
    return tuple(q_rows.new_empty((heads,)) for _ in range(5))


def compiled_ops() -> Any:
    """``torch.ops.attn_probe``, with ``flex_logits`` and ``flex_chunk_stats`` registered (once per
    process, with ``torch.library.custom_op``): the parts of :func:`flex_stats` that a compiler
    sees only as calls, so none of the probe's arithmetic is lowered by inductor. Inductor's CPU
    matmul template under ``max_autotune`` (torchtitan 0.3 compiles flex with it) failed to
    generate code for the statistics' ``bmm`` with the masking fused after it (``InductorError:
    AssertionError`` in the template's epilogue, torch 2.13), inside the user's forward.
    Call it before any compile may trace a flex call (the capture does, at construction)."""
    if not _OPS:
        logits = torch.library.custom_op("attn_probe::flex_logits", _op_logits, mutates_args=())
        logits.register_fake(lambda q_rows, kt, owner: q_rows.new_empty(_logits_shape(q_rows, kt)))
        chunk = torch.library.custom_op("attn_probe::flex_chunk_stats", _op_chunk, mutates_args=())
        chunk.register_fake(_op_chunk_fake)
        _OPS.append(torch.ops.attn_probe)
    return _OPS[0]


__all__ = ["FIELDS", "FLEX", "FlexCall", "block_mask_reader", "chunk_stats", "compiled_ops", "flex_stats",
           "flex_visible", "take_failures", "trace_failed"]
