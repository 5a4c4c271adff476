"""Attention modules shaped as the research stacks' own, each calling ``scaled_dot_product_attention``
the way that stack does (written here after their public architectures: attribute names, the
reshape of q/k/v, and the exact call), plus a float64 reference of the statistics from the q/k a
call received.

* nanoGPT ``CausalSelfAttention``: ``c_attn(x).split(n_embd, dim=2)``,
  ``F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=..., is_causal=True)``;
* timm ``Attention`` (``__module__`` timm's, as the real class): ``qkv(x).reshape(B, N, 3, H, hd)``,
  ``F.scaled_dot_product_attention(q, k, v, dropout_p=...)`` (no mask: bidirectional);
* LitGPT ``CausalSelfAttention`` (``__module__`` litgpt's): ``qkv`` split per ``n_query_groups``,
  keys ``repeat_interleave``-d, ``scale=1/sqrt(attention_scores_scalar)`` and a boolean mask
  (causal with a sliding window here);
* torchtune ``MultiHeadAttention``: ``q_proj/k_proj/v_proj``, keys expanded per KV group
  (``expand(...).flatten(1, 2)``) or passed with ``enable_gqa=True``, an additive float mask;
* torchtitan 0.2 ``Attention``: ``wq/wk/wv``, ``repeat_kv`` and a child ``ScaledDotProductAttention``
  module that makes the call (``is_causal=True``).

:class:`Recorder` replaces ``torch.nn.functional.scaled_dot_product_attention`` by a wrapper that
keeps what every call received (the modules look the function up at call time), and
:func:`reference` recomputes max |logit| and the mean entropy per head in float64, with explicit
masks, from those calls alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

D, HEADS, KV = 32, 4, 2


class NanoCausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(D, 3 * D)
        self.c_proj = nn.Linear(D, D)
        self.n_head, self.n_embd, self.dropout = HEADS, D, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Attention(nn.Module):
    """timm's ``Attention``; carries timm's module name, by which the real class is recognised."""

    def __init__(self, dim: int = D, num_heads: int = HEADS) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.q_norm = self.k_norm = nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


Attention.__module__ = "timm.layers.attention"


class LitConfig:
    n_embd, n_head, n_query_groups, head_size, attention_scores_scalar, window = D, HEADS, KV, D // HEADS, 3, 3


class CausalSelfAttention(nn.Module):
    """LitGPT's ``CausalSelfAttention`` (0.5.x): fused ``qkv``, GQA by ``repeat_interleave``."""

    def __init__(self, config: LitConfig | None = None) -> None:
        super().__init__()
        self.config = config or LitConfig()
        c = self.config
        self.qkv = nn.Linear(c.n_embd, (c.n_head + 2 * c.n_query_groups) * c.head_size, bias=False)
        self.proj = nn.Linear(c.head_size * c.n_head, c.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        B, T, C = x.size()
        q, k, v = self.qkv(x).split((c.n_head * c.head_size, c.n_query_groups * c.head_size,
                                     c.n_query_groups * c.head_size), dim=-1)
        q = q.view(B, T, c.n_head, c.head_size).transpose(1, 2)
        k = k.view(B, T, c.n_query_groups, c.head_size).transpose(1, 2)
        v = v.view(B, T, c.n_query_groups, c.head_size).transpose(1, 2)
        k = k.repeat_interleave(c.n_head // c.n_query_groups, dim=1)
        v = v.repeat_interleave(c.n_head // c.n_query_groups, dim=1)
        pos = torch.arange(T)
        mask = (pos[None] <= pos[:, None]) & (pos[:, None] - pos[None] < c.window)  # sliding window
        y = self.scaled_dot_product_attention(q, k, v, mask[None, None])
        return self.proj(y.reshape(B, T, c.head_size * c.n_head))

    def scaled_dot_product_attention(self, q, k, v, mask=None):
        scale = 1.0 / math.sqrt(self.config.attention_scores_scalar or self.config.head_size)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=mask is None)
        return y.transpose(1, 2)


CausalSelfAttention.__module__ = "litgpt.model"


class MultiHeadAttention(nn.Module):
    """torchtune's ``MultiHeadAttention``: keys expanded per group, or ``enable_gqa``; an additive mask."""

    def __init__(self, enable_gqa: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.embed_dim = HEADS, KV, D // HEADS, D
        self.q_proj = nn.Linear(D, HEADS * self.head_dim, bias=False)
        self.k_proj = nn.Linear(D, KV * self.head_dim, bias=False)
        self.v_proj = nn.Linear(D, KV * self.head_dim, bias=False)
        self.output_proj = nn.Linear(D, D, bias=False)
        self.gqa = enable_gqa
        self.mask: torch.Tensor | None = None  # additive (B, 1, T, T), set by the test

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s_x, _ = x.shape
        q_per_kv = self.num_heads // self.num_kv_heads
        q = self.q_proj(x).view(b, s_x, self.num_kv_heads * q_per_kv, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s_x, -1, self.head_dim)
        v = self.v_proj(x).view(b, s_x, -1, self.head_dim)
        if self.num_heads != self.num_kv_heads and not self.gqa:
            expand_shape = (b, -1, self.num_kv_heads, q_per_kv, self.head_dim)
            k = k.unsqueeze(3).expand(expand_shape).flatten(2, 3)
            v = v.unsqueeze(3).expand(expand_shape).flatten(2, 3)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        extra = {"enable_gqa": True} if self.gqa else {}
        output = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=0.0,
                                                            is_causal=self.mask is None, **extra)
        return self.output_proj(output.transpose(1, 2).contiguous().view(b, s_x, -1))


class ScaledDotProductAttention(nn.Module):
    """torchtitan 0.2's child module that makes the call."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class TitanAttention(nn.Module):
    """torchtitan 0.2 ``Attention``: ``wq/wk/wv/wo``, ``repeat_kv``, ``self.sdpa``."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = HEADS, KV, D // HEADS
        self.n_rep = HEADS // KV
        self.wq = nn.Linear(D, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(D, KV * self.head_dim, bias=False)
        self.wv = nn.Linear(D, KV * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, D, bias=False)
        self.sdpa = ScaledDotProductAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)

        def repeat_kv(t):
            b, s, n, d = t.shape
            return t[:, :, :, None, :].expand(b, s, n, self.n_rep, d).reshape(b, s, n * self.n_rep, d)

        xq, xk, xv = xq.transpose(1, 2), repeat_kv(xk).transpose(1, 2), repeat_kv(xv).transpose(1, 2)
        output = self.sdpa(xq, xk, xv)
        return self.wo(output.transpose(1, 2).contiguous().view(bs, seqlen, -1))


STACKS = {
    "nanogpt": NanoCausalSelfAttention,
    "timm": Attention,
    "litgpt": CausalSelfAttention,
    "torchtune": MultiHeadAttention,
    "torchtune_gqa": lambda: MultiHeadAttention(enable_gqa=True),
    "torchtitan": TitanAttention,
}


class Block(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = attn
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class Net(nn.Module):
    """Two blocks of one stack's attention on float inputs ``(B, T, D)``."""

    def __init__(self, stack: str, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(STACKS[stack]()) for _ in range(layers)])
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Recorder:
    """``torch.nn.functional.scaled_dot_product_attention`` replaced (monkeypatch) by a wrapper
    that keeps, per call, float64 copies of q and k, the mask, is_causal, scale, enable_gqa and
    whether gradients were enabled, then calls the real function."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[dict] = []
        real = F.scaled_dot_product_attention

        def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            self.calls.append(dict(q=query.detach().double().clone(), k=key.detach().double().clone(),
                                   mask=None if attn_mask is None else attn_mask.detach().clone(),
                                   causal=is_causal, scale=scale, gqa=enable_gqa, grad=torch.is_grad_enabled()))
            return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)


def reference(calls: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head ``(max |s q.k| over visible pairs, mean entropy over rows with a visible key)``,
    float64, accumulated over ``calls`` (explicit ``(B, H, L, S)`` logits, masks and softmax)."""
    top, ent_sum, rows = None, None, None
    for c in calls:
        q, k = c["q"], c["k"]
        if k.shape[1] != q.shape[1]:  # enable_gqa: torch repeats each key head for its query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scale = c["scale"] if c["scale"] is not None else 1 / math.sqrt(q.shape[-1])
        logits = torch.einsum("bhid,bhjd->bhij", q, k) * scale
        B, H, L, S = logits.shape
        visible = torch.ones(B, H, L, S, dtype=torch.bool)
        bias = torch.zeros(B, H, L, S, dtype=torch.float64)
        if c["causal"]:
            visible &= torch.ones(L, S).tril().bool()
        if c["mask"] is not None:
            m = c["mask"].expand(B, H, L, S)
            if m.dtype == torch.bool:
                visible &= m
            else:
                visible &= m > -1e30
                bias = torch.where(m > -1e30, m.double(), bias)
        z = torch.where(visible, logits + bias, -math.inf)
        p = torch.softmax(z, dim=-1)
        entropy = -torch.where(visible, torch.special.xlogy(p, p), 0).sum(-1)  # (B, H, L)
        counted = visible.any(-1)
        head_top = torch.where(visible, logits.abs(), -math.inf).amax(dim=(0, 2, 3))
        head_ent = torch.where(counted, entropy, 0).sum(dim=(0, 2))
        head_rows = counted.sum(dim=(0, 2)).double()
        top = head_top if top is None else torch.maximum(top, head_top)
        ent_sum = head_ent if ent_sum is None else ent_sum + head_ent
        rows = head_rows if rows is None else rows + head_rows
    return top, ent_sum / rows
