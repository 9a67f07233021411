"""TANGO's wide-gate average (docs/design.md §2.2).

For each head h, `gbar^h_t = sum_{s<=t} softmax_s(q^h_t . k^h_s / sqrt(d_h)) g^h_s`, where the
values are the source gates g (width F/H per head, usually far wider than d_h). It is causal
attention with the gates as values, and the value width makes the probabilities-times-gates
matmuls the cost. `gate_average_sdpa` is one `scaled_dot_product_attention` call, batched over
heads (no per-head loop, no per-(t, s) products), and runs fused kernels on GPUs;
`gate_average_reference` is the plain definition it is tested against. The TANGO block on a CPU
uses the fused op in `tango_mix.py`, which also folds in the SiLU and the product by u.

The fused CPU op skips the all-zero blocks above the diagonal, with each matmul split so that
its pieces stay wide (`tango_mix._blocks`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, H*w] -> [B, H, T, w]."""
    b, t, c = x.shape
    return x.view(b, t, n_heads, c // n_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, w] -> [B, T, H*w]."""
    b, h, t, w = x.shape
    return x.transpose(1, 2).reshape(b, t, h * w)


def gate_average_reference(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Naive reference: explicit score matrix, mask, softmax and weighted sum, in at least fp32."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    qf, kf, gf = q.to(dtype), k.to(dtype), g.to(dtype)
    t = q.shape[-2]
    scores = qf @ kf.transpose(-1, -2) / q.shape[-1] ** 0.5
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (probs @ gf).to(g.dtype)


def gate_average_sdpa(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """q, k: [..., T, d_h]; g: [..., T, w] -> [..., T, w]."""
    return F.scaled_dot_product_attention(q, k, g, is_causal=True)


def gate_average(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The causal average of the gates (the default path)."""
    return gate_average_sdpa(q, k, g)
