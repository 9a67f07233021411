"""TANGO's token mixing fused for CPUs: `y = gate_average(q, k, silu(a)) * u`.

The composition of library ops moves the wide [B, T, F] tensors through several extra memory
passes: the gates are transposed to head-major [B, H, T, F/H] for attention and the average
back, in the forward and again in the backward, and the SiLU, the product with u and their
backwards each read and write them once more. On a CPU those passes cost about as much as the
attention itself. This op instead

- multiplies the probabilities by a strided per-head view of the gates (BLAS reads the
  [T, F/H] slice of a [T, F] matrix in place), one batch element at a time, in blocks that skip
  the all-zero probabilities above the diagonal (`_blocks`);
- fuses the transpose back with the product by u, and the backward transposes with the SiLU
  backward and the products by u and the average.

The probabilities [B, H, T, T] are kept for the backward while T <= F/H and recomputed from q
and k beyond (`recompute_probs`), so at long context they do not outgrow the gates.
`tango_mix_reference` is the plain composition it is tested against (forward and gradients).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tango_lm.ops.causal_matmul import causal_blocks
from tango_lm.ops.gate_average import gate_average_sdpa, merge_heads, split_heads


def tango_mix_reference(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """q, k: [B, H, T, d_h]; a (gate pre-activation), u: [B, T, F] -> [B, T, F]."""
    g = split_heads(F.silu(a), q.shape[1])
    return merge_heads(gate_average_sdpa(q, k, g)) * u


def _heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, F] -> strided view [B, H, T, F/H] (no copy)."""
    b, t, f = x.shape
    return x.view(b, t, n_heads, f // n_heads).transpose(1, 2)


CAUSAL_BLOCK = 128  # positions per block; the all-zero blocks above the diagonal are skipped


def _blocks(t: int) -> list[tuple[int, int]]:
    """Blocks (s0, s1) of CAUSAL_BLOCK positions. Each matmul of the op is split along the
    positions of one operand so that every piece stays a wide matmul and none multiplies an
    all-zero block of probabilities: sources s0:s1 are seen by destinations s0: onwards, and
    destinations s0:s1 see sources :s1. At T = 256 that is 3/4 of the square's work, at T = 1024
    36/64. Measured on the project's CPU (one batch element, H = 8, F/H = 1024, T = 256): the
    forward's matmul 6.3 -> 5.1-5.4 ms, the probability gradient's 6.0 -> 5.1-5.4 ms, the gate
    gradient's 6.7 -> 6.5 ms; splitting by destination blocks instead (each piece a short matmul)
    was not faster."""
    return causal_blocks(t, CAUSAL_BLOCK)


def _causal_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Causal softmax of q k^T / sqrt(d_h), normalized in fp32 or wider, returned in q's dtype."""
    t = q.shape[-2]
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))  # scale the small operand
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu_(1)
    scores = scores.masked_fill_(mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)


def recompute_probs(t: int, gate_width_per_head: int) -> bool:
    """Whether the backward recomputes the [B, H, T, T] probabilities instead of keeping them:
    when they would take more memory than the gates [B, H, T, F/H]."""
    return t > gate_width_per_head


