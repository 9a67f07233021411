"""The autotune configurations of windowed TANGO's kernels (`windowed_triton.py`) and the launch
arguments their choices are cached by."""

from __future__ import annotations

from tango_lm.ops.triton_common import configs

# (BLOCK_W, num_warps, num_stages[, limits]): without register spills on sm_90 in bf16 and fp16
# at d_h 32-128 where the limits admit them (triton_common.admitted; tools/triton_ptxas_report.py,
# triton 3.9 and 3.6, widths 1,780 and 593).
# fp32 inputs multiply in full fp32 on FMAs, whose operands' whole contraction ([C = 64] or d_h)
# sits in registers: narrow column blocks of their own, spill-free at d_h 32-64.
FP32 = {"fp32": True}
FORWARD_CONFIGS = configs(
    ("BLOCK_W",),
    [
        (64, 8, 2, {"min_align": 2}),
        (128, 8, 2, {"max_d": 64, "min_align": 2}),
        (64, 4, 2, {"max_d": 64, "min_align": 2}),
        (32, 8, 2, {"max_align": 1}),  # gate columns one by one (an odd width per head)
        (64, 8, 3, {"max_d": 32, "max_align": 1}),
        (16, 8, 1, {"max_d": 64, **FP32}),
        (32, 8, 1, {"min_d": 128, **FP32}),  # spills 1 KB
    ],
)
BAND_CONFIGS = configs(("BLOCK_W",), [(64, 4, 2), (128, 8, 2), (16, 8, 1, FP32), (16, 8, 2, FP32)])
BACKWARD_CONFIGS = configs(
    ("BLOCK_W",),
    [
        (32, 8, 2),
        (64, 8, 2, {"max_d": 64, "min_align": 2}),
        (32, 4, 2, {"max_d": 64, "min_align": 2}),
        # at d_h = 128 these spilled 16-92 B (fp16) and 4 B (bf16, triton 3.6): (32, 8, 2) serves there
        (16, 4, 2, {"max_d": 64, "max_align": 1}),
        (32, 8, 3, {"max_d": 64, "max_align": 1}),
        (16, 8, 1, {"max_d": 64, **FP32}),
        (16, 8, 2, FP32),  # spills 0.4 KB at d_h = 128
    ],
)
KEY = ["T", "W", "C", "D", "PRECISION", "ALIGN"]  # what `for_launch` prunes by, too (as tango_mix's)
