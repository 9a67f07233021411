"""Compile every autotune configuration of the project's Triton kernels for a CUDA GPU, without one.

Usage: PYTHONPATH=src python tools/triton_ptxas_report.py [--ops relu2,tango_mix,windowed --kernels NAME,...
       --dtype bf16 [--tf32] --head-dim 128 --width 1780 --arch 90 --first N]

Triton's NVIDIA backend (and the ptxas in its wheel) compiles a kernel for a named architecture on
any machine, so a GPU session's scarce minutes need not find out that a configuration fails to
compile, spills registers or needs more shared memory than the chip has (the autotuner skips such a
configuration silently; if all of a kernel's do, the op fails). For each kernel and configuration
this prints the shared memory, whether it fits (227 KiB on sm_90), the registers per thread and the
bytes spilled, from `ptxas -v`. Run it without TRITON_INTERPRET (under the interpreter the
kernels have one small configuration only).

`--mix` adds, from the disassembled machine code (nvdisasm), what one iteration of each innermost
loop issues per warp: its instructions, those on the special-function units (MUFU: exp2,
reciprocal; 16 lanes per clock per SM on sm_90) and those on the tensor cores (HGMMA/HMMA). These
are not timings, but a loop whose instructions outnumber its tensor-core work cannot run at the
tensor cores' speed whatever the memory does. `--silu-on-load` compiles tango_mix's kernels with
the SiLU applied in their loops (`tango_mix_triton(..., silu_on_load=True)`) instead of reading
gates written once.

Each kernel is compiled as triton's JIT would for a launch at the issue's shape (B = H = 16,
T = 1024, `--width` gate columns per head, contiguous gates; for relu2, GAU's layout with
`--width` as the value width e, 7,152 at the 70M tier): integer arguments equal to 1 become
constants and multiples of 16 are marked so, pointers are 16-byte aligned, and only the
configurations the autotuner tries at that head dim and width are shown (`triton_common.admitted`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}  # bytes of shared memory per block
FP32 = "fp32"  # pointer arguments that are fp32 whatever the inputs' dtype
IO = "io"  # pointer arguments in the inputs' dtype
PREFIX = "prefix"  # windowed TANGO's prefix factors: in windowed_triton.operand_dtypes' dtype for the inputs'

# op -> (kernels module, {kernel: {pointer argument: IO | FP32 | PREFIX}}, constexpr arguments besides the configs')
OPS = {
    "relu2": (
        "tango_lm.ops.relu2_attention_triton_kernels",
        {
            "forward_kernel": {"Q": IO, "K": IO, "V": IO, "BIAS": FP32, "O": IO},
            "dv_kernel": {"Q": IO, "K": IO, "DO": IO, "BIAS": FP32, "DV": IO},
            "dqk_kernel": {"Q": IO, "K": IO, "V": IO, "DO": IO, "BIAS": FP32, "DQ": FP32, "DK": FP32, "DBIAS": FP32},
        },
        {},
    ),
    "tango_mix": (
        "tango_lm.ops.tango_mix_triton_kernels",
        {
            name: {p: FP32 if p in ("LSE", "DELTA", "DQ", "DK") else IO for p in pointers}
            for name, pointers in {
                "lse_kernel": ("Q", "K", "LSE"),
                "forward_kernel": ("Q", "K", "A", "U", "LSE", "Y", "AVG"),
                "scores_backward_kernel": ("Q", "K", "A", "U", "DY", "LSE", "DELTA", "DQ", "DK"),
                "gates_backward_kernel": ("Q", "K", "A", "U", "DY", "LSE", "AVG", "DA", "DU", "DELTA", "G", "DG"),
            }.items()
        },
        {
            "HAS_U": True,
            "STORE_AVG": True,
            "GATES_READY": True,
            "OPERANDS_READY": True,
            "STORE_OPERANDS": True,
        },  # the op's defaults
    ),
    "windowed": (
        "tango_lm.ops.windowed_triton",
        {
            name: {
                p: PREFIX if p in ("PQ", "PK") else IO if p in ("WB", "A", "U", "DY", "Y", "AVG", "DA", "DU") else FP32
                for p in pointers
            }
            for name, pointers in {
                "_forward_kernel": ("WB", "PQ", "PK", "A", "U", "Y", "AVG"),
                "_band_backward_kernel": ("A", "U", "DY", "DWB"),
                "_backward_kernel": ("WB", "PQ", "PK", "A", "U", "DY", "AVG", "DPQ", "DPK", "DA", "DU"),
            }.items()
        },
        {"HAS_AVG": True, "BLOCK_C": 64},  # chunks of the window, 64 by default
    ),
}


def launch_ints(op: str, head_dim: int, width: int) -> dict[str, int]:
    """The integer arguments of `op`'s kernels at the issue's launch (B = 16, H = 16, T = 1024, the
    given width per head): q, k [B, H, T, d_h] as the layers make them (heads split from [B, T, H d_h]),
    gates [B, T, F] contiguous (windowed TANGO: chunks of 64). relu2 (GAU): q, k [B, T, s] from
    the [B, 2, T, s] offset-scaled bases, v [B, T, e] (e: the width) from the [B, T, 2e] U|V
    projection, dO [B, T, e] contiguous, a bias over 2T - 1 offsets."""
    if op == "relu2":
        t, d, e = 1024, head_dim, width
        ints = {"T": t, "E": e, "D": d, "HALF": t}
        for x in "qk":
            ints |= {f"s{x}n": 2 * t * d, f"s{x}t": d, f"s{x}d": 1}
        return ints | {"svn": t * 2 * e, "svt": 2 * e, "sve": 1, "son": t * e, "sot": e, "soe": 1}
    h, t, d, w = 16, 1024, head_dim, width
    f = h * w
    ints = {"H": h, "T": t, "W": w, "D": d}
    if op == "tango_mix":
        for x in "qk":
            ints |= {f"s{x}b": t * h * d, f"s{x}h": d, f"s{x}t": h * d, f"s{x}d": 1}
        for x in "audy":
            ints |= {f"s{x}b": t * f, f"s{x}t": f, f"s{x}f": 1}
    if op == "windowed":
        ints |= {"C": 64, "N": t // 64}
    return ints


def ptxas_path(arch: int) -> Path | None:
    """The ptxas triton itself runs for `arch` (its wheel ships one per architecture range)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return Path(get_ptxas(arch).path)
    except (ImportError, AttributeError, RuntimeError):
        return None


