"""GAU's and FLASH's causal squared-ReLU attention as Triton kernels, forward and backward.

The contract of a full forward of `relu2_attention_reference` (ops/relu2_attention.py): q, k
[..., T, s], v [..., T, e], the relative bias of 2L - 1 entries (T <= L), and

    S = q k^T * scale + rel_bias[t - j],   P = relu(S)^2 for j <= t (else 0),   O = P V.

The kernels work flash-attention style, one program per query block (or key block) looping over
the key (query) blocks of the causal triangle only; no [T, T] tensor is ever held in memory. There
is no softmax, so no row statistics: the forward is one pass.

1. `forward_kernel`: one program per (query block, block of e columns, leading index): S, P
   recomputed per key block, O += P V accumulated in fp32;
2. `dv_kernel`: one program per (key block, block of e columns, leading index): dV = P^T dO;
   both run the blocks wholly inside the causal triangle and before T in a loop of their own,
   without masks and with the bias read at a loop-invariant tile of offsets (bf16 and fp16);
3. `dqk_kernel`: one program per (key block, leading index): dP = dO V^T contracted over the whole
   width e, dS = 2 relu(S) dP; dK = dS^T Q * scale and dQ = dS K * scale added atomically into
   fp32 buffers, and the bias's gradient (the sum of dS per offset t - j) summed
   per tile diagonal in registers and added atomically into an fp32 buffer of 2L - 1 entries.

Why e is tiled over a grid axis (forward and dV) instead of looped over inside one program: e is
wide (GAU's e = 2d, 1,024-1,536 at the presets, against s = 128), and a program that held the
whole [BLOCK_M, e] fp32 accumulator would spill registers (ptxas for sm_90: a [64, 256] tile
already uses all 255 registers per thread at s = 128); a tile of 128-256 columns keeps it in
registers, at the price of recomputing S = q k^T once per tile (s / BLOCK_E of the P V work: 1/2
at 256 columns, 1 at 128), and gives the grid e / BLOCK_E times more programs to fill the GPU with.
dP must be contracted over the whole of e before dS exists, so `dqk_kernel` loops over e instead
(its accumulator is the [BLOCK, BLOCK] tile of dP, whatever e is).

Inputs bf16, fp16 or fp32 (q, k, v of one dtype; the bias of any of them, read as fp32), products
on the tensor cores in the inputs' dtype with fp32 accumulation, as flash attention does (fp32
inputs in full fp32 unless PyTorch's matmuls are allowed TF32). The kernels are wrapped as
`torch.library` custom ops with fake implementations and an autograd formula, so `torch.compile`
keeps them inside its graph. `TRITON_INTERPRET=1` (set before triton is imported) runs them on
CPU tensors, which is how the tests check their arithmetic without a GPU.
"""

from __future__ import annotations

import torch
import triton

from tango_lm.ops.relu2_attention_triton_kernels import dqk_kernel, dv_kernel, forward_kernel
from tango_lm.ops.triton_common import DTYPES, INTERPRETED, MAX_GRID, precision

