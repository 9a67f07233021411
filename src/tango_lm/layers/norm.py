"""RMSNorm computed in fp32 or wider (docs/design.md §1), with an optional learned weight; and
LayerNorm (weight and bias, the same fp32 statistics) for GAU/FLASH's `gau_norm: layernorm` reading."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Weightless RMSNorm over the last dimension, in fp32 or wider, returned in x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """`x / rms(x) * weight`; the statistics are taken in fp32 whatever the autocast dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(xf.dtype)
        return y.to(x.dtype)


class LayerNorm(nn.Module):
    """`(x - mean(x)) / std(x) * weight + bias`, statistics in fp32 whatever the autocast dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        y = torch.nn.functional.layer_norm(
            xf, xf.shape[-1:], self.weight.to(xf.dtype), self.bias.to(xf.dtype), self.eps
        )
        return y.to(x.dtype)