def _pointer_dtype(kind: str, dtype: str) -> str:
    """A pointer argument's element type, for inputs of `dtype` (bf16, fp16 or fp32)."""
    if kind == FP32:
        return "fp32"
    if kind == PREFIX:
        import torch

        from tango_lm.ops.windowed_triton import operand_dtypes

        names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
        return names[operand_dtypes({v: k for k, v in names.items()}[dtype])[1]]
    return dtype


def report_kernel(
    kernel,
    pointers: dict[str, str],
    constexprs: dict,
    dtype: str,
    arch: int,
    ints: dict[str, int] | None = None,
    first: int | None = None,
    mix: bool = False,
) -> list[dict]:
    """One row per autotune configuration of `kernel` (a triton Autotuner around a JITFunction).
    `ints` gives integer arguments their values at a launch: as triton's JIT does, those equal to 1
    are compiled as constants and multiples of 16 are marked so (which lets loads be vectorized)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tango_lm.ops.triton_common import FP_FUSION, admitted

    fn = kernel.fn
    rows = []
    fp32 = dtype == "fp32"
    configs = admitted(kernel.hardware_configs, fp32, **constexprs)[:first]  # those the autotuner tries here
    for config in configs:
        consts = {k: v for k, v in {**constexprs, **config.kwargs}.items() if k in fn.arg_names}
        signature, attrs = {}, {}
        for name in fn.arg_names:
            value = (ints or {}).get(name)
            if name in consts:
                signature[name] = "constexpr"
            elif value == 1:  # the JIT makes an integer argument equal to 1 a constant
                signature[name], consts[name] = "constexpr", 1
            elif name in pointers:
                signature[name] = "*" + _pointer_dtype(pointers[name], dtype)
                attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]  # torch's allocations
            else:  # strides and sizes, and the float scales
                signature[name] = "fp32" if name.startswith("scale") else "i32"
                if value is not None and value % 16 == 0:  # the JIT marks multiples of 16 so
                    attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
        row = {"kernel": fn.__name__, "config": config.kwargs, "warps": config.num_warps, "stages": config.num_stages}
        try:
            source = ASTSource(
                fn=fn,
                signature=signature,
                constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                attrs=attrs,
            )
            compiled = triton.compile(
                source,
                target=GPUTarget("cuda", arch, 32),
                options={"num_warps": config.num_warps, "num_stages": config.num_stages, "enable_fp_fusion": FP_FUSION},
            )
        except Exception as exc:  # a configuration that does not compile is this report's finding
            rows.append({**row, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"})
            continue
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "kernel.ptx"
            ptx.write_text(compiled.asm["ptx"])
            sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
            out = subprocess.run(
                [str(ptxas_path(arch)), f"-arch={sm}", "-v", str(ptx), "-o", os.devnull], capture_output=True, text=True
            ).stderr
        registers = re.search(r"Used (\d+) registers", out)
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", out)]
        shared = compiled.metadata.shared
        rows.append(
            {
                **row,
                "shared": shared,
                "fits": shared <= SHARED_LIMIT.get(arch, SHARED_LIMIT[90]),
                "registers": int(registers.group(1)) if registers else None,
                "spill_bytes": max(spills) if spills else None,
                **({"loops": loop_mixes(disassemble(compiled.asm["cubin"], arch))} if mix else {}),
            }
        )
    return rows


def disassemble(cubin: bytes, arch: int) -> str:
    """The machine code, by the nvdisasm beside triton's ptxas."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        nvdisasm = ptxas_path(arch).with_name("nvdisasm")
        return subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True, text=True, check=True).stdout


