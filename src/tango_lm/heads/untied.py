"""The untied control: an input table `embed_tokens` and a separate output table `lm_head`
(`log_softmax(h Wᵀ)`), the same V x d extra as onóna's second table without input-output sharing
(seed 001, Table 5). Both tables are drawn N(0, init_std²), the input table first, so it equals
the Standard head's E under the same seed."""

from __future__ import annotations

import torch
from torch import nn

from tango_lm.heads.base import float_logits
from tango_lm.heads.standard import StandardHead
from tango_lm.models.config import ModelConfig
from tango_lm.ops.twin_loss import softmax_nll


class UntiedHead(StandardHead):
    display_name = "Untied head"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.lm_head.weight, std=cfg.init_std)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return float_logits(h, self.lm_head.weight)

    def nll(self, h: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return softmax_nll(h, self.lm_head.weight, targets, chunk=self.loss_chunk)

    @staticmethod
    def embedding_params(cfg: ModelConfig) -> int:
        return 2 * cfg.vocab_size * cfg.d_model
