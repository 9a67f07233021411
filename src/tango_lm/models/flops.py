"""Analytic model FLOPs per trained token (forward + backward = 3x forward).

Forward FLOPs per token are 2 x (weights multiplied, loops counted per application, plus the
output projection) plus the token-mixing FLOPs averaged over a causal sequence, where position t
sees t + 1 sources. Elementwise work (norms, activations, softmax) is not counted, as usual for MFU,
and neither is recomputation (`train.activation_checkpointing` reruns each block's forward in the
backward: hardware FLOPs rise, model FLOPs and so MFU do not).

Rotating narrow-width training (`active_width`, docs/design.md §2.6) runs only K of each head's (or the FFN's)
gated columns per step, so by default the count is what a training step runs: the active columns,
averaged over one rotation (the last segment may be shorter). `full_width=True` counts every
column, as evaluation with all segments runs; without `active_width` the two are the same.
"""

from __future__ import annotations

from tango_lm.models.config import ModelConfig


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, *, full_width: bool = False) -> int:
    from tango_lm.heads.registry import HEADS
    from tango_lm.models.registry import ARCHITECTURES

    if full_width and cfg.active_width is not None:
        cfg = cfg.replace(active_width=None)
    arch, head = ARCHITECTURES[cfg.arch], HEADS[cfg.head]
    matmul = arch.matmul_params_per_token(cfg) + head.matmul_params_per_token(cfg)
    return int(2 * matmul + arch.attention_flops_per_token(cfg, seq_len))


def flops_per_token(cfg: ModelConfig, seq_len: int, *, full_width: bool = False) -> int:
    """Training FLOPs per token: forward plus a backward of twice the forward (`full_width`: every
    gated column, not only the active ones of rotating narrow-width training)."""
    return 3 * forward_flops_per_token(cfg, seq_len, full_width=full_width)
