"""TANGO's mixing as Triton kernels: `y = gate_average(q, k, silu(a)) * u`, forward and backward.

The same contract as `tango_mix_reference` (ops/tango_mix.py): q, k [B, H, T, d_h]; gate
pre-activations a and u [B, T, F], head h owning columns h*W:(h+1)*W (W = F/H, any width); u may
be None (tango-compact's narrow average of its controller: y = gbar). The value width W is far
larger than d_h, so the probabilities are cheap to recompute and the design is

1. `_lse_kernel`: the row log-sum-exp of the causal scores, one program per (query block, head):
   O(T^2 d_h), kept as [B, H, T] fp32;
2. `_forward_kernel`: one program per (query block, column block, head); over the key blocks at or
   before the diagonal only, P = exp(S - lse) is recomputed and multiplied by the gates read in
   place from a (SiLU on load); the epilogue multiplies by u and writes y, and the average itself
   only when the backward needs it for u's gradient;
3. backward: `_delta_kernel` precomputes D = rowsum(dgbar * gbar) = rowsum(dy * y) per head;
   `_scores_backward_kernel` (one program per key block and head) forms dP = dgbar g^T over the
   whole width, dS = P (dP - D), and accumulates dk in registers and dq atomically;
   `_gates_backward_kernel` (one program per key block, column block and head) accumulates
   dg = P^T dgbar and writes da = dg * silu'(a) and du = dy * gbar at the same positions.

No [B, H, T, T] tensor is ever held, the gates and the gradient of the average are never written
out, and every accumulation is fp32 (bf16 and fp16 inputs are multiplied on the tensor cores in
their own type, as flash attention does; fp32 inputs in full fp32, as PyTorch's default matmuls).
The kernels take every input by its strides (the per-head q, k views and the [B, T, F] layout need
no copy). They are wrapped as `torch.library` custom ops with fake implementations and an autograd
formula, so `torch.compile` keeps them inside its graph. `TRITON_INTERPRET=1` (set before triton
is imported) runs them on CPU tensors, which is how the tests check their arithmetic without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634


def supported(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor | None) -> bool:
    """Whether the kernels take these inputs: one dtype of `DTYPES`, head dim <= 256, a device
    they run on (CUDA, or the CPU when interpreted)."""
    tensors = (q, k, a) if u is None else (q, k, a, u)
    device_ok = q.is_cuda or (INTERPRETED and q.device.type == "cpu")
    return (device_ok and q.dtype in DTYPES and all(x.dtype == q.dtype for x in tensors)
            and q.dim() == k.dim() == 4 and a.dim() == 3 and 0 < q.shape[-1] <= 256 and q.shape == k.shape
            and a.shape[0] == q.shape[0] and a.shape[1] == q.shape[2] and a.shape[2] % q.shape[1] == 0
            and (u is None or u.shape == a.shape))


def _configs(names: tuple[str, ...], choices: list[tuple]) -> list[triton.Config]:
    if INTERPRETED:  # one small configuration: several blocks in every direction at the tests' sizes
        return [triton.Config(dict.fromkeys(names, 16), num_warps=1)]
    return [triton.Config(dict(zip(names, c[:-2], strict=True)), num_warps=c[-2], num_stages=c[-1]) for c in choices]


# (block sizes..., num_warps, num_stages). Larger column blocks recompute P less often.
_LSE_CONFIGS = _configs(("BLOCK_M", "BLOCK_N"), [(64, 64, 4, 2), (128, 64, 4, 2), (128, 128, 8, 2)])
_FORWARD_CONFIGS = _configs(("BLOCK_M", "BLOCK_N", "BLOCK_W"), [
    (64, 64, 128, 4, 3), (128, 64, 128, 8, 3), (128, 32, 256, 8, 3), (64, 64, 256, 8, 2), (128, 64, 64, 4, 3),
])
_DELTA_CONFIGS = _configs(("BLOCK_M", "BLOCK_W"), [(64, 128, 4, 1), (32, 256, 4, 1)])
_SCORES_CONFIGS = _configs(("BLOCK_M", "BLOCK_N", "BLOCK_W"), [
    (64, 64, 64, 4, 3), (64, 128, 64, 8, 3), (128, 64, 64, 8, 3), (64, 64, 128, 8, 2),
])
_GATES_CONFIGS = _configs(("BLOCK_M", "BLOCK_N", "BLOCK_W"), [
    (64, 64, 128, 4, 3), (64, 128, 128, 8, 3), (32, 128, 256, 8, 3), (64, 64, 256, 8, 2), (64, 128, 64, 4, 3),
])
_KEY = ["T", "W", "D"]


# The interpreter multiplies bf16 operands as their raw 16-bit patterns (triton 3.9): there the
# operands, already rounded to their dtype, are multiplied as fp32, which is what the tensor cores do.
_UPCAST_DOTS = tl.constexpr(INTERPRETED)


@triton.jit
def _dot(x, y, PRECISION: tl.constexpr):
    if _UPCAST_DOTS:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), input_precision="ieee")
    return tl.dot(x, y, input_precision=PRECISION)


@triton.jit
def _silu_f32(a):
    a = a.to(tl.float32)
    return a / (1.0 + tl.exp(-a))


@triton.autotune(_LSE_CONFIGS, key=_KEY)
@triton.jit
def _lse_kernel(Q, K, LSE, sqb, sqh, sqt, sqd, skb, skh, skt, skd, H, T, W, D, scale_log2,
                PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows first
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: B * T * F can pass 2^31
    b, h = bh // H, bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=(offs_m[:, None] < T) & (offs_d[None, :] < D), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, tl.minimum((pid_m + 1) * BLOCK_M, T), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = tl.load(K + b * skb + h * skh + offs_n[None, :] * skt + offs_d[:, None] * skd,
                     mask=(offs_n[None, :] < T) & (offs_d[:, None] < D), other=0.0)
        s = _dot(q, kt, PRECISION) * scale_log2
        s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every row sees source 0
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    tl.store(LSE + bh * T + offs_m, m_i + tl.log2(l_i), mask=offs_m < T)


@triton.autotune(_FORWARD_CONFIGS, key=_KEY)
@triton.jit
def _forward_kernel(Q, K, A, U, LSE, Y, AVG, sqb, sqh, sqt, sqd, skb, skh, skt, skd, sab, sat, saf,
                    sub, sut, suf, H, T, W, D, scale_log2, HAS_U: tl.constexpr, STORE_AVG: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_W: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_w, bh = tl.program_id(1), tl.program_id(2).to(tl.int64)
    b, h = bh // H, bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    cols = h * W + offs_w
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=(offs_m[:, None] < T) & (offs_d[None, :] < D), other=0.0)
    lse = tl.load(LSE + bh * T + offs_m, mask=offs_m < T, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    for start_n in range(0, tl.minimum((pid_m + 1) * BLOCK_M, T), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = tl.load(K + b * skb + h * skh + offs_n[None, :] * skt + offs_d[:, None] * skd,
                     mask=(offs_n[None, :] < T) & (offs_d[:, None] < D), other=0.0)
        s = _dot(q, kt, PRECISION) * scale_log2
        p = tl.where((offs_m[:, None] >= offs_n[None, :]) & (offs_n[None, :] < T), tl.exp2(s - lse[:, None]), 0.0)
        a = tl.load(A + b * sab + offs_n[:, None] * sat + cols[None, :] * saf,
                    mask=(offs_n[:, None] < T) & (offs_w[None, :] < W), other=0.0)
        g = _silu_f32(a).to(A.dtype.element_ty)
        acc += _dot(p.to(A.dtype.element_ty), g, PRECISION)
    rows = b * sab + offs_m[:, None] * sat + cols[None, :] * saf  # Y and AVG share a's layout (contiguous)
    mask = (offs_m[:, None] < T) & (offs_w[None, :] < W)
    if STORE_AVG:
        tl.store(AVG + rows, acc.to(AVG.dtype.element_ty), mask=mask)
    if HAS_U:
        u = tl.load(U + b * sub + offs_m[:, None] * sut + cols[None, :] * suf, mask=mask, other=0.0)
        acc = acc * u.to(tl.float32)
    tl.store(Y + rows, acc.to(Y.dtype.element_ty), mask=mask)


@triton.autotune(_DELTA_CONFIGS, key=_KEY)
@triton.jit
def _delta_kernel(DY, Y, DELTA, sdb, sdt, sdf, syb, syt, syf, H, T, W, D,
                  BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M], tl.float32)
    for start_w in range(0, W, BLOCK_W):
        offs_w = start_w + tl.arange(0, BLOCK_W)
        cols = h * W + offs_w
        mask = (offs_m[:, None] < T) & (offs_w[None, :] < W)
        dy = tl.load(DY + b * sdb + offs_m[:, None] * sdt + cols[None, :] * sdf, mask=mask, other=0.0)
        y = tl.load(Y + b * syb + offs_m[:, None] * syt + cols[None, :] * syf, mask=mask, other=0.0)
        acc += tl.sum(dy.to(tl.float32) * y.to(tl.float32), 1)
    tl.store(DELTA + bh * T + offs_m, acc, mask=offs_m < T)


@triton.autotune(_SCORES_CONFIGS, key=_KEY, reset_to_zero=["DQ"])
@triton.jit
def _scores_backward_kernel(Q, K, A, U, DY, LSE, DELTA, DQ, DK, sqb, sqh, sqt, sqd, skb, skh, skt, skd,
                            sab, sat, saf, sub, sut, suf, sdb, sdt, sdf, H, T, W, D, scale_log2, scale,
                            HAS_U: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: B * T * F can pass 2^31
    b, h = bh // H, bh % H
    dt = A.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kmask = (offs_n[:, None] < T) & (offs_d[None, :] < D)
    k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skt + offs_d[None, :] * skd, mask=kmask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start_m in range((pid_n * BLOCK_N) // BLOCK_M * BLOCK_M, T, BLOCK_M):  # destinations that see these keys
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qmask = (offs_m[:, None] < T) & (offs_d[None, :] < D)
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd, mask=qmask, other=0.0)
        lse = tl.load(LSE + bh * T + offs_m, mask=offs_m < T, other=0.0)
        delta = tl.load(DELTA + bh * T + offs_m, mask=offs_m < T, other=0.0)
        s = _dot(q, tl.trans(k), PRECISION) * scale_log2
        valid = (offs_m[:, None] >= offs_n[None, :]) & (offs_m[:, None] < T) & (offs_n[None, :] < T)
        p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start_w in range(0, W, BLOCK_W):  # dP = dgbar g^T, contracted over the whole width
            offs_w = start_w + tl.arange(0, BLOCK_W)
            cols = h * W + offs_w
            mmask = (offs_m[:, None] < T) & (offs_w[None, :] < W)
            dg = tl.load(DY + b * sdb + offs_m[:, None] * sdt + cols[None, :] * sdf, mask=mmask, other=0.0)
            dg = dg.to(tl.float32)
            if HAS_U:
                dg = dg * tl.load(U + b * sub + offs_m[:, None] * sut + cols[None, :] * suf, mask=mmask,
                                  other=0.0).to(tl.float32)
            at = tl.load(A + b * sab + offs_n[None, :] * sat + cols[:, None] * saf,
                         mask=(offs_n[None, :] < T) & (offs_w[:, None] < W), other=0.0)
            dp += _dot(dg.to(dt), _silu_f32(at).to(dt), PRECISION)
        ds = (p * (dp - delta[:, None])).to(dt)
        dk += _dot(tl.trans(ds), q, PRECISION)
        dq = _dot(ds, k, PRECISION) * scale
        tl.atomic_add(DQ + bh * T * D + offs_m[:, None] * D + offs_d[None, :], dq, mask=qmask)
    tl.store(DK + bh * T * D + offs_n[:, None] * D + offs_d[None, :], dk * scale, mask=kmask)


@triton.autotune(_GATES_CONFIGS, key=_KEY)
@triton.jit
def _gates_backward_kernel(Q, K, A, U, DY, LSE, AVG, DA, DU, sqb, sqh, sqt, sqd, skb, skh, skt, skd,
                           sab, sat, saf, sub, sut, suf, sdb, sdt, sdf, H, T, W, D, scale_log2,
                           HAS_U: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_w, bh = tl.program_id(1), tl.program_id(2).to(tl.int64)
    b, h = bh // H, bh % H
    dt = A.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    cols = h * W + offs_w
    k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skt + offs_d[None, :] * skd,
                mask=(offs_n[:, None] < T) & (offs_d[None, :] < D), other=0.0)
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    for start_m in range((pid_n * BLOCK_N) // BLOCK_M * BLOCK_M, T, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qt = tl.load(Q + b * sqb + h * sqh + offs_m[None, :] * sqt + offs_d[:, None] * sqd,
                     mask=(offs_m[None, :] < T) & (offs_d[:, None] < D), other=0.0)
        lse = tl.load(LSE + bh * T + offs_m, mask=offs_m < T, other=0.0)
        st = _dot(k, qt, PRECISION) * scale_log2  # S^T: [keys, destinations]
        valid = (offs_m[None, :] >= offs_n[:, None]) & (offs_m[None, :] < T) & (offs_n[:, None] < T)
        pt = tl.where(valid, tl.exp2(st - lse[None, :]), 0.0)
        mmask = (offs_m[:, None] < T) & (offs_w[None, :] < W)
        dg = tl.load(DY + b * sdb + offs_m[:, None] * sdt + cols[None, :] * sdf, mask=mmask, other=0.0)
        dg = dg.to(tl.float32)
        if HAS_U:
            dg = dg * tl.load(U + b * sub + offs_m[:, None] * sut + cols[None, :] * suf, mask=mmask,
                              other=0.0).to(tl.float32)
        acc += _dot(pt.to(dt), dg.to(dt), PRECISION)
    mask = (offs_n[:, None] < T) & (offs_w[None, :] < W)
    a = tl.load(A + b * sab + offs_n[:, None] * sat + cols[None, :] * saf, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    rows = b * sab + offs_n[:, None] * sat + cols[None, :] * saf  # DA, DU and AVG share a's layout
    tl.store(DA + rows, (acc * sig * (1.0 + a * (1.0 - sig))).to(DA.dtype.element_ty), mask=mask)
    if HAS_U:
        dy = tl.load(DY + b * sdb + offs_n[:, None] * sdt + cols[None, :] * sdf, mask=mask, other=0.0)
        avg = tl.load(AVG + rows, mask=mask, other=0.0)
        tl.store(DU + rows, (dy.to(tl.float32) * avg.to(tl.float32)).to(DU.dtype.element_ty), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 unless PyTorch's own matmuls are allowed TF32; bf16 and
    fp16 operands take the tensor cores' own path (Triton's default setting)."""
    return "ieee" if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"


