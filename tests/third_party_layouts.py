"""Verbatim-shaped modules of third-party layouts, for CI where the real package cannot be installed.

Each class has the real module's attribute names and the same forward maths, written here (not copied)
after reading the package's source; ``tests/extraction/test_stack_layouts.py`` checks each against the
real package where that package imports (installed apart, ``pip install --target DIR --no-deps``).

* torchtitan 0.3.0 (``torchtitan.models.common.attention``): ``GQAttention`` whose ``qkv_linear`` is a
  ``FusedQKVLinear`` (one ``wqkv``, output viewed ``(..., n_kv_heads, heads_per_kv + 2, head_dim)`` and split
  ``[heads_per_kv, 1, 1]`` into q, k, v) or a ``QKVLinear`` (``wq``/``wk``/``wv``). The real forward also
  applies RoPE and an inner attention module; rotary is not part of ``W_qk`` and is left out here.
* torchtune 0.6.1 (``torchtune.modules``): ``LoRALinear`` (``W x + (alpha / rank) B A x``, a ``disabled``
  flag), ``DoRALinear`` (the base and LoRA outputs scaled by ``magnitude / ||W + s B A||_row``) and
  ``MultiHeadAttention`` (``q_proj``/``k_proj``/``v_proj``/``output_proj``, keys expanded per group).
* nanoGPT (Karpathy's ``model.py``): ``NanoConfig`` (its ``GPTConfig`` fields), ``CausalSelfAttention``
  (``c_attn(x).split(n_embd, dim=2)``), ``MLP``, ``Block``, ``GPT`` (tied ``wte``/``lm_head``);
  ``tests/extraction/test_research_layouts.py`` checks the scores against the module's own q/k.
* x-transformers 2.31.10 (``x_transformers.x_transformers.Attention`` with ``kv_heads``): separate ``to_q``/``to_k``,
  keys *tiled* over the query heads (``repeat(k, 'b kvh n d -> b (r kvh) n d')`` in ``Attend.forward``), so query
  head ``h`` meets key head ``h % kv_heads``; ``__module__`` is x-transformers', by which the real class is
  recognised. ``tests/extraction/test_xtransformers_layout.py`` checks it against the real package.
* TransformerLens (``transformer_lens.components``): ``Attention`` (per-head ``W_Q``/``W_K``/``W_V``
  ``[n_heads, d_model, d_head]``, ``W_O [n_heads, d_head, d_model]``, ``q = einsum(x, W_Q) + b_Q``, scores
  ``q . k / sqrt(d_head)`` through ``hook_attn_scores``) and ``GroupedQueryAttention`` (``_W_K``/``_W_V``
  ``[n_key_value_heads, d_model, d_head]``, keys ``repeat_interleave``-d over the head axis), in a
  ``HookedTransformer`` of ``embed``, ``pos_embed``, ``blocks`` (``ln1``, ``attn``, ``ln2``, ``mlp``),
  ``ln_final``, ``unembed``. Hook points are identity modules, as TransformerLens' ``HookPoint``.
* timm 1.0.31 (``timm.layers.attention.Attention``): fused ``qkv(x).reshape(B, N, 3, num_heads, head_dim)``;
  ``__module__`` is timm's, by which the real class is recognised (timm needs torchvision, which does
  not install beside a CPU torch).

The sdpa-calling variants of ``tests/activations/sdpa_stacks.py`` stay there: they share these class
names (``Attention``, ``CausalSelfAttention``, ``MultiHeadAttention``) with other constructors (fixed
widths, a settable mask, ``enable_gqa``) and are paired with that module's float64 reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


# --------------------------------------------------------------------------- torchtitan 0.3
class FusedQKVLinear(nn.Module):
    """torchtitan's fused projection: rows grouped per KV head, ``[q x heads_per_kv, k, v]``."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * head_dim, bias=False)
        self.heads_per_kv = n_heads // n_kv_heads
        self.r_dim = self.heads_per_kv + 2

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs, seqlen, _ = x.shape
        grouped = self.wqkv(x).view(bs, seqlen, -1, self.r_dim, self.head_dim)
        xq, xk, xv = torch.split(grouped, [self.heads_per_kv, 1, 1], dim=-2)
        return tuple(t.reshape(bs, seqlen, -1, self.head_dim) for t in (xq, xk, xv))


