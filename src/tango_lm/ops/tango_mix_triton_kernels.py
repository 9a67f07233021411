"""The Triton kernels of TANGO's mixing; `tango_mix_triton.py` says what each computes and wraps
them as custom ops, `tango_mix_triton_configs.py` holds their autotune configurations."""

from __future__ import annotations

import triton
import triton.language as tl

from tango_lm.ops import tango_mix_triton_configs as tuning
from tango_lm.ops.triton_common import autotune, block_masks, dot, sigmoid_f32, silu_f32


@autotune(tuning.LSE_CONFIGS, key=tuning.LSE_KEY)
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
    k_mask, a_mask = block_masks(start_n, offs_n, offs_d, offs_w, T, W, D, MASKED)
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


@autotune(tuning.FORWARD_CONFIGS, key=tuning.GATES_KEY)
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


@autotune(tuning.SCORES_CONFIGS, key=tuning.SCORES_KEY, reset_to_zero=["DQ"])
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
    OPERANDS_READY: tl.constexpr,
    PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    # OPERANDS_READY: A holds the gates silu(a) and DY the average's gradient dy * u (without u, dy
    # itself), both written by the gates backward's epilogue; otherwise the loop applies the SiLU
    # and the product by u to every tile it loads.
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
            at = tl.load(
                at_first + offs_n[None, :] * sat + offs_w[:, None] * saf,
                mask=(first_n + offs_n[None, :] < T) & (offs_w[:, None] < W),
                other=0.0,
            )
            if OPERANDS_READY:
                dp += dot(dg.to(dt), at, PRECISION)
            else:
                dg = dg.to(tl.float32)
                if HAS_U:
                    u = tl.load(u_first + offs_m[:, None] * sut + offs_w[None, :] * suf, mask=mmask, other=0.0)
                    dg = dg * u.to(tl.float32)
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


@triton.jit
def _gate_gradients(
    acc,
    k,
    q_head,
    lse_head,
    dy_head,
    u_head,
    start_m,
    first_n,
    offs_m,
    offs_n,
    offs_w,
    offs_d,
    sqt,
    sqd,
    sdt,
    sdf,
    sut,
    suf,
    T,
    W,
    D,
    scale_log2,
    MASKED: tl.constexpr,
    HAS_U: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """`gates_backward_kernel`'s step: acc + P^T dgbar over the destination block at start_m.
    MASKED: the block may hold destinations before these keys or past T."""
    dt = dy_head.dtype.element_ty
    q_mask, m_mask = block_masks(start_m, offs_m, offs_d, offs_w, T, W, D, MASKED)
    qt = tl.load(
        q_head + tl.cast(start_m, tl.int64) * sqt + offs_m[None, :] * sqt + offs_d[:, None] * sqd,
        mask=q_mask,
        other=0.0,
    )
    if MASKED:
        lse = tl.load(lse_head + start_m + offs_m, mask=start_m + offs_m < T, other=0.0)
    else:
        lse = tl.load(lse_head + start_m + offs_m)
    st = dot(k, qt, PRECISION) * scale_log2  # S^T: [keys, destinations]
    if MASKED:
        valid = (start_m + offs_m[None, :] >= first_n + offs_n[:, None]) & (start_m + offs_m[None, :] < T)
        pt = tl.where(valid, tl.exp2(st - lse[None, :]), 0.0)
    else:
        pt = tl.exp2(st - lse[None, :])
    dg = tl.load(
        dy_head + tl.cast(start_m, tl.int64) * sdt + offs_m[:, None] * sdt + offs_w[None, :] * sdf,
        mask=m_mask,
        other=0.0,
    ).to(tl.float32)
    if HAS_U:
        u = tl.load(
            u_head + tl.cast(start_m, tl.int64) * sut + offs_m[:, None] * sut + offs_w[None, :] * suf,
            mask=m_mask,
            other=0.0,
        )
        dg = dg * u.to(tl.float32)
    return acc + dot(pt.to(dt), dg.to(dt), PRECISION)


@autotune(tuning.GATES_CONFIGS, key=tuning.PRUNED_KEY, reset_to_zero=["DELTA"])
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
    DG,
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
    STORE_OPERANDS: tl.constexpr,
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
        u = tl.load(u_rows, mask=mask, other=0.0).to(tl.float32)
        if STORE_OPERANDS:  # the average's gradient dy * u, for the scores backward: no product in its loop
            tl.store(DG + first + rows, (dy * u).to(DG.dtype.element_ty), mask=mask)
        avg = avg * u
    row_sums = tl.sum(dy * avg, 1)
    tl.atomic_add(DELTA + bh.to(tl.int64) * T + first_n + offs_n, row_sums, mask=first_n + offs_n < T, sem="relaxed")
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    start = first_n // BLOCK_M * BLOCK_M  # the first destination block that sees these keys
    # Destination blocks wholly past these keys and before T need no causal mask and no row bounds
    # (as in the forward): masked blocks on the diagonal, unmasked ones after it, masked ones at T's
    # end. Not for fp32 inputs (their tiles live in registers) nor for odd widths (ALIGN 1, columns
    # loaded one by one): there the three loops spilled (312 B per thread at width 593).
    diagonal_end = T
    unmasked_end = T
    if A.dtype.element_ty != tl.float32:
        if ALIGN > 1:
            diagonal_end = tl.minimum(tl.cdiv(first_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, T)
            unmasked_end = tl.maximum(T // BLOCK_M * BLOCK_M, diagonal_end)
    for start_m in range(start, diagonal_end, BLOCK_M):
        acc = _gate_gradients(
            acc, k, q_head, lse_head, dy_head, u_head, start_m, first_n, offs_m, offs_n, offs_w, offs_d,
            sqt, sqd, sdt, sdf, sut, suf, T, W, D, scale_log2, True, HAS_U, PRECISION,
        )  # fmt: skip
    for start_m in range(diagonal_end, unmasked_end, BLOCK_M):
        acc = _gate_gradients(
            acc, k, q_head, lse_head, dy_head, u_head, start_m, first_n, offs_m, offs_n, offs_w, offs_d,
            sqt, sqd, sdt, sdf, sut, suf, T, W, D, scale_log2, False, HAS_U, PRECISION,
        )  # fmt: skip
    for start_m in range(unmasked_end, T, BLOCK_M):
        acc = _gate_gradients(
            acc, k, q_head, lse_head, dy_head, u_head, start_m, first_n, offs_m, offs_n, offs_w, offs_d,
            sqt, sqd, sdt, sdf, sut, suf, T, W, D, scale_log2, True, HAS_U, PRECISION,
        )  # fmt: skip
    a = tl.load(A + first + rows, mask=mask, other=0.0).to(tl.float32)
    sig = sigmoid_f32(a)
    g = a * sig
    tl.store(DA + first + rows, (acc * (sig + g * (1.0 - sig))).to(DA.dtype.element_ty), mask=mask)
    if STORE_OPERANDS:  # the gates themselves, for the scores backward: no pass of their own
        tl.store(G + first + rows, g.to(G.dtype.element_ty), mask=mask)