class _TangoMix(torch.autograd.Function):
    # One batch element at a time, so that each element's gates, average and their gradients
    # ([T, F], a few MiB) are still in cache when the next pass over them runs.
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        n_heads = q.shape[1]
        probs = _causal_probs(q, k)
        g = torch.empty_like(a)
        avg = torch.empty(q.shape[:3] + (a.shape[-1] // n_heads,), dtype=a.dtype, device=a.device)
        y = torch.empty_like(u)
        for b in range(q.shape[0]):
            torch.ops.aten.silu.out(a[b], out=g[b])
            g_heads = _heads(g[b : b + 1], n_heads)[0]
            for i, (s0, s1) in enumerate(_blocks(q.shape[2])):  # sources s0:s1, seen from s0 on
                if i == 0:
                    torch.bmm(probs[b, :, :, :s1], g_heads[:, :s1], out=avg[b])
                else:
                    avg[b, :, s0:].baddbmm_(probs[b, :, s0:, s0:s1], g_heads[:, s0:s1])
            torch.mul(avg[b].transpose(0, 1), u[b].view_as(avg[b].transpose(0, 1)),
                      out=y[b].view_as(avg[b].transpose(0, 1)))
        # Keep the probabilities only while they are smaller than the gates they average; past
        # that (T > F/H) the backward recomputes them from q and k, at 2 T d_h FLOPs per
        # destination and head against the 6 T F/H of the op's matmuls.
        ctx.recompute = recompute_probs(q.shape[2], avg.shape[-1])
        ctx.save_for_backward(q, k, a, g, u, None if ctx.recompute else probs, avg)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        q, k, a, g, u, probs, avg = ctx.saved_tensors
        if ctx.recompute:
            probs = _causal_probs(q, k)
        n_heads = q.shape[1]
        grad_y = grad_y.contiguous()
        blocks = _blocks(q.shape[2])
        grad_probs = torch.empty_like(probs)
        for s0, s1 in blocks[1:]:
            grad_probs[:, :, :s0, s0:s1] = 0  # sources after the destination: zero probability, zero gradient
        grad_u, grad_a = torch.empty_like(u), torch.empty_like(a)
        grad_avg = torch.empty_like(avg[0])  # [H, T, F/H] for one batch element, reused
        grad_g = torch.empty_like(avg[0])
        for b in range(q.shape[0]):
            grad_y_heads = _heads(grad_y[b : b + 1], n_heads)[0]
            # dL/du = dy * avg, written straight into u's [T, F] layout; dL/davg = dy * u, head-major.
            torch.mul(grad_y_heads, avg[b], out=_heads(grad_u[b : b + 1], n_heads)[0])
            torch.mul(grad_y_heads, _heads(u[b : b + 1], n_heads)[0], out=grad_avg)
            g_heads = _heads(g[b : b + 1], n_heads)[0]
            for s0, s1 in blocks:  # sources s0:s1 are seen by destinations s0: onwards
                torch.bmm(grad_avg[:, s0:], g_heads[:, s0:s1].transpose(-1, -2), out=grad_probs[b, :, s0:, s0:s1])
            for i, (r0, r1) in enumerate(reversed(blocks)):  # destinations r0:r1 see sources :r1
                if i == 0:
                    torch.bmm(probs[b, :, r0:, :].transpose(-1, -2), grad_avg[:, r0:], out=grad_g)
                else:
                    grad_g[:, :r1].baddbmm_(probs[b, :, r0:r1, :r1].transpose(-1, -2), grad_avg[:, r0:r1])
            # SiLU backward fused with the transpose back to [T, F].
            torch.ops.aten.silu_backward.grad_input(
                grad_g.transpose(0, 1), a[b].view_as(grad_g.transpose(0, 1)),
                grad_input=grad_a[b].view_as(grad_g.transpose(0, 1)),
            )
        # Softmax backward in one kernel; masked entries have probability 0 and so get no gradient.
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        scale = q.shape[-1] ** -0.5
        grad_q = torch.matmul(grad_scores, k).mul_(scale)
        grad_k = torch.matmul(grad_scores.transpose(-1, -2), q).mul_(scale)
        return grad_q, grad_k, grad_a, grad_u


def tango_mix_fused(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Same contract as `tango_mix_reference`; all inputs share one dtype."""
    return _TangoMix.apply(q.contiguous(), k.contiguous(), a.contiguous(), u.contiguous())


def tango_mix(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The fused op on CPUs in eager mode; elsewhere the composition, whose SDPA call runs fused
    GPU kernels. Under torch.compile the composition too: inductor fuses its elementwise passes
    itself, and cannot compile the fused op (its `out=` writes into transposed views)."""
    if a.device.type == "cpu" and q.dtype == a.dtype == u.dtype and not torch.compiler.is_compiling():
        return tango_mix_fused(q, k, a, u)
    return tango_mix_reference(q, k, a, u)
