"""GAU, the gated attention unit (Hua et al. 2022, "Transformer Quality in Linear Time"; docs/design.md §2.7).

One GAU layer replaces both attention and the FFN of a Transformer block:

    h      = RMSNorm(x)
    [U|V]  = silu(h W_uv + b_uv)                      # d -> 2e
    Z      = silu(h W_z + b_z)                        # d -> s, one shared query/key base
    Q, K   = RoPE(Z * gamma_q + beta_q), RoPE(Z * gamma_k + beta_k)
    A[t,j] = relu(Q_t . K_j / n + b[t - j])^2  for j <= t, else 0
    x     += (U * (A V)) W_o + b_o

`n` is the model's context length (not the batch's sequence length), so a position's output does
not depend on how many positions follow it and cached decoding reproduces the full forward.
Unlike the rest of the project these layers have biases, as in the paper's pseudocode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tango_lm.layers.norm import LayerNorm, RMSNorm
from tango_lm.layers.rope import apply_rope
from tango_lm.ops.relu2_attention import relu2_attention
from tango_lm.serve.cache import LayerState


def offset_scale(z: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Per-head offset and scale of a shared base: z [B, T, s], gamma, beta [H, s] -> [B, H, T, s]."""
    return z.unsqueeze(1) * gamma[:, None, :].to(z.dtype) + beta[:, None, :].to(z.dtype)


class GatedUnit(nn.Module):
    """What GAU and FLASH share: the norm, the projections, the offset-scales and the relative
    bias; subclasses define `mix`, the attention that produces A V.

    Init: the model draws every W ~ N(0, init_std^2) and zeroes every linear bias; here
    gamma ~ N(0, init_std^2), beta = 0 and the relative bias = 0, as in the paper's pseudocode
    (`scale_offset`, with Adam the small gamma grows within the first steps)."""

    no_weight_decay = ("gamma", "beta")  # per-dimension scales and offsets: vectors, stored stacked (train/optim.py)

    def __init__(
        self,
        d_model: int,
        width: int,
        qk_dim: int,
        n_offsets: int,
        bias_range: int,
        eps: float,
        init_std: float,
        norm: str = "rmsnorm",
    ) -> None:
        super().__init__()
        self.width = width
        # design.md §2.7's RMSNorm, or a LayerNorm with a bias (+d per layer: seed 000 Table 3's
        # non-embedding ranges come closer; docs/table3-ranges.md).
        self.norm = LayerNorm(d_model, eps) if norm == "layernorm" else RMSNorm(d_model, eps)
        self.uv_proj = nn.Linear(d_model, 2 * width)  # [U | V]
        self.z_proj = nn.Linear(d_model, qk_dim)  # the shared query/key base Z
        self.gamma = nn.Parameter(torch.empty(n_offsets, qk_dim).normal_(std=init_std))
        self.beta = nn.Parameter(torch.zeros(n_offsets, qk_dim))
        self.rel_bias = nn.Parameter(torch.zeros(2 * bias_range - 1))  # offsets -(L-1) .. L-1
        self.o_proj = nn.Linear(width, d_model)

    def mix(self, base: torch.Tensor, v: torch.Tensor, state: LayerState | None) -> torch.Tensor:
        """A V [B, T, e] from the rotated offset-scaled bases [B, n_offsets, T, s] and V [B, T, e]."""
        raise NotImplementedError

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        application: int = 0,
        state: LayerState | None = None,
    ) -> torch.Tensor:
        cos, sin = rope
        h = self.norm(x)
        u, v = F.silu(self.uv_proj(h)).split(self.width, dim=-1)
        base = apply_rope(offset_scale(F.silu(self.z_proj(h)), self.gamma, self.beta), cos, sin)
        return x + self.o_proj(u * self.mix(base, v, state))


class GAULayer(GatedUnit):
    """One GAU layer: full causal relu^2 attention scaled by 1/n, relative bias over 2n - 1 offsets.
    Parameters: 3de + 2e + ds + s + 4s + d + d + (2n - 1) (+ d with `norm="layernorm"`).
    Decoding caches K and V."""

    def __init__(
        self,
        d_model: int,
        width: int,
        qk_dim: int,
        context_length: int,
        eps: float = 1e-6,
        init_std: float = 0.02,
        norm: str = "rmsnorm",
    ) -> None:
        super().__init__(d_model, width, qk_dim, 2, context_length, eps, init_std, norm)
        self.scale = 1.0 / context_length

    def mix(self, base: torch.Tensor, v: torch.Tensor, state: LayerState | None) -> torch.Tensor:
        q, k = base.unbind(1)
        if state is not None:  # decoding: the new queries see every cached key and value
            k, v = state.append("k", k), state.append("v", v)
        position = state.position if state is not None else None  # static steps: the whole buffer
        return relu2_attention(q, k, v, self.rel_bias, self.scale, position)
