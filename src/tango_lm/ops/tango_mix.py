"""TANGO's token mixing, `y = gate_average(q, k, silu(a)) * u`, and the one door to its implementations.

`tango_mix` picks the implementation (`ops/dispatch.py`): on CPUs the fused ops below, on CUDA the
Triton kernels of `tango_mix_triton.py` (or, without triton, the sliced SDPA of
`ops/gate_average.py`), under torch.compile on CPUs the composition. Without u (tango-compact's
narrow average of its controller) it returns the average alone: the reference on CPUs, the same
Triton or sliced paths on CUDA.

**The fused CPU ops.** The composition of library ops moves the wide [B, T, F] tensors through several extra memory
passes: the gates are transposed to head-major [B, H, T, F/H] for attention and the average
back, in the forward and again in the backward, and the SiLU, the product with u and their
backwards each read and write them once more. On a CPU those passes cost about as much as the
attention itself. This op instead

- multiplies the probabilities by a strided per-head view of the gates (BLAS reads the
  [T, F/H] slice of a [T, F] matrix in place), one batch element at a time, in blocks that skip
  the all-zero probabilities above the diagonal (`_blocks`), each block's heads in one batched
  matmul into a contiguous output (the average is kept by destination block);
- fuses the transpose back with the product by u, and the backward transposes with the SiLU
  backward and the products by u and the average.

The probabilities [B, H, T, T] are kept for the backward while T <= F/H and recomputed from q
and k beyond (`recompute_probs`), so at long context they do not outgrow the gates.

In float32, where the C kernels of `ops/cpu_kernels.py` build (a C compiler on the machine) and
are preferred (not on Intel CPUs with MKL, whose GEMMs run the blocked products faster),
`_TangoMixKernels` runs the three probability-times-gates products over the causal triangle
only, which no BLAS call can; the blocked products above serve every other case.
`tango_mix_reference` is the plain composition it is tested against (forward and gradients).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tango_lm.ops import cpu_kernels
from tango_lm.ops.causal_matmul import causal_blocks, scratch_view
from tango_lm.ops.dispatch import check_devices, check_installed, choose, eager
from tango_lm.ops.gate_average import gate_average_sdpa, gate_average_sliced, merge_heads, split_heads

try:  # registers the Triton custom ops (before any torch.compile trace reaches `tango_mix`)
    from tango_lm.ops import tango_mix_triton
except ImportError:  # no triton: CUDA runs the sliced SDPA
    tango_mix_triton = None


def tango_mix_reference(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """q, k: [B, H, T, d_h]; a (gate pre-activation), u: [B, T, F] -> [B, T, F] (without u, the
    average). Inputs of mixed dtypes run in their promoted dtype, as `tango_mix_sliced`'s do."""
    g = F.silu(a)
    dtype = torch.promote_types(q.dtype, g.dtype)
    avg = merge_heads(gate_average_sdpa(q.to(dtype), k.to(dtype), split_heads(g.to(dtype), q.shape[1])))
    return avg if u is None else avg * u


