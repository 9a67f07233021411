"""The Triton kernels of TANGO's mixing; `tango_mix_triton.py` says what each computes and wraps
them as custom ops."""

from __future__ import annotations

import triton
import triton.language as tl

from tango_lm.ops.triton_common import autotune, configs, dot, silu_f32

# (block sizes..., num_warps, num_stages[, limits]). Larger column blocks recompute P less often.
# Each configuration compiles for sm_90 without spilling registers, in bf16 and fp16 at head dims
# 32-128, for the launches its limits admit (triton_common.admitted; ALIGN 1: a width per head
# that is odd, as 3-set TANGO's 593); fp32 ones too (d_h = 128 has its own: the smaller d_h's
# spill there, and d_h = 128's spill a few bytes at 64). tools/triton_ptxas_report.py shows them;
# tests/ops/test_triton_spills.py keeps TANGO's shape so, in bf16 and in fp32.
_ALIGNED = {"min_align": 2}  # vectorized gate columns
_UNALIGNED = {"max_align": 1}  # columns one by one: smaller tiles or more warps
_FP32 = {"fp32": True}  # fp32 inputs: small tiles (full-fp32 products on FMAs hold them in registers)
_LSE_CONFIGS = configs(
    ("BLOCK_M", "BLOCK_N"),
    [
        (64, 64, 4, 2),
        (128, 64, 4, 2),
        (128, 128, 8, 2),
        (32, 32, 4, 2, {"max_d": 64, **_FP32}),
        (32, 64, 4, 2, {"max_d": 64, **_FP32}),
        (32, 32, 8, 1, {"min_d": 128, **_FP32}),
    ],
)
_FORWARD_CONFIGS = configs(
    ("BLOCK_M", "BLOCK_N", "BLOCK_W"),
    [
        (64, 64, 128, 4, 3, {"max_d": 32, **_ALIGNED}),  # spills 24 B at d_h = 64
        (128, 64, 128, 8, 3, _ALIGNED),
        (64, 64, 256, 8, 2, {"max_d": 32, **_ALIGNED}),
        (128, 64, 64, 4, 3, {"max_d": 32, **_ALIGNED}),
        (64, 64, 128, 8, 3, _UNALIGNED),
        (64, 64, 64, 8, 3, _UNALIGNED),
        (64, 32, 128, 4, 2, _UNALIGNED),
        (32, 64, 64, 8, 2, _FP32),
        (32, 32, 32, 4, 2, _FP32),
        (32, 32, 64, 4, 2, {"max_d": 64, **_FP32}),
    ],
)
_SCORES_CONFIGS = configs(
    ("BLOCK_M", "BLOCK_N", "BLOCK_W"),
    [
        (64, 64, 64, 8, 2, _ALIGNED),
        (128, 64, 64, 8, 3, {"max_d": 64, **_ALIGNED}),
        (32, 64, 64, 4, 2, {"max_d": 32, **_ALIGNED}),
        (64, 32, 128, 8, 2, {"max_d": 32, **_ALIGNED}),
        (64, 64, 32, 8, 2, _UNALIGNED),
        (32, 64, 64, 8, 2, {"max_d": 64, **_UNALIGNED}),
        (32, 64, 32, 4, 2, _UNALIGNED),
        (64, 32, 32, 8, 2, {"max_d": 64, **_FP32}),
        (32, 64, 32, 8, 2, {"max_d": 64, **_FP32}),
        (32, 32, 64, 4, 2, {"max_d": 32, "min_align": 2, **_FP32}),
        (32, 32, 32, 8, 2, {"min_d": 128, **_FP32}),
    ],
)
_GATES_CONFIGS = configs(
    ("BLOCK_M", "BLOCK_N", "BLOCK_W"),
    [
        (64, 64, 128, 8, 3, _ALIGNED),
        (64, 128, 64, 8, 3, _ALIGNED),
        (64, 64, 64, 4, 3, _ALIGNED),
        (64, 64, 64, 8, 3, _UNALIGNED),
        (32, 64, 64, 4, 2, {"max_d": 32, **_UNALIGNED}),
        (64, 128, 32, 8, 3, _UNALIGNED),
        (32, 32, 32, 4, 2, _FP32),
        (32, 32, 64, 4, 2, {"max_d": 64, **_FP32}),
    ],
)
# `for_launch` prunes by PRECISION and ALIGN: they belong in the cache key too, or a configuration
# tuned at one (same T, W, D and dtypes) would be reused, unpruned, at another.
_KEY = ["T", "W", "D"]
_LSE_KEY = [*_KEY, "PRECISION"]
_PRUNED_KEY = [*_KEY, "PRECISION", "ALIGN"]
_GATES_KEY = [*_PRUNED_KEY, "GATES_READY"]  # a loop without SiLU may tune to other blocks


