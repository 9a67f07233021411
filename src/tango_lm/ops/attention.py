"""Causal softmax attention where the keys may extend further back than the queries.

During cached decoding the queries are the last T of S positions (S >= T): query i sits at
position S - T + i and sees keys 0 .. S - T + i. With S == T this is ordinary causal attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [..., T, d_h], k [..., S, d_h], v [..., S, w] -> [..., T, w], queries aligned to the end;
    with `mask` [T, S] (a static decode step over a full-capacity cache) the keys it allows."""
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    t, s = q.shape[-2], k.shape[-2]
    if t == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if t == 1:
        return F.scaled_dot_product_attention(q, k, v)
    rows = torch.arange(s - t, s, device=q.device)[:, None]
    mask = torch.arange(s, device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