def loop_mixes(sass: str) -> list[dict[str, int]]:
    """Per innermost loop of `sass` (nvdisasm -c), in code order, what one iteration issues per
    warp: instructions, MUFU (special-function) ones, tensor-core ones. A loop is a branch back to
    a label; an innermost one holds no other."""
    labels: dict[str, int] = {}  # label -> index of the first instruction after it
    pending: list[str] = []
    instructions: list[tuple[str, str]] = []  # (opcode, operands)
    for line in sass.splitlines():
        label = re.fullmatch(r"(\.L_x_\d+):", line.strip())
        if label:
            pending.append(label.group(1))
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m:
            labels |= dict.fromkeys(pending, len(instructions))
            pending = []
            instructions.append((m.group(1), m.group(2)))
    loops = []
    for end, (opcode, operands) in enumerate(instructions):
        target = re.search(r"\((\.L_x_\d+)\)", operands)
        if opcode == "BRA" and target and labels.get(target.group(1), end + 1) <= end:
            loops.append((labels[target.group(1)], end))
    loops = [(s, e) for s, e in loops if s < e]  # not the one-instruction `BRA` to itself a kernel ends with
    innermost = [(s, e) for s, e in loops if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in loops)]
    mixes = []
    for start, end in sorted(innermost):
        opcodes = [opcode for opcode, _ in instructions[start : end + 1]]
        mixes.append(
            {
                "instructions": len(opcodes),
                "mufu": sum(o.startswith("MUFU") for o in opcodes),
                "tensor": sum(o.startswith(("HGMMA", "HMMA")) for o in opcodes),
            }
        )
    return mixes


