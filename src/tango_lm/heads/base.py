"""The head interface. A head owns the vocabulary tables, so it embeds the input tokens as well
as producing the output distribution (onóna's input is the average of its two tables)."""

from __future__ import annotations

import torch
from torch import nn

from tango_lm.models.config import ModelConfig


class Head(nn.Module):
    """Subclasses implement `embed`, `log_probs` and `nll`, and the static parameter counts."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> input vectors [B, T, d]."""
        raise NotImplementedError

    def log_probs(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, T, d] -> normalized next-token log-probs [B, T, V] in fp32."""
        raise NotImplementedError

    def nll(self, h: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed NLL in nats (fp32 scalar) of targets [B, T] through the head's loss path."""
        raise NotImplementedError

    @staticmethod
    def embedding_params(cfg: ModelConfig) -> int:
        """Parameters in vocabulary tables (reported as 'embedding')."""
        raise NotImplementedError

    @staticmethod
    def extra_params(cfg: ModelConfig) -> int:
        """Head parameters that are not vocabulary tables (counted as non-embedding)."""
        return 0

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> int:
        """Weights each position multiplies through in the output projection(s)."""
        raise NotImplementedError
