"""Windowed TANGO's gate average (docs/design.md §2.3): exact scores in a recent window, a feature map beyond.

For destination t and source s <= t (per head; q, k [..., T, d_h], gates g [..., T, w]):

    w[t, s] = exp(q_t . k_s / sqrt(d_h))    for t - W < s <= t   (q, k with RoPE)
    w[t, s] = phi(q_t) . phi(k_s)           for s <= t - W       (phi of the UN-rotated q, k)
    gbar_t  = sum_s w[t, s] g_s / sum_s w[t, s]

Feature maps (`FEATURE_MAPS`): "elu+1" (the default of docs/design.md §2.3, phi(x) = elu(x) + 1 > 0) and "relu"
(phi(x) = max(x, 0); a destination whose older weights are all zero simply averages its window).
"exp" is not offered: phi(q) . phi(k) would then grow like exp(|q| + |k|) and overflow in fp32.

`windowed_gate_average` is linear in T. The sequence is cut into chunks of C >= W positions; a
destination in chunk i sees its whole window inside chunks i - 1 and i, so it takes exact and
feature-map weights against those 2C sources from one small [C, 2C] matrix, and everything older
(chunks <= i - 2, all outside its window) from an exclusive prefix sum over chunks of
S = sum_s phi(k_s) g_s^T ([d_h, w]) and z = sum_s phi(k_s) ([d_h]). Per head that is O(T C w) for
the band and O(T d_h w) for the prefix, with no [T, T] tensor and no loop in Python.
`windowed_gate_average_cached` is the decode form: new destinations aligned to the end of a short
run of recent sources, with (S, z) summarising every source before it.

Numerics: everything runs in fp32 (or float64 for float64 inputs). Each row subtracts its stabiliser
m_t = max(largest exact score, log c_t), where c_t is the row's total feature-map weight; exact
weights become exp(score - m_t) <= 1 and feature-map weights (phi(q) . phi(k) / c_t) * exp(log c_t - m_t),
both at most 1, so neither large nor small scores overflow. m_t is detached: the ratio does not
depend on it. Autograd differentiates the chunked forward directly.
`windowed_gate_average_reference` is the quadratic definition the fast paths are tested against.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

FEATURE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # ELU on a contiguous copy: torch.compile traces elu_backward through its decomposition, which
    # lays the gradient out like the input, while the eager kernel run by AOTAutograd lays it out
    # like the incoming gradient; on a head-transposed input the two disagree and the compiled
    # backward's views fail. The copy is [B, H, T, d_h], small beside the [B, T, F] gates.
    "elu+1": lambda x: F.elu(x.contiguous()) + 1,
    "relu": F.relu,
}

MIN_CHUNK = 64  # chunks shorter than this make the band matmuls too small to run efficiently


def chunk_length(window: int, chunk_size: int | None, t: int) -> int:
    """Positions per chunk: `chunk_size`, by default max(window, MIN_CHUNK), capped at T."""
    return min(chunk_size or max(window, MIN_CHUNK), t)


def apply_feature_map(x: torch.Tensor, name: str) -> torch.Tensor:
    """phi(x) for a name in `FEATURE_MAPS`."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; choose one of: {', '.join(FEATURE_MAPS)}")
    return FEATURE_MAPS[name](x)


def compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    """fp32, or wider when an input is wider."""
    dtype = torch.float32
    for x in xs:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def windowed_gate_average_reference(
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    q_raw: torch.Tensor,
    k_raw: torch.Tensor,
    g: torch.Tensor,
    window: int,
    feature_map: str = "elu+1",
) -> torch.Tensor:
    """Quadratic reference: the full [T, T] weight matrix with explicit masks.
    q_*, k_* [..., T, d_h], g [..., T, w] -> [..., T, w] in g's dtype."""
    dtype = compute_dtype(q_rot, k_rot, q_raw, k_raw, g)
    q_rot, k_rot, q_raw, k_raw, gf = (x.to(dtype) for x in (q_rot, k_rot, q_raw, k_raw, g))
    t = q_rot.shape[-2]
    pos = torch.arange(t, device=g.device)
    dist = pos[:, None] - pos[None, :]  # t - s
    in_window = (dist >= 0) & (dist < window)
    is_old = dist >= window
    scores = (q_rot @ k_rot.transpose(-1, -2)) / math.sqrt(q_rot.shape[-1])
    scores = scores.masked_fill(~in_window, float("-inf"))
    m = scores.amax(-1, keepdim=True).detach()  # the window's row maximum (the window holds s = t)
    linear = apply_feature_map(q_raw, feature_map) @ apply_feature_map(k_raw, feature_map).transpose(-1, -2)
    weights = torch.exp(scores - m) + linear.masked_fill(~is_old, 0.0) * torch.exp(-m)
    return ((weights @ gf) / weights.sum(-1, keepdim=True)).to(g.dtype)


