"""A stack of block *applications*: `depth` applications drawn from a list of unique blocks.

Untied models apply block i at step i; looped models (Loop Transformer++, TANGO) apply block 0
`depth` times. Each block receives the application index so variants (TANGO with three
gated-projection sets) can pick weights by position in the loop, and the decode state of that
application (`serve/cache.py`).

Activation checkpointing (`train.activation_checkpointing`): in a training forward that builds a
graph, each application runs under `torch.utils.checkpoint` (non-reentrant), so autograd keeps
only its input and the backward recomputes the rest; a looped block is checkpointed once per
application. Decoding, evaluation and `no_grad` forwards never recompute.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tango_lm.layers.rope import rope_tables
from tango_lm.serve.cache import DecodeCache


class Backbone(nn.Module):
    def __init__(self, layers: list[nn.Module], schedule: list[int], head_dim: int, rope_theta: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.schedule = list(schedule)
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.activation_checkpointing = False  # set by LanguageModel.set_activation_checkpointing

    def recomputes(self, cache: DecodeCache | None) -> bool:
        """Whether this forward checkpoints its applications: training with a graph, no cache."""
        return self.activation_checkpointing and self.training and cache is None and torch.is_grad_enabled()

    def forward(self, x: torch.Tensor, cache: DecodeCache | None = None) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d]. With a cache, x holds the positions after those already
        cached, and each application reads and extends its own state."""
        start = cache.position if cache is not None else 0
        rope = rope_tables(x.shape[1], self.head_dim, self.rope_theta, x.device, start=start, dtype=x.dtype)
        recompute = self.recomputes(cache)
        for application, index in enumerate(self.schedule):
            if recompute:
                x = self.recomputed(self.layers[index], x, rope, application)
            else:
                state = cache.states[application] if cache is not None else None
                x = self.layers[index](x, rope, application, state)
        return x

    def recomputed(self, layer: nn.Module, x: torch.Tensor, rope: tuple, application: int) -> torch.Tensor:
        """One application under activation checkpointing; a backbone whose layers keep statistics
        (MoE) overrides it so that nothing is written inside the recomputed region (Dynamo breaks
        the graph at a side effect there)."""
        return checkpoint(layer, x, rope, application, None, use_reentrant=False)
