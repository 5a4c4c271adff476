"""The arithmetic of the attention statistics: max |logit|, signed max and entropy of one call.

:func:`attn_probe.activations.statistics.logit_stats` (the documented entry, autocast off) calls
:func:`logit_stats_impl`. The logits ``l = s q.k`` are formed ``C`` query rows at a time (the
chunk, ``C = max(1, chunk_elements // (B * H * L_k))``) in float32 (float64 for float64 inputs)
and reduced row by row; two paths give the same values:

- **plain** (:class:`~attn_probe.activations.masks.PlainRows`: no mask, or causal with an
  offset, no bias, no softcapping, no sinks; the call of a causal model without padding under
  sdpa or flash attention): a chunk's logits are formed against the keys its rows can see only
  (``j < r1 + offset``, half the work of the full square on average), and the only mask formed
  is the chunk's diagonal block ``(C, C)``: no ``(B, H, C, L_k)`` boolean buffer, no
  ``masked_fill`` of the whole chunk;
- **general** (any other :data:`~attn_probe.activations.masks.RowMask`): the chunk's boolean
  mask and additive bias as the row mask gives them.

Per row, ``max_logit`` and the signed max come from one ``aminmax`` pass:
``max |l| = max(max l, -min l)``; both are exact maxima over every counted entry in every path
(no sampling ever applies to them). The entropy of row ``i`` over its visible keys is

.. math:: H_i = \\log S_i - \\sum_j p_{ij} d_{ij},\\quad d_{ij} = z_{ij} - \\max_j z_{ij},\\;
          S_i = \\sum_j e^{d_{ij}},\\; p = \\mathrm{softmax}(z) = e^{d} / S,

with ``log S_i = -log max_j p_ij`` (the largest probability is ``1 / S_i``). ``torch.softmax``
forms ``p``: ``exp`` of strongly negative ``d`` gives denormal numbers, whose slow path costs
up to 40x on CPU in ``torch.exp``, not in the softmax kernel.

**Entropy on a sample of query rows** (``entropy_rows``; the plain path of a call without
padding only). With ``n`` query rows that see a key above ``entropy_rows``, the entropy is
averaged over a systematic sample of them: every ``t``-th row, ``t = ceil(n / entropy_rows)``,
from a start in ``[0, t)`` that the layer index (``entropy_seed``) and the shape fix (plain
integer arithmetic: a compiled forward sees constants; the same call gives the same sample), so
``entropy_rows / 2 <= m <= entropy_rows`` rows are used, the same positions in every batch row
and head. The sample's mean counts for all ``n`` rows (the returned sum is ``n / m`` times the
sample's, the count that of all rows, so :func:`~attn_probe.activations.steps.combine` and
gradient accumulation weigh calls as before). ``max_logit`` and the signed max still read every
entry. A row's entropy lies in ``[0, log L_k]``, so for ``m`` rows drawn independently at random
Hoeffding's inequality gives, with probability at least ``1 - delta``,

.. math:: |\\hat H - H| \\le \\log(L_k) \\sqrt{\\ln(2/\\delta) / (2 m)}

(:func:`entropy_error_bound`; ``0.10 log L_k`` nats at ``delta = 0.01``, ``m = 256``: 0.78 nats at
``L_k = 2048``) per head and batch row. The sample is systematic, not random, so the bound is a
guide, not a guarantee: a row entropy that drifts slowly with position is tracked much more
closely (measured errors, 0.007-0.03 nats, in ``docs/performance.md``), one that oscillates with
a period dividing ``t`` would not be.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .masks import PlainRows, RowMask

Tensor = torch.Tensor

#: what a hidden key's logit is lowered by on the plain path: exp(-HIDE) is 0 in float32 and float64
HIDE = 1e30

#: default ``entropy_rows`` of the capture and the probe (``attention_entropy_rows``): above this
#: many query rows in one call, the entropy is averaged over a sample of rows (module docstring)
DEFAULT_ENTROPY_ROWS = 256

#: default number of logit elements formed at once (see the module docstring for the bound)
DEFAULT_CHUNK_ELEMENTS = 1 << 22

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "DEFAULT_ENTROPY_ROWS", "autocast_off", "entropy_error_bound", "logit_stats_impl", "sample_rows"]


def entropy_error_bound(k_len: int, m: int, delta: float = 0.01) -> float:
    """Hoeffding's bound on the error of a mean of ``m`` row entropies (each in ``[0, log k_len]``)
    drawn independently, holding with probability ``1 - delta`` (nats)."""
    if m < 1 or k_len < 1 or not 0 < delta < 1:
        raise ValueError(f"entropy_error_bound needs m >= 1, k_len >= 1, 0 < delta < 1; got {m}, {k_len}, {delta}")
    return math.log(k_len) * math.sqrt(math.log(2 / delta) / (2 * m))


def sample_rows(first: int, n_rows: int, entropy_rows: int | None, seed: int = 0) -> tuple[int, int]:
    """``(start, stride)`` of the systematic sample of rows ``first .. first + n_rows - 1``: every
    row (``(first, 1)``) when ``entropy_rows`` is ``None`` or ``n_rows <= entropy_rows``; else every
    ``stride``-th row from ``start``, which ``seed`` and the shape fix (plain integers: a compiled
    forward sees constants, and the same call gives the same sample)."""
    if entropy_rows is None or n_rows <= entropy_rows:
        return first, 1
    stride = -(-n_rows // entropy_rows)
    return first + (seed * 2654435761 + n_rows * 40503) % stride, stride


def logit_stats_impl(query: Tensor, key: Tensor, scaling: float, rows: RowMask | None, *,
                     query_valid: Tensor | None, softcap: float | None, sinks: Tensor | None,
                     chunk_elements: int, entropy_rows: int | None = None,
                     entropy_seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(max |l|, entropy sum, counted tokens, max l)`` per query head (see
    :func:`attn_probe.activations.statistics.logit_stats`); autocast must be off."""
    B, H, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    if H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of {Hkv} key heads")
    if entropy_rows is not None and entropy_rows < 1:
        raise ValueError(f"entropy_rows must be a positive integer or None, got {entropy_rows!r}")
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    # the scaling folded into q: logits = (s q) . k
    q = (query.detach().to(dtype) * scaling).unflatten(1, (Hkv, H // Hkv))  # (B, Hkv, G, Lq, D)
    kt = key.detach().to(dtype).unsqueeze(2).transpose(-1, -2)  # (B, Hkv, 1, D, Lk)
    step = max(1, chunk_elements // max(1, B * H * Lk))
    valid = None if query_valid is None else query_valid.to(device=q.device, dtype=torch.bool)
    if (rows is None or isinstance(rows, PlainRows)) and softcap is None and sinks is None:
        offset = None if rows is None else rows.offset
        return _plain(q, kt, offset, valid, step, None if valid is not None else entropy_rows, entropy_seed)
    return _general(q, kt, rows, valid, softcap, sinks, step)


def _accumulators(H: int, q: Tensor) -> list[Tensor]:
    """``max |l|``, entropy sum, tokens, signed max: ``(H,)`` each."""
    new = dict(dtype=q.dtype, device=q.device)
    return [torch.full((H,), -math.inf, **new), torch.zeros(H, **new), torch.zeros(H, **new),
            torch.full((H,), -math.inf, **new)]


def _row_entropy(p: Tensor, d: Tensor) -> Tensor:
    """``log S - sum_j p_j d_j`` per row from ``p = softmax(d)`` (``d`` finite where ``p > 0``,
    ``0`` elsewhere); overwrites ``p``."""
    log_total = -torch.log(p.amax(-1))
    return log_total - p.mul_(d).sum(-1)


def _plain(q: Tensor, kt: Tensor, offset: int | None, valid: Tensor | None, step: int,
           entropy_rows: int | None, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """No mask, or causal ``j <= i + offset``; no bias, softcap or sinks (the module docstring)."""
    B, Hkv, G, Lq, _ = q.shape
    H, Lk = Hkv * G, kt.shape[-1]
    max_abs, ent, count, max_signed = _accumulators(H, q)
    first = 0 if offset is None else max(0, -offset)  # rows before it see no key
    if first >= Lq:
        return max_abs, ent, count, max_signed
    n_rows = Lq - first
    start, stride = sample_rows(first, n_rows, entropy_rows, seed)
    device, inf = q.device, math.inf
    for r0 in range(first, Lq, step):
        r1 = min(Lq, r0 + step)
        end = Lk if offset is None else min(Lk, r1 + offset)  # keys past it are hidden from every row
        lo = end if offset is None else max(0, min(end, r0 + offset + 1))  # keys before it: seen by all rows
        logits = torch.matmul(q[..., r0:r1, :], kt[..., :end]).flatten(1, 2)  # (B, H, C, end)
        diag = None
        if lo < end:  # the diagonal block: row i sees key j iff j <= i + offset; hidden entries get -HIDE
            qpos = torch.arange(r0, r1, device=device)[:, None] + offset
            hide = (torch.arange(lo, end, device=device)[None] > qpos).to(q.dtype) * -HIDE  # (C, end - lo)
            diag = logits[..., lo:end]
            diag.add_(hide)  # never a row's max, 0 after the softmax, p * z = 0 there
            d_high = diag.amax(-1)
            d_low = torch.sub(diag, hide, alpha=2).amin(-1)  # hidden: l + HIDE, never a visible row's min
        if lo > 0:
            low, high = torch.aminmax(logits[..., :lo], dim=-1)  # (B, H, C)
            if diag is not None:
                low, high = torch.minimum(low, d_low), torch.maximum(high, d_high)
        else:
            low, high = d_low, d_high
        row_abs = torch.maximum(high, -low)
        row_valid = None if valid is None else valid[:, None, r0:r1]  # (B, 1, C)
        if row_valid is not None:
            high = high.masked_fill(~row_valid, -inf)
            row_abs = row_abs.masked_fill(~row_valid, -inf)
        max_signed = torch.maximum(max_signed, high.amax(dim=(0, 2)))
        max_abs = torch.maximum(max_abs, row_abs.amax(dim=(0, 2)))
        n_valid = (r1 - r0) * B if row_valid is None else row_valid.sum()
        count = count + n_valid
        # entropy of the sampled rows of this chunk: local indices (s - r0) :: stride
        s0 = r0 + (start - r0) % stride
        if s0 >= r1:
            continue
        pick = slice(s0 - r0, r1 - r0, stride)
        z = logits[:, :, pick]  # a view when stride is 1
        if stride > 1:
            z = z.contiguous()
        z = z.sub_(high[:, :, pick, None] if row_valid is None else torch.where(
            row_valid[:, :, pick, None], high[:, :, pick, None], 0))  # d = z - max z
        p = torch.softmax(z, dim=-1)
        row = _row_entropy(p, z)  # (B, H, c)
        if row_valid is not None:  # (never sampled: every row is measured)
            row = row.masked_fill(~row_valid, 0)
        ent = ent + row.sum(dim=(0, 2))
    if stride > 1:  # each of the m sampled rows stands for n / m rows of its head
        ent = ent * (n_rows / len(range(start, Lq, stride)))
    return max_abs, ent, count, max_signed


def _general(q: Tensor, kt: Tensor, rows: RowMask, valid_rows: Tensor | None, softcap: float | None,
             sinks: Tensor | None, step: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Any row mask, additive biases, softcapping, sinks (the module docstring)."""
    B, Hkv, G, Lq, _ = q.shape
    H = Hkv * G
    dtype, device = q.dtype, q.device
    zero = torch.zeros((), dtype=dtype, device=device)
    max_abs, ent, count, max_signed = _accumulators(H, q)
    sink = None if sinks is None else sinks.detach().to(device=device, dtype=dtype).reshape(1, H, 1, 1)
    for r0 in range(0, Lq, step):
        r1 = min(Lq, r0 + step)
        logits = torch.matmul(q[..., r0:r1, :], kt).flatten(1, 2)  # (B, H, C, Lk)
        allowed, bias = rows(r0, r1) if rows is not None else (None, None)
        blocked = None if allowed is None else ~allowed
        valid = torch.ones(B, 1, r1 - r0, dtype=torch.bool, device=device)
        if valid_rows is not None:
            valid = valid & valid_rows[:, None, r0:r1]
        if allowed is not None:
            valid = valid & allowed.any(-1)  # (B, H|1, C): a row with no visible key is not counted
        # hidden entries 0 for the extremes of |l| (|0| never exceeds a visible |l|), -inf for the signed max
        shown = logits if blocked is None else logits.masked_fill(blocked, 0)
        low, high = torch.aminmax(shown, dim=-1)
        del shown
        if blocked is not None:
            high = logits.masked_fill(blocked, -math.inf).amax(-1)
        max_signed = torch.maximum(max_signed, torch.where(valid, high, -math.inf).amax(dim=(0, 2)))
        row_abs = torch.maximum(high, -low)
        max_abs = torch.maximum(max_abs, torch.where(valid, row_abs, -math.inf).amax(dim=(0, 2)))
        z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
        if bias is not None:
            z = z + bias.to(dtype)
        if blocked is not None:
            z = z.masked_fill_(blocked, -math.inf)  # logits are not needed any more
        if sink is not None:
            z = torch.cat([z, sink.expand(B, H, r1 - r0, 1)], dim=-1)
        z = z.sub_(z.amax(-1, keepdim=True))
        p = torch.softmax(z, dim=-1)
        log_total = -torch.log(p.amax(-1))
        row = log_total - torch.nansum(p.mul_(z), dim=-1)  # hidden keys: 0 * -inf = NaN, dropped
        ent = ent + torch.where(valid, row, zero).sum(dim=(0, 2))
        count = count + valid.expand(B, H, r1 - r0).sum(dim=(0, 2)).to(dtype)
    return max_abs, ent, count, max_signed


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off for ``device_type``; nothing where this torch has no autocast for it (torch < 2.5
    refuses ``torch.autocast("mps", enabled=False)``), since nothing can be autocast there."""
    try:
        return torch.autocast(device_type=device_type, enabled=False)
    except (RuntimeError, ValueError):
        return contextlib.nullcontext()
