"""The Triton kernels of GAU's and FLASH's squared-ReLU attention; `relu2_attention_triton.py` says
what each computes and wraps them as custom ops.

Every kernel takes q, k [N, T, s] and v (or dO) [N, T, e] by their strides and writes its outputs
contiguous; `BIAS` is the relative bias of 2 HALF - 1 entries, the one for offset t - j at index
t - j + HALF - 1 (T <= HALF, so every causal offset is inside it)."""

from __future__ import annotations

import triton
import triton.language as tl

from tango_lm.ops.triton_common import autotune, block_masks, configs, dot

# (block sizes..., num_warps, num_stages[, limits]: triton_common.admitted). The width e of V is
# tiled over a grid axis in the forward and in dV's kernel (see relu2_attention_triton.py for why),
# so BLOCK_E trades the recomputation of S (s / BLOCK_E of the P V work) against registers for the
# [BLOCK, BLOCK_E] fp32 accumulator. Chosen from ptxas's report for sm_90 (tools/triton_ptxas_report.py;
# no GPU was at hand to time them): none spills registers in bf16 or fp16 at s = 32, 64 or 128
# with e a multiple of 8 (GAU's); with another e the first forward one spills 16 B at s = 32 under
# triton 3.6.
# fp32 inputs multiply in full fp32 on FMAs, whose operands sit whole in registers: they take
# narrow tiles of their own ({"fp32": True}; the bf16 ones spilled 14-39 KB per thread there).
# Three or four per launch keep the autotuning inside the GPU check's time limits.
_FP32 = {"fp32": True}
_FORWARD_CONFIGS = configs(
    ("BLOCK_M", "BLOCK_N", "BLOCK_E"),
    [
        (128, 64, 128, 8, 2),  # 3 stages spill 4 B at s = 128 (triton 3.6, e % 8 != 0)
        (64, 64, 128, 8, 3),
        (128, 64, 64, 8, 3),
        (64, 32, 64, 4, 2),
        (32, 16, 64, 8, 1, _FP32),
        (16, 16, 128, 8, 1, _FP32),
        (32, 16, 32, 4, 1, _FP32),
    ],
)
_DV_CONFIGS = configs(
    ("BLOCK_M", "BLOCK_N", "BLOCK_E"),
    [
        (64, 64, 128, 8, 3),
        (64, 128, 128, 8, 3),
        (32, 128, 128, 8, 3),
        (32, 64, 64, 4, 2),
        (16, 32, 64, 8, 1, _FP32),
        (32, 32, 32, 8, 1, _FP32),
        (16, 16, 128, 8, 1, _FP32),
    ],
)
# One square block for queries and keys: the relative bias's gradient sums dS along the tile's
# diagonals, which needs BLOCK_M == BLOCK_N (2 BLOCK - 1 offsets per tile). Blocks of 64 put dP's
# contraction over e on the warpgroup MMA (sm_90's wgmma: 79 instructions per warp for 64 x 64 x 64,
# where blocks of 32 and 128 columns issued 240 for a quarter of the work on mma.sync); they spilled
# registers (64-372 B per thread) while the program also held dK in registers: dK is now added
# atomically per query block, as dQ is, and the diagonals are summed in two halves.
_DQK_CONFIGS = configs(
    ("BLOCK", "BLOCK_E"),
    [
        (64, 64, 8, 2),
        (32, 128, 8, 2),
        (32, 64, 8, 3),
        (32, 64, 4, 2, {"max_d": 64}),
        (16, 32, 8, 1, _FP32),
        (16, 32, 4, 1, _FP32),
        (16, 64, 4, 1, {"max_d": 64, **_FP32}),
    ],
)
_KEY = ["T", "E", "D", "PRECISION"]  # what `for_launch` prunes by: D (as BLOCK_D) and PRECISION


@triton.jit
def relu_scores(qk, BIAS, t, j, T, HALF, scale):
    """relu(q.k * scale + bias[t - j]) in fp32, zero where j > t or either position is past T;
    `qk` is the tile of q.k products, t and j the query and key positions broadcast to its shape."""
    valid = (t >= j) & (t < T) & (j < T)
    bias = tl.load(BIAS + (t - j + HALF - 1), mask=valid, other=0.0).to(tl.float32)
    # propagate_nan: tl.maximum's default returns 0 for a NaN score, where torch.relu keeps the NaN
    return tl.where(valid, tl.maximum(qk * scale + bias, 0.0, propagate_nan=tl.PropagateNan.ALL), 0.0)


