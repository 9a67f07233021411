"""Windowed TANGO's token mixing, `y = merge_heads(windowed_gate_average(...)) * u` with the gates
`g = silu(a)`, and the one door to its implementations (`windowed_mix`): the fused CPU op below,
the Triton kernels of `windowed_triton.py` on CUDA, the composition elsewhere.

`band_weights` (ops/windowed.py) computes the small tensors: the normalised [C, 2C] band weights
per chunk and the feature-map factors, all O(T C) per head. What remains is the wide part, O(T C w)
per head: each chunk's gate average is its band weights times the gates of its own chunk and the
previous one, plus phi(q) times the running sum S = sum phi(k_s) g_s^T of the chunks before those.
Composed of library ops (`windowed_mix_reference`), that part copies the [B, T, F] gates into
chunk-major layout, and autograd's backward of the chunk slices fills and adds full-size zero
gradients: on the project's CPU those passes cost more than the matmuls. This op instead

- reads the gates of each chunk and head in place (a strided [2C, F/H] view of [B, T, F]: the
  previous chunk's sources and this chunk's, one matmul with the heads batched), into a
  contiguous chunk buffer copied into the head-major average (a matmul into a strided slice runs
  head by head, at about half the speed for these sizes), one batch element at a time so its
  gates and average are still in cache for the SiLU before and the product by u after;
- writes every gradient once, into its final buffer (the chunk's gates get their three
  contributions: own band, the next chunk's band, the prefix sums read by later chunks);
- folds the SiLU and the product by u into those passes, as `tango_mix.py` does for TANGO.

It keeps the band weights, the gates, u, the average and the running sums for the backward.
Tested against `windowed_mix_reference` (forward and gradients, float64, odd T, partial chunks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tango_lm.ops.causal_matmul import scratch_view
from tango_lm.ops.dispatch import check_devices, check_installed, choose, eager
from tango_lm.ops.gate_average import split_heads
from tango_lm.ops.windowed import band_weights, chunk_length, windowed_gate_average_chunks

try:  # registers the Triton custom ops (before any torch.compile trace reaches `windowed_mix`)
    from tango_lm.ops import windowed_triton
except ImportError:  # no triton: CUDA runs the composition
    windowed_triton = None


def windowed_mix_reference(
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    q_raw: torch.Tensor,
    k_raw: torch.Tensor,
    a: torch.Tensor,
    u: torch.Tensor,
    window: int,
    feature_map: str = "elu+1",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The composition: q_* [B, H, T, d_h], gate pre-activations a and u [B, T, F] -> [B, T, F]."""
    g = split_heads(F.silu(a), q_rot.shape[1])
    out = windowed_gate_average_chunks(q_rot, k_rot, q_raw, k_raw, g, window, feature_map, chunk_size)
    n, b, h, c, w = out.shape
    t = u.shape[1]
    if n * c != t:
        u = F.pad(u, (0, 0, 0, n * c - t))
    y = u.view(b, n, c, h, w) * out.permute(1, 0, 3, 2, 4)  # laid out like u: [B, n, C, H, w]
    return y.view(b, n * c, h * w)[:, :t].to(u.dtype)


def _chunks(t: int, c: int) -> list[tuple[int, int]]:
    return [(s, min(s + c, t)) for s in range(0, t, c)]