def tango_mix_sliced(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """The composition with the average as the sliced SDPA (`gate_average_sliced`): no fused SDPA
    backend takes the gates' full width per head. Inputs of mixed dtypes run in their promoted
    dtype (SDPA takes one), so that this fallback takes whatever the Triton kernels do not."""
    g = F.silu(a)
    dtype = torch.promote_types(q.dtype, g.dtype)
    avg = merge_heads(gate_average_sliced(q.to(dtype), k.to(dtype), split_heads(g.to(dtype), q.shape[1])))
    return avg if u is None else avg * u


def _heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, F] -> strided view [B, H, T, F/H] (no copy)."""
    b, t, f = x.shape
    return x.view(b, t, n_heads, f // n_heads).transpose(1, 2)


CAUSAL_BLOCK = 64  # positions per block up to T = 8 blocks; twice that beyond


def _block_size(t: int) -> int:
    """Smaller blocks skip more zeros (blocks of n waste n / 2T of the square) but make more,
    smaller matmuls. Measured on the project's CPU (op forward + backward, H = 8, F/H = 1024,
    `tools/op_speed.py tango B T F BLOCK`): blocks of 64 were 0-8% faster than 128 at T = 256,
    equal at T = 512 and 5-10% slower at T = 1024."""
    return CAUSAL_BLOCK if t <= 8 * CAUSAL_BLOCK else 2 * CAUSAL_BLOCK


def _blocks(t: int) -> list[tuple[int, int]]:
    """The op's blocks. Each matmul is cut into blocks along the side that keeps its contraction
    long and skips the all-zero probabilities above the diagonal: the average and the probability
    gradient by destinations (destinations r0:r1 see sources :r1), the gate gradient by sources
    (sources s0:s1 are seen by destinations s0 onwards). At T = 256 that is 5/8 of the square's
    work, at T = 1024 (blocks of 128) 9/16."""
    return causal_blocks(t, _block_size(t))


def _rows(x: torch.Tensor, b: int, r0: int, r1: int, n_heads: int) -> torch.Tensor:
    """Rows r0:r1 of batch element b of a [B, T, F] tensor as a head-major view [H, r1 - r0, F/H]."""
    return x[b, r0:r1].view(r1 - r0, n_heads, -1).transpose(0, 1)


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


def _save(ctx, q, k, a, g, u, probs, avg) -> None:
    # Keep the probabilities only while they are smaller than the gates they average; past that
    # (T > F/H) the backward recomputes them from q and k, at 2 T d_h FLOPs per destination and
    # head against the 6 T F/H of the op's matmuls.
    ctx.recompute = recompute_probs(q.shape[2], a.shape[-1] // q.shape[1])
    ctx.save_for_backward(q, k, a, g, u, None if ctx.recompute else probs, avg)


def _saved(ctx) -> tuple[torch.Tensor, ...]:
    """What `_save` kept: q, k, a, g, u, probs (recomputed if dropped), avg."""
    q, k, a, g, u, probs, avg = ctx.saved_tensors
    return q, k, a, g, u, _causal_probs(q, k) if ctx.recompute else probs, avg


class _TangoMix(torch.autograd.Function):
    # One batch element at a time, so that each element's gates, average and their gradients
    # ([T, F], a few MiB) are still in cache when the next pass over them runs.
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        bsz, n_heads, t, _ = q.shape
        w = a.shape[-1] // n_heads
        blocks = _blocks(t)
        probs = _causal_probs(q, k)
        g = torch.empty_like(a)
        # The average by destination block, [B, blocks, H, block, F/H]: each block contiguous.
        avg = torch.empty(bsz, len(blocks), n_heads, blocks[0][1], w, dtype=a.dtype, device=a.device)
        y = torch.empty_like(u)
        for b in range(bsz):
            torch.ops.aten.silu.out(a[b], out=g[b])
            g_heads = _heads(g[b : b + 1], n_heads)[0]
            for i, (r0, r1) in enumerate(blocks):  # destinations r0:r1 see sources :r1
                out = avg[b, i, :, : r1 - r0]
                torch.bmm(probs[b, :, r0:r1, :r1], g_heads[:, :r1], out=out)
                torch.mul(out, _rows(u, b, r0, r1, n_heads), out=_rows(y, b, r0, r1, n_heads))
        _save(ctx, q, k, a, g, u, probs, avg)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        q, k, a, g, u, probs, avg = _saved(ctx)
        bsz, n_heads, t, _ = q.shape
        block, w = avg.shape[-2:]
        grad_y = grad_y.contiguous()
        blocks = _blocks(t)
        grad_probs = torch.empty_like(probs)
        grad_u, grad_a = torch.empty_like(u), torch.empty_like(a)
        grad_avg = torch.empty(n_heads, t, w, dtype=a.dtype, device=a.device)  # one batch element, reused
        scratch = torch.empty(n_heads * block * max(t, w), dtype=a.dtype, device=a.device)
        for b in range(bsz):
            # dL/davg = dy * u, head-major; dL/du = dy * avg, written straight into u's [T, F] layout.
            torch.mul(_rows(grad_y, b, 0, t, n_heads), _rows(u, b, 0, t, n_heads), out=grad_avg)
            g_heads = _heads(g[b : b + 1], n_heads)[0]
            for i, (r0, r1) in enumerate(blocks):  # destinations r0:r1 see sources :r1
                torch.mul(
                    _rows(grad_y, b, r0, r1, n_heads), avg[b, i, :, : r1 - r0], out=_rows(grad_u, b, r0, r1, n_heads)
                )
                piece = scratch_view(scratch, n_heads, r1 - r0, r1)
                torch.bmm(grad_avg[:, r0:r1], g_heads[:, :r1].transpose(-1, -2), out=piece)
                grad_probs[b, :, r0:r1, :r1] = piece
                grad_probs[b, :, r0:r1, r1:] = 0  # later sources: zero probability, zero gradient
            for s0, s1 in blocks:  # sources s0:s1 are seen by destinations s0 onwards
                grad_g = scratch_view(scratch, n_heads, s1 - s0, w)
                torch.bmm(probs[b, :, s0:, s0:s1].transpose(-1, -2), grad_avg[:, s0:], out=grad_g)
                # SiLU backward fused with the transpose back to [T, F].
                torch.ops.aten.silu_backward.grad_input(
                    grad_g, _rows(a, b, s0, s1, n_heads), grad_input=_rows(grad_a, b, s0, s1, n_heads)
                )
        return (*_scores_backward(grad_probs, probs, q, k), grad_a, grad_u)


class _TangoMixKernels(torch.autograd.Function):
    # The same op with the three probability-times-gates products in C (`ops/cpu_kernels.py`),
    # which compute only the causal triangle; y = avg * u is fused into the average's kernel.
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        probs = _causal_probs(q, k).contiguous()
        g = F.silu(a)
        avg, y = torch.empty_like(a), torch.empty_like(u)
        cpu_kernels.gate_average(probs, g, u, avg, y)
        _save(ctx, q, k, a, g, u, probs, avg)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        q, k, a, g, u, probs, avg = _saved(ctx)
        grad_y = grad_y.contiguous()
        grad_avg = grad_y * u
        grad_u = grad_y * avg
        grad_probs = torch.empty_like(probs)
        cpu_kernels.gate_average_grad_probs(grad_avg, g, grad_probs)
        grad_a = torch.empty_like(a)
        cpu_kernels.gate_average_grad_gates(probs, grad_avg, grad_a)
        del grad_avg  # before the softmax backward allocates
        torch.ops.aten.silu_backward.grad_input(grad_a, a, grad_input=grad_a)
        return (*_scores_backward(grad_probs, probs, q, k), grad_a, grad_u)


def _scores_backward(grad_probs: torch.Tensor, probs: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """Gradients of q and k from the probabilities' gradient: the softmax backward in one kernel
    (masked entries have probability 0 and so get no gradient), then the two score products."""
    grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
    scale = q.shape[-1] ** -0.5
    grad_q = torch.matmul(grad_scores, k).mul_(scale)
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q).mul_(scale)
    return grad_q, grad_k


def tango_mix_fused(
    q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor, *, kernels: bool | None = None
) -> torch.Tensor:
    """Same contract as `tango_mix_reference`; all inputs share one dtype. `kernels`: the C
    kernels (True), the blocked PyTorch products (False), or the kernels where usable (None)."""
    if kernels is None:
        kernels = cpu_kernels.usable(a)
    op = _TangoMixKernels if kernels else _TangoMix
    return op.apply(q.contiguous(), k.contiguous(), a.contiguous(), u.contiguous())


def tango_mix(
    q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor | None, *, kernels: str | None = None
) -> torch.Tensor:
    """`gate_average(q, k, silu(a)) * u` (u None: the average alone), through the implementation
    that `kernels` (or $TANGO_LM_KERNELS, else 'auto') names, where it can take these inputs:

    - CPUs: in eager mode the fused op, on the C kernels where they build (float32) and are
      `cpu_kernels.preferred()` (not on Intel CPUs with MKL), and blocked otherwise; under
      torch.compile the composition (inductor fuses its elementwise passes itself and cannot
      compile the fused op's `out=` writes into transposed views). Without u the composition.
    - CUDA: the Triton kernels (a custom op, so also inside torch.compile graphs) for fp32, bf16 and
      fp16 inputs of one dtype; otherwise (no triton, other dtypes) the sliced SDPA.
    """
    check_devices("tango_mix", q=q, k=k, a=a, u=u)
    check_installed("triton", tango_mix_triton is not None, kernels)
    if a.numel() == 0:  # no position, batch or column: the blocked op needs a block
        return tango_mix_reference(q, k, a, u)
    name = choose(*_paths(q, k, a, u, kernels), kernels)
    if name == "triton":
        return tango_mix_triton.tango_mix_triton(q, k, a, u)
    if name == "sdpa-sliced":
        return tango_mix_sliced(q, k, a, u)
    if name in ("c", "blocked"):
        return tango_mix_fused(q, k, a, u, kernels=name == "c")
    return tango_mix_reference(q, k, a, u)


def _paths(
    q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor | None, kernels: str | None
) -> tuple[dict[str, bool], str]:
    """Which implementations can take these inputs, and the one 'auto' picks."""
    cpu_fused = a.device.type == "cpu" and u is not None and q.dtype == a.dtype == u.dtype and eager()
    c, auto_c = cpu_kernels.choices(a, kernels) if cpu_fused else (False, False)
    triton = tango_mix_triton is not None and tango_mix_triton.supported(q, k, a, u)
    usable = {"reference": True, "sdpa-sliced": True, "blocked": cpu_fused, "c": c, "triton": triton}
    if a.device.type == "cpu":
        auto = "c" if auto_c else "blocked" if cpu_fused else "reference"
    elif a.is_cuda:
        auto = "triton" if triton else "sdpa-sliced"
    else:
        auto = "reference"
    return usable, auto
