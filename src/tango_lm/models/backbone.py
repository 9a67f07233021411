"""A stack of block *applications*: `depth` applications drawn from a list of unique blocks.

Untied models apply block i at step i; looped models (Loop Transformer++, TANGO) apply block 0
`depth` times. Each block receives the application index so variants (TANGO with three
gated-projection sets) can pick weights by position in the loop.
"""

from __future__ import annotations

import torch
from torch import nn

from tango_lm.layers.rope import rope_tables


class Backbone(nn.Module):
    def __init__(self, layers: list[nn.Module], schedule: list[int], head_dim: int, rope_theta: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.schedule = list(schedule)
        self.head_dim = head_dim
        self.rope_theta = rope_theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rope = rope_tables(x.shape[1], self.head_dim, self.rope_theta, x.device, dtype=x.dtype)
        for application, index in enumerate(self.schedule):
            x = self.layers[index](x, rope, application)
        return x