class QKVLinear(nn.Module):
    """torchtitan's unfused projection (``fuse_qkv=False``)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs, seqlen, _ = x.shape
        return tuple(w(x).view(bs, seqlen, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))


class GQAttention(nn.Module):
    """torchtitan's grouped-query attention with a pluggable ``qkv_linear`` (RoPE left out)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, fuse_qkv: bool = True) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.head_dim = dim // n_heads
        self.enable_gqa = self.n_heads > self.n_kv_heads
        cls = FusedQKVLinear if fuse_qkv else QKVLinear
        self.qkv_linear = cls(dim, self.n_heads, self.n_kv_heads, self.head_dim)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xk, xv = (t.transpose(1, 2) for t in self.qkv_linear(x))
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True, enable_gqa=self.enable_gqa)
        return self.wo(out.transpose(1, 2).flatten(2))


class TitanBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, fuse_qkv: bool) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = GQAttention(dim, n_heads, n_kv_heads, fuse_qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attention(self.attention_norm(x))


class TitanModel(nn.Module):
    """A Llama-3-shaped torchtitan model: ``tok_embeddings``, ``layers``, ``norm``, ``output``."""

    def __init__(self, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2, n_layers: int = 2,
                 vocab: int = 30, fuse_qkv: bool = True) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TitanBlock(dim, n_heads, n_kv_heads, fuse_qkv) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


# --------------------------------------------------------------------------- torchtune 0.6
class LoRALinear(nn.Module):
    """torchtune's ``LoRALinear`` (no quantized base here: that needs torchao)."""

    def __init__(self, in_dim: int, out_dim: int, rank: int, alpha: float, use_bias: bool = False) -> None:
        super().__init__()
        self.in_dim, self.out_dim, self.rank, self.alpha, self.use_bias = in_dim, out_dim, rank, alpha, use_bias
        self._quantize_base = False
        linear = nn.Linear(in_dim, out_dim, bias=use_bias)
        self.disabled = False
        self.register_parameter("weight", nn.Parameter(linear.weight))
        self.register_parameter("bias", nn.Parameter(linear.bias) if use_bias else None)
        self.dropout = nn.Identity()
        self.lora_a = nn.Linear(in_dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, out_dim, bias=False)
        self.merged = False
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.disabled:
            return out
        return out + (self.alpha / self.rank) * self.lora_b(self.lora_a(self.dropout(x)))


class DoRALinear(nn.Module):
    """torchtune's ``DoRALinear``: output rows rescaled by ``magnitude / ||W + scaling B A||_row``."""

    def __init__(self, in_dim: int, out_dim: int, rank: int, alpha: float, use_bias: bool = False) -> None:
        super().__init__()
        self.in_dim, self.out_dim, self.scaling, self.use_bias = in_dim, out_dim, alpha / rank, use_bias
        self._quantize_base = False
        linear = nn.Linear(in_dim, out_dim, bias=use_bias)
        self.disabled = False
        self.register_parameter("weight", nn.Parameter(linear.weight))
        self.register_parameter("bias", nn.Parameter(linear.bias) if use_bias else None)
        self.dropout = nn.Identity()
        self.lora_a = nn.Linear(in_dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, out_dim, bias=False)
        self.magnitude = nn.Parameter(torch.empty(out_dim))
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)

    @torch.no_grad()
    def initialize_dora_magnitude(self) -> None:
        self.magnitude.copy_(self._get_weight_norm(self.weight, self.lora_b.weight @ self.lora_a.weight))

    def _get_weight_norm(self, weight: torch.Tensor, lora_weight: torch.Tensor) -> torch.Tensor:
        return torch.linalg.norm(weight + self.scaling * lora_weight, dim=1).to(weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base_out = F.linear(x, self.weight, self.bias)
        if self.disabled:
            return base_out
        x = self.dropout(x)
        lora_out = self.lora_b(self.lora_a(x))
        eye = torch.eye(self.lora_a.weight.shape[1], device=x.device, dtype=x.dtype)
        lora_weight = self.lora_b(self.lora_a(eye)).T
        norm = self._get_weight_norm(self.weight.to(x.dtype), lora_weight.detach()).detach()
        scale = (self.magnitude / norm).view(1, -1)
        return (scale - 1) * base_out + scale * lora_out * self.scaling + base_out


class MultiHeadAttention(nn.Module):
    """torchtune's ``MultiHeadAttention`` (self-attention path, no KV cache, no positional embedding)."""

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int, q_proj: nn.Module, k_proj: nn.Module,
                 v_proj: nn.Module, output_proj: nn.Module) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.embed_dim = num_heads, num_kv_heads, embed_dim
        self.head_dim = embed_dim // num_heads
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = q_proj, k_proj, v_proj, output_proj
        self.pos_embeddings = None

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        y = x if y is None else y
        b, s_x, _ = x.shape
        q_per_kv = self.num_heads // self.num_kv_heads
        q = self.q_proj(x).view(b, s_x, self.num_kv_heads * q_per_kv, self.head_dim).transpose(1, 2)
        k = self.k_proj(y).view(b, y.shape[1], -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(y).view(b, y.shape[1], -1, self.head_dim).transpose(1, 2)
        if self.num_heads != self.num_kv_heads:
            shape = (b, self.num_kv_heads, q_per_kv, -1, self.head_dim)
            k, v = (t.unsqueeze(2).expand(shape).flatten(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(out.transpose(1, 2).reshape(b, s_x, -1))


def tune_attention(embed_dim: int = 32, num_heads: int = 4, num_kv_heads: int = 2, rank: int = 4,
                   alpha: float = 8.0, dora: bool = False) -> MultiHeadAttention:
    """torchtune's ``lora_llama3_self_attention`` shape: adapters on q, k and v, a plain output projection."""
    head_dim = embed_dim // num_heads
    cls = DoRALinear if dora else LoRALinear
    return MultiHeadAttention(
        embed_dim, num_heads, num_kv_heads,
        cls(embed_dim, num_heads * head_dim, rank, alpha), cls(embed_dim, num_kv_heads * head_dim, rank, alpha),
        cls(embed_dim, num_kv_heads * head_dim, rank, alpha), nn.Linear(embed_dim, embed_dim, bias=False))


class TuneModel(nn.Module):
    """Layers of torchtune attention (``layers.N.attn``, as torchtune's ``TransformerSelfAttentionLayer``)."""

    def __init__(self, n_layers: int = 2, vocab: int = 30, dora: bool = False, **kwargs) -> None:
        super().__init__()
        embed_dim = kwargs.get("embed_dim", 32)
        self.tok_embeddings = nn.Embedding(vocab, embed_dim)
        self.layers = nn.ModuleList(nn.ModuleDict({"attn": tune_attention(dora=dora, **kwargs)}) for _ in range(n_layers))
        self.output = nn.Linear(embed_dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = x + layer["attn"](x)
        return self.output(x)


# --------------------------------------------------------------------------- nanoGPT (verbatim-shaped)
class NanoConfig:
    def __init__(self, n_embd: int = 32, n_head: int = 4, n_layer: int = 2, block_size: int = 64,
                 vocab_size: int = 50, bias: bool = True, dropout: float = 0.0) -> None:
        self.n_embd, self.n_head, self.n_layer = n_embd, n_head, n_layer
        self.block_size, self.vocab_size, self.bias, self.dropout = block_size, vocab_size, bias, dropout


class CausalSelfAttention(nn.Module):
    """Shaped as nanoGPT's ``model.py`` (attribute names and forward)."""

    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# --------------------------------------------------------------------------- timm (verbatim-shaped)
class Attention(nn.Module):
    """Shaped as ``timm.layers.attention.Attention`` (timm 1.0.31): same attributes, same reshape.
    ``__module__`` is timm's, as for the real class (timm cannot be imported here, see the module doc)."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False) -> None:
        super().__init__()
        head_dim = dim // num_heads
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.attn_dim = num_heads * head_dim
        self.scale = head_dim ** -0.5
        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.proj = nn.Linear(self.attn_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, self.attn_dim))


Attention.__module__ = "timm.layers.attention"


# --------------------------------------------------------------------------- x-transformers (verbatim-shaped)
class XTransformersAttention(nn.Module):
    """Shaped as x-transformers 2.31.10's ``Attention`` (``heads``, ``kv_heads``, ``groups``, bias-free
    ``to_q``/``to_k``/``to_v``/``to_out``; the non-flash ``Attend`` path: keys tiled, ``einsum`` logits).
    ``forward`` returns ``(out, qk_similarities)``, the scaled logits x-transformers keeps in its
    intermediates. Named ``Attention`` in x-transformers' module, as the real class is (see the module doc)."""

    def __init__(self, dim: int, heads: int = 8, kv_heads: int | None = None, dim_head: int = 8) -> None:
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        self.scale = dim_head ** -0.5
        self.heads, self.kv_heads, self.groups = heads, kv_heads, heads // kv_heads
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_k = nn.Linear(dim, dim_head * kv_heads, bias=False)
        self.to_v = nn.Linear(dim, dim_head * kv_heads, bias=False)
        self.to_out = nn.Linear(dim_head * heads, dim, bias=False)
        self.dim_head = dim_head

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, -1, self.dim_head).transpose(1, 2) for t in (self.to_q(x), self.to_k(x), self.to_v(x)))
        if self.kv_heads < self.heads:  # einops repeat 'b kvh n d -> b (r kvh) n d': tiled, not interleaved
            k, v = (t.repeat(1, self.groups, 1, 1) for t in (k, v))
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
        out = sim.softmax(-1) @ v
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1)), sim