class _WindowedBandMix(torch.autograd.Function):
    """weights [n, B, H, C, 2C], prefix_q and pk [n, B, H, C, d_h] (band_weights), a, u [B, T, F]."""

    @staticmethod
    def forward(ctx, weights, prefix_q, pk, a, u):
        n, bsz, h, c, _ = weights.shape
        t, f = a.shape[1], a.shape[2]
        w, d_h = f // h, pk.shape[-1]
        g = torch.empty_like(a)
        gh = g.view(bsz, t, h, w)  # rows s0:e of batch element b, head-major: gh[b, s0:e].transpose(0, 1)
        avg = torch.empty(bsz, h, t, w, dtype=a.dtype, device=a.device)
        y = torch.empty_like(u)
        # sums[i - 2] = sum over chunks j <= i - 2 of phi(k_j)^T g_j, the summary chunk i reads.
        sums = a.new_empty(max(n - 2, 0), bsz, h, d_h, w)
        spans = _chunks(t, c)
        # Each chunk's average goes to a contiguous buffer first: matmuls into a slice of `avg` (a
        # strided batch of heads) run head by head, at about half the speed for these sizes.
        chunk_avg = a.new_empty(h * c * w)
        # One batch element at a time, so that its gates and average ([T, F]) are still in cache
        # for the SiLU before and the product by u after the chunk loop.
        for b in range(bsz):
            torch.ops.aten.silu.out(a[b], out=g[b])
            for i, (s0, e) in enumerate(spans):
                rows, lo = e - s0, max(s0 - c, 0)
                out = scratch_view(chunk_avg, h, rows, w)
                # The band: the previous chunk's sources and this chunk's, in one matmul.
                torch.bmm(weights[i, b, :, :rows, c - (s0 - lo) : c + rows], gh[b, lo:e].transpose(0, 1), out=out)
                if i >= 2:
                    j0 = (i - 2) * c
                    add = torch.bmm(pk[i - 2, b].transpose(-1, -2), gh[b, j0 : j0 + c].transpose(0, 1))
                    if i >= 3:
                        add += sums[i - 3, b]
                    sums[i - 2, b] = add
                    out.baddbmm_(prefix_q[i, b, :, :rows], add)
                avg[b, :, s0:e] = out
            torch.mul(
                avg[b].transpose(0, 1), u[b].view_as(avg[b].transpose(0, 1)), out=y[b].view_as(avg[b].transpose(0, 1))
            )
        ctx.save_for_backward(weights, prefix_q, pk, a, g, u, avg, sums)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        weights, prefix_q, pk, a, g, u, avg, sums = ctx.saved_tensors
        n, bsz, h, c, _ = weights.shape
        t, f = a.shape[1], a.shape[2]
        w = f // h
        grad_y = grad_y.contiguous()
        grad_u, grad_a = torch.empty_like(u), torch.empty_like(a)
        gh = g.view(bsz, t, h, w)
        grad_weights = torch.zeros_like(weights)  # stays zero where no source or destination is
        grad_prefix_q = torch.zeros_like(prefix_q)
        grad_pk = torch.zeros_like(pk)
        grad_avg = torch.empty_like(avg[0])  # [H, T, w] for one batch element, reused
        grad_g = torch.empty_like(avg[0])
        chunk_grad_g = a.new_empty(h * c * w)  # as chunk_avg in the forward
        spans = _chunks(t, c)
        for b in range(bsz):
            # dL/du = dy * avg, written straight into u's [T, F] layout; dL/davg = dy * u, head-major.
            grad_y_heads = grad_y[b].view(t, h, w).transpose(0, 1)
            torch.mul(grad_y_heads, avg[b], out=grad_u[b].view(t, h, w).transpose(0, 1))
            torch.mul(grad_y_heads, u[b].view(t, h, w).transpose(0, 1), out=grad_avg)
            later = None  # sum of the gradients of the summaries read by chunks >= i + 2
            grad_sum = [None] * n  # gradient of the summary chunk i reads
            for i in reversed(range(n)):
                s0, e = spans[i]
                rows, lo = e - s0, max(s0 - c, 0)
                d_out = grad_avg[:, s0:e]
                band = gh[b, lo:e].transpose(0, 1)  # the previous chunk's gates and this chunk's
                torch.bmm(d_out, band.transpose(-1, -2), out=grad_weights[i, b, :, :rows, c - (s0 - lo) : c + rows])
                d_g = scratch_view(chunk_grad_g, h, rows, w)
                torch.bmm(weights[i, b, :, :rows, c : c + rows].transpose(-1, -2), d_out, out=d_g)
                if i + 1 < n:  # the next chunk's band reads this chunk's gates
                    s1, e1 = spans[i + 1]
                    d_g.baddbmm_(weights[i + 1, b, :, : e1 - s1, :c].transpose(-1, -2), grad_avg[:, s1:e1])
                if i >= 2:
                    grad_sum[i] = torch.bmm(prefix_q[i, b, :, :rows].transpose(-1, -2), d_out)
                    torch.bmm(d_out, sums[i - 2, b].transpose(-1, -2), out=grad_prefix_q[i, b, :, :rows])
                if i + 2 < n:  # this chunk is summarised for chunks i + 2, ...
                    later = grad_sum[i + 2] if later is None else later + grad_sum[i + 2]
                    grad_sum[i + 2] = None
                    torch.bmm(gh[b, s0:e].transpose(0, 1), later.transpose(-1, -2), out=grad_pk[i, b])
                    d_g.baddbmm_(pk[i, b], later)
                grad_g[:, s0:e] = d_g
            # SiLU backward fused with the transpose back to [T, F].
            torch.ops.aten.silu_backward.grad_input(
                grad_g.transpose(0, 1),
                a[b].view_as(grad_g.transpose(0, 1)),
                grad_input=grad_a[b].view_as(grad_g.transpose(0, 1)),
            )
        return grad_weights, grad_prefix_q, grad_pk, grad_a, grad_u


