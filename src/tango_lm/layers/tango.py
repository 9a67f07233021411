"""The TANGO block (docs/design.md §2.2): one block that replaces attention and the feed-forward network.

Each source token emits a SiLU gate `g = silu(h W_g)`; attention (q, k with RoPE, no value
projection) averages the gates per destination; the average gates the destination's projection
`u = h W_u`; `x += W_o(gbar * u)`. With self-only attention it is exactly a SwiGLU FFN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tango_lm.layers.gated_projections import add_gated_projections, gated_weights
from tango_lm.layers.norm import RMSNorm
from tango_lm.layers.rope import apply_rope
from tango_lm.ops.attention import attention_over_slices, runs_sliced, sdpa_attention, value_slices
from tango_lm.ops.dispatch import requested
from tango_lm.ops.gate_average import merge_heads, split_heads
from tango_lm.ops.tango_mix import tango_mix
from tango_lm.serve.cache import LayerState


def prefill_through_door(q: torch.Tensor, state: LayerState) -> bool:
    """Whether a cached forward runs the training forward's door (`mix`: the Triton kernels or the
    sliced SDPA on CUDA) and only stores its keys and gates: a plain prefill (nothing cached yet, no
    key mask), off the CPU or with an implementation named ($TANGO_LM_KERNELS). On CPUs 'auto'
    keeps the cached path's one SDPA call, and its numbers."""
    return state.empty() and (q.device.type != "cpu" or requested() != "auto")


def cache_and_attend(
    q: torch.Tensor, k: torch.Tensor, values: torch.Tensor, state: LayerState, name: str, attend: bool = True
) -> torch.Tensor | None:
    """Append k and the values [B, H, T, w] (under `name`) to the state and, with `attend`, return
    the new positions' average over everything cached, [B, H, T, w] (`causal_attention`'s door).
    Where it runs sliced (CUDA) the cache keeps the values slice-major (`value_slices`), so a decode
    step copies none of them."""
    sliced = runs_sliced(q, values)
    k_all = state.append("k", k)
    v_all = state.append(name, value_slices(values) if sliced else values)
    if not attend:
        return None
    if sliced:
        return attention_over_slices(q, k_all, v_all, values.shape[-1], state.key_mask())
    return sdpa_attention(q, k_all, v_all, state.key_mask())


class TangoBlockBase(nn.Module):
    """What every TANGO block shares: the block norm, the q, k projections ([B, H, T, d_h]) and the
    forward around the gate average; a variant says which weights make its gates (`gate_inputs`)
    and, where it averages something else, how it mixes (`mix`, `mix_cached`)."""

    def __init__(self, d_model: int, n_heads: int, eps: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm = RMSNorm(d_model, eps)
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)

    def raw_queries_keys(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k before RoPE (the windowed block's feature map reads these)."""
        return split_heads(self.q_proj(h), self.n_heads), split_heads(self.k_proj(h), self.n_heads)

    def queries_keys(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k with RoPE."""
        cos, sin = rope
        q_raw, k_raw = self.raw_queries_keys(h)
        return apply_rope(q_raw, cos, sin), apply_rope(k_raw, cos, sin)

    def gate_inputs(self, h: torch.Tensor, application: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gate pre-activations a, the projection u of the normed input h, and W_o."""
        raise NotImplementedError

    def mix(self, q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """`gbar * u` from q, k [B, H, T, d_h], gate pre-activations a and u [B, T, F]."""
        return tango_mix(q, k, a, u)

    def mix_cached(
        self, q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor, state: LayerState
    ) -> torch.Tensor:
        """Decoding: the new positions attend over the keys and gates cached for this application
        (`causal_attention`: sliced on CUDA); a plain prefill runs `mix` (`prefill_through_door`)."""
        g = split_heads(F.silu(a), self.n_heads)
        if prefill_through_door(q, state):
            cache_and_attend(q, k, g, state, "g", attend=False)
            return self.mix(q, k, a, u)
        return merge_heads(cache_and_attend(q, k, g, state, "g")) * u

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        application: int = 0,
        state: LayerState | None = None,
    ) -> torch.Tensor:
        h = self.norm(x)
        q, k = self.queries_keys(h, rope)
        a, u, w_o = self.gate_inputs(h, application)
        mixed = self.mix(q, k, a, u) if state is None else self.mix_cached(q, k, a, u, state)
        return x + F.linear(mixed, w_o)


class TangoBlock(TangoBlockBase):
    """Full-prefix TANGO. Parameters: 2d^2 + 3dF + d (plus the final norm, counted by the model)."""

    def __init__(self, d_model: int, n_heads: int, width: int, eps: float, active_width: int | None = None) -> None:
        super().__init__(d_model, n_heads, eps)
        add_gated_projections(self, d_model, n_heads, width, active_width)

    def gated_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W_g, W_u, W_o; under rotating narrow-width training only the active segment's columns."""
        return gated_weights(self)

    def gate_inputs(self, h: torch.Tensor, application: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w_g, w_u, w_o = self.gated_weights()  # the full weights unless a segment is selected
        return F.linear(h, w_g), F.linear(h, w_u), w_o
