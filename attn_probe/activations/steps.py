"""A step's attention statistics across layers and ranks, and how much of its bound a logit uses.

:class:`StepStats` holds one step's per-layer, per-head accumulators (max |logit|, MuonClip's
signed max, entropy sums, token counts, input norms, scalings); :func:`combine` reduces them over
ranks (two collectives, whatever the layers); :func:`logit_bound_ratio` compares a measured
max logit with the weight-only bound. Pure tensor functions: the capture that fills them is
:mod:`attn_probe.activations.statistics`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

__all__ = ["StepStats", "combine", "logit_bound_ratio"]


def logit_bound_ratio(max_logit: Tensor, qk_bound: Tensor, input_norm: Tensor | float, scaling: float) -> Tensor:
    """How much of its weight-only bound the measured logit uses.

    .. math:: r = \\frac{\\max |\\ell|}{\\sigma_{max}(W_q^h)\\,\\sigma_{max}(W_k^h)\\,\\|x\\|_{max}^2\\, s}

    ``qk_bound`` as the weight metric of that name (per head; the layer value is the max over
    heads), ``input_norm`` the largest ``||x||_2`` of the attention's input on the step, ``s`` the
    scaling. At most 1 for bias-free q/k projections without QK-norm or position biases (rotary
    embeddings are rotations; an attention factor in them, as in YaRN, scales the logits by its
    square); q/k biases (BERT, GPT-2) can make it exceed 1. NaN where the bound is 0 or either
    side is missing.
    """
    bound = qk_bound.to(torch.float64) * torch.as_tensor(input_norm, dtype=torch.float64) ** 2 * scaling
    ratio = max_logit.to(torch.float64) / bound
    return torch.where(bound > 0, ratio, torch.full_like(ratio, math.nan))


# ---------------------------------------------------------------------------------------------
# One step's values and their distributed reduction
# ---------------------------------------------------------------------------------------------


@dataclass
class StepStats:
    """One step's accumulated values, flat over ``(layer, head)`` so ranks reduce two tensors.

    ``max_logit``, ``entropy_sum``, ``tokens``: ``(sum heads,)`` float64 in layer order, layer
    ``i``'s heads at ``offsets[i]:offsets[i + 1]``; ``input_norm (layers,)``; ``-inf`` marks
    a max with nothing seen. ``scaling[i]`` is what layer ``i``'s attention received;
    ``signed_max`` (like ``max_logit``) the largest signed logit, ``None`` where not kept.
    """

    names: tuple[str, ...]
    heads: tuple[int, ...]
    max_logit: Tensor
    entropy_sum: Tensor
    tokens: Tensor
    input_norm: Tensor
    scaling: tuple[float | None, ...]
    signed_max: Tensor | None = None

    @property
    def offsets(self) -> list[int]:
        out = [0]
        for h in self.heads:
            out.append(out[-1] + h)
        return out

    def tables(self) -> list[Tensor]:
        """Per layer a float64 ``(2, 1 + H)`` table, rows :data:`ATTENTION_METRICS`, column 0
        the layer (max over heads; mean of the head entropies), the core's layout. NaN where
        nothing was counted."""
        nan = torch.tensor(math.nan, dtype=torch.float64, device=self.max_logit.device)
        mx = torch.where(self.max_logit == -math.inf, nan, self.max_logit)  # +inf is a real overflow
        ent = torch.where(self.tokens > 0, self.entropy_sum / self.tokens.clamp_min(1), nan)
        out = []
        off = self.offsets
        for i in range(len(self.heads)):
            m, e = mx[off[i]:off[i + 1]], ent[off[i]:off[i + 1]]
            head_max = self.max_logit[off[i]:off[i + 1]].amax()
            layer_max = torch.where(head_max == -math.inf, nan, head_max)
            out.append(torch.stack([torch.cat([layer_max[None], m]), torch.cat([e.mean()[None], e])]))
        return out

    def counted(self) -> list[Tensor]:
        """Per layer a bool ``(1 + H,)``: whether any token was counted (column 0: in any head).
        A column that was not counted is NaN in :meth:`tables` because nothing was measured (no
        forward reached the layer, or its measurement failed), not because the logits were NaN."""
        seen = self.tokens > 0
        off = self.offsets
        return [torch.cat([seen[off[i]:off[i + 1]].any()[None], seen[off[i]:off[i + 1]]])
                for i in range(len(self.heads))]

    def input_norms(self) -> Tensor:
        """``(layers,)`` largest input norm per layer, NaN where none was seen."""
        return torch.where(torch.isinf(self.input_norm), math.nan, self.input_norm)


def combine(stats: StepStats, reduce: Callable[[Tensor, str], Tensor]) -> StepStats:
    """Reduce ``stats`` over ranks with ``reduce(tensor, op)``, ``op`` ``"max"`` then ``"sum"``.

    Exactly two calls in this order on every rank, with tensors of the same shape (every watched
    layer has its slots whether or not this rank saw it), so a collective per call is safe:
    ``[max_logit, input_norm, signed_max]`` by max, ``[entropy_sum, tokens]`` by sum. The combined
    entropy is the token-weighted mean over all ranks' tokens.
    """
    n, m = stats.max_logit.numel(), stats.input_norm.numel()
    signed = [] if stats.signed_max is None else [stats.signed_max]
    maxes = reduce(torch.cat([stats.max_logit, stats.input_norm, *signed]), "max")
    sums = reduce(torch.cat([stats.entropy_sum, stats.tokens]), "sum")
    return StepStats(stats.names, stats.heads, maxes[:n], sums[:n], sums[n:], maxes[n:n + m], stats.scaling,
                     maxes[n + m:] if signed else None)