@autotune(_LSE_CONFIGS, key=_LSE_KEY)
@triton.jit
def lse_kernel(
    Q,
    K,
    LSE,
    sqb,
    sqh,
    sqt,
    sqd,
    skb,
    skh,
    skt,
    skd,
    H,
    T,
    W,
    D,
    scale_log2,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows first
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: B * T * F can pass 2^31
    b, h = bh // H, bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
        mask=(offs_m[:, None] < T) & (offs_d[None, :] < D),
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, tl.minimum((pid_m + 1) * BLOCK_M, T), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = tl.load(
            K + b * skb + h * skh + offs_n[None, :] * skt + offs_d[:, None] * skd,
            mask=(offs_n[None, :] < T) & (offs_d[:, None] < D),
            other=0.0,
        )
        s = dot(q, kt, PRECISION) * scale_log2
        s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every row sees source 0
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    tl.store(LSE + bh * T + offs_m, m_i + tl.log2(l_i), mask=offs_m < T)


@triton.jit
def _average_keys(
    acc,
    q,
    lse,
    k_head,
    a_head,
    start_n,
    first_m,
    offs_m,
    offs_n,
    offs_w,
    offs_d,
    skt,
    skd,
    sat,
    saf,
    T,
    W,
    D,
    scale_log2,
    MASKED: tl.constexpr,
    GATES_READY: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """`forward_kernel`'s step: acc + P G over the key block at start_n, P = exp(S - lse) and G the
    gates (A holds silu(a) when GATES_READY). MASKED: the block may reach past a query row or T."""
    dt = a_head.dtype.element_ty
    k_mask = offs_d[:, None] < D
    a_mask = offs_w[None, :] < W
    if MASKED:
        k_mask = k_mask & (start_n + offs_n[None, :] < T)
        a_mask = a_mask & (start_n + offs_n[:, None] < T)
    kt = tl.load(
        k_head + tl.cast(start_n, tl.int64) * skt + offs_n[None, :] * skt + offs_d[:, None] * skd,
        mask=k_mask,
        other=0.0,
    )
    s = dot(q, kt, PRECISION) * scale_log2
    if MASKED:
        causal = (first_m + offs_m[:, None] >= start_n + offs_n[None, :]) & (start_n + offs_n[None, :] < T)
        p = tl.where(causal, tl.exp2(s - lse[:, None]), 0.0)
    else:
        p = tl.exp2(s - lse[:, None])
    a = tl.load(
        a_head + tl.cast(start_n, tl.int64) * sat + offs_n[:, None] * sat + offs_w[None, :] * saf,
        mask=a_mask,
        other=0.0,
    )
    if GATES_READY:
        g = a
    else:
        g = silu_f32(a).to(dt)
    return acc + dot(p.to(dt), g, PRECISION)


@autotune(_FORWARD_CONFIGS, key=_GATES_KEY)
@triton.jit
def forward_kernel(
    Q,
    K,
    A,
    U,
    LSE,
    Y,
    AVG,
    sqb,
    sqh,
    sqt,
    sqd,
    skb,
    skh,
    skt,
    skd,
    sab,
    sat,
    saf,
    sub,
    sut,
    suf,
    H,
    T,
    W,
    D,
    scale_log2,
    HAS_U: tl.constexpr,
    STORE_AVG: tl.constexpr,
    GATES_READY: tl.constexpr,
    PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_w, bh = tl.program_id(1), tl.program_id(2)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)  # h * a stride can pass 2^31 too
    W = W // ALIGN * ALIGN  # W, the row strides and so each head's first column are multiples of ALIGN:
    sat, sut = sat // ALIGN * ALIGN, sut // ALIGN * ALIGN  # the compiler may then vectorize the gates
    offs_m = tl.arange(0, BLOCK_M)  # 32-bit offsets within a block, 64-bit ones to its first element
    offs_n = tl.arange(0, BLOCK_N)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    first_m = pid_m * BLOCK_M
    q = tl.load(
        Q + b * sqb + h * sqh + tl.cast(first_m, tl.int64) * sqt + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
        mask=(first_m + offs_m[:, None] < T) & (offs_d[None, :] < D),
        other=0.0,
    )
    lse = tl.load(LSE + bh.to(tl.int64) * T + first_m + offs_m, mask=first_m + offs_m < T, other=0.0)
    k_head = K + b * skb + h * skh
    a_head = A + b * sab + h * W * saf
    acc = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    # Key blocks that end at or before this block's first query row are wholly visible and before T:
    # no causal mask and no row bounds (the masks were half of an iteration's instructions). Not for
    # fp32 inputs, whose tiles live in registers (products on FMAs): there a second copy of the loop
    # took 80-105 registers to 255 and spilled up to 0.8 KB.
    end_full = 0
    if A.dtype.element_ty != tl.float32:
        end_full = first_m // BLOCK_N * BLOCK_N
        for start_n in range(0, end_full, BLOCK_N):
            acc = _average_keys(
                acc, q, lse, k_head, a_head, start_n, first_m, offs_m, offs_n, offs_w, offs_d, skt, skd, sat, saf,
                T, W, D, scale_log2, False, GATES_READY, PRECISION,
            )  # fmt: skip
    for start_n in range(end_full, tl.minimum(first_m + BLOCK_M, T), BLOCK_N):  # the diagonal, and T's end
        acc = _average_keys(
            acc, q, lse, k_head, a_head, start_n, first_m, offs_m, offs_n, offs_w, offs_d, skt, skd, sat, saf,
            T, W, D, scale_log2, True, GATES_READY, PRECISION,
        )  # fmt: skip
    mask = (first_m + offs_m[:, None] < T) & (offs_w[None, :] < W)
    rows = offs_m[:, None] * sat + offs_w[None, :] * saf  # Y and AVG share a's layout (contiguous)
    first = b * sab + tl.cast(first_m, tl.int64) * sat + h * W * saf
    if STORE_AVG:
        tl.store(AVG + first + rows, acc.to(AVG.dtype.element_ty), mask=mask)
    if HAS_U:
        u_first = U + b * sub + tl.cast(first_m, tl.int64) * sut + h * W * suf
        u = tl.load(u_first + offs_m[:, None] * sut + offs_w[None, :] * suf, mask=mask, other=0.0)
        acc = acc * u.to(tl.float32)
    tl.store(Y + first + rows, acc.to(Y.dtype.element_ty), mask=mask)


@autotune(_SCORES_CONFIGS, key=_GATES_KEY, reset_to_zero=["DQ"])
@triton.jit
def scores_backward_kernel(
    Q,
    K,
    A,
    U,
    DY,
    LSE,
    DELTA,
    DQ,
    DK,
    sqb,
    sqh,
    sqt,
    sqd,
    skb,
    skh,
    skt,
    skd,
    sab,
    sat,
    saf,
    sub,
    sut,
    suf,
    sdb,
    sdt,
    sdf,
    H,
    T,
    W,
    D,
    scale_log2,
    scale,
    HAS_U: tl.constexpr,
    GATES_READY: tl.constexpr,
    PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid_n, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)  # h * a stride can pass 2^31 too
    dt = A.dtype.element_ty
    W = W // ALIGN * ALIGN  # as in forward_kernel: vectorized gate columns, 32-bit in-block offsets
    sat, sut, sdt = sat // ALIGN * ALIGN, sut // ALIGN * ALIGN, sdt // ALIGN * ALIGN
    first_n = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kmask = (first_n + offs_n[:, None] < T) & (offs_d[None, :] < D)
    k = tl.load(
        K + b * skb + h * skh + tl.cast(first_n, tl.int64) * skt + offs_n[:, None] * skt + offs_d[None, :] * skd,
        mask=kmask,
        other=0.0,
    )
    q_head = Q + b * sqb + h * sqh
    at_first = A + b * sab + tl.cast(first_n, tl.int64) * sat + h * W * saf  # these keys' gates
    dy_head = DY + b * sdb + h * W * sdf
    u_head = U + b * sub + h * W * suf
    bht = bh.to(tl.int64) * T
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start_m in range(first_n // BLOCK_M * BLOCK_M, T, BLOCK_M):  # destinations that see these keys
        dy_first = dy_head + tl.cast(start_m, tl.int64) * sdt
        u_first = u_head + tl.cast(start_m, tl.int64) * sut
        dp = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start_w in range(0, W, BLOCK_W):  # dP = dgbar g^T, contracted over the whole width
            offs_w = start_w + tl.arange(0, BLOCK_W)
            mmask = (start_m + offs_m[:, None] < T) & (offs_w[None, :] < W)
            dg = tl.load(dy_first + offs_m[:, None] * sdt + offs_w[None, :] * sdf, mask=mmask, other=0.0)
            dg = dg.to(tl.float32)
            if HAS_U:
                u = tl.load(u_first + offs_m[:, None] * sut + offs_w[None, :] * suf, mask=mmask, other=0.0)
                dg = dg * u.to(tl.float32)
            at = tl.load(
                at_first + offs_n[None, :] * sat + offs_w[:, None] * saf,
                mask=(first_n + offs_n[None, :] < T) & (offs_w[:, None] < W),
                other=0.0,
            )
            if GATES_READY:  # A holds silu(a) already
                dp += dot(dg.to(dt), at, PRECISION)
            else:
                dp += dot(dg.to(dt), silu_f32(at).to(dt), PRECISION)
        # The probabilities only now, so that they are not held through the loop over the width.
        qmask = (start_m + offs_m[:, None] < T) & (offs_d[None, :] < D)
        q = tl.load(
            q_head + tl.cast(start_m, tl.int64) * sqt + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
            mask=qmask,
            other=0.0,
        )
        lse = tl.load(LSE + bht + start_m + offs_m, mask=start_m + offs_m < T, other=0.0)
        delta = tl.load(DELTA + bht + start_m + offs_m, mask=start_m + offs_m < T, other=0.0)
        s = dot(q, tl.trans(k), PRECISION) * scale_log2
        valid = (start_m + offs_m[:, None] >= first_n + offs_n[None, :]) & (start_m + offs_m[:, None] < T)
        p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
        ds = (p * (dp - delta[:, None])).to(dt)
        dk += dot(tl.trans(ds), q, PRECISION)
        dq = dot(ds, k, PRECISION) * scale
        dq_first = DQ + (bht + start_m) * D
        tl.atomic_add(dq_first + offs_m[:, None] * D + offs_d[None, :], dq, mask=qmask, sem="relaxed")
    dk_first = DK + (bht + first_n) * D
    tl.store(dk_first + offs_n[:, None] * D + offs_d[None, :], dk * scale, mask=kmask)


@autotune(_GATES_CONFIGS, key=_PRUNED_KEY, reset_to_zero=["DELTA"])
@triton.jit
def gates_backward_kernel(
    Q,
    K,
    A,
    U,
    DY,
    LSE,
    AVG,
    DA,
    DU,
    DELTA,
    G,
    sqb,
    sqh,
    sqt,
    sqd,
    skb,
    skh,
    skt,
    skd,
    sab,
    sat,
    saf,
    sub,
    sut,
    suf,
    sdb,
    sdt,
    sdf,
    H,
    T,
    W,
    D,
    scale_log2,
    HAS_U: tl.constexpr,
    STORE_G: tl.constexpr,
    PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_w, bh = tl.program_id(1), tl.program_id(2)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)  # h * a stride can pass 2^31 too
    dt = A.dtype.element_ty
    W = W // ALIGN * ALIGN  # as in forward_kernel: vectorized gate columns, 32-bit in-block offsets
    sat, sut, sdt = sat // ALIGN * ALIGN, sut // ALIGN * ALIGN, sdt // ALIGN * ALIGN
    first_n = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    k = tl.load(
        K + b * skb + h * skh + tl.cast(first_n, tl.int64) * skt + offs_n[:, None] * skt + offs_d[None, :] * skd,
        mask=(first_n + offs_n[:, None] < T) & (offs_d[None, :] < D),
        other=0.0,
    )
    q_head = Q + b * sqb + h * sqh
    dy_head = DY + b * sdb + h * W * sdf
    u_head = U + b * sub + h * W * suf
    lse_head = LSE + bh.to(tl.int64) * T
    mask = (first_n + offs_n[:, None] < T) & (offs_w[None, :] < W)
    rows = offs_n[:, None] * sat + offs_w[None, :] * saf  # DA, DU and AVG share a's layout (contiguous)
    first = b * sab + tl.cast(first_n, tl.int64) * sat + h * W * saf
    # First, at these rows and columns: du = dy * gbar, and this column block's share of the
    # scores backward's D = rowsum(dy * y) (y = gbar * u; AVG is y itself without u), summed over
    # the column blocks atomically: no pass of its own over dy and y. Its tiles are then not live
    # beside the accumulator.
    dy = tl.load(
        dy_head + tl.cast(first_n, tl.int64) * sdt + offs_n[:, None] * sdt + offs_w[None, :] * sdf, mask=mask, other=0.0
    ).to(tl.float32)
    avg = tl.load(AVG + first + rows, mask=mask, other=0.0).to(tl.float32)
    if HAS_U:
        tl.store(DU + first + rows, (dy * avg).to(DU.dtype.element_ty), mask=mask)
        u_rows = u_head + tl.cast(first_n, tl.int64) * sut + offs_n[:, None] * sut + offs_w[None, :] * suf
        avg = avg * tl.load(u_rows, mask=mask, other=0.0).to(tl.float32)
    row_sums = tl.sum(dy * avg, 1)
    tl.atomic_add(DELTA + bh.to(tl.int64) * T + first_n + offs_n, row_sums, mask=first_n + offs_n < T, sem="relaxed")
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    for start_m in range(first_n // BLOCK_M * BLOCK_M, T, BLOCK_M):
        qt = tl.load(
            q_head + tl.cast(start_m, tl.int64) * sqt + offs_m[None, :] * sqt + offs_d[:, None] * sqd,
            mask=(start_m + offs_m[None, :] < T) & (offs_d[:, None] < D),
            other=0.0,
        )
        lse = tl.load(lse_head + start_m + offs_m, mask=start_m + offs_m < T, other=0.0)
        st = dot(k, qt, PRECISION) * scale_log2  # S^T: [keys, destinations]
        valid = (start_m + offs_m[None, :] >= first_n + offs_n[:, None]) & (start_m + offs_m[None, :] < T)
        pt = tl.where(valid, tl.exp2(st - lse[None, :]), 0.0)
        mmask = (start_m + offs_m[:, None] < T) & (offs_w[None, :] < W)
        dg = tl.load(
            dy_head + tl.cast(start_m, tl.int64) * sdt + offs_m[:, None] * sdt + offs_w[None, :] * sdf,
            mask=mmask,
            other=0.0,
        ).to(tl.float32)
        if HAS_U:
            u = tl.load(
                u_head + tl.cast(start_m, tl.int64) * sut + offs_m[:, None] * sut + offs_w[None, :] * suf,
                mask=mmask,
                other=0.0,
            )
            dg = dg * u.to(tl.float32)
        acc += dot(pt.to(dt), dg.to(dt), PRECISION)
    a = tl.load(A + first + rows, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    g = a * sig
    tl.store(DA + first + rows, (acc * (sig + g * (1.0 - sig))).to(DA.dtype.element_ty), mask=mask)
    if STORE_G:  # the gates themselves, for the scores backward: no pass of their own
        tl.store(G + first + rows, g.to(G.dtype.element_ty), mask=mask)