def _normalized_weights(
    scores: torch.Tensor,
    in_window: torch.Tensor,
    linear: torch.Tensor,
    is_old: torch.Tensor,
    prefix_den: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final weights against a band of L sources, plus the factor for the summary of older ones.

    scores / linear [..., n, L]: exact scores and phi(q) . phi(k), valid where in_window / is_old;
    prefix_den [..., n] = phi(q) . z for the summarised sources. Returns (weights [..., n, L],
    prefix_scale [..., n]) with gbar = weights @ g_band + (prefix_scale * phi(q)) @ S.
    """
    scores = scores.masked_fill(~in_window, float("-inf"))
    linear = linear.masked_fill(~is_old, 0.0)
    c = linear.sum(-1)
    if prefix_den is not None:
        c = c + prefix_den
    has_old = c > 0
    c_safe = torch.where(has_old, c, torch.ones_like(c))
    log_c = c_safe.log()
    m = torch.maximum(scores.amax(-1), torch.where(has_old, log_c, torch.full_like(c, float("-inf")))).detach()
    # r = c exp(-m) <= 1: the feature-map weights' total on the stabilised scale.
    r = torch.where(has_old, torch.exp(log_c - m), torch.zeros_like(c))
    exact = torch.exp(scores - m.unsqueeze(-1))
    inv_den = 1 / (exact.sum(-1) + r)  # the window holds s = t, so the sum is at least 1
    r_den = r * inv_den
    weights = exact * inv_den.unsqueeze(-1) + linear / c_safe.unsqueeze(-1) * r_den.unsqueeze(-1)
    return weights, r_den / c_safe


def _chunk_major(x: torch.Tensor, n: int, c: int, lead: int = 0) -> torch.Tensor:
    """[..., T, w] -> [lead + n, ..., c, w] (chunk index first, so slices of chunks stay
    contiguous for batched matmuls), zero where no position is; one copy."""
    t, w = x.shape[-2], x.shape[-1]
    buf = x.new_empty((lead + n, *x.shape[:-2], c, w))
    if lead:
        buf[:lead].zero_()
    full, rem = divmod(t, c)
    if full:
        buf[lead : lead + full].copy_(x[..., : full * c, :].unflatten(-2, (full, c)).movedim(-3, 0))
    if rem:
        buf[lead + full, ..., :rem, :].copy_(x[..., full * c :, :])
        buf[lead + full, ..., rem:, :].zero_()
    return buf


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a.flatten(0, -3), b.flatten(0, -3)).unflatten(0, a.shape[:-2])


def _addbmm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b in place (the matmul accumulates; no extra pass over out)."""
    out.flatten(0, -3).baddbmm_(a.flatten(0, -3), b.flatten(0, -3))


def band_weights(
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    q_raw: torch.Tensor,
    k_raw: torch.Tensor,
    window: int,
    feature_map: str = "elu+1",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything but the gates, chunk-major in the compute dtype, for chunks of C positions:

    - weights [n, ..., C, 2C]: destination a of chunk i against the 2C sources of chunks i - 1
      (columns :C) and i (columns C:), normalised (zero where no source or no destination is);
    - prefix_q [n, ..., C, d_h]: phi(q) times the row's scale for the summary of chunks <= i - 2
      (read only for i >= 2): gbar += prefix_q @ sum_{chunks j <= i-2} phi(k_j)^T g_j;
    - pk [n, ..., C, d_h]: phi(k) per chunk, zero past T.
    """
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    t, d_h = q_rot.shape[-2], q_rot.shape[-1]
    c = chunk_length(window, chunk_size, t)
    if c < min(window, t):
        raise ValueError(f"chunk_size {c} is shorter than the window {window}")
    n = -(-t // c)
    dtype = compute_dtype(q_rot, k_rot, q_raw, k_raw)
    with torch.autocast(q_rot.device.type, enabled=False):
        qr = _chunk_major(q_rot.to(dtype), n, c)
        pq = _chunk_major(apply_feature_map(q_raw.to(dtype), feature_map), n, c)
        # Keys and features get one leading zero chunk: [:-1] is each chunk's predecessor.
        kr = _chunk_major(k_rot.to(dtype), n, c, lead=1)
        pk = _chunk_major(apply_feature_map(k_raw.to(dtype), feature_map), n, c, lead=1)

        # The band: destination a of chunk i (local index c + a) against the 2c sources of chunks
        # i - 1 and i (local index j); the distance t - s is c + a - j.
        scores = _bmm(qr, torch.cat([kr[:-1], kr[1:]], dim=-2).transpose(-1, -2)) / math.sqrt(d_h)
        linear = _bmm(pq, torch.cat([pk[:-1], pk[1:]], dim=-2).transpose(-1, -2))
        device = q_rot.device
        a = torch.arange(c, device=device)[:, None]
        j = torch.arange(2 * c, device=device)[None, :]
        dist = c + a - j
        exists = torch.ones((n,) + (1,) * (qr.dim() - 2) + (2 * c,), dtype=torch.bool, device=device)
        exists[0, ..., :c] = False  # the first chunk has no predecessor
        in_window = (dist >= 0) & (dist < window) & exists
        is_old = (dist >= window) & exists

        prefix_den = None
        if n > 2:
            # Exclusive prefix over chunks: chunk i reads the sums over chunks 0 .. i - 2.
            z_prefix = torch.cumsum(pk[1 : n - 1].sum(-2), dim=0)
            prefix_den = F.pad((pq[2:] * z_prefix.unsqueeze(-2)).sum(-1), (0, 0) * (pq.dim() - 2) + (2, 0))
        weights, prefix_scale = _normalized_weights(scores, in_window, linear, is_old, prefix_den)
    return weights, pq * prefix_scale.unsqueeze(-1), pk[1:]


def windowed_gate_average_chunks(
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    q_raw: torch.Tensor,
    k_raw: torch.Tensor,
    g: torch.Tensor,
    window: int,
    feature_map: str = "elu+1",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The linear-time path composed of library ops; returns gbar chunk-major, [n, ..., C, w] in
    the compute dtype, rows past T zero-padded. `windowed_gate_average` lays it out."""
    weights, prefix_q, pk = band_weights(q_rot, k_rot, q_raw, k_raw, window, feature_map, chunk_size)
    n, c = weights.shape[0], weights.shape[-2]
    dtype = torch.promote_types(weights.dtype, g.dtype)
    with torch.autocast(g.device.type, enabled=False):
        gc = _chunk_major(g.to(dtype), n, c, lead=1)
        out = _bmm(weights[..., c:], gc[1:])
        _addbmm_(out, weights[..., :c], gc[:-1])
        if n > 2:
            s_prefix = torch.cumsum(_bmm(pk[: n - 2].transpose(-1, -2), gc[1 : n - 1]), dim=0)
            _addbmm_(out[2:], prefix_q[2:], s_prefix)
    return out


def windowed_gate_average(
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    q_raw: torch.Tensor,
    k_raw: torch.Tensor,
    g: torch.Tensor,
    window: int,
    feature_map: str = "elu+1",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Linear-time windowed average, same contract as `windowed_gate_average_reference`.
    chunk_size (>= window) defaults to max(window, MIN_CHUNK), capped at T."""
    out = windowed_gate_average_chunks(q_rot, k_rot, q_raw, k_raw, g, window, feature_map, chunk_size)
    t = q_rot.shape[-2]
    return out.movedim(0, -3).flatten(-3, -2)[..., :t, :].to(g.dtype)


def windowed_gate_average_cached(
    q_rot: torch.Tensor,
    q_raw: torch.Tensor,
    k_rot: torch.Tensor,
    k_phi: torch.Tensor,
    g: torch.Tensor,
    s_prefix: torch.Tensor,
    z_prefix: torch.Tensor,
    window: int,
    feature_map: str = "elu+1",
) -> torch.Tensor:
    """Decoding: n destinations aligned to the end of L >= n recent sources, older ones summarised.

    q_rot, q_raw [..., n, d_h]; k_rot and k_phi = phi(k_raw) [..., L, d_h]; g [..., L, w];
    s_prefix [..., d_h, w] and z_prefix [..., d_h] sum phi(k_s) g_s^T and phi(k_s) over every source
    before the L. The caller keeps at least the last W - 1 sources before the destinations in the L
    (all of them while fewer exist), so the summarised sources are outside every window. Cost is
    O(n L w): feed long prompts in pieces. Returns [..., n, w] in g's dtype.
    """
    n, big_l = q_rot.shape[-2], k_rot.shape[-2]
    dtype = compute_dtype(q_rot, q_raw, k_rot, k_phi, g, s_prefix)
    with torch.autocast(g.device.type, enabled=False):
        qr, kr, kp, gf = (x.to(dtype) for x in (q_rot, k_rot, k_phi, g))
        pq = apply_feature_map(q_raw.to(dtype), feature_map)
        scores = (qr @ kr.transpose(-1, -2)) / math.sqrt(q_rot.shape[-1])
        linear = pq @ kp.transpose(-1, -2)
        dist = (big_l - n + torch.arange(n, device=g.device))[:, None] - torch.arange(big_l, device=g.device)[None, :]
        in_window = (dist >= 0) & (dist < window)
        is_old = dist >= window
        prefix_den = (pq * z_prefix.to(dtype).unsqueeze(-2)).sum(-1)
        weights, prefix_scale = _normalized_weights(scores, in_window, linear, is_old, prefix_den)
        out = weights @ gf + (pq * prefix_scale.unsqueeze(-1)) @ s_prefix.to(dtype)
    return out.to(g.dtype)
