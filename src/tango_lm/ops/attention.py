"""Causal softmax attention where the keys may extend further back than the queries.

During cached decoding the queries are the last T of S positions (S >= T): query i sits at
position S - T + i and sees keys 0 .. S - T + i. With S == T this is ordinary causal attention.

Values far wider than the keys (TANGO's gates: F/H columns per head against d_h) are a shape no
fused SDPA backend takes on CUDA (flash attention needs equal widths up to 256, cuDNN widths up to
256, the memory-efficient kernel multiples of 8), so one SDPA call there runs PyTorch's math
backend, which holds the [B, H, T, S] probabilities in fp32. `sliced_attention` cuts the values
into slices of at most `SDPA_SLICE` columns (a multiple of 8, zero-padded) and runs them as extra
heads with q and k broadcast to every slice, which the fused backends take (a decode step, one
query, computes its probabilities once for every slice instead: `step_over_slices`). `causal_attention` is
the door (`ops/dispatch.py`): on CUDA the sliced SDPA whenever the values' width differs from the
keys', one SDPA call otherwise and everywhere else ('reference').
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tango_lm.ops.dispatch import check_devices, choose

SDPA_SLICE = 128  # widest value slice; fused SDPA backends take up to 256


def slices(width: int, max_slice: int | None = None) -> tuple[int, int]:
    """(n, s): the fewest slices of at most `max_slice` columns (None: `SDPA_SLICE`, read at the
    call), each s columns wide, s a multiple of 8 (n * s >= width; 1780 -> 14 x 128, 593 -> 5 x 120,
    368 -> 3 x 128)."""
    n = _ceil_div(width, max_slice or SDPA_SLICE)
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


def grouped_step_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """One decode step of grouped-query attention: q [B, H, 1, d_h] against the G = H / KV query
    heads' shared k, v [B, KV, S, .] -> [B, H, 1, w], every key seen (`mask` [1, S]: the keys a static
    step allows). A group's queries ride as G rows of their key/value head, so the cache is read in
    place; repeating it per query head copied the whole cache G times per layer per token."""
    check_devices("grouped_step_attention", q=q, k=k, v=v)
    b, h, _, d = q.shape
    kv = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, kv, h // kv, d), k, v, attn_mask=mask)  # never causal
    return out.reshape(b, h, 1, v.shape[-1])


def value_slices(v: torch.Tensor, max_slice: int | None = None) -> torch.Tensor:
    """[B, H, S, w] -> [B, H * n, S, s]: the values as n zero-padded slices of s columns (`slices`),
    slice-major, one copy. A decode cache keeps wide values in this layout, so a step copies none."""
    b, h, s_len, w = v.shape
    n, s = slices(w, max_slice)
    if n == 1 and s == w:
        return v
    return F.pad(v, (0, n * s - w)).unflatten(-1, (n, s)).transpose(2, 3).reshape(b, h * n, s_len, s)


def attention_over_slices(
    q: torch.Tensor, k: torch.Tensor, v_slices: torch.Tensor, width: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`sdpa_attention` of q, k [B, H, ., d_h] over values laid out by `value_slices` ([B, H * n, S, s]),
    with q and k broadcast to every slice: [B, H, T, width]."""
    b, h, t = q.shape[:3]
    n, s = v_slices.shape[1] // h, v_slices.shape[-1]
    if t == 1:
        return step_over_slices(q, k, v_slices, width, mask)
    qs, ks = (x.unsqueeze(2).expand(b, h, n, *x.shape[-2:]).reshape(b, h * n, *x.shape[-2:]) for x in (q, k))
    out = sdpa_attention(qs, ks, v_slices, mask)
    return out.view(b, h, n, t, s).transpose(2, 3).reshape(b, h, t, n * s)[..., :width]


def step_over_slices(
    q: torch.Tensor, k: torch.Tensor, v_slices: torch.Tensor, width: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`attention_over_slices` for one query per head (a decode step), every key seen but those
    `mask` [1, S] hides: the probabilities [B, H, 1, S] once (scores in float32 at least), applied to
    every slice by one batched product. Run as extra SDPA heads, each slice would recompute them
    from its own copy of the keys, n copies of the cache's keys per step; with one query there is
    no [T, S] matrix to keep out of memory."""
    b, h = q.shape[:2]
    n, s = v_slices.shape[1] // h, v_slices.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False):  # autocast would round the scores to bf16
        scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = scores.softmax(-1).to(v_slices.dtype).unsqueeze(2)  # [B, H, 1, 1, S], broadcast over the slices
    out = torch.matmul(p, v_slices.view(b, h, n, *v_slices.shape[-2:]))  # [B, H, n, 1, s]
    return out.reshape(b, h, 1, n * s)[..., :width]


def sliced_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    max_slice: int | None = None,
) -> torch.Tensor:
    """Same contract as `sdpa_attention` for [B, H, ., .] inputs, with the values run as n slices of
    s columns (`slices`): q, k broadcast to [B, H * n, ., d_h], v to [B, H * n, S, s]; one copy of each."""
    w = v.shape[-1]
    n, s = slices(w, max_slice)
    if n == 1 and s == w:
        return sdpa_attention(q, k, v, mask)
    return attention_over_slices(q, k, value_slices(v, max_slice), w, mask)


def runs_sliced(q: torch.Tensor, v: torch.Tensor, kernels: str | None = None) -> bool:
    """`causal_attention`'s choice: the sliced SDPA (True) or one SDPA call. On CUDA values of another
    width than the queries' run sliced; `kernels` or $TANGO_LM_KERNELS overrides."""
    four_d = q.dim() == v.dim() == 4
    auto = "sdpa-sliced" if v.is_cuda and four_d and v.shape[-1] != q.shape[-1] else "reference"
    return choose({"reference": True, "sdpa-sliced": four_d}, auto, kernels) == "sdpa-sliced"


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *, kernels: str | None = None
) -> torch.Tensor:
    """q [..., T, d_h], k [..., S, d_h], v [..., S, w] -> [..., T, w], queries aligned to the end;
    with `mask` [T, S] the keys it allows. On CUDA values of another width than the keys run sliced
    (`sliced_attention`), never on SDPA's math backend; `kernels` or $TANGO_LM_KERNELS overrides
    ('reference': one SDPA call; 'sdpa-sliced', for [B, H, ., .] inputs)."""
    check_devices("causal_attention", q=q, k=k, v=v)
    if runs_sliced(q, v, kernels):
        return sliced_attention(q, k, v, mask)
    return sdpa_attention(q, k, v, mask)
