"""Analytic model FLOPs per trained token (forward + backward = 3x forward).

Forward FLOPs per token are 2 x (weights multiplied, loops counted per application, plus the
output projection) plus the token-mixing FLOPs averaged over a causal sequence, where position t
sees t + 1 sources. Elementwise work (norms, activations, softmax) is not counted, as usual for MFU.
"""

from __future__ import annotations

from tango_lm.models.config import ModelConfig


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    from tango_lm.heads.registry import HEADS
    from tango_lm.models.registry import ARCHITECTURES

    arch, head = ARCHITECTURES[cfg.arch], HEADS[cfg.head]
    matmul = arch.matmul_params_per_token(cfg) + head.matmul_params_per_token(cfg)
    return 2 * matmul + arch.attention_flops_per_token(cfg, seq_len)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: forward plus a backward of twice the forward."""
    return 3 * forward_flops_per_token(cfg, seq_len)