def _common(q: torch.Tensor, a: torch.Tensor) -> tuple:
    b, h, t, d = q.shape
    return b, h, t, a.shape[-1] // h, d, d**-0.5 * LOG2E, max(16, triton.next_power_of_2(d))


def _like_a(a: torch.Tensor) -> torch.Tensor:
    """A contiguous [B, T, F] buffer (outputs in a's layout share its offsets only when a is contiguous)."""
    return torch.empty(a.shape, dtype=a.dtype, device=a.device)


@torch.library.custom_op("tango_lm::tango_mix_triton_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor | None,
             store_avg: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, lse [B, H, T] fp32 in log2 units, the average when store_avg else an empty tensor)."""
    a = a.contiguous()  # y and the average are written at a's offsets
    bsz, h, t, w, d, scale_log2, block_d = _common(q, a)
    lse = torch.empty(bsz, h, t, dtype=torch.float32, device=q.device)
    y = _like_a(a)
    avg = _like_a(a) if store_avg else a.new_empty(0)
    if y.numel() == 0:
        return y, lse.fill_(0.0), avg
    prec = _precision(q.dtype)
    _lse_kernel[lambda m: (triton.cdiv(t, m["BLOCK_M"]), bsz * h)](
        q, k, lse, *q.stride(), *k.stride(), h, t, w, d, scale_log2, PRECISION=prec, BLOCK_D=block_d)
    uu = a if u is None else u
    _forward_kernel[lambda m: (triton.cdiv(t, m["BLOCK_M"]), triton.cdiv(w, m["BLOCK_W"]), bsz * h)](
        q, k, a, uu, lse, y, avg if store_avg else y, *q.stride(), *k.stride(), *a.stride(), *uu.stride(),
        h, t, w, d, scale_log2, HAS_U=u is not None, STORE_AVG=store_avg, PRECISION=prec, BLOCK_D=block_d)
    return y, lse, avg


@_forward.register_fake
def _forward_fake(q, k, a, u, store_avg):
    b, h, t, _ = q.shape
    return (a.new_empty(a.shape), q.new_empty(b, h, t, dtype=torch.float32),
            a.new_empty(a.shape) if store_avg else a.new_empty(0))


@torch.library.custom_op("tango_lm::tango_mix_triton_backward", mutates_args=())
def _backward(dy: torch.Tensor, q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor | None,
              y: torch.Tensor, avg: torch.Tensor, lse: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, da, du; du empty without u)."""
    a = a.contiguous()
    bsz, h, t, w, d, scale_log2, block_d = _common(q, a)
    dq = torch.zeros(bsz, h, t, d, dtype=torch.float32, device=q.device)  # accumulated atomically
    dk = torch.empty(bsz, h, t, d, dtype=torch.float32, device=q.device)
    da = _like_a(a)
    du = _like_a(a) if u is not None else a.new_empty(0)
    if da.numel() == 0:
        return dq.to(q.dtype), dk.zero_().to(k.dtype), da, du
    prec = _precision(q.dtype)
    delta = torch.empty(bsz, h, t, dtype=torch.float32, device=q.device)
    _delta_kernel[lambda m: (triton.cdiv(t, m["BLOCK_M"]), bsz * h)](
        dy, y, delta, *dy.stride(), *y.stride(), h, t, w, d)
    uu = a if u is None else u
    args = (*q.stride(), *k.stride(), *a.stride(), *uu.stride(), *dy.stride(), h, t, w, d, scale_log2)
    _scores_backward_kernel[lambda m: (triton.cdiv(t, m["BLOCK_N"]), bsz * h)](
        q, k, a, uu, dy, lse, delta, dq, dk, *args, d**-0.5, HAS_U=u is not None, PRECISION=prec, BLOCK_D=block_d)
    _gates_backward_kernel[lambda m: (triton.cdiv(t, m["BLOCK_N"]), triton.cdiv(w, m["BLOCK_W"]), bsz * h)](
        q, k, a, uu, dy, lse, avg if u is not None else a, da, du if u is not None else da, *args,
        HAS_U=u is not None, PRECISION=prec, BLOCK_D=block_d)
    return dq.to(q.dtype), dk.to(k.dtype), da, du


@_backward.register_fake
def _backward_fake(dy, q, k, a, u, y, avg, lse):
    return (q.new_empty(q.shape), k.new_empty(k.shape), a.new_empty(a.shape),
            a.new_empty(a.shape) if u is not None else a.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    q, k, a, u, _ = inputs
    y, lse, avg = output
    ctx.has_u = u is not None
    ctx.save_for_backward(q, k, a, u, y, avg, lse)


def _autograd_backward(ctx, dy, _dlse, _davg):
    q, k, a, u, y, avg, lse = ctx.saved_tensors
    dq, dk, da, du = _backward(dy, q, k, a, u, y, avg, lse)
    return dq, dk, da, du if ctx.has_u else None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def tango_mix_triton(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """`gate_average(q, k, silu(a)) * u` (or without u, the average alone) on the Triton kernels.
    The inputs must pass `supported`."""
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, a, u))
    return _forward(q, k, a, u, u is not None and needs_grad)[0]
