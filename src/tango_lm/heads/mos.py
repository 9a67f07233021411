"""Heads that mix or reshape softmaxes under one tied table (seed 001, Section 3.3; docs/design.md §3).

- `mos`: mixture of softmaxes (Yang et al. 2018, seed 001 Eq. 3) with K = 2:
  `p = Σ_k π_k softmax(E tanh(W_k h))`, `π = softmax(W_π h)`.
- `sigsoftmax` (Kanai et al. 2018): `p_v ∝ exp(z_v) σ(z_v)`, i.e. `log_softmax(z + logsigmoid(z))`
  with `z = h Eᵀ`; no parameters beyond E.
- `moss`: MoS whose components are sigsoftmax.

Parameters: docs/design.md §3 counts MoS's extra as K·d² + K·d. Following docs/design.md §1 ("no biases") and the
paper ("all output projections are bias-free"), that is `latent_proj` (W_1..W_K stacked, K·d x d,
no bias: K·d²) plus `prior_proj` (W_π, K x d, no bias: K·d); no biases anywhere. Both are drawn
N(0, init_std²) after E, and E is drawn like the Standard head's, so it equals Standard's E
under the same seed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tango_lm.heads.base import Head, float_logits, vocab_table
from tango_lm.heads.standard import StandardHead
from tango_lm.models.config import ModelConfig
from tango_lm.ops.twin_loss import mixture_nll, softmax_nll

MOS_COMPONENTS = 2


def sigsoftmax_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """`log_softmax(z + logsigmoid(z))` over the last dimension."""
    return F.log_softmax(logits + F.logsigmoid(logits), dim=-1)


class SigsoftmaxHead(StandardHead):
    """Tied table `embed_tokens`; `log_softmax(z + logsigmoid(z))`, z = h Eᵀ."""

    display_name = "Sigsoftmax"

    def log_probs(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return sigsoftmax_log_probs(self.logits(h))

    def nll(self, h: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return softmax_nll(h, self.embed_tokens.weight, targets, sigsoftmax=True, chunk=self.loss_chunk)


class MosHead(Head):
    """Tied table `embed_tokens`, `latent_proj` (W_k, stacked) and `prior_proj` (W_π)."""

    display_name = "MoS"
    n_components = MOS_COMPONENTS
    vocab_projections = MOS_COMPONENTS
    sigsoftmax = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        k, d = self.n_components, cfg.d_model
        self.embed_tokens = vocab_table(cfg)
        self.latent_proj = nn.Linear(d, k * d, bias=False)
        self.prior_proj = nn.Linear(d, k, bias=False)
        for proj in (self.latent_proj, self.prior_proj):
            nn.init.normal_(proj.weight, std=cfg.init_std)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def components(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [..., d] -> (tanh(W_k h) [..., K, d], log π [..., K] in fp32 or wider)."""
        latent = torch.tanh(self.latent_proj(h)).unflatten(-1, (self.n_components, h.shape[-1]))
        prior = self.prior_proj(h)
        return latent, F.log_softmax(prior.to(torch.promote_types(prior.dtype, torch.float32)), dim=-1)

    def log_probs(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        latent, log_prior = self.components(h)
        logits = float_logits(latent, self.embed_tokens.weight)  # [..., K, V]
        lp = sigsoftmax_log_probs(logits) if self.sigsoftmax else F.log_softmax(logits, dim=-1)
        return torch.logsumexp(lp + log_prior.unsqueeze(-1).to(lp.dtype), dim=-2)

    def nll(self, h: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        latent, log_prior = self.components(h)
        latent = latent.reshape(-1, self.n_components, h.shape[-1])
        hs = [latent[:, k] for k in range(self.n_components)]
        shared_table = tuple((k, 0) for k in range(self.n_components))  # every component reads table 0
        return mixture_nll(
            hs,
            [self.embed_tokens.weight],
            targets,
            log_prior.reshape(-1, self.n_components),
            components=shared_table,
            sigsoftmax=self.sigsoftmax,
            chunk=self.loss_chunk,
        )

    @staticmethod
    def embedding_params(cfg: ModelConfig) -> int:
        return cfg.vocab_size * cfg.d_model

    @classmethod
    def extra_params(cls, cfg: ModelConfig) -> int:
        return cls.n_components * cfg.d_model**2 + cls.n_components * cfg.d_model

    @classmethod
    def matmul_params_per_token(cls, cfg: ModelConfig) -> int:
        return cls.n_components * cfg.vocab_size * cfg.d_model + cls.extra_params(cfg)


class MossHead(MosHead):
    """MoS with sigsoftmax components (MoSS)."""

    display_name = "MoSS"

    sigsoftmax = True
