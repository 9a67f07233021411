"""TANGO's mixing as Triton kernels: `y = gate_average(q, k, silu(a)) * u`, forward and backward.

The same contract as `tango_mix_reference` (ops/tango_mix.py): q, k [B, H, T, d_h]; gate
pre-activations a and u [B, T, F], head h owning columns h*W:(h+1)*W (W = F/H, any width); u may
be None (tango-compact's narrow average of its controller: y = gbar). The value width W is far
larger than d_h, so the probabilities are cheap to recompute and the design is

1. `lse_kernel`: the row log-sum-exp of the causal scores, one program per (query block, head):
   O(T^2 d_h), kept as [B, H, T] fp32;
2. `forward_kernel`: one program per (query block, column block, head); over the key blocks at or
   before the diagonal only, P = exp(S - lse) is recomputed and multiplied by the gates g = silu(a);
   the epilogue multiplies by u and writes y, and the average itself only when the backward needs
   it for u's gradient;
3. backward: `gates_backward_kernel` (one program per key block, column block and head)
   accumulates dg = P^T dgbar and writes da = dg * silu'(a) and du = dy * gbar at the same
   positions (and g and dgbar = dy * u, which its epilogue has at hand, for the scores
   backward); on the way it adds its columns' share of
   D = rowsum(dgbar * gbar) = rowsum(dy * y) per row (atomically, so D costs no pass of its own over
   the [B, T, F] dy and y); then `scores_backward_kernel` (one program per key block and head)
   forms dP = dgbar g^T over the whole width, dS = P (dP - D), and accumulates dk in registers and
   dq atomically.

Where the SiLU runs (`silu_on_load`): every query block's program reads every earlier key block's
gates, so a SiLU applied as the loops load a (`silu_on_load=True`) runs T / (2 BLOCK_M) times per
gate, each an exp and a division on the special-function units (MUFU), which do 16 lanes' worth per
clock per SM where the tensor cores do 4,096 bf16 FLOPs. Compiled for sm_90 at TANGO's shape
(`tools/triton_ptxas_report.py --mix [--silu-on-load]`), one iteration of the forward's loop then
issues 712 instructions per warp, 160 of them MUFU (1,280 clocks of the MUFU units for 4 warps),
for 320 clocks of tensor-core work (64 x 64 x (32 + 128) multiply-adds); the scores backward's
inner loop 244 (32 MUFU) for 128. The default
(False) writes the gates once, as a [B, T, F] tensor in the inputs' dtype (F.silu before the
forward kernel; the gates backward's epilogue, which has silu(a) at hand, for the backward), and
the loops read them as they are: 222 (32 MUFU) and 144 (none). The same epilogue has dy and u at
hand too, so it writes dgbar = dy * u for the scores backward, whose loop then loads two tiles
instead of three and multiplies none: 106. That costs a transient [B, T, F] buffer in the forward
and two in the backward, and in the forward one elementwise pass;
`tools/gate_average_bench.py` times both placements on a GPU, side by side. (The forward's key blocks wholly
before a query block's first row run in a loop without masks, the diagonal in a masked one.)

No [B, H, T, T] tensor is ever held, the gradient of the average is never written out, and every
accumulation is fp32 (bf16 and fp16 inputs are multiplied on the tensor cores in
their own type, as flash attention does; fp32 inputs in full fp32, as PyTorch's default matmuls).
The kernels take every input by its strides (the per-head q, k views and the [B, T, F] layout need
no copy). They are wrapped as `torch.library` custom ops with fake implementations and an autograd
formula, so `torch.compile` keeps them inside its graph. `TRITON_INTERPRET=1` (set before triton
is imported) runs them on CPU tensors, which is how the tests check their arithmetic without a GPU.
"""

from __future__ import annotations

import torch
import triton

from tango_lm.ops.tango_mix_triton_kernels import (
    forward_kernel,
    gates_backward_kernel,
    lse_kernel,
    scores_backward_kernel,
)
from tango_lm.ops.triton_common import DTYPES, INTERPRETED, LOG2E, MAX_GRID, column_alignment, precision

__all__ = ["DTYPES", "INTERPRETED", "supported", "tango_mix_triton"]


