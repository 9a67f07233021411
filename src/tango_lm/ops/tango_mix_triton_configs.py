"""The autotune configurations of TANGO's mixing kernels (`tango_mix_triton_kernels.py`) and the
launch arguments their choices are cached by."""

from __future__ import annotations

from tango_lm.ops.triton_common import configs

# (block sizes..., num_warps, num_stages[, limits]). Larger column blocks recompute P less often.
# Each configuration compiles for sm_90 without spilling registers (with the gates written, the
# default of tango_mix_triton.py), in bf16 and fp16 at head dims 32-128, for the launches its limits admit (triton_common.admitted; ALIGN 1: a width per head
# that is odd, as 3-set TANGO's 593); fp32 ones too (d_h = 128 has its own: the smaller d_h's
# spill there, and d_h = 128's spill a few bytes at 64). tools/triton_ptxas_report.py shows them;
# tests/ops/test_triton_spills.py keeps TANGO's shape so, in bf16 and in fp32.
ALIGNED = {"min_align": 2}  # vectorized gate columns
UNALIGNED = {"max_align": 1}  # columns one by one: smaller tiles or more warps
FP32 = {"fp32": True}  # fp32 inputs: small tiles (full-fp32 products on FMAs hold them in registers)
LSE_CONFIGS = configs(
    ("BLOCK_M", "BLOCK_N"),
    [
        (64, 64, 4, 2),
        (128, 64, 4, 2),
        (128, 128, 8, 2),
        (32, 32, 4, 2, {"max_d": 64, **FP32}),
        (32, 64, 4, 2, {"max_d": 64, **FP32}),
        (32, 32, 8, 1, {"min_d": 128, **FP32}),
    ],
)
FORWARD_CONFIGS = configs(
    ("BLOCK_M", "BLOCK_N", "BLOCK_W"),
    [
        (64, 64, 128, 4, 3, {"max_d": 32, **ALIGNED}),  # spills 24 B at d_h = 64
        (128, 64, 128, 8, 3, ALIGNED),
        (64, 64, 256, 8, 2, {"max_d": 32, **ALIGNED}),
        (128, 64, 64, 4, 3, {"max_d": 32, **ALIGNED}),
        (64, 64, 128, 8, 3, UNALIGNED),
        (64, 64, 64, 8, 3, UNALIGNED),
        (64, 32, 128, 4, 2, UNALIGNED),
        (32, 64, 64, 8, 2, FP32),
        (32, 32, 32, 4, 2, FP32),
        (32, 32, 64, 4, 2, {"max_d": 64, **FP32}),
    ],
)
SCORES_CONFIGS = configs(
    ("BLOCK_M", "BLOCK_N", "BLOCK_W"),
    [
        (64, 64, 64, 8, 2, ALIGNED),
        (128, 64, 64, 8, 3, {"max_d": 64, **ALIGNED}),
        (32, 64, 64, 4, 2, {"max_d": 32, **ALIGNED}),
        (64, 32, 128, 8, 2, {"max_d": 32, **ALIGNED}),
        (64, 64, 32, 8, 2, UNALIGNED),
        (32, 64, 64, 8, 2, {"max_d": 64, **UNALIGNED}),
        (32, 64, 32, 4, 2, UNALIGNED),
        (64, 32, 32, 8, 2, {"max_d": 64, **FP32}),
        (32, 64, 32, 8, 2, {"max_d": 64, **FP32}),
        (32, 32, 64, 4, 2, {"max_d": 32, "min_align": 2, **FP32}),
        (32, 16, 32, 8, 2, {"min_d": 128, **FP32}),  # first: the next spills 12 B under triton 3.8
        (32, 32, 32, 8, 2, {"min_d": 128, **FP32}),
    ],
)
GATES_CONFIGS = configs(
    ("BLOCK_M", "BLOCK_N", "BLOCK_W"),
    [
        (64, 64, 128, 8, 3, ALIGNED),
        (64, 128, 64, 8, 3, ALIGNED),
        (64, 64, 64, 4, 3, ALIGNED),
        (64, 64, 64, 8, 3, UNALIGNED),
        (32, 64, 64, 4, 2, {"max_d": 32, **UNALIGNED}),
        (64, 128, 32, 8, 3, UNALIGNED),
        (32, 32, 32, 4, 2, FP32),
        (32, 32, 64, 4, 2, {"max_d": 64, **FP32}),
    ],
)
# `for_launch` prunes by PRECISION and ALIGN: they belong in the cache key too, or a configuration
# tuned at one (same T, W, D and dtypes) would be reused, unpruned, at another.
KEY = ["T", "W", "D"]
LSE_KEY = [*KEY, "PRECISION"]
PRUNED_KEY = [*KEY, "PRECISION", "ALIGN"]
GATES_KEY = [*PRUNED_KEY, "GATES_READY"]  # a loop without SiLU may tune to other blocks
SCORES_KEY = [*PRUNED_KEY, "OPERANDS_READY"]
