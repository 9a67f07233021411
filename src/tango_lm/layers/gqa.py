"""Qwen3-style attention and block (docs/design.md §4.1, Dense): grouped-query attention with QK-norm and RoPE,
then SwiGLU, each pre-normed (a `PreNormBlock`), no biases.

QK-norm is RMSNorm over d_h on every query and key head (learned weights `q_norm`, `k_norm` shared
across heads), applied before RoPE (Qwen3; Henry et al. 2020). GQA (Ainslie et al. 2023) shares
each key/value head among n_heads / n_kv_heads query heads; the decode cache keeps the n_kv_heads
heads only.
"""

from __future__ import annotations

import torch
from torch import nn

from tango_lm.layers.norm import RMSNorm
from tango_lm.layers.prenorm import PreNormBlock
from tango_lm.layers.rope import apply_rope
from tango_lm.layers.transformer import SwiGLU
from tango_lm.ops.attention import causal_attention, grouped_step_attention
from tango_lm.ops.gate_average import merge_heads, split_heads
from tango_lm.serve.cache import LayerState


def gqa_params(d_model: int, n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """q, k, v, o projections plus the two QK-norm weights."""
    return 2 * d_model * n_heads * head_dim + 2 * d_model * n_kv_heads * head_dim + 2 * head_dim


def dense_block_params(d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, width: int) -> int:
    """One Dense layer: attention, SwiGLU (3dF) and the two pre-norms."""
    return gqa_params(d_model, n_heads, n_kv_heads, head_dim) + 3 * d_model * width + 2 * d_model


class GroupedQueryAttention(nn.Module):
    """Causal softmax attention with n_heads query heads, n_kv_heads key/value heads, QK-norm, RoPE."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], state: LayerState | None = None
    ) -> torch.Tensor:
        cos, sin = rope
        q = apply_rope(self.q_norm(split_heads(self.q_proj(h), self.n_heads)), cos, sin)
        k = apply_rope(self.k_norm(split_heads(self.k_proj(h), self.n_kv_heads)), cos, sin)
        v = split_heads(self.v_proj(h), self.n_kv_heads)
        if state is not None:  # decoding: attend over everything cached for this layer
            k, v = state.append("k", k), state.append("v", v)
        mask = state.key_mask() if state is not None else None
        group = self.n_heads // self.n_kv_heads
        if group > 1 and q.shape[-2] == 1:  # a decode step: read the cache in place
            return self.o_proj(merge_heads(grouped_step_attention(q, k, v, mask)))
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return self.o_proj(merge_heads(causal_attention(q, k, v, mask)))


def dense_block(d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, width: int, eps: float) -> PreNormBlock:
    """The Dense layer: `x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x))` with GQA + QK-norm attention."""
    attn = GroupedQueryAttention(d_model, n_heads, n_kv_heads, head_dim, eps)
    return PreNormBlock(d_model, eps, attn, SwiGLU(d_model, width))