__all__ = ["DTYPES", "INTERPRETED", "relu2_attention_triton", "supported"]


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor) -> bool:
    """Whether the kernels take this full forward: q, k, v of one dtype of `DTYPES` (the bias any
    of them) on a device they run on (CUDA, or the CPU when interpreted), q.shape == k.shape,
    v [..., T, e] with the same leading shape, 0 < s <= 256, at most 65,535 leading indices, and
    a bias vector that covers every offset."""
    device_ok = q.is_cuda or (INTERPRETED and q.device.type == "cpu")
    return (
        device_ok
        and q.dtype in DTYPES
        and k.dtype == v.dtype == q.dtype
        and rel_bias.dtype in DTYPES
        and rel_bias.dim() == 1
        and q.dim() >= 2
        and q.shape == k.shape
        and v.dim() == q.dim()
        and v.shape[:-1] == q.shape[:-1]
        and 0 < q.shape[-1] <= 256
        and q.shape[-2] <= (rel_bias.shape[0] + 1) // 2
        and q.shape[:-2].numel() <= MAX_GRID
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., T, w] -> [N, T, w] (a view when the layout allows; the kernels take any strides)."""
    return x.reshape(-1, *x.shape[-2:])


def _sizes(q: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor) -> tuple[int, ...]:
    """N, T, e, s, HALF (the bias covers offsets -(HALF-1)..HALF-1) and BLOCK_D."""
    n, t = q.shape[:-2].numel(), q.shape[-2]
    d = q.shape[-1]
    return n, t, v.shape[-1], d, (rel_bias.shape[0] + 1) // 2, max(16, triton.next_power_of_2(d))


@torch.library.custom_op("tango_lm::relu2_attention_triton_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor, scale: float) -> torch.Tensor:
    """O [..., T, e] in v's dtype."""
    n, t, e, d, half, block_d = _sizes(q, v, rel_bias)
    if n * t * e == 0:
        return torch.zeros(*q.shape[:-1], e, dtype=v.dtype, device=v.device)
    q3, k3, v3 = _rows(q), _rows(k), _rows(v)
    # Allocated in the output's shape (the kernel writes a [n, T, e] view of it): a custom op's
    # output that is a view of its own buffer may not be changed in place by the caller.
    result = torch.empty(*q.shape[:-1], e, dtype=v.dtype, device=v.device)
    out = result.view(n, t, e)
    forward_kernel[lambda m: (triton.cdiv(t, m["BLOCK_M"]), triton.cdiv(e, m["BLOCK_E"]), n)](
        q3,
        k3,
        v3,
        rel_bias.contiguous(),
        out,
        *q3.stride(),
        *k3.stride(),
        *v3.stride(),
        t,
        e,
        d,
        half,
        scale,
        PRECISION=precision(q.dtype),
        BLOCK_D=block_d,
    )
    return result


@_forward.register_fake
def _forward_fake(q, k, v, rel_bias, scale):
    return v.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("tango_lm::relu2_attention_triton_backward", mutates_args=())
def _backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d rel_bias), each in its input's dtype and shape."""
    n, t, e, d, half, block_d = _sizes(q, v, rel_bias)
    dq = torch.zeros(n, t, d, dtype=torch.float32, device=q.device)  # accumulated atomically
    dbias = torch.zeros(rel_bias.shape, dtype=torch.float32, device=q.device)  # accumulated atomically
    if n * t * e == 0:
        return dq.to(q.dtype).view(q.shape), torch.zeros_like(k), torch.zeros_like(v), dbias.to(rel_bias.dtype)
    q3, k3, v3, do3 = _rows(q), _rows(k), _rows(v), _rows(grad_out)
    dk = torch.zeros(n, t, d, dtype=torch.float32, device=q.device)  # accumulated atomically
    dv = torch.empty(n, t, e, dtype=v.dtype, device=v.device)
    bias, prec = rel_bias.contiguous(), precision(q.dtype)
    dv_kernel[lambda m: (triton.cdiv(t, m["BLOCK_N"]), triton.cdiv(e, m["BLOCK_E"]), n)](
        q3, k3, do3, bias, dv, *q3.stride(), *k3.stride(), *do3.stride(), t, e, d, half, scale,
        PRECISION=prec, BLOCK_D=block_d,
    )  # fmt: skip
    dqk_kernel[lambda m: (triton.cdiv(t, m["BLOCK"]), n)](
        q3, k3, v3, do3, bias, dq, dk, dbias, *q3.stride(), *k3.stride(), *v3.stride(), *do3.stride(),
        t, e, d, half, scale, PRECISION=prec, BLOCK_D=block_d,
    )  # fmt: skip
    return (
        dq.to(q.dtype).view(q.shape),
        dk.to(k.dtype).view(k.shape),
        dv.view(v.shape),
        dbias.to(rel_bias.dtype),
    )


@_backward.register_fake
def _backward_fake(grad_out, q, k, v, rel_bias, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), rel_bias.new_empty(rel_bias.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, rel_bias, scale = inputs
    ctx.scale = scale
    ctx.save_for_backward(q, k, v, rel_bias)


def _autograd_backward(ctx, grad_out):
    q, k, v, rel_bias = ctx.saved_tensors
    dq, dk, dv, dbias = _backward(grad_out, q, k, v, rel_bias, ctx.scale)
    return dq, dk, dv, dbias, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def relu2_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """The full causal forward `relu(q k^T * scale + rel_bias[t - j])^2 V` on the Triton kernels.
    The inputs must pass `supported`."""
    return _forward(q, k, v, rel_bias, float(scale))
