"""What the Triton kernels of TANGO's mixing (`tango_mix_triton*.py`) and windowed TANGO's
(`windowed_triton.py`) share: the dtypes they take, autotune configurations (one small one under
the interpreter), the matmul and SiLU they use inside kernels, and the matmul precision setting."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tango_lm.errors import UserError

# Triton's own reading of TRITON_INTERPRET (1, true, on, yes...): the kernels run interpreted exactly when
# it says so, and under the interpreter they must upcast their dots (_UPCAST_DOTS).
INTERPRETED = bool(triton.knobs.runtime.interpret)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634
MAX_GRID = 65535  # CUDA's limit on a grid's second and third axes (the kernels put B * H there)
# Multiply-adds contracted into FMAs, as every launch asks: what the kernels were written, tested
# and compiled for (tools/triton_ptxas_report.py). Triton <= 3.9 defaults to it, 3.9 warns that
# 3.10 will not, and without it a kernel runs more instructions and rounds differently.
FP_FUSION = True


def configs(names: tuple[str, ...], choices: list[tuple]) -> list[triton.Config]:
    """Autotune configurations from (block sizes..., num_warps, num_stages[, limits]). `limits`
    {"min_d": l, "max_d": n, "min_align": m, "max_align": x} keeps a configuration to launches with
    l <= BLOCK_D <= n and m <= ALIGN <= x (`admitted`): outside them it spills registers on sm_90, or
    (max_align) others serve better (tools/triton_ptxas_report.py). {"fp32": True} marks one sized
    for fp32 inputs (`admitted`): where a kernel has such, fp32 launches take only them and no other
    launch takes them."""
    out = []
    for c in choices:
        blocks, rest = c[: len(names)], c[len(names) :]
        config = triton.Config(dict(zip(names, blocks, strict=True)), num_warps=rest[0], num_stages=rest[1])
        config.limits = rest[2] if len(rest) > 2 else {}
        out.append(config)
    return out


def autotune(hardware: list[triton.Config], key: list[str], **kwargs):
    """`triton.autotune` over the `configs` list `hardware`, pruned per launch by `for_launch`. Under
    the interpreter the tuner gets one small configuration instead (blocks of 16: several blocks in
    every direction at the tests' sizes); either way it keeps the hardware list as
    `hardware_configs`, which the kernel tests run one by one (tests/triton_configurations.py), and
    every launch compiles with `FP_FUSION` set, whatever triton's default."""
    interpreted = [triton.Config(dict.fromkeys(hardware[0].kwargs, 16), num_warps=1)]

    def decorate(fn):
        tuner = triton.autotune(
            interpreted if INTERPRETED else hardware,
            key=key,
            prune_configs_by={"early_config_prune": for_launch},
            do_bench=time_configuration,
            **kwargs,
        )(fn)
        tuner.hardware_configs = hardware
        launch = tuner.run  # `kernel[grid](...)` calls the tuner's `run`: every launch passes by here

        def run(*args, **launch_kwargs):
            launch_kwargs.setdefault("enable_fp_fusion", FP_FUSION)
            return launch(*args, **launch_kwargs)

        tuner.run = run
        return tuner

    return decorate


def autotuning() -> bool:
    """Whether a launch times the configurations its limits admit (the default) or takes the first of
    them untimed (`TANGO_LM_TRITON_AUTOTUNE=0`: for tests, where many small shapes would each be
    timed and the choice does not matter; `make gpu-check` sets it for its tests)."""
    value = os.environ.get("TANGO_LM_TRITON_AUTOTUNE", "1")
    if value not in ("0", "1"):
        raise UserError(f"TANGO_LM_TRITON_AUTOTUNE must be 0 (no timing: the first configuration) or 1, not {value!r}")
    return value == "1"


def admitted(configs: list[triton.Config], fp32_inputs: bool = False, **launch) -> list[triton.Config]:
    """The configurations whose limits admit a launch's BLOCK_D and ALIGN (unaligned widths load
    their columns one by one: fewer fit in registers), and, where a kernel has configurations marked
    for fp32 inputs, only those for an fp32 launch and none of those for another; the first one if
    none is left. fp32 tiles take twice the bytes of bf16's in shared memory and registers, whether
    their products run in full fp32 on FMAs or in TF32 where PyTorch allows it (`precision`): at
    d_h > 128 no bf16-sized tile of tango_mix's kernels fit sm_90's shared memory in fp32, and a
    launch with none that fits fails (triton's OutOfResources)."""
    block_d, align = launch.get("BLOCK_D", 16), launch.get("ALIGN", 1)
    limits = [getattr(c, "limits", {}) for c in configs]
    fp32 = fp32_inputs and any("fp32" in lim for lim in limits)
    kept = [
        c
        for c, lim in zip(configs, limits, strict=True)
        if lim.get("min_d", 1) <= block_d <= lim.get("max_d", block_d)
        and lim.get("min_align", 1) <= align <= lim.get("max_align", align)
        and lim.get("fp32", False) == fp32
    ]
    return kept or configs[:1]


def has_fp32_inputs(named_args: dict) -> bool:
    """Whether a launch's float tensors are all 32-bit or wider (its buffers, such as the LSE and row
    sums, are fp32 whatever the inputs' dtype: one 16-bit tensor makes a bf16 or fp16 launch)."""
    floats = [v.dtype for v in named_args.values() if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
    return bool(floats) and all(dtype.itemsize >= 4 for dtype in floats)


def for_launch(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The autotuner's `early_config_prune`: the `admitted` configurations, or only the first of them
    without `autotuning()` (which `time_configuration` then does not time)."""
    kept = admitted(configs, has_fp32_inputs(named_args), **kwargs)
    return kept if autotuning() else kept[:1]


def time_configuration(kernel_call, quantiles: tuple[float, ...]) -> list[float]:
    """The autotuner's timing of one configuration: the GPU driver's benchmarker, or nothing at all
    without `autotuning()`, where `for_launch` left one configuration. Triton 3.9 times nothing
    when one is left; 3.6 (torch 2.11's) still timed it, ~0.1 s of launches per launch shape, and
    under the interpreter, which has no driver, failed ("0 active drivers")."""
    if not autotuning():
        return [0.0] * len(quantiles)
    from triton.runtime import driver

    return driver.active.get_benchmarker()(kernel_call, quantiles=quantiles)


# The interpreter multiplies bf16 operands as their raw 16-bit patterns (triton 3.9): there the
# operands, already rounded to their dtype, are multiplied as fp32, which is what the tensor cores do.
_UPCAST_DOTS = tl.constexpr(INTERPRETED)


@triton.jit
def dot(x, y, PRECISION: tl.constexpr):
    if _UPCAST_DOTS:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), input_precision="ieee")
    return tl.dot(x, y, input_precision=PRECISION)


@triton.jit
def block_masks(start, offs, offs_d, offs_w, T, W, D, MASKED: tl.constexpr):
    """The masks of a loop step over the block of positions at start (tango_mix's and relu²'s
    kernels): [BLOCK_D, block] for its q or k tile (transposed) and [block, wide block] for its
    gates or values; MASKED adds the bound at T."""
    narrow = offs_d[:, None] < D
    wide = offs_w[None, :] < W
    if MASKED:
        narrow = narrow & (start + offs[None, :] < T)
        wide = wide & (start + offs[:, None] < T)
    return narrow, wide


# Compiled, the SiLU and the sigmoid divide by the fast reciprocal (__fdividef); the interpreter
# has no such function (numpy) and divides exactly. They differ by at most 2 ulp of fp32.
_FAST_DIVISION = tl.constexpr(not INTERPRETED)
_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _over_one_plus_exp(x, a):
    """x / (1 + e^-a) in fp32: exp2 (as flash attention's softmax) and the fast division. On sm_90
    that is five instructions per element, two of them MUFU, where `x / (1 + tl.exp(-a))` took about
    twelve with the range fix-ups of exp and of the full-range division (the windowed kernels'
    loops: tools/triton_ptxas_report.py --mix). __fdividef returns 0 once e^-a passes 2^126
    (a < -87.3), where the sigmoid is about 1e-38 or less anyway."""
    e = 1.0 + tl.exp2(-a * _LOG2E)
    if _FAST_DIVISION:
        return libdevice.fast_dividef(x, e)
    return x / e


@triton.jit
def sigmoid_f32(a):
    return _over_one_plus_exp(1.0, a.to(tl.float32))


@triton.jit
def silu_f32(a):
    a = a.to(tl.float32)
    return _over_one_plus_exp(a, a)


def precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 unless PyTorch's own matmuls are allowed TF32; bf16 and
    fp16 operands take the tensor cores' own path (Triton's default setting)."""
    return "ieee" if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"


def column_alignment(width: int, element_size: int, *tensors: torch.Tensor) -> int:
    """The largest power of two, up to 16 bytes' worth of elements, that divides the width per head
    and every tensor's storage offset and strides but the last: the gate kernels' `ALIGN`. Told it,
    the compiler loads a row's columns in vectors of that many elements (TANGO's width 1,780 in
    bf16: 4) instead of one by one, each with its own 64-bit address."""
    align = 16 // element_size
    while align > 1 and any(
        v % align
        for v in (width, *(x.storage_offset() for x in tensors), *(s for x in tensors for s in x.stride()[:-1]))
    ):
        align //= 2
    return align
