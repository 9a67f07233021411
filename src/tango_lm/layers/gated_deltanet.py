"""Gated DeltaNet token mixer and block (docs/design.md §4.2, GDN hybrid; Yang, Kautz, Hatamizadeh, ICLR 2025).

    q, k, v = SiLU(ShortConv(W_q x)), SiLU(ShortConv(W_k x)), SiLU(ShortConv(W_v x))
    q, k    = L2-normalized per head (q also scaled by d_k^-1/2, as fla does)
    β       = σ(W_β x)                       (b_proj)
    log α   = −exp(A_log) · softplus(W_α x + dt_bias)   (a_proj)
    o       = gated delta rule (ops/delta_rule.py)
    out     = W_o(RMSNorm(o) ⊙ silu(W_g x))   (per head, weight `o_norm` over d_v shared by heads)

The structure, the names and the initialization (A ~ U(0, 16), dt log-uniform in [1e-3, 0.1]
through the inverse softplus, short convolutions without bias and with PyTorch's default init)
follow fla's `GatedDeltaNet` layer. Decoding keeps the recurrent state and the last
`conv_size - 1` pre-convolution inputs of q, k, v in `state.extra`, so a step costs O(1) in the
prefix length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tango_lm.layers.norm import RMSNorm
from tango_lm.layers.prenorm import PreNormBlock
from tango_lm.layers.transformer import SwiGLU
from tango_lm.ops.delta_rule import gated_delta_rule
from tango_lm.ops.gate_average import merge_heads, split_heads
from tango_lm.serve.cache import LayerState


def gdn_params(d_model: int, n_heads: int, head_k: int, head_v: int, conv_size: int) -> int:
    """q, k, v, g, o projections; a, b projections; A_log and dt_bias; three short convs; o_norm."""
    key, value = n_heads * head_k, n_heads * head_v
    return (
        2 * d_model * key
        + 3 * d_model * value
        + 2 * d_model * n_heads
        + 2 * n_heads
        + conv_size * (2 * key + value)
        + head_v
    )


class ShortConvolution(nn.Module):
    """Causal depthwise convolution over time, `y_t = Σ_j w_j x_{t−K+1+j}` per channel (no bias).
    With a decode state it continues from the last K − 1 inputs kept under `name`."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False)
        self.weight = conv.weight  # [C, 1, K]; the model draws it N(0, init_std²), as fla's models do
        self.kernel_size = kernel_size

    def forward(self, x: torch.Tensor, state: LayerState | None = None, name: str = "") -> torch.Tensor:
        """x [B, T, C] -> [B, T, C]."""
        keep = self.kernel_size - 1
        if state is None:
            window = F.pad(x, (0, 0, keep, 0))
        else:
            prev = state.read(name)
            if prev is None:
                prev = x.new_zeros(x.shape[0], keep, x.shape[2])
            window = torch.cat([prev, x], dim=1)
            state.write(name, window[:, window.shape[1] - keep :].detach() if keep else window[:, :0])
        return F.conv1d(window.transpose(1, 2), self.weight, groups=x.shape[-1]).transpose(1, 2)


class GatedDeltaNet(nn.Module):
    """The GDN token mixer: `n_heads` heads of key width `head_k` and value width `head_v`."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_k: int,
        head_v: int,
        conv_size: int,
        eps: float,
        chunk: int = 64,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.n_heads, self.head_k, self.chunk, self.backend = n_heads, head_k, chunk, backend
        key, value = n_heads * head_k, n_heads * head_v
        self.q_proj = nn.Linear(d_model, key, bias=False)
        self.k_proj = nn.Linear(d_model, key, bias=False)
        self.v_proj = nn.Linear(d_model, value, bias=False)
        self.a_proj = nn.Linear(d_model, n_heads, bias=False)  # W_α: the decay
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)  # W_β: the write strength
        self.g_proj = nn.Linear(d_model, value, bias=False)  # W_g: the output gate
        self.o_proj = nn.Linear(value, d_model, bias=False)
        self.q_conv1d = ShortConvolution(key, conv_size)
        self.k_conv1d = ShortConvolution(key, conv_size)
        self.v_conv1d = ShortConvolution(value, conv_size)
        self.o_norm = RMSNorm(head_v, eps)
        # Mamba-2 / fla initialization of the decay: A ~ U(0, 16), dt ~ logU(1e-3, 0.1).
        self.A_log = nn.Parameter(torch.empty(n_heads).uniform_(0, 16).clamp_(min=1e-4).log())
        dt = torch.exp(torch.rand(n_heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt); vectors: no weight decay

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None, state: LayerState | None = None
    ) -> torch.Tensor:
        """h [B, T, d] (already normed) -> [B, T, d]. `rope` is not used: the recurrence orders the
        positions itself (the argument is there because every mixer of a `PreNormBlock` gets it)."""
        q = F.silu(self.q_conv1d(self.q_proj(h), state, "conv_q"))
        k = F.silu(self.k_conv1d(self.k_proj(h), state, "conv_k"))
        v = F.silu(self.v_conv1d(self.v_proj(h), state, "conv_v"))
        q = F.normalize(split_heads(q, self.n_heads), dim=-1, eps=1e-6) * self.head_k**-0.5
        k = F.normalize(split_heads(k, self.n_heads), dim=-1, eps=1e-6)
        v = split_heads(v, self.n_heads)
        wide = torch.promote_types(h.dtype, torch.float32)  # gates in fp32 (float64 for a float64 model)
        beta = torch.sigmoid(self.b_proj(h).to(wide)).transpose(1, 2)  # [B, H, T]
        # The decay is computed in the delta rule's contiguous [B, H, T] layout, so its gradient and
        # its input agree in layout: where they differ, PyTorch's traced softplus_backward (2.11 and
        # 2.13) assumes a contiguous result while the kernel follows the gradient's strides, and the
        # compiled backward (AOTAutograd) then views the result over strides it did not trace.
        a = self.a_proj(h).to(wide).transpose(1, 2).contiguous()
        log_alpha = -self.A_log.to(wide).exp()[:, None] * F.softplus(a + self.dt_bias.to(wide)[:, None])
        s0 = state.read("S") if state is not None else None
        o, s = gated_delta_rule(q, k, v, beta, log_alpha, s0, self.chunk, self.backend if state is None else "torch")
        if state is not None:
            state.write("S", s.detach())
        gate = split_heads(F.silu(self.g_proj(h)), self.n_heads)
        return self.o_proj(merge_heads(self.o_norm(o) * gate))


def gated_deltanet_block(
    d_model: int,
    n_heads: int,
    head_k: int,
    head_v: int,
    conv_size: int,
    width: int,
    eps: float,
    chunk: int = 64,
    backend: str = "auto",
) -> PreNormBlock:
    """`x += GDN(RMSNorm(x)); x += SwiGLU(RMSNorm(x))`; the mixer is `linear_attn` (Qwen3-Next's name)."""
    gdn = GatedDeltaNet(d_model, n_heads, head_k, head_v, conv_size, eps, chunk, backend)
    return PreNormBlock(d_model, eps, gdn, SwiGLU(d_model, width), mixer_name="linear_attn")
