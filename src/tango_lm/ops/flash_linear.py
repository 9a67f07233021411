"""FLASH's global linear attention across groups (Hua et al. 2022, docs/design.md §2.7), causal form.

Positions are cut into groups of `g` aligned to position 0 (group of t is `t // g`). Position t
attends linearly to every source in an *earlier* group:

    out_t = scale * sum_{j : j // g < t // g} (q_t . k_j) v_j
          = scale * q_t @ (sum_{groups c < t // g} K_c^T V_c)

so the chunked form builds one `K_c^T V_c` per group and takes an exclusive cumulative sum over
groups (the paper's pseudocode: cumsum, then shift by one group). Sources inside t's own group
are FLASH's quadratic part and are not counted here. Cost O(T s e), memory O(T/g s e).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def group_linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_size: int, scale: float = 1.0
) -> torch.Tensor:
    """q, k [..., T, s], v [..., T, e] -> [..., T, e]: linear attention to earlier groups only.

    T need not be a multiple of `group_size`: the tail is zero-padded into a last group, which
    no real position reads (only later groups read a group's sum)."""
    t, g = q.shape[-2], group_size
    if t <= g:  # one group: nothing earlier to attend to
        return v.new_zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.promote_types(q.dtype, v.dtype))
    pad = -t % g
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    groups = (t + pad) // g
    qg, kg, vg = (x.unflatten(-2, (groups, g)) for x in (q, k, v))  # [..., G, g, w]
    kv = kg.transpose(-1, -2) @ vg  # [..., G, s, e]: K_c^T V_c per group
    # Exclusive cumulative sum over groups, accumulated in fp32 or wider (up to T/g terms).
    wide = torch.promote_types(kv.dtype, torch.float32)
    total = kv[..., :-1, :, :].to(wide).cumsum(-3).to(kv.dtype)
    earlier = torch.cat([torch.zeros_like(kv[..., :1, :, :]), total], dim=-3)
    out = (qg @ earlier) * scale  # [..., G, g, e]
    return out.flatten(-3, -2)[..., :t, :]


def group_linear_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_size: int, scale: float = 1.0
) -> torch.Tensor:
    """The same quantity from an explicit T x T mask (source group < destination group); O(T^2)."""
    t = q.shape[-2]
    group = torch.arange(t, device=q.device) // group_size
    mask = group[None, :] < group[:, None]  # [dest, source]
    scores = (q @ k.transpose(-1, -2)) * mask.to(q.dtype)
    return (scores @ v) * scale
