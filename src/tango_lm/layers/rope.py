"""Rotary position embedding, rotate-half form (SPEC 1)."""

from __future__ import annotations

import torch


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [seq_len, head_dim] for positions start .. start+seq_len-1."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    pos = torch.arange(start, start + seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, d_h] by the tables [T, d_h]; computed in fp32, returned in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
