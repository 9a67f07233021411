"""The head interface. A head owns the vocabulary tables, so it embeds the input tokens as well
as producing the output distribution (onóna's input is the average of its two tables)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tango_lm.models.config import ModelConfig
from tango_lm.ops.twin_loss import LOSS_CHUNK


class Head(nn.Module):
    """Subclasses implement `embed`, `log_probs` and `nll`, and the static parameter counts."""

    display_name: str = ""  # in reports ("Standard"); empty: the registry name
    vocab_projections: int = 1  # projections onto the vocabulary per position (h E^T, or two for mixtures)
    # Positions per chunk of a fused loss (ops/twin_loss.py); set it on the instance
    # (`model.head.loss_chunk = 512`) to trade speed for memory.
    loss_chunk: int = LOSS_CHUNK
    # What a head may offer beyond the three methods, declared here so that generate, serve, eval
    # and bench ask the head (a new head states what it takes) instead of looking for a method:
    # exact temperature-1 sampling with one vocabulary projection per position, through
    # `sample(h, ids, generator, vocab_size)` and `sample_static(h, ids, noise, vocab_size)` (onóna)
    one_projection_sampling: bool = False
    # twin tables that `eval --ablate A|B` can run alone, through the instance's `ablation`
    twin_tables: bool = False

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """The context decoding runs in (onóna folds its tables for static steps); nothing here."""
        yield

    def serving_tensors(self) -> tuple[torch.Tensor, ...]:
        """While serving, the tensors a static decode step reads that are made from the weights
        when the step begins (before a compiled step, which must not make them); none here."""
        return ()

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


def vocab_table(cfg: ModelConfig) -> nn.Embedding:
    """A V x d table drawn N(0, init_std^2) (docs/design.md §1), built like the Standard head's, so a head's
    first table equals Standard's E under the same seed."""
    table = nn.Embedding(cfg.vocab_size, cfg.d_model)
    nn.init.normal_(table.weight, std=cfg.init_std)
    return table


def float_logits(h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`h tableᵀ` in fp32, or wider for a float64 model."""
    logits = F.linear(h, table)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))
