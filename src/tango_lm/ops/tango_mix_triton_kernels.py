"""The Triton kernels of TANGO's mixing; `tango_mix_triton.py` says what each computes and wraps
them as custom ops."""

from __future__ import annotations

import triton
import triton.language as tl

from tango_lm.ops.triton_common import configs, dot, silu_f32

# (block sizes..., num_warps, num_stages). Larger column blocks recompute P less often.
_LSE_CONFIGS = configs(("BLOCK_M", "BLOCK_N"), [(64, 64, 4, 2), (128, 64, 4, 2), (128, 128, 8, 2)])
_FORWARD_CONFIGS = configs(
    ("BLOCK_M", "BLOCK_N", "BLOCK_W"),
    [
        (64, 64, 128, 4, 3),
        (128, 64, 128, 8, 3),
        (128, 32, 256, 8, 3),
        (64, 64, 256, 8, 2),
        (128, 64, 64, 4, 3),
    ],
)
_DELTA_CONFIGS = configs(("BLOCK_M", "BLOCK_W"), [(64, 128, 4, 1), (32, 256, 4, 1)])
_SCORES_CONFIGS = configs(
    ("BLOCK_M", "BLOCK_N", "BLOCK_W"),
    [
        (64, 64, 64, 4, 3),
        (64, 128, 64, 8, 3),
        (128, 64, 64, 8, 3),
        (64, 64, 128, 8, 2),
    ],
)
_GATES_CONFIGS = configs(
    ("BLOCK_M", "BLOCK_N", "BLOCK_W"),
    [
        (64, 64, 128, 4, 3),
        (64, 128, 128, 8, 3),
        (32, 128, 256, 8, 3),
        (64, 64, 256, 8, 2),
        (64, 128, 64, 4, 3),
    ],
)
_KEY = ["T", "W", "D"]


@triton.autotune(_LSE_CONFIGS, key=_KEY)
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


@triton.autotune(_FORWARD_CONFIGS, key=_KEY)
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
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_w, bh = tl.program_id(1), tl.program_id(2).to(tl.int64)
    b, h = bh // H, bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    cols = h * W + offs_w
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
        mask=(offs_m[:, None] < T) & (offs_d[None, :] < D),
        other=0.0,
    )
    lse = tl.load(LSE + bh * T + offs_m, mask=offs_m < T, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    for start_n in range(0, tl.minimum((pid_m + 1) * BLOCK_M, T), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = tl.load(
            K + b * skb + h * skh + offs_n[None, :] * skt + offs_d[:, None] * skd,
            mask=(offs_n[None, :] < T) & (offs_d[:, None] < D),
            other=0.0,
        )
        s = dot(q, kt, PRECISION) * scale_log2
        p = tl.where((offs_m[:, None] >= offs_n[None, :]) & (offs_n[None, :] < T), tl.exp2(s - lse[:, None]), 0.0)
        a = tl.load(
            A + b * sab + offs_n[:, None] * sat + cols[None, :] * saf,
            mask=(offs_n[:, None] < T) & (offs_w[None, :] < W),
            other=0.0,
        )
        g = silu_f32(a).to(A.dtype.element_ty)
        acc += dot(p.to(A.dtype.element_ty), g, PRECISION)
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
def delta_kernel(DY, Y, DELTA, sdb, sdt, sdf, syb, syt, syf, H, T, W, D, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
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
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
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
        s = dot(q, tl.trans(k), PRECISION) * scale_log2
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
                dg = dg * tl.load(U + b * sub + offs_m[:, None] * sut + cols[None, :] * suf, mask=mmask, other=0.0).to(
                    tl.float32
                )
            at = tl.load(
                A + b * sab + offs_n[None, :] * sat + cols[:, None] * saf,
                mask=(offs_n[None, :] < T) & (offs_w[:, None] < W),
                other=0.0,
            )
            dp += dot(dg.to(dt), silu_f32(at).to(dt), PRECISION)
        ds = (p * (dp - delta[:, None])).to(dt)
        dk += dot(tl.trans(ds), q, PRECISION)
        dq = dot(ds, k, PRECISION) * scale
        tl.atomic_add(DQ + bh * T * D + offs_m[:, None] * D + offs_d[None, :], dq, mask=qmask)
    tl.store(DK + bh * T * D + offs_n[:, None] * D + offs_d[None, :], dk * scale, mask=kmask)


@triton.autotune(_GATES_CONFIGS, key=_KEY)
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
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_w, bh = tl.program_id(1), tl.program_id(2).to(tl.int64)
    b, h = bh // H, bh % H
    dt = A.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_d = tl.arange(0, BLOCK_D)
    cols = h * W + offs_w
    k = tl.load(
        K + b * skb + h * skh + offs_n[:, None] * skt + offs_d[None, :] * skd,
        mask=(offs_n[:, None] < T) & (offs_d[None, :] < D),
        other=0.0,
    )
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    for start_m in range((pid_n * BLOCK_N) // BLOCK_M * BLOCK_M, T, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qt = tl.load(
            Q + b * sqb + h * sqh + offs_m[None, :] * sqt + offs_d[:, None] * sqd,
            mask=(offs_m[None, :] < T) & (offs_d[:, None] < D),
            other=0.0,
        )
        lse = tl.load(LSE + bh * T + offs_m, mask=offs_m < T, other=0.0)
        st = dot(k, qt, PRECISION) * scale_log2  # S^T: [keys, destinations]
        valid = (offs_m[None, :] >= offs_n[:, None]) & (offs_m[None, :] < T) & (offs_n[:, None] < T)
        pt = tl.where(valid, tl.exp2(st - lse[None, :]), 0.0)
        mmask = (offs_m[:, None] < T) & (offs_w[None, :] < W)
        dg = tl.load(DY + b * sdb + offs_m[:, None] * sdt + cols[None, :] * sdf, mask=mmask, other=0.0)
        dg = dg.to(tl.float32)
        if HAS_U:
            dg = dg * tl.load(U + b * sub + offs_m[:, None] * sut + cols[None, :] * suf, mask=mmask, other=0.0).to(
                tl.float32
            )
        acc += dot(pt.to(dt), dg.to(dt), PRECISION)
    mask = (offs_n[:, None] < T) & (offs_w[None, :] < W)
    a = tl.load(A + b * sab + offs_n[:, None] * sat + cols[None, :] * saf, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    rows = b * sab + offs_n[:, None] * sat + cols[None, :] * saf  # DA, DU and AVG share a's layout
    tl.store(DA + rows, (acc * sig * (1.0 + a * (1.0 - sig))).to(DA.dtype.element_ty), mask=mask)
    if HAS_U:
        dy = tl.load(DY + b * sdb + offs_n[:, None] * sdt + cols[None, :] * sdf, mask=mask, other=0.0)
        avg = tl.load(AVG + rows, mask=mask, other=0.0)
        tl.store(DU + rows, (dy.to(tl.float32) * avg.to(tl.float32)).to(DU.dtype.element_ty), mask=mask)