def supported(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor | None) -> bool:
    """Whether the kernels take these inputs: one dtype of `DTYPES`, head dim <= 256, B * H within
    a grid axis, a device they run on (CUDA, or the CPU when interpreted)."""
    tensors = (q, k, a) if u is None else (q, k, a, u)
    device_ok = q.is_cuda or (INTERPRETED and q.device.type == "cpu")
    return (
        device_ok
        and q.dtype in DTYPES
        and all(x.dtype == q.dtype for x in tensors)
        and q.dim() == k.dim() == 4
        and a.dim() == 3
        and 0 < q.shape[-1] <= 256
        and q.shape == k.shape
        and a.shape[0] == q.shape[0]
        and a.shape[1] == q.shape[2]
        and a.shape[2] % q.shape[1] == 0
        and (u is None or u.shape == a.shape)
        and q.shape[0] * q.shape[1] <= MAX_GRID  # B * H is a grid axis: more would not launch
    )


def _common(q: torch.Tensor, a: torch.Tensor) -> tuple:
    b, h, t, d = q.shape
    return b, h, t, a.shape[-1] // h, d, d**-0.5 * LOG2E, max(16, triton.next_power_of_2(d))


def _like_a(a: torch.Tensor) -> torch.Tensor:
    """A contiguous [B, T, F] buffer (outputs in a's layout share its offsets only when a is contiguous)."""
    return torch.empty(a.shape, dtype=a.dtype, device=a.device)


SILU_ON_LOAD = False  # the default: the gates written once, not recomputed in every program's loop


@torch.library.custom_op("tango_lm::tango_mix_triton_forward", mutates_args=())
def _forward(
    q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor | None, store_avg: bool, silu_on_load: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, lse [B, H, T] fp32 in log2 units, the average when store_avg else an empty tensor)."""
    a = a.contiguous()  # y and the average are written at a's offsets
    bsz, h, t, w, d, scale_log2, block_d = _common(q, a)
    lse = torch.empty(bsz, h, t, dtype=torch.float32, device=q.device)
    y = _like_a(a)
    avg = _like_a(a) if store_avg else a.new_empty(0)
    if y.numel() == 0:
        return y, lse.fill_(0.0), avg
    prec = precision(q.dtype)
    lse_kernel[lambda m: (triton.cdiv(t, m["BLOCK_M"]), bsz * h)](
        q, k, lse, *q.stride(), *k.stride(), h, t, w, d, scale_log2, PRECISION=prec, BLOCK_D=block_d
    )
    uu = a if u is None else u
    gates = a if silu_on_load else torch.nn.functional.silu(a)  # a's layout: the kernel reads either by a's strides
    forward_kernel[lambda m: (triton.cdiv(t, m["BLOCK_M"]), triton.cdiv(w, m["BLOCK_W"]), bsz * h)](
        q,
        k,
        gates,
        uu,
        lse,
        y,
        avg if store_avg else y,
        *q.stride(),
        *k.stride(),
        *a.stride(),
        *uu.stride(),
        h,
        t,
        w,
        d,
        scale_log2,
        HAS_U=u is not None,
        STORE_AVG=store_avg,
        GATES_READY=not silu_on_load,
        PRECISION=prec,
        ALIGN=column_alignment(w, a.element_size(), a, uu),
        BLOCK_D=block_d,
    )
    return y, lse, avg


@_forward.register_fake
def _forward_fake(q, k, a, u, store_avg, silu_on_load):
    b, h, t, _ = q.shape
    return (
        a.new_empty(a.shape),
        q.new_empty(b, h, t, dtype=torch.float32),
        a.new_empty(a.shape) if store_avg else a.new_empty(0),
    )


@torch.library.custom_op("tango_lm::tango_mix_triton_backward", mutates_args=())
def _backward(
    dy: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    u: torch.Tensor | None,
    y: torch.Tensor,
    avg: torch.Tensor,
    lse: torch.Tensor,
    silu_on_load: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, da, du; du empty without u). y: the output without u; with u its kernels read avg only."""
    a = a.contiguous()
    bsz, h, t, w, d, scale_log2, block_d = _common(q, a)
    dq = torch.zeros(bsz, h, t, d, dtype=torch.float32, device=q.device)  # accumulated atomically
    dk = torch.empty(bsz, h, t, d, dtype=torch.float32, device=q.device)
    da = _like_a(a)
    du = _like_a(a) if u is not None else a.new_empty(0)
    if da.numel() == 0:
        return dq.to(q.dtype), dk.zero_().to(k.dtype), da, du
    prec = precision(q.dtype)
    delta = torch.zeros(bsz, h, t, dtype=torch.float32, device=q.device)  # rowsum(dy * y), accumulated atomically
    uu = a if u is None else u
    align = column_alignment(w, a.element_size(), a, uu, dy, y)
    # Written by the gates backward for the scores backward: the gates, and with u dgbar = dy * u
    # (without u, dy is dgbar). a's layout, so the scores backward reads dgbar by a's strides.
    gates = a if silu_on_load else _like_a(a)
    dgbar = _like_a(a) if u is not None and not silu_on_load else dy
    args = (*q.stride(), *k.stride(), *a.stride(), *uu.stride())
    tail = (h, t, w, d, scale_log2)
    gates_backward_kernel[lambda m: (triton.cdiv(t, m["BLOCK_N"]), triton.cdiv(w, m["BLOCK_W"]), bsz * h)](
        q,
        k,
        a,
        uu,
        dy,
        lse,
        avg if u is not None else y,  # gbar; without u, y is gbar
        da,
        du if u is not None else da,
        delta,
        gates,
        dgbar,
        *args,
        *dy.stride(),
        *tail,
        HAS_U=u is not None,
        STORE_OPERANDS=not silu_on_load,
        PRECISION=prec,
        ALIGN=align,
        BLOCK_D=block_d,
    )
    scores_backward_kernel[lambda m: (triton.cdiv(t, m["BLOCK_N"]), bsz * h)](
        q,
        k,
        gates,
        uu,
        dgbar,
        lse,
        delta,
        dq,
        dk,
        *args,
        *dgbar.stride(),
        *tail,
        d**-0.5,
        HAS_U=u is not None,
        OPERANDS_READY=not silu_on_load,
        PRECISION=prec,
        ALIGN=align,
        BLOCK_D=block_d,
    )
    return dq.to(q.dtype), dk.to(k.dtype), da, du


