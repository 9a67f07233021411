"""Causal softmax attention where the keys may extend further back than the queries.

During cached decoding the queries are the last T of S positions (S >= T): query i sits at
position S - T + i and sees keys 0 .. S - T + i. With S == T this is ordinary causal attention.

Values far wider than the keys (TANGO's gates: F/H columns per head against d_h) are a shape no
fused SDPA backend takes on CUDA (flash attention needs equal widths up to 256, cuDNN widths up to
256, the memory-efficient kernel multiples of 8), so one SDPA call there runs PyTorch's math
backend, which holds the [B, H, T, S] probabilities in fp32. `sliced_attention` cuts the values
into slices of at most `SDPA_SLICE` columns (a multiple of 8, zero-padded) and runs them as extra
heads with q and k broadcast to every slice, which the fused backends take. `causal_attention` is
the door (`ops/dispatch.py`): on CUDA the sliced SDPA whenever the values' width differs from the
keys', one SDPA call otherwise and everywhere else ('reference').
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tango_lm.ops.dispatch import check_devices, choose

SDPA_SLICE = 128  # widest value slice; fused SDPA backends take up to 256


def slices(width: int, max_slice: int = SDPA_SLICE) -> tuple[int, int]:
    """(n, s): the fewest slices of at most `max_slice` columns, each s columns wide, s a multiple of 8
    (n * s >= width; 1780 -> 14 x 128, 593 -> 5 x 120, 368 -> 3 x 128)."""
    n = _ceil_div(width, max_slice)
    return n, _ceil_div(_ceil_div(width, n), 8) * 8


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def offset_mask(t: int, s: int, device: torch.device) -> torch.Tensor | None:
    """[T, S] bool: query i (at position S - T + i) sees keys 0 .. S - T + i. None where no mask is
    needed (T == 1 sees every key; T == S is SDPA's `is_causal`)."""
    if t == 1 or t == s:
        return None
    rows = torch.arange(s - t, s, device=device)[:, None]
    return torch.arange(s, device=device)[None, :] <= rows


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One SDPA call: q [..., T, d_h], k [..., S, d_h], v [..., S, w] -> [..., T, w], queries aligned
    to the end; with `mask` [T, S] (a static decode step over a full-capacity cache) the keys it allows."""
    if mask is None:
        mask = offset_mask(q.shape[-2], k.shape[-2], q.device)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[-2] > 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sliced_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    max_slice: int = SDPA_SLICE,
) -> torch.Tensor:
    """Same contract as `sdpa_attention` for [B, H, ., .] inputs, with the values run as n slices of
    s columns (`slices`): q, k broadcast to [B, H * n, ., d_h], v to [B, H * n, S, s]; one copy of each."""
    b, h, s_len, w = v.shape
    n, s = slices(w, max_slice)
    if n == 1 and s == w:
        return sdpa_attention(q, k, v, mask)
    t = q.shape[-2]
    values = F.pad(v, (0, n * s - w)).unflatten(-1, (n, s)).transpose(2, 3).reshape(b, h * n, s_len, s)
    qs, ks = (x.unsqueeze(2).expand(b, h, n, *x.shape[-2:]).reshape(b, h * n, *x.shape[-2:]) for x in (q, k))
    out = sdpa_attention(qs, ks, values, mask)
    return out.view(b, h, n, t, s).transpose(2, 3).reshape(b, h, t, n * s)[..., :w]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *, kernels: str | None = None
) -> torch.Tensor:
    """q [..., T, d_h], k [..., S, d_h], v [..., S, w] -> [..., T, w], queries aligned to the end;
    with `mask` [T, S] the keys it allows. On CUDA values of another width than the keys run sliced
    (`sliced_attention`), never on SDPA's math backend; `kernels` or $TANGO_LM_KERNELS overrides
    ('reference': one SDPA call; 'sdpa-sliced', for [B, H, ., .] inputs)."""
    check_devices("causal_attention", q=q, k=k, v=v)
    four_d = q.dim() == k.dim() == v.dim() == 4
    auto = "sdpa-sliced" if v.is_cuda and four_d and v.shape[-1] != q.shape[-1] else "reference"
    if choose({"reference": True, "sdpa-sliced": four_d}, auto, kernels) == "sdpa-sliced":
        return sliced_attention(q, k, v, mask)
    return sdpa_attention(q, k, v, mask)
