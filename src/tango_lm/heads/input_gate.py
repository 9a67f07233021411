"""The input-gate control (seed 001, Section 4.1; docs/design.md §3): a learned input mixture with an averaged
single-table head.

Input row of token v: `g_v A_v + (1 - g_v) B_v` with `g_v = σ(wᵀ rmsnorm(M_v))`, M = (A + B)/2;
head `log_softmax(h Mᵀ)`. It has onóna's parameters (`table_a`, `table_b`, `gate`: 2Vd + d) and
draws them in the same order, but gates the input instead of the output, so its head keeps the
single-softmax rank bound.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tango_lm.heads.base import Head, float_logits, vocab_table
from tango_lm.heads.onona import TokenGate
from tango_lm.models.config import ModelConfig
from tango_lm.ops.twin_loss import softmax_nll


class InputGateHead(Head):
    display_name = "Input gate"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.table_a = vocab_table(cfg)
        self.table_b = vocab_table(cfg)
        self.gate = TokenGate(cfg.d_model, cfg.norm_eps)

    def merged_table(self) -> torch.Tensor:
        """M = (A + B) / 2 [V, d], the output table."""
        return 0.5 * (self.table_a.weight + self.table_b.weight)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        a, b = self.table_a(input_ids), self.table_b(input_ids)
        g = torch.sigmoid(self.gate(0.5 * (a + b))).unsqueeze(-1).to(a.dtype)
        return g * a + (1 - g) * b

    def log_probs(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(float_logits(h, self.merged_table()), dim=-1)

    def nll(self, h: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return softmax_nll(h, self.merged_table(), targets, chunk=self.loss_chunk)

    @staticmethod
    def embedding_params(cfg: ModelConfig) -> int:
        return 2 * cfg.vocab_size * cfg.d_model

    @staticmethod
    def extra_params(cfg: ModelConfig) -> int:
        return cfg.d_model

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> int:
        return cfg.vocab_size * cfg.d_model + cfg.d_model