@_backward.register_fake
def _backward_fake(dy, q, k, a, u, y, avg, lse, silu_on_load):
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        a.new_empty(a.shape),
        a.new_empty(a.shape) if u is not None else a.new_empty(0),
    )


def _setup_context(ctx, inputs, output) -> None:
    q, k, a, u, _, silu_on_load = inputs
    y, lse, avg = output
    ctx.has_u, ctx.silu_on_load = u is not None, silu_on_load
    # With u the backward reads the average, not y: y is not saved, so the caller may change it in place.
    ctx.save_for_backward(q, k, a, u, None if ctx.has_u else y, avg, lse)
    # lse and the average are outputs only to be saved: no gradient reaches them, and autograd
    # would otherwise fill one of the average's [B, T, F] with zeros at every backward.
    ctx.set_materialize_grads(False)


def _autograd_backward(ctx, dy, _dlse, _davg):
    q, k, a, u, y, avg, lse = ctx.saved_tensors
    if ctx.has_u and avg.numel() != a.numel():  # the op was called with store_avg=False: recompute it
        avg = _forward(q, k, a, None, False, ctx.silu_on_load)[0]
    dq, dk, da, du = _backward(dy, q, k, a, u, avg if ctx.has_u else y, avg, lse, ctx.silu_on_load)
    return dq, dk, da, du if ctx.has_u else None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def tango_mix_triton(
    q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor | None, silu_on_load: bool = SILU_ON_LOAD
) -> torch.Tensor:
    """`gate_average(q, k, silu(a)) * u` (or without u, the average alone) on the Triton kernels.
    The inputs must pass `supported`. `silu_on_load`: the kernels' loops apply the SiLU to a (and the
    scores backward's the product dy * u) as they read it, instead of reading operands written once
    (the module docstring says which costs what)."""
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, a, u))
    return _forward(q, k, a, u, u is not None and needs_grad, silu_on_load)[0]
