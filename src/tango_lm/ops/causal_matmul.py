"""`tril(p) @ v` that skips the all-zero blocks above the diagonal (CPU, eager).

GAU's and FLASH's squared-ReLU attention multiply a causal [T, T] kernel by values [T, e] with
e = 2d or more, so that product and its two gradients are most of the attention's work, and a
plain matmul spends half of it on zeros. Here each product is cut into blocks of `CAUSAL_BLOCK`
positions that skip the blocks above the diagonal, along whichever side keeps the contraction of
every piece long: the forward by destinations (destinations r0:r1 see sources :r1), the gradient
for v by sources (sources s0:s1 are seen by destinations s0 onwards), the gradient for the kernel
(contracted over e) by sources too. At T = 256 that is 3/4 of the square's work, at T = 1024 36/64.
Measured on the project's CPU (forward + backward, e = 2048, `tools/op_speed.py causal N T E`):
this blocked op 0.66-0.68x the composition's time at T = 1024 (one sequence), 0.87-0.91x at
T = 256 (four); the C kernels 0.52x and 0.59-0.62x.

The op computes `tril(p) @ v` exactly, with that function's gradients (the gradient for p is
zero above the diagonal): each piece of p is copied to mask its part of the diagonal block.
In float32, where the C kernels of `ops/cpu_kernels.py` build and are preferred (not on Intel
CPUs with MKL), `_CausalMatmulKernels` runs the three products over the causal triangle only
instead. `causal_matmul_reference` is the composition both are tested against.
"""

from __future__ import annotations

import torch

from tango_lm.ops import cpu_kernels
from tango_lm.ops.dispatch import check_devices, choose, eager

CAUSAL_BLOCK = 128  # positions per block


def causal_blocks(t: int, block: int) -> list[tuple[int, int]]:
    """Consecutive (s0, s1) ranges of `block` positions covering 0..t."""
    return [(s0, min(s0 + block, t)) for s0 in range(0, t, block)]


def causal_matmul_reference(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [..., T, T], v [..., T, e] -> [..., T, e]: destinations see sources at or before them."""
    return torch.tril(p) @ v


def scratch_view(buffer: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous tensor of `shape` on the start of a flat scratch buffer. A batched matmul runs
    as one call only into a contiguous output; into a strided slice it runs matrix by matrix."""
    return buffer[: torch.Size(shape).numel()].view(shape)


class _CausalMatmul(torch.autograd.Function):
    # All leading indices in one batched matmul per block, into a scratch buffer copied into place;
    # each piece of p is copied, to mask its part of the diagonal block.
    @staticmethod
    def forward(ctx, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, t, e = v.shape
        out = torch.empty_like(v)
        scratch = torch.empty(n * min(CAUSAL_BLOCK, t) * e, dtype=v.dtype, device=v.device)
        for r0, r1 in causal_blocks(t, CAUSAL_BLOCK):  # destinations r0:r1 see sources :r1
            piece = p[:, r0:r1, :r1].clone()
            piece[:, :, r0:].tril_()
            rows = scratch_view(scratch, n, r1 - r0, e)
            torch.bmm(piece, v[:, :r1], out=rows)
            out[:, r0:r1] = rows
        ctx.save_for_backward(p, v)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        p, v = ctx.saved_tensors
        n, t, e = v.shape
        grad_out = grad_out.contiguous()
        grad_p = torch.empty_like(p) if ctx.needs_input_grad[0] else None
        grad_v = torch.empty_like(v) if ctx.needs_input_grad[1] else None
        scratch = torch.empty(n * min(CAUSAL_BLOCK, t) * max(t, e), dtype=v.dtype, device=v.device)
        for s0, s1 in causal_blocks(t, CAUSAL_BLOCK):  # sources s0:s1 are seen by destinations s0 onwards
            if grad_v is not None:
                piece = p[:, s0:, s0:s1].clone()
                piece[:, : s1 - s0].tril_()
                rows = scratch_view(scratch, n, s1 - s0, e)
                torch.bmm(piece.transpose(1, 2), grad_out[:, s0:], out=rows)
                grad_v[:, s0:s1] = rows
            if grad_p is not None:
                cols = scratch_view(scratch, n, t - s0, s1 - s0)
                torch.bmm(grad_out[:, s0:], v[:, s0:s1].transpose(1, 2), out=cols)
                grad_p[:, s0:, s0:s1] = cols
                grad_p[:, :s0, s0:s1] = 0
                grad_p[:, s0:s1, s0:s1].tril_()
        return grad_p, grad_v


class _CausalMatmulKernels(torch.autograd.Function):
    # The three products on the C kernels of TANGO's gate average (`ops/cpu_kernels.py`, one
    # "head" of width e), which compute only the causal triangle.
    @staticmethod
    def forward(ctx, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, t, _ = v.shape
        lower = torch.tril(p).view(n, 1, t, t)  # the kernels read exact zeros above the diagonal
        out = torch.empty_like(v)
        cpu_kernels.gate_average(lower, v, None, out, None)
        ctx.save_for_backward(lower, v)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        lower, v = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_p = grad_v = None
        if ctx.needs_input_grad[0]:  # zero above the diagonal, as tril's gradient
            grad_p = torch.empty_like(lower)
            cpu_kernels.gate_average_grad_probs(grad_out, v, grad_p)
            grad_p = grad_p.view(lower.shape[0], *lower.shape[2:])
        if ctx.needs_input_grad[1]:
            grad_v = torch.empty_like(v)
            cpu_kernels.gate_average_grad_gates(lower, grad_out, grad_v)
        return grad_p, grad_v


def causal_matmul_fused(p: torch.Tensor, v: torch.Tensor, *, kernels: bool | None = None) -> torch.Tensor:
    """Same contract as `causal_matmul_reference`; p and v share one dtype and leading shape.
    `kernels`: the C kernels (True), the blocked PyTorch products (False), or the kernels where
    usable (None)."""
    if kernels is None:
        kernels = cpu_kernels.usable(v)
    lead = p.shape[:-2]
    op = _CausalMatmulKernels if kernels else _CausalMatmul
    out = op.apply(p.reshape(-1, *p.shape[-2:]).contiguous(), v.reshape(-1, *v.shape[-2:]).contiguous())
    return out.view(*lead, *out.shape[-2:])


def causal_matmul(p: torch.Tensor, v: torch.Tensor, *, kernels: str | None = None) -> torch.Tensor:
    """On CPUs in eager mode (no autocast), when p and v share a dtype and leading shape: the C
    kernels where they build (float32) and are `cpu_kernels.preferred()`, else the blocked op when
    the sequence is longer than one block. Elsewhere the composition (GPU matmuls, and inductor
    under torch.compile, do better with one call). `kernels` or $TANGO_LM_KERNELS overrides
    (`ops/dispatch.py`)."""
    check_devices("causal_matmul", p=p, v=v)
    cpu_eager = (
        p.device.type == "cpu"
        and p.dtype == v.dtype
        and p.shape[:-2] == v.shape[:-2]
        and eager()
        and not torch.is_autocast_enabled("cpu")
    )
    c, auto_c = cpu_kernels.choices(v, kernels) if cpu_eager else (False, False)
    auto = "c" if auto_c else "blocked" if cpu_eager and p.shape[-1] > CAUSAL_BLOCK else "reference"
    name = choose({"reference": True, "blocked": cpu_eager, "c": c}, auto, kernels)
    if name == "reference" or p.numel() == 0 or v.numel() == 0:  # nothing to block or tile
        return causal_matmul_reference(p, v)
    return causal_matmul_fused(p, v, kernels=name == "c")