def windowed_mix_fused(
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    q_raw: torch.Tensor,
    k_raw: torch.Tensor,
    a: torch.Tensor,
    u: torch.Tensor,
    window: int,
    feature_map: str = "elu+1",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Same contract as `windowed_mix_reference`; a and u in the compute dtype (fp32 or wider)."""
    weights, prefix_q, pk = band_weights(q_rot, k_rot, q_raw, k_raw, window, feature_map, chunk_size)
    return _WindowedBandMix.apply(weights, prefix_q, pk, a.contiguous(), u.contiguous())


def windowed_mix(
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    q_raw: torch.Tensor,
    k_raw: torch.Tensor,
    a: torch.Tensor,
    u: torch.Tensor,
    window: int,
    feature_map: str = "elu+1",
    chunk_size: int | None = None,
    *,
    kernels: str | None = None,
) -> torch.Tensor:
    """The fused op ('blocked') on CPUs in fp32 or wider, in eager mode without autocast; on CUDA
    the wide part on the Triton kernels (`windowed_triton.py`) where triton is installed; elsewhere
    (and under torch.compile on CPUs) the composition. `kernels` or $TANGO_LM_KERNELS overrides
    (`ops/dispatch.py`)."""
    check_devices("windowed_mix", q_rot=q_rot, k_rot=k_rot, q_raw=q_raw, k_raw=k_raw, a=a, u=u)
    check_installed("triton", windowed_triton is not None, kernels)
    if a.numel() == 0:  # no position, batch or column: nothing to chunk
        nothing = sum(x.sum() for x in (q_rot, k_rot, q_raw, k_raw)) * 0  # zero gradients, not none
        return a * u * 0 + nothing
    wide = a.dtype in (torch.float32, torch.float64) and a.dtype == u.dtype == q_rot.dtype
    fused = a.device.type == "cpu" and wide and eager() and not torch.is_autocast_enabled("cpu")
    chunk = chunk_length(window, chunk_size, a.shape[1])
    triton = windowed_triton is not None and windowed_triton.supported(q_rot, k_rot, a, u, chunk)
    auto = "blocked" if fused else "triton" if a.is_cuda and triton else "reference"
    name = choose({"reference": True, "blocked": fused, "triton": triton}, auto, kernels)
    if name == "blocked":
        return windowed_mix_fused(q_rot, k_rot, q_raw, k_raw, a, u, window, feature_map, chunk_size)
    if name == "triton":
        # The small tensors' intermediates (scores, masks, exponentials: [n, B, H, C, 2C] fp32 each)
        # are recomputed in the backward instead of kept: under 1% of the layer's FLOPs for a sixth
        # of its saved bytes (tools/saved_for_backward.py gpu-path; docs/benchmarks.md).
        weights, prefix_q, pk = checkpoint(
            band_weights, q_rot, k_rot, q_raw, k_raw, window, feature_map, chunk_size, use_reentrant=False
        )
        return windowed_triton.windowed_band_mix_triton(weights, prefix_q, pk, a, u)
    return windowed_mix_reference(q_rot, k_rot, q_raw, k_raw, a, u, window, feature_map, chunk_size)
