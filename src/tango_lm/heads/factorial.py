"""The 2x2 input-output factorial cells (seed 001, Section 4.2 and Appendix B; docs/design.md §3).

The input is A[x_t] or M[x_t] = (A[x_t] + B[x_t])/2; the output is the A softmax
`q_A = softmax(h Aᵀ)` or the gated mixture `g_t q_A + (1 - g_t) q_B`, where a mixture cell's gate
reads the rmsnorm of *that cell's own input vector*: `g_t = σ(wᵀ rmsnorm(x_t⁽⁰⁾))`.

    name               input   output      parameters
    factorial-a-a      A       A-softmax   Vd          (Standard with the table named table_a)
    factorial-a-mix    A       mixture     2Vd + d
    factorial-m-a      M       A-softmax   2Vd
    factorial-m-mix    M       mixture     2Vd + d     (onóna itself: OnonaHead under the cell's name)

Like the paper, every cell draws the complete two-table model (A, B, gate, in onóna's order)
and then drops what it does not use, so under one seed A is the same in all four cells and
onóna; unused tables are not parameters of the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tango_lm.heads.base import Head, float_logits, vocab_table
from tango_lm.heads.onona import OnonaHead, TokenGate, twin_log_probs
from tango_lm.models.config import ModelConfig
from tango_lm.ops.twin_loss import softmax_nll, twin_nll


class FactorialHead(Head):
    """A cell of the grid; subclasses set `input_rows` ('a' or 'm') and `output` ('a' or 'mix')."""

    input_rows = "m"
    output = "mix"
    vocab_projections = 2

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        table_a, table_b = vocab_table(cfg), vocab_table(cfg)
        gate = TokenGate(cfg.d_model, cfg.norm_eps)
        self.table_a = table_a
        if self.uses_b():
            self.table_b = table_b
        if self.output == "mix":
            self.gate = gate

    @classmethod
    def uses_b(cls) -> bool:
        return cls.input_rows == "m" or cls.output == "mix"

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.input_rows == "a":
            return self.table_a(input_ids)
        return 0.5 * (self.table_a(input_ids) + self.table_b(input_ids))

    def gate_logit(self, input_ids: torch.Tensor) -> torch.Tensor:
        """z_t = wᵀ rmsnorm(x_t⁽⁰⁾) of this cell's input vector [B, T], fp32."""
        return self.gate(self.embed(input_ids))

    def log_probs(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if self.output == "a":
            return F.log_softmax(float_logits(h, self.table_a.weight), dim=-1)
        return twin_log_probs(h, self.table_a.weight, self.table_b.weight, self.gate_logit(input_ids))

    def nll(self, h: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.output == "a":
            return softmax_nll(h, self.table_a.weight, targets, chunk=self.loss_chunk)
        return twin_nll(
            h, self.table_a.weight, self.table_b.weight, self.gate_logit(input_ids), targets, chunk=self.loss_chunk
        )

    @classmethod
    def embedding_params(cls, cfg: ModelConfig) -> int:
        return (2 if cls.uses_b() else 1) * cfg.vocab_size * cfg.d_model

    @classmethod
    def extra_params(cls, cfg: ModelConfig) -> int:
        return cfg.d_model if cls.output == "mix" else 0

    @classmethod
    def matmul_params_per_token(cls, cfg: ModelConfig) -> int:
        if cls.output == "a":
            return cfg.vocab_size * cfg.d_model
        return 2 * cfg.vocab_size * cfg.d_model + cfg.d_model


class FactorialAA(FactorialHead):
    """Input A, output A-softmax: the grid's single-table corner."""

    input_rows, output = "a", "a"
    vocab_projections = 1


class FactorialAMix(FactorialHead):
    """Input A, output gated mixture (gate on rmsnorm(A[x_t])): the output role of B alone."""

    input_rows, output = "a", "mix"


class FactorialMA(FactorialHead):
    """Input M, output A-softmax: the input role of B alone (fixed averaging, no gate)."""

    input_rows, output = "m", "a"
    vocab_projections = 1


class FactorialMMix(OnonaHead):
    """Input M, output gated mixture: onóna itself, reported under its cell's name."""

    display_name = ""