@triton.jit
def relu_scores_visible(qk, BIAS, offset, rel, scale):
    """`relu_scores` of a tile whose every pair is causal and before T: no masks. The bias of pair
    (t, j) at offset + rel, with `offset` the tile's first query position less its first key
    position plus HALF - 1 and `rel` the loop-invariant tile of in-tile offsets (t - j less that)."""
    bias = tl.load(BIAS + offset + rel).to(tl.float32)
    return tl.maximum(qk * scale + bias, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _average_values(
    acc, q, K, V, BIAS, first_m, start_n, rel, offs_m, offs_n, offs_e, offs_d, skt, skd, svt, sve,
    T, E, D, HALF, scale, MASKED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """`forward_kernel`'s step: acc + relu(S)^2 V over the key block at start_n. MASKED: the block
    may hold keys after a query row or past T, or rows past T; otherwise every pair is visible."""
    keys = start_n + offs_n
    k_mask, v_mask = block_masks(start_n, offs_n, offs_d, offs_e, T, E, D, MASKED)
    kt = tl.load(K + keys[None, :] * skt + offs_d[:, None] * skd, mask=k_mask, other=0.0)
    if MASKED:
        r = relu_scores(dot(q, kt, PRECISION), BIAS, first_m + offs_m[:, None], keys[None, :], T, HALF, scale)
    else:
        r = relu_scores_visible(dot(q, kt, PRECISION), BIAS, first_m - start_n + HALF - 1, rel, scale)
    v = tl.load(V + keys[:, None] * svt + offs_e[None, :] * sve, mask=v_mask, other=0.0)
    return acc + dot((r * r).to(V.dtype.element_ty), v, PRECISION)


@autotune(_FORWARD_CONFIGS, key=_KEY)
@triton.jit
def forward_kernel(
    Q,
    K,
    V,
    BIAS,
    O,
    sqn,
    sqt,
    sqd,
    skn,
    skt,
    skd,
    svn,
    svt,
    sve,
    T,
    E,
    D,
    HALF,
    scale,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows first
    pid_e, n = tl.program_id(1), tl.program_id(2).to(tl.int64)  # 64-bit offsets: N * T * e can pass 2^31
    first_m = pid_m * BLOCK_M
    rows, cols = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    offs_m = first_m + rows
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    # One 64-bit base per sequence, 32-bit offsets within it (64-bit offset tiles cost registers).
    Q, K, V, O = Q + n * sqn, K + n * skn, V + n * svn, O + n * T * E
    q = tl.load(
        Q + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
        mask=(offs_m[:, None] < T) & (offs_d[None, :] < D),
        other=0.0,
    )
    rel = rows[:, None] - cols[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    # The causal triangle only. Key blocks that end at or before this block's first row, in a block
    # of rows before T, are wholly visible: no causal mask, no bounds, the bias at a loop-invariant
    # tile of offsets (the masks and the bias's indices were half of an iteration's instructions).
    # Not for fp32 inputs, whose tiles live in registers (as tango_mix's kernels).
    end_full = 0
    if Q.dtype.element_ty != tl.float32:
        if first_m + BLOCK_M <= T:
            end_full = first_m // BLOCK_N * BLOCK_N
        for start_n in range(0, end_full, BLOCK_N):
            acc = _average_values(
                acc, q, K, V, BIAS, first_m, start_n, rel, rows, cols, offs_e, offs_d, skt, skd, svt, sve,
                T, E, D, HALF, scale, False, PRECISION,
            )  # fmt: skip
    for start_n in range(end_full, tl.minimum(first_m + BLOCK_M, T), BLOCK_N):
        acc = _average_values(
            acc, q, K, V, BIAS, first_m, start_n, rel, rows, cols, offs_e, offs_d, skt, skd, svt, sve,
            T, E, D, HALF, scale, True, PRECISION,
        )  # fmt: skip
    tl.store(
        O + offs_m[:, None] * E + offs_e[None, :],
        acc.to(O.dtype.element_ty),
        mask=(offs_m[:, None] < T) & (offs_e[None, :] < E),
    )


@triton.jit
def _value_gradients(
    acc, k, Q, DO, BIAS, first_n, start_m, rel, offs_m, offs_n, offs_e, offs_d, sqt, sqd, sot, soe,
    T, E, D, HALF, scale, MASKED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """`dv_kernel`'s step: acc + relu(S)^2^T dO over the query block at start_m. MASKED: the block
    may hold queries before a key or past T (or the keys pass T); otherwise every pair is visible."""
    queries = start_m + offs_m
    q_mask, do_mask = block_masks(start_m, offs_m, offs_d, offs_e, T, E, D, MASKED)
    qt = tl.load(Q + queries[None, :] * sqt + offs_d[:, None] * sqd, mask=q_mask, other=0.0)
    if MASKED:  # relu(S)^T: [keys, queries]
        rt = relu_scores(dot(k, qt, PRECISION), BIAS, queries[None, :], first_n + offs_n[:, None], T, HALF, scale)
    else:
        rt = relu_scores_visible(dot(k, qt, PRECISION), BIAS, start_m - first_n + HALF - 1, rel, scale)
    do = tl.load(DO + queries[:, None] * sot + offs_e[None, :] * soe, mask=do_mask, other=0.0)
    return acc + dot((rt * rt).to(DO.dtype.element_ty), do, PRECISION)  # dV = P^T dO


@autotune(_DV_CONFIGS, key=_KEY)
@triton.jit
def dv_kernel(
    Q,
    K,
    DO,
    BIAS,
    DV,
    sqn,
    sqt,
    sqd,
    skn,
    skt,
    skd,
    son,
    sot,
    soe,
    T,
    E,
    D,
    HALF,
    scale,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid_n, pid_e, n = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    first_n = pid_n * BLOCK_N
    keys, cols = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_M)
    offs_n = first_n + keys
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    Q, K, DO, DV = Q + n * sqn, K + n * skn, DO + n * son, DV + n * T * E  # as in forward_kernel
    k = tl.load(
        K + offs_n[:, None] * skt + offs_d[None, :] * skd,
        mask=(offs_n[:, None] < T) & (offs_d[None, :] < D),
        other=0.0,
    )
    rel = cols[None, :] - keys[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    # The queries that see these keys: masked blocks on the diagonal, unmasked ones wholly after it
    # and before T, a masked one at T's end (as in forward_kernel; not for fp32 inputs).
    start = first_n // BLOCK_M * BLOCK_M
    diagonal_end = T
    unmasked_end = T
    if Q.dtype.element_ty != tl.float32:
        diagonal_end = tl.minimum(tl.cdiv(first_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, T)
        unmasked_end = tl.maximum(T // BLOCK_M * BLOCK_M, diagonal_end)
    for start_m in range(start, diagonal_end, BLOCK_M):
        acc = _value_gradients(
            acc, k, Q, DO, BIAS, first_n, start_m, rel, cols, keys, offs_e, offs_d, sqt, sqd, sot, soe,
            T, E, D, HALF, scale, True, PRECISION,
        )  # fmt: skip
    for start_m in range(diagonal_end, unmasked_end, BLOCK_M):
        acc = _value_gradients(
            acc, k, Q, DO, BIAS, first_n, start_m, rel, cols, keys, offs_e, offs_d, sqt, sqd, sot, soe,
            T, E, D, HALF, scale, False, PRECISION,
        )  # fmt: skip
    for start_m in range(unmasked_end, T, BLOCK_M):
        acc = _value_gradients(
            acc, k, Q, DO, BIAS, first_n, start_m, rel, cols, keys, offs_e, offs_d, sqt, sqd, sot, soe,
            T, E, D, HALF, scale, True, PRECISION,
        )  # fmt: skip
    tl.store(
        DV + offs_n[:, None] * E + offs_e[None, :],
        acc.to(DV.dtype.element_ty),
        mask=(offs_n[:, None] < T) & (offs_e[None, :] < E),
    )


@autotune(_DQK_CONFIGS, key=_KEY, reset_to_zero=["DQ", "DK", "DBIAS"])
@triton.jit
def dqk_kernel(
    Q,
    K,
    V,
    DO,
    BIAS,
    DQ,
    DK,
    DBIAS,
    sqn,
    sqt,
    sqd,
    skn,
    skt,
    skd,
    svn,
    svt,
    sve,
    son,
    sot,
    soe,
    T,
    E,
    D,
    HALF,
    scale,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid_n, n = tl.program_id(0), tl.program_id(1).to(tl.int64)
    dt = Q.dtype.element_ty
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    kmask = (offs_n[:, None] < T) & (offs_d[None, :] < D)
    Q, K, V, DO = Q + n * sqn, K + n * skn, V + n * svn, DO + n * son  # as in forward_kernel
    DQ, DK = DQ + n * T * D, DK + n * T * D
    k = tl.load(K + offs_n[:, None] * skt + offs_d[None, :] * skd, mask=kmask, other=0.0)
    rows = tl.arange(0, BLOCK)
    for start_m in range(pid_n * BLOCK, T, BLOCK):  # queries that see these keys
        offs_m = start_m + rows
        dp = tl.zeros([BLOCK, BLOCK], tl.float32)
        for start_e in range(0, E, BLOCK_E):  # dP = dO V^T, contracted over the whole width
            offs_e = start_e + tl.arange(0, BLOCK_E)
            do = tl.load(
                DO + offs_m[:, None] * sot + offs_e[None, :] * soe,
                mask=(offs_m[:, None] < T) & (offs_e[None, :] < E),
                other=0.0,
            )
            vt = tl.load(
                V + offs_n[None, :] * svt + offs_e[:, None] * sve,
                mask=(offs_n[None, :] < T) & (offs_e[:, None] < E),
                other=0.0,
            )
            dp += dot(do, vt, PRECISION)
        # The scores only now, so that they and q are not held through the loop over the width.
        qmask = (offs_m[:, None] < T) & (offs_d[None, :] < D)
        q = tl.load(Q + offs_m[:, None] * sqt + offs_d[None, :] * sqd, mask=qmask, other=0.0)
        r = relu_scores(dot(q, tl.trans(k), PRECISION), BIAS, offs_m[:, None], offs_n[None, :], T, HALF, scale)
        ds = 2.0 * r * dp  # dS = 2 relu(S) dP: zero wherever relu(S) is, masked entries included
        ds_in = ds.to(dt)
        # dK added per query block rather than held through the loop (registers for blocks of 64)
        dk = dot(tl.trans(ds_in), q, PRECISION) * scale
        tl.atomic_add(DK + offs_n[:, None] * D + offs_d[None, :], dk, mask=kmask, sem="relaxed")
        dq = dot(ds_in, k, PRECISION) * scale
        tl.atomic_add(DQ + offs_m[:, None] * D + offs_d[None, :], dq, mask=qmask, sem="relaxed")
        # The bias's gradient, the sum of dS per offset: each tile's diagonals summed in registers
        # (a gather that lines them up in columns, then a column sum), so only 2 BLOCK atomic adds
        # per tile reach the [2 HALF - 1] fp32 buffer. One atomic add per entry of dS instead
        # would put BLOCK^2 atomics per tile on only 2 BLOCK - 1 addresses, serializing them; a
        # buffer of per-tile partial sums would be as large as the [T, T] scores it avoids.
        # Column c of `lined` holds the tile's offset t - j = start_m - start_n + c - (BLOCK - 1): row
        # i's entry at key column i - c + BLOCK - 1 (c = 2 BLOCK - 1 is always empty), for c in two
        # halves of BLOCK (one [BLOCK, 2 BLOCK] gather spilled registers at blocks of 64). The
        # indices are rebuilt per tile rather than kept live across the loop.
        for half in tl.static_range(2):
            diag = half * BLOCK + tl.arange(0, BLOCK)
            diag_col = rows[:, None] - diag[None, :] + BLOCK - 1
            on_tile = (diag_col >= 0) & (diag_col < BLOCK)
            lined = tl.where(on_tile, tl.gather(ds, tl.where(on_tile, diag_col, 0), 1), 0.0)
            offset = start_m - pid_n * BLOCK + diag - (BLOCK - 1)
            tl.atomic_add(DBIAS + offset + HALF - 1, tl.sum(lined, 0), mask=(offset >= 0) & (offset < T), sem="relaxed")
