"""Windowed TANGO's wide part as Triton kernels: the same contract as `_WindowedBandMix`
(ops/windowed_mix.py), `y = (band average + prefix average) * u` from the small tensors of
`band_weights` (ops/windowed.py) and the gate pre-activations a, u [B, T, F].

Per head, with chunks of C positions, band weights Wb_i [C, 2C] (chunk i's destinations against
the sources of chunks i - 1 and i), the prefix factors pq_i and phi(k) pk_i [C, d_h], and g = silu(a):

    avg_i = Wb_i[:, :C] g_{i-1} + Wb_i[:, C:] g_i + pq_i S_{i-2},    S_m = sum_{c <= m} pk_c^T g_c

- `_forward_kernel`: one program per (column block, head) walks the chunks in order, carrying the
  running sum S [d_h, column block] in registers and (bf16, fp16) the previous chunk's gates, so no
  per-chunk state is ever written (the composition keeps S for every chunk); SiLU on load (once per
  gate), u in the epilogue.
- `_band_backward_kernel`: one program per (chunk, head) contracts over the whole width for the
  band weights' gradient, dWb_i = dgbar_i [g_{i-1}, g_i]^T.
- `_backward_kernel`: one program per (column block, head) walks the chunks forward (S again,
  for pq's gradient dgbar_i S_{i-2}^T) and then backward, carrying dgbar_{c+1} and
  R_c = sum_{i >= c+2} pq_i^T dgbar_i for the gates' gradient (own band, the next chunk's band,
  pk_c R_c) and pk's (g_c R_c^T); the two gradients contracted over the width are accumulated
  atomically across column blocks.

The small tensors come fp32 (band_weights' compute dtype); the op rounds them once to the dtypes
the kernels multiply them in (`_operands`), and the kernels read and the backward keeps those
copies. The products take bf16/fp16 operands when the gates are bf16/fp16 (fp32 accumulation), fp32
operands otherwise, except that with fp16 gates the products with S, R, pq and pk take fp32
operands: S grows with T past fp16's range. Tested against
`windowed_mix_reference` in float64 under the interpreter (tests/ops/test_triton_windowed.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tango_lm.ops import windowed_triton_configs as tuning
from tango_lm.ops.triton_common import (
    DTYPES,
    INTERPRETED,
    MAX_GRID,
    autotune,
    column_alignment,
    dot,
    precision,
    sigmoid_f32,
    silu_f32,
)
from tango_lm.ops.windowed import MIN_CHUNK

# The longest chunk (window) the kernels take: their [C, 2C] band tiles at C = 256 need 576 KiB of
# shared memory (sm_90 has 227) and spill 17 KB per thread; at 128 they fit (tools/triton_ptxas_report.py
# with BLOCK_C = 128, 2026-12-05). Longer windows run the composition.
MAX_CHUNK = 128


def supported(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor, chunk: int = MIN_CHUNK) -> bool:
    """CUDA tensors (or CPU ones when interpreted); gates a, u of one dtype of `DTYPES`; q, k that
    `band_weights` turns into fp32 weights (no float64); d_h <= 256; q [B, H, T, d_h] and a, u
    [B, T, F] with F a multiple of H; chunks (`chunk_length`) of at most MAX_CHUNK positions."""
    device_ok = a.is_cuda or (INTERPRETED and a.device.type == "cpu")
    return (
        device_ok
        and chunk <= MAX_CHUNK
        and a.dtype in DTYPES
        and u.dtype == a.dtype
        and torch.float64 not in (q.dtype, k.dtype)
        and q.shape[-1] <= 256
        and a.dim() == 3
        and u.shape == a.shape
        # the kernels index a by q's batch, positions and heads: another shape reads out of bounds
        and q.dim() == 4
        and q.shape[0] == a.shape[0]
        and q.shape[2] == a.shape[1]
        and a.shape[2] % q.shape[1] == 0
        and q.shape[0] * q.shape[1] <= MAX_GRID  # B * H is a grid axis: more would not launch
    )


@autotune(tuning.FORWARD_CONFIGS, key=tuning.KEY)
@triton.jit
def _forward_kernel(
    WB,
    PQ,
    PK,
    A,
    U,
    Y,
    AVG,
    H,
    T,
    W,
    C,
    D,
    N,
    HAS_AVG: tl.constexpr,
    PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid_w, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    dt = A.dtype.element_ty
    # The running sums S = sum phi(k) g grow with T past fp16's 65504 (gates ~20, phi ~3: from T ~ 1,100),
    # and R's pq are small: with fp16 gates, the products with S, R, pq and pk take fp32 operands
    # (TF32 on the tensor cores where fp32 inputs would); bf16 has fp32's range.
    sdt = dt
    if dt == tl.float16:
        sdt = tl.float32
    W = W // ALIGN * ALIGN  # as in tango_mix's kernels: vectorized gate columns
    F = H * W
    BH = tl.num_programs(1)
    # fp32 on FMAs holds a product's whole contraction in registers: at d_h 33-64, pq S in two
    # halves, each with its running sum (S_hi: rows BLOCK_DP.. of S), spills no more (at d_h = 128
    # halves of 64 spill more than one piece: docs/benchmarks.md); bf16/fp16 in one piece. fp32
    # inputs under TF32 take the fp32 tiles (triton_common.admitted), and so the halves too.
    SPLIT_D: tl.constexpr = (dt == tl.float32) & (BLOCK_D == 64)
    BLOCK_DP: tl.constexpr = BLOCK_D // 2 if SPLIT_D else BLOCK_D
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_DP)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    tile = offs_c[:, None] * F + offs_w[None, :]  # 32-bit offsets within a chunk, 64-bit ones to it
    cc = (offs_c[:, None] < C) & (offs_c[None, :] < C)
    cd = (offs_c[:, None] < C) & (offs_d[None, :] < D)
    cd_hi = (offs_c[:, None] < C) & (BLOCK_DP + offs_d[None, :] < D)
    head = b * T * F + h * W
    s = tl.zeros([BLOCK_DP, BLOCK_W], tl.float32)  # S_{i-2}
    s_hi = tl.zeros([BLOCK_DP, BLOCK_W], tl.float32)
    # The previous chunk's gates: carried from the last iteration in bf16 and fp16 (reading them
    # again applied the SiLU twice per gate, in two layouts: 1,312 instructions per warp and
    # iteration against 840 carried, at TANGO's shape); read again for fp32 inputs, whose tiles
    # live in registers (carried, they spilled 0.4-3.6 KB at d_h 64 and 128).
    CARRY: tl.constexpr = dt != tl.float32
    g_prev = tl.zeros([BLOCK_C, BLOCK_W], dt)
    for i in range(0, N):
        first = head + tl.cast(i * C, tl.int64) * F
        mask = (offs_c[:, None] < C) & (i * C + offs_c[:, None] < T) & (offs_w[None, :] < W)
        g = silu_f32(tl.load(A + first + tile, mask=mask, other=0.0)).to(dt)
        small = (tl.cast(i, tl.int64) * BH + bh) * C  # chunk i, batch b, head h in the [n, B, H, C, .] tensors
        wb = WB + small * 2 * C + offs_c[:, None] * 2 * C + offs_c[None, :]
        acc = dot(tl.load(wb + C, mask=cc, other=0.0).to(dt), g, PRECISION)
        if i >= 1:
            if CARRY:
                g_back = g_prev
            else:
                pmask = (offs_c[:, None] < C) & (offs_w[None, :] < W)
                g_back = silu_f32(tl.load(A + first - C * F + tile, mask=pmask, other=0.0)).to(dt)
            acc += dot(tl.load(wb, mask=cc, other=0.0).to(dt), g_back, PRECISION)
            if i >= 2:
                pq = tl.load(PQ + small * D + offs_c[:, None] * D + offs_d[None, :], mask=cd, other=0.0)
                acc += dot(pq.to(sdt), s.to(sdt), PRECISION)
                if SPLIT_D:
                    pq = tl.load(
                        PQ + small * D + offs_c[:, None] * D + BLOCK_DP + offs_d[None, :], mask=cd_hi, other=0.0
                    )
                    acc += dot(pq.to(sdt), s_hi.to(sdt), PRECISION)
            # S_{i-1} = S_{i-2} + pk_{i-1}^T g_{i-1}, read by chunk i + 1
            prev = small - BH * C
            pkt = tl.load(
                PK + prev * D + offs_c[None, :] * D + offs_d[:, None],
                mask=(offs_c[None, :] < C) & (offs_d[:, None] < D),
                other=0.0,
            )
            s += dot(pkt.to(dt), g_back, PRECISION)
            if SPLIT_D:
                pkt = tl.load(
                    PK + prev * D + offs_c[None, :] * D + BLOCK_DP + offs_d[:, None],
                    mask=(offs_c[None, :] < C) & (BLOCK_DP + offs_d[:, None] < D),
                    other=0.0,
                )
                s_hi += dot(pkt.to(dt), g_back, PRECISION)
        if CARRY:
            g_prev = g
        if HAS_AVG:
            tl.store(AVG + first + tile, acc.to(dt), mask=mask)
        u = tl.load(U + first + tile, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + first + tile, (acc * u).to(dt), mask=mask)


@autotune(tuning.BAND_CONFIGS, key=tuning.KEY)
@triton.jit
def _band_backward_kernel(
    A,
    U,
    DY,
    DWB,
    H,
    T,
    W,
    C,
    D,
    N,
    PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    i, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    dt = A.dtype.element_ty
    W = W // ALIGN * ALIGN
    F = H * W
    offs_c = tl.arange(0, BLOCK_C)
    first = b * T * F + tl.cast(i * C, tl.int64) * F + h * W
    rows_ok = (offs_c < C) & (i * C + offs_c < T)
    prev_ok = (offs_c < C) & (i * C + offs_c >= C)  # the previous chunk, when there is one
    acc_prev = tl.zeros([BLOCK_C, BLOCK_C], tl.float32)
    acc_cur = tl.zeros([BLOCK_C, BLOCK_C], tl.float32)
    for start_w in range(0, W, BLOCK_W):
        offs_w = start_w + tl.arange(0, BLOCK_W)
        tile = offs_c[:, None] * F + offs_w[None, :]
        mask = rows_ok[:, None] & (offs_w[None, :] < W)
        dg = tl.load(DY + first + tile, mask=mask, other=0.0).to(tl.float32)
        dg = (dg * tl.load(U + first + tile, mask=mask, other=0.0).to(tl.float32)).to(dt)
        tile_t = offs_c[None, :] * F + offs_w[:, None]  # transposed: [columns, sources]
        gt = silu_f32(tl.load(A + first + tile_t, mask=rows_ok[None, :] & (offs_w[:, None] < W), other=0.0))
        acc_cur += dot(dg, gt.to(dt), PRECISION)
        pmask = prev_ok[None, :] & (offs_w[:, None] < W)
        gpt = silu_f32(tl.load(A + first - C * F + tile_t, mask=pmask, other=0.0))
        acc_prev += dot(dg, gpt.to(dt), PRECISION)
    cc = (offs_c[:, None] < C) & (offs_c[None, :] < C)
    small = (tl.cast(i, tl.int64) * tl.num_programs(1) + bh) * C  # [n, B, H, C, 2C]
    out = DWB + small * 2 * C + offs_c[:, None] * 2 * C + offs_c[None, :]
    tl.store(out, acc_prev, mask=cc)
    tl.store(out + C, acc_cur, mask=cc)


@autotune(tuning.BACKWARD_CONFIGS, key=tuning.KEY, reset_to_zero=["DPQ", "DPK"])
@triton.jit
def _backward_kernel(
    WB,
    PQ,
    PK,
    A,
    U,
    DY,
    AVG,
    DPQ,
    DPK,
    DA,
    DU,
    H,
    T,
    W,
    C,
    D,
    N,
    PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid_w, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    dt = A.dtype.element_ty
    sdt = dt  # as in the forward: fp32 products with S, R, pq and pk for fp16 gates
    if dt == tl.float16:
        sdt = tl.float32
    W = W // ALIGN * ALIGN
    F = H * W
    BH = tl.num_programs(1)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    tile = offs_c[:, None] * F + offs_w[None, :]
    cc = (offs_c[:, None] < C) & (offs_c[None, :] < C)
    cd = (offs_c[:, None] < C) & (offs_d[None, :] < D)
    dc = (offs_c[None, :] < C) & (offs_d[:, None] < D)
    cw = (offs_c[:, None] < C) & (offs_w[None, :] < W)  # a whole chunk (the one before or after a valid one)
    head = b * T * F + h * W
    # Forward sweep: pq's gradient dgbar_i S_{i-2}^T.
    s = tl.zeros([BLOCK_D, BLOCK_W], tl.float32)
    for i in range(0, N):
        first = head + tl.cast(i * C, tl.int64) * F
        mask = cw & (i * C + offs_c[:, None] < T)
        small = (tl.cast(i, tl.int64) * BH + bh) * C
        if i >= 2:
            dg = tl.load(DY + first + tile, mask=mask, other=0.0).to(tl.float32)
            dg = dg * tl.load(U + first + tile, mask=mask, other=0.0).to(tl.float32)
            dpq = dot(dg.to(sdt), tl.trans(s.to(sdt)), PRECISION)
            tl.atomic_add(DPQ + small * D + offs_c[:, None] * D + offs_d[None, :], dpq, mask=cd, sem="relaxed")
        if i >= 1:  # the previous chunk's gates read again rather than carried
            g_prev = silu_f32(tl.load(A + first - C * F + tile, mask=cw, other=0.0)).to(dt)
            pkt = tl.load(PK + (small - BH * C) * D + offs_c[None, :] * D + offs_d[:, None], mask=dc, other=0.0)
            s += dot(pkt.to(dt), g_prev, PRECISION)
    # Backward sweep over chunks c = N-1 .. 0, carrying R_c = sum_{i >= c+2} pq_i^T dgbar_i.
    r = tl.zeros([BLOCK_D, BLOCK_W], tl.float32)
    dg_next = tl.zeros([BLOCK_C, BLOCK_W], dt)
    for j in range(0, N):
        c = N - 1 - j
        first = head + tl.cast(c * C, tl.int64) * F
        mask = cw & (c * C + offs_c[:, None] < T)
        dy = tl.load(DY + first + tile, mask=mask, other=0.0).to(tl.float32)
        dg = (dy * tl.load(U + first + tile, mask=mask, other=0.0).to(tl.float32)).to(dt)
        small = (tl.cast(c, tl.int64) * BH + bh) * C
        wbt = WB + small * 2 * C + offs_c[None, :] * 2 * C + offs_c[:, None]  # transposed tile of Wb_c
        grad = dot(tl.load(wbt + C, mask=cc, other=0.0).to(dt), dg, PRECISION)
        a = tl.load(A + first + tile, mask=mask, other=0.0).to(tl.float32)
        sig = sigmoid_f32(a)  # for g and for silu'(a)
        if c + 2 < N:
            pk = tl.load(PK + small * D + offs_c[:, None] * D + offs_d[None, :], mask=cd, other=0.0)
            grad += dot(pk.to(sdt), r.to(sdt), PRECISION)
            g = (a * sig).to(dt)
            dpk = dot(g.to(sdt), tl.trans(r.to(sdt)), PRECISION)
            tl.atomic_add(DPK + small * D + offs_c[:, None] * D + offs_d[None, :], dpk, mask=cd, sem="relaxed")
        if c + 1 < N:  # dgbar_{c+1}, carried from the last iteration
            grad += dot(tl.load(wbt + BH * C * 2 * C, mask=cc, other=0.0).to(dt), dg_next, PRECISION)
            if c + 1 >= 2:  # R_{c-1} = R_c + pq_{c+1}^T dgbar_{c+1}, once chunk c has used R_c
                pqt = tl.load(PQ + (small + BH * C) * D + offs_c[None, :] * D + offs_d[:, None], mask=dc, other=0.0)
                r += dot(pqt.to(sdt), dg_next.to(sdt), PRECISION)
        dg_next = dg
        tl.store(DA + first + tile, (grad * sig * (1.0 + a * (1.0 - sig))).to(DA.dtype.element_ty), mask=mask)
        avg = tl.load(AVG + first + tile, mask=mask, other=0.0).to(tl.float32)
        tl.store(DU + first + tile, (dy * avg).to(DU.dtype.element_ty), mask=mask)


def _sizes(weights: torch.Tensor, pk: torch.Tensor, a: torch.Tensor) -> tuple:
    n, bsz, h, c, _ = weights.shape
    t, f = a.shape[1], a.shape[2]
    d = pk.shape[-1]
    return n, bsz, h, c, t, f // h, d, max(16, triton.next_power_of_2(c)), max(16, triton.next_power_of_2(d))


def operand_dtypes(gates: torch.dtype) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """The dtypes the kernels multiply the band weights, prefix_q and pk in, for gates of dtype
    `gates`: the gates' own, but prefix_q and pk in fp32 for fp16 gates (the kernels' `sdt`: the
    prefix sums pass fp16's range). tools/triton_ptxas_report.py types the kernels' pointers by it."""
    prefix = torch.float32 if gates == torch.float16 else gates
    return gates, prefix, prefix


def _operands(small: tuple[torch.Tensor, ...], a: torch.Tensor, fake: bool = False) -> tuple[torch.Tensor, ...]:
    """The small tensors (weights, prefix_q, pk) rounded once to the dtypes the kernels multiply
    them in, or empty tensors where that is theirs already (an op's output may not be its input):
    the band weights in the gates' dtype, prefix_q and pk too for bf16 gates (fp32 for fp16 ones,
    the kernels' `sdt`). The kernels rounded them so on every load, in every column program (each
    reads its head's whole band): read as 2-byte tiles they take half the bytes there and in what
    the op saves, and the loops issue 16-22% fewer instructions (docs/benchmarks.md, "Windowed
    TANGO's kernels"). `fake`: shapes only, for the fake implementation."""
    return tuple(
        x.new_empty(0) if x.dtype == dt else x.new_empty(x.shape, dtype=dt) if fake else x.to(dt)
        for x, dt in zip(small, operand_dtypes(a.dtype), strict=True)
    )


def _either(copies: tuple[torch.Tensor, ...], small: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Each `_operands` copy, or the tensor itself where it had no copy made."""
    return tuple(c if c.numel() else x for c, x in zip(copies, small, strict=True))


@torch.library.custom_op("tango_lm::windowed_mix_triton_forward", mutates_args=())
def _forward(
    weights: torch.Tensor, prefix_q: torch.Tensor, pk: torch.Tensor, a: torch.Tensor, u: torch.Tensor, store_avg: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, the average when store_avg else an empty tensor, the three `_operands`); every input
    contiguous."""
    n, bsz, h, c, t, w, d, block_c, block_d = _sizes(weights, pk, a)
    y = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    avg = torch.empty(a.shape, dtype=a.dtype, device=a.device) if store_avg else a.new_empty(0)
    copies = _operands((weights, prefix_q, pk), a)
    if y.numel():
        _forward_kernel[lambda m: (triton.cdiv(w, m["BLOCK_W"]), bsz * h)](
            *_either(copies, (weights, prefix_q, pk)),
            a,
            u,
            y,
            avg if store_avg else y,
            h,
            t,
            w,
            c,
            d,
            n,
            HAS_AVG=store_avg,
            PRECISION=precision(a.dtype),
            ALIGN=column_alignment(w, a.element_size(), a, u),
            BLOCK_C=block_c,
            BLOCK_D=block_d,
        )
    return y, avg, *copies


@_forward.register_fake
def _forward_fake(weights, prefix_q, pk, a, u, store_avg):
    avg = a.new_empty(a.shape) if store_avg else a.new_empty(0)
    return a.new_empty(a.shape), avg, *_operands((weights, prefix_q, pk), a, fake=True)


@torch.library.custom_op("tango_lm::windowed_mix_triton_backward", mutates_args=())
def _backward(
    dy: torch.Tensor,
    weights: torch.Tensor,
    prefix_q: torch.Tensor,
    pk: torch.Tensor,
    a: torch.Tensor,
    u: torch.Tensor,
    avg: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d weights, d prefix_q, d pk, da, du). weights, prefix_q and pk as the forward's kernel read
    them (`_operands`); their gradients in fp32, `band_weights`' compute dtype for every input
    `supported` takes."""
    dy = dy.contiguous()
    n, bsz, h, c, t, w, d, block_c, block_d = _sizes(weights, pk, a)
    # zero where no source or destination is; the others accumulated atomically
    d_weights, d_prefix_q, d_pk = (
        torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (weights, prefix_q, pk)
    )
    da = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    du = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if da.numel():
        prec = precision(a.dtype)
        align = column_alignment(w, a.element_size(), a, u, dy, avg)
        _band_backward_kernel[(n, bsz * h)](
            a, u, dy, d_weights, h, t, w, c, d, n, PRECISION=prec, ALIGN=align, BLOCK_C=block_c
        )
        _backward_kernel[lambda m: (triton.cdiv(w, m["BLOCK_W"]), bsz * h)](
            weights,
            prefix_q,
            pk,
            a,
            u,
            dy,
            avg,
            d_prefix_q,
            d_pk,
            da,
            du,
            h,
            t,
            w,
            c,
            d,
            n,
            PRECISION=prec,
            ALIGN=align,
            BLOCK_C=block_c,
            BLOCK_D=block_d,
        )
    return d_weights, d_prefix_q, d_pk, da, du


@_backward.register_fake
def _backward_fake(dy, weights, prefix_q, pk, a, u, avg):
    return (
        *(x.new_empty(x.shape, dtype=torch.float32) for x in (weights, prefix_q, pk)),
        a.new_empty(a.shape),
        a.new_empty(a.shape),
    )


def _setup_context(ctx, inputs, output) -> None:
    weights, prefix_q, pk, a, u, _ = inputs
    _, avg, *copies = output
    ctx.save_for_backward(*_either(tuple(copies), (weights, prefix_q, pk)), a, u, avg)
    # The average and the copies are saved, never differentiated: no zeros of their shapes.
    ctx.set_materialize_grads(False)


def _autograd_backward(ctx, dy, _davg, *_dcopies):
    weights, prefix_q, pk, a, u, avg = ctx.saved_tensors
    if avg.numel() != a.numel():  # the op was called with store_avg=False: recompute the average
        avg = _forward(weights, prefix_q, pk, a, u, True)[1]
    return (*_backward(dy, weights, prefix_q, pk, a, u, avg), None)


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def windowed_band_mix_triton(
    weights: torch.Tensor, prefix_q: torch.Tensor, pk: torch.Tensor, a: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """`_WindowedBandMix.apply` on the Triton kernels (inputs must pass `supported`)."""
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (weights, prefix_q, pk, a, u))
    xs = (x.contiguous() for x in (weights, prefix_q, pk, a, u))
    return _forward(*xs, needs_grad)[0]