XTransformersAttention.__name__ = XTransformersAttention.__qualname__ = "Attention"
XTransformersAttention.__module__ = "x_transformers.x_transformers"
# --------------------------------------------------------------------------- TransformerLens (verbatim-shaped)
class TLConfig:
    """The ``HookedTransformerConfig`` fields the components below read."""

    def __init__(self, n_layers: int = 2, d_model: int = 16, n_heads: int = 4, d_head: int = 8,
                 n_key_value_heads: int | None = None, d_mlp: int = 32, d_vocab: int = 20, n_ctx: int = 12) -> None:
        self.n_layers, self.d_model, self.n_heads, self.d_head = n_layers, d_model, n_heads, d_head
        self.n_key_value_heads, self.d_mlp, self.d_vocab, self.n_ctx = n_key_value_heads, d_mlp, d_vocab, n_ctx


class HookPoint(nn.Module):
    """An identity module that forward hooks attach to (``transformer_lens.hook_points.HookPoint``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class TLAttention(nn.Module):
    """Shaped as ``transformer_lens.components.Attention``: per-head parameters, einsum projections."""

    def __init__(self, cfg: TLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d, dh = cfg.n_heads, cfg.d_model, cfg.d_head
        self.W_Q = nn.Parameter(torch.randn(h, d, dh) / math.sqrt(d))
        self.W_O = nn.Parameter(torch.randn(h, dh, d) / math.sqrt(h * dh))
        self.b_Q = nn.Parameter(torch.zeros(h, dh))
        self.b_O = nn.Parameter(torch.zeros(d))
        self._key_value_parameters()
        self.attn_scale = math.sqrt(dh)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_attn_scores, self.hook_pattern, self.hook_z = HookPoint(), HookPoint(), HookPoint()

    def _key_value_parameters(self) -> None:
        h, d, dh = self.cfg.n_heads, self.cfg.d_model, self.cfg.d_head
        self.W_K = nn.Parameter(torch.randn(h, d, dh) / math.sqrt(d))
        self.W_V = nn.Parameter(torch.randn(h, d, dh) / math.sqrt(d))
        self.b_K = nn.Parameter(torch.zeros(h, dh))
        self.b_V = nn.Parameter(torch.zeros(h, dh))

    def _keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.hook_k(torch.einsum("bpm,hmd->bphd", x, self.W_K) + self.b_K)
        v = self.hook_v(torch.einsum("bpm,hmd->bphd", x, self.W_V) + self.b_V)
        return k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.hook_q(torch.einsum("bpm,hmd->bphd", x, self.W_Q) + self.b_Q)
        k, v = self._keys_values(x)
        scores = self.hook_attn_scores(torch.einsum("bqhd,bkhd->bhqk", q, k) / self.attn_scale)
        n = scores.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        pattern = self.hook_pattern(scores.masked_fill(~causal, -torch.inf).softmax(-1))
        z = self.hook_z(torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        return torch.einsum("bqhd,hdm->bqm", z, self.W_O) + self.b_O


class TLGroupedQueryAttention(TLAttention):
    """Shaped as ``transformer_lens.components.GroupedQueryAttention``: ``_W_K``/``_W_V`` hold
    ``n_key_value_heads`` heads, and the keys and values are ``repeat_interleave``-d over the head axis."""

    def _key_value_parameters(self) -> None:
        kv, d, dh = self.cfg.n_key_value_heads, self.cfg.d_model, self.cfg.d_head
        self.repeat_kv_heads = self.cfg.n_heads // kv
        self._W_K = nn.Parameter(torch.randn(kv, d, dh) / math.sqrt(d))
        self._W_V = nn.Parameter(torch.randn(kv, d, dh) / math.sqrt(d))
        self._b_K = nn.Parameter(torch.zeros(kv, dh))
        self._b_V = nn.Parameter(torch.zeros(kv, dh))

    @property
    def W_K(self) -> torch.Tensor:
        return torch.repeat_interleave(self._W_K, dim=0, repeats=self.repeat_kv_heads)

    def _keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.hook_k(torch.einsum("bpm,hmd->bphd", x, self._W_K) + self._b_K)
        v = self.hook_v(torch.einsum("bpm,hmd->bphd", x, self._W_V) + self._b_V)
        return (torch.repeat_interleave(k, dim=2, repeats=self.repeat_kv_heads),
                torch.repeat_interleave(v, dim=2, repeats=self.repeat_kv_heads))


for _cls, _name in ((TLAttention, "Attention"), (TLGroupedQueryAttention, "GroupedQueryAttention")):
    _cls.__name__ = _cls.__qualname__ = _name
    _cls.__module__ = "transformer_lens.components"


class TLLayerNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:]) * self.w + self.b


class TLMLP(nn.Module):
    def __init__(self, cfg: TLConfig) -> None:
        super().__init__()
        self.W_in = nn.Parameter(torch.randn(cfg.d_model, cfg.d_mlp) / math.sqrt(cfg.d_model))
        self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp))
        self.W_out = nn.Parameter(torch.randn(cfg.d_mlp, cfg.d_model) / math.sqrt(cfg.d_mlp))
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ self.W_in + self.b_in) @ self.W_out + self.b_out


class TLBlock(nn.Module):
    """``transformer_lens.components.TransformerBlock``: pre-norm attention and MLP."""

    def __init__(self, cfg: TLConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = TLLayerNorm(cfg.d_model), TLLayerNorm(cfg.d_model)
        self.attn = TLGroupedQueryAttention(cfg) if cfg.n_key_value_heads else TLAttention(cfg)
        self.mlp = TLMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class HookedTransformer(nn.Module):
    """``transformer_lens.HookedTransformer``'s module tree: ``embed.W_E``, ``pos_embed.W_pos``,
    ``blocks``, ``ln_final``, ``unembed.W_U``."""

    def __init__(self, cfg: TLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed, self.pos_embed, self.unembed = nn.Module(), nn.Module(), nn.Module()
        self.embed.W_E = nn.Parameter(torch.randn(cfg.d_vocab, cfg.d_model))
        self.pos_embed.W_pos = nn.Parameter(torch.randn(cfg.n_ctx, cfg.d_model))
        self.blocks = nn.ModuleList([TLBlock(cfg) for _ in range(cfg.n_layers)])
        self.ln_final = TLLayerNorm(cfg.d_model)
        self.unembed.W_U = nn.Parameter(torch.randn(cfg.d_model, cfg.d_vocab) / math.sqrt(cfg.d_model))
        self.unembed.b_U = nn.Parameter(torch.zeros(cfg.d_vocab))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed.W_E[tokens] + self.pos_embed.W_pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_final(x) @ self.unembed.W_U + self.unembed.b_U