def format_rows(rows: list[dict], dtype: str, arch: int, head_dim: int, mix: bool = False) -> str:
    lines = [
        f"Triton kernels compiled for sm_{arch}, {dtype} inputs, head dim {head_dim}: shared memory per "
        "block, whether it fits, registers per thread and bytes spilled (ptxas -v)"
        + ("; per innermost loop, one iteration's instructions/MUFU/tensor-core instructions per warp" if mix else ""),
        f"{'kernel':<24}{'config':<48}{'warps':>6}{'stages':>7}{'shared KiB':>11}{'fits':>6}{'regs':>6}{'spill B':>9}"
        + ("  loops" if mix else ""),
    ]
    for r in rows:
        config = ", ".join(f"{k}={v}" for k, v in r["config"].items())
        if "error" in r:
            lines.append(
                f"{r['kernel']:<24}{config:<48}{r['warps']:>6}{r['stages']:>7}  does not compile: {r['error']}"
            )
            continue
        lines.append(
            f"{r['kernel']:<24}{config:<48}{r['warps']:>6}{r['stages']:>7}{r['shared'] / 1024:>11.0f}"
            f"{'yes' if r['fits'] else 'NO':>6}{r['registers'] or '-':>6}{r['spill_bytes'] if r['spill_bytes'] is not None else '-':>9}"
            + ("  " + " ".join(f"{x['instructions']}/{x['mufu']}/{x['tensor']}" for x in r["loops"]) if mix else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of: {', '.join(OPS)}")
    p.add_argument(
        "--kernels", default="", help="comma-separated kernel names to keep (default: every kernel of --ops)"
    )
    p.add_argument("--first", type=int, default=None, help="only each kernel's first N configurations")
    p.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="input dtype (default %(default)s)"
    )
    p.add_argument(
        "--tf32",
        action="store_true",
        help="fp32 inputs with TF32 matmuls allowed (torch.backends.cuda.matmul.allow_tf32)",
    )
    p.add_argument("--head-dim", type=int, default=128, help="the query/key width (GAU's s = 128; TANGO's d_h = 32)")
    p.add_argument(
        "--width",
        type=int,
        default=1780,
        help="gate columns per head (TANGO's presets: 1,780); relu2: the value width e (GAU 70M: 7,152)",
    )
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--mix", action="store_true", help="each innermost loop's instruction mix, from the machine code")
    p.add_argument(
        "--silu-on-load", action="store_true", help="tango_mix's kernels with the SiLU in their loops (not the default)"
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        print(f"error: unknown --ops {', '.join(unknown)}; choose from: {', '.join(OPS)}", file=sys.stderr)
        return 2
    if args.head_dim < 1:
        print("error: --head-dim must be >= 1", file=sys.stderr)
        return 2
    if args.arch < 75:  # triton's NVIDIA backend starts at Turing: older ones abort inside LLVM
        print(f"error: --arch {args.arch}: triton compiles for compute capability 7.5 (75) and newer", file=sys.stderr)
        return 2
    known = {k for op in ops for k in OPS[op][1]}
    unknown = [k for k in (args.kernels or "").split(",") if k and k not in known]
    if unknown:
        print(
            f"error: unknown --kernels {', '.join(unknown)}; --ops {args.ops} has: {', '.join(sorted(known))}",
            file=sys.stderr,
        )
        return 2
    try:
        import triton
    except ImportError:
        print("error: triton is not installed: pip install 'tango-lm[triton]'", file=sys.stderr)
        return 2
    if triton.knobs.runtime.interpret:
        print("error: TRITON_INTERPRET leaves the kernels one interpreter configuration: unset it", file=sys.stderr)
        return 2
    ptxas = ptxas_path(args.arch)
    if ptxas is None or not ptxas.is_file():
        print(
            f"error: triton has no ptxas for sm_{args.arch} here ({ptxas}): its NVIDIA backend is missing",
            file=sys.stderr,
        )
        return 2
    from tango_lm.ops.triton_common import column_alignment

    rows = []
    for op in ops:
        module, kernels, constexprs = OPS[op]
        mod = importlib.import_module(module)
        block_d = max(16, 1 << (args.head_dim - 1).bit_length())  # as the ops' wrappers pick it
        align = column_alignment(args.width, 4 if args.dtype == "fp32" else 2)  # as the wrappers pick it
        ieee = args.dtype == "fp32" and not args.tf32  # triton_common.precision
        consts = {"PRECISION": "ieee" if ieee else "tf32", "BLOCK_D": block_d, "ALIGN": align}
        consts |= constexprs
        if args.silu_on_load:
            consts |= {"GATES_READY": False, "OPERANDS_READY": False, "STORE_OPERANDS": False}
        for name, pointers in kernels.items():
            if args.kernels and name not in args.kernels.split(","):
                continue
            ints = launch_ints(op, args.head_dim, args.width)
            kernel = getattr(mod, name)
            rows += report_kernel(kernel, pointers, consts, args.dtype, args.arch, ints, args.first, args.mix)
    if args.json:
        print(json.dumps(rows))
        return 0
    dtype = f"{args.dtype} (TF32 products)" if args.tf32 else args.dtype
    print(format_rows(rows, dtype, args.arch, args.head_dim, args.mix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
