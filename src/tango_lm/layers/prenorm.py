"""The pre-norm block `x += mixer(RMSNorm(x)); x += ffn(RMSNorm(x))`, parameterized by its token
mixer and its feed-forward.

Transformer++ (causal attention + SwiGLU, docs/design.md §2.1), Dense (GQA with QK-norm + SwiGLU,
§4.1), the GDN hybrid's recurrent layers (Gated DeltaNet + SwiGLU, §4.2) and MoE (GQA + routed
SwiGLU experts, §4.3) are configurations of this one block; see the factories next to each mixer
(`transformer_block`, `dense_block`, `gated_deltanet_block`, `moe_block`).

The parts are called the same way whatever they are:

- `mixer(h, rope, state)`: h [B, T, d] already normed, the RoPE tables of these positions, and this
  application's decode state (None outside cached decoding); returns [B, T, d].
- `ffn(h, state)`: position-wise; it gets the decode state only to know that it is decoding (MoE
  serves decoding at its evaluation capacity).

State-dict names are those the blocks always had, so earlier checkpoints load: `attn_norm`, the
mixer under `mixer_name` (`attn`, or `linear_attn` for Gated DeltaNet as in Qwen3-Next),
`mlp_norm`, `mlp`. Submodules are registered in that order, which is also the order in which the
model initializes their weights.
"""

from __future__ import annotations

import torch
from torch import nn

from tango_lm.layers.norm import RMSNorm
from tango_lm.serve.cache import LayerState


class PreNormBlock(nn.Module):
    def __init__(self, d_model: int, eps: float, mixer: nn.Module, ffn: nn.Module, mixer_name: str = "attn") -> None:
        super().__init__()
        self.attn_norm = RMSNorm(d_model, eps)
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.mlp_norm = RMSNorm(d_model, eps)
        self.mlp = ffn

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        application: int = 0,
        state: LayerState | None = None,
    ) -> torch.Tensor:
        x = x + self.mixer(self.attn_norm(x), rope, state)
        return x + self.mlp(self.mlp_norm(x), state)
