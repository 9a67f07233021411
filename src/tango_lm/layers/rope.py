"""Rotary position embedding, rotate-half form (docs/design.md §1)."""

from __future__ import annotations

import torch


def rope_tables(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    start: int | torch.Tensor = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq_len, head_dim] for positions start .. start+seq_len-1, computed in
    float64 (exact angles at long positions) and returned in `dtype` (at least fp32). `start` may
    be a device tensor [1] (static decode steps: no host value, one graph for every position)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    pos = torch.arange(seq_len, device=device, dtype=torch.float64) + start
    emb = torch.outer(pos, inv_freq).repeat(1, 2)
    dtype = torch.promote_types(dtype, torch.float32)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, d_h] by the tables [T, d_h]; computed in the tables' dtype, returned in x's."""
    xf = x.to(cos.dtype)
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
