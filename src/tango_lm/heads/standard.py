"""The Standard head: one tied table E for input and output, `log_softmax(h E^T)` (docs/design.md §3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tango_lm.heads.base import Head, float_logits
from tango_lm.models.config import ModelConfig
from tango_lm.ops.twin_loss import softmax_nll


class StandardHead(Head):
    display_name = "Standard"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed_tokens.weight, std=cfg.init_std)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Output logits in fp32 (or wider, for a float64 model)."""
        return float_logits(h, self.embed_tokens.weight)

    def log_probs(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.logits(h), dim=-1)

    def nll(self, h: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Chunked like every other head, so head comparisons run on the same loss path.
        return softmax_nll(h, self.embed_tokens.weight, targets, chunk=self.loss_chunk)

    @staticmethod
    def embedding_params(cfg: ModelConfig) -> int:
        return cfg.vocab_size * cfg.d_model

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> int:
        return cfg.vocab_size * cfg.d_model
