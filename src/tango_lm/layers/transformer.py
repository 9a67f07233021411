"""Transformer++ parts (docs/design.md §2.1): causal multi-head attention with RoPE, SwiGLU, and the block
`x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x))` (a `PreNormBlock`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tango_lm.layers.gated_projections import add_gated_projections, gated_weights
from tango_lm.layers.prenorm import PreNormBlock
from tango_lm.layers.rope import apply_rope
from tango_lm.ops.attention import causal_attention
from tango_lm.ops.gate_average import merge_heads, split_heads
from tango_lm.serve.cache import LayerState


class CausalSelfAttention(nn.Module):
    """Multi-head softmax attention with q, k, v, o projections of d x d and RoPE on q and k."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], state: LayerState | None = None
    ) -> torch.Tensor:
        cos, sin = rope
        q = apply_rope(split_heads(self.q_proj(h), self.n_heads), cos, sin)
        k = apply_rope(split_heads(self.k_proj(h), self.n_heads), cos, sin)
        v = split_heads(self.v_proj(h), self.n_heads)
        if state is not None:  # decoding: attend over everything cached for this application
            k, v = state.append("k", k), state.append("v", v)
        mask = state.key_mask() if state is not None else None
        return self.o_proj(merge_heads(causal_attention(q, k, v, mask)))


class SwiGLU(nn.Module):
    """`down_proj(silu(gate_proj h) * up_proj h)` with hidden width F."""

    def __init__(self, d_model: int, width: int, active_width: int | None = None) -> None:
        super().__init__()
        add_gated_projections(self, d_model, 1, width, active_width)  # rotating width: K of the F columns

    def forward(self, h: torch.Tensor, state: LayerState | None = None) -> torch.Tensor:
        """h [B, T, d] -> [B, T, d]; position-wise, so the decode state is not used."""
        w_g, w_u, w_o = gated_weights(self)  # the full weights unless a segment is selected
        return F.linear(F.silu(F.linear(h, w_g)) * F.linear(h, w_u), w_o)


def transformer_block(
    d_model: int, n_heads: int, width: int, eps: float, active_width: int | None = None
) -> PreNormBlock:
    """The Transformer++ block: causal attention, then SwiGLU. Parameters: 4d^2 + 3dF + 2d."""
    attn = CausalSelfAttention(d_model, n_heads)
    return PreNormBlock(d_model, eps, attn, SwiGLU(d_model, width, active_width))
