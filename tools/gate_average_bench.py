"""TANGO's token mixing alone on a GPU: the Triton kernels against the sliced SDPA and the math backend.

Usage: PYTHONPATH=src python tools/gate_average_bench.py [--batch 16 --heads 16 --seq-len 1024
       --width 1780 --head-dim 32 --dtype bf16 --rounds 10 --no-math --json FILE --device cuda]

For each implementation of `tango_mix(q, k, a, u)` (ops/tango_mix.py): `triton` (the gates, and
in the backward dy * u, written once: the default) and `triton-silu-on-load` (the SiLU, and the
scores backward's product by u, in the kernels' loops), `sdpa-sliced` with
slices of 128 and of 256 columns, and `math` (one SDPA call with the full width per head, which no
fused SDPA backend takes, so PyTorch runs its math backend), it times forward + backward (and the
forward alone), in rounds that alternate the implementations, and reports the median, TFLOP/s per
causal FLOP (3 x 2 (d_h + W) per visible (destination, source) pair and head, as
`models/flops.py` counts TANGO's mixing), that as a fraction of a bf16 matmul peak measured in the
same process, the time as a ratio to the sliced SDPA's (128), and the memory the step allocates
beyond its inputs. Each output is checked against the math backend's first. `--device cpu` runs
tiny sizes for a smoke test (the Triton row under TRITON_INTERPRET=1 only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import op_timing  # noqa: E402

from tango_lm.ops import gate_average as gate_average_module  # noqa: E402
from tango_lm.ops import tango_mix as tango_mix_module  # noqa: E402

DTYPES = op_timing.DTYPES


def implementations(include_math: bool) -> dict:
    def sliced(max_slice: int):
        def run(q, k, a, u):
            g = gate_average_module.split_heads(torch.nn.functional.silu(a), q.shape[1])
            avg = gate_average_module.gate_average_sliced(q, k, g, max_slice)
            return gate_average_module.merge_heads(avg) * u

        return run

    impls = {}
    if tango_mix_module.tango_mix_triton is not None:
        impls["triton"] = lambda q, k, a, u: tango_mix_module.tango_mix(q, k, a, u, kernels="triton")
        # The kernels' other SiLU placement (ops/tango_mix_triton.py): applied in their loops on load.
        on_load = tango_mix_module.tango_mix_triton.tango_mix_triton
        impls["triton-silu-on-load"] = lambda q, k, a, u: on_load(q, k, a, u, silu_on_load=True)
    impls["sdpa-sliced-128"] = sliced(128)
    impls["sdpa-sliced-256"] = sliced(256)
    if include_math:
        impls["math"] = tango_mix_module.tango_mix_reference
    return impls


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    b, h, t, w, d = args.batch, args.heads, args.seq_len, args.width, args.head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(b, h, t, d, device=device, dtype=dtype, generator=gen).requires_grad_(True) for _ in range(2))
    a, u = (torch.randn(b, t, h * w, device=device, dtype=dtype, generator=gen).requires_grad_(True) for _ in range(2))
    dy = torch.randn(b, t, h * w, device=device, dtype=dtype, generator=gen)
    xs = (q, k, a, u)
    impls = implementations(args.math)
    if "triton" in impls and not tango_mix_module.tango_mix_triton.supported(q, k, a, u):
        del impls["triton"], impls["triton-silu-on-load"]  # CPU tensors without the interpreter
    causal_flops = 3 * 2 * b * h * (d + w) * t * (t + 1) / 2

    reference = "math" if "math" in impls else next(iter(impls))
    timed = op_timing.time_implementations(impls, xs, dy, reference, args.rounds, device)
    # forward: q, k, a, u in, y out; backward: q, k, a, u, dy in, dq, dk, da, du out
    min_bytes = (6 * q.numel() + 8 * a.numel()) * a.element_size()
    peak, floor, ceiling_fields = op_timing.ceilings(device, causal_flops, min_bytes)
    rows = op_timing.report_rows(timed, causal_flops, peak, "sdpa-sliced-128", "time_vs_sliced", floor)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "batch": b,
        "heads": h,
        "seq_len": t,
        "width": w,
        "head_dim": d,
        "rounds": args.rounds,
        "reference": reference,
        **ceiling_fields,
        "rows": rows,
        "autotuned": op_timing.autotuned_if_run(impls, "tango_lm.ops.tango_mix_triton_kernels"),
    }


def format_report(report: dict) -> str:
    lines = [
        f"tango_mix alone: {report['device']}, torch {report['torch']}, {report['dtype']}, B={report['batch']}, "
        f"H={report['heads']}, T={report['seq_len']}, W={report['width']}, d_h={report['head_dim']}; forward + "
        f"backward, median of {report['rounds']} alternating rounds; TFLOP/s per causal FLOP; peak = measured "
        f"square matmul ({report['matmul_peak_tflop_per_s']:.0f} TFLOP/s); error: max normalized difference to "
        f"{report['reference']}",
        op_timing.floor_line(report),
        *op_timing.table_lines(report["rows"], "time_vs_sliced", "x sliced"),
        *op_timing.autotune_lines(report),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    op_timing.add_common_arguments(
        p, batch=16, dtype="bf16", rounds=10, device="cuda", device_help="torch device (default %(default)s)"
    )
    p.add_argument("--heads", type=op_timing.positive_int, default=16, help="heads (default %(default)s)")
    p.add_argument("--width", type=op_timing.positive_int, default=1780, help="gate columns per head (F/H)")
    p.add_argument(
        "--head-dim",
        type=op_timing.positive_int,
        default=32,
        help="query/key width d_h (default: the TANGO paper's %(default)s)",
    )
    p.add_argument("--no-math", dest="math", action="store_false", help="skip SDPA's math backend")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = op_timing.parse_with_cpu_sizes(p, argv, batch=1, heads=2, seq_len=64, width=20, head_dim=8, rounds=2)
    error = op_timing.cannot_run(args.device, tango_mix_module.tango_mix_triton is not None)
    if error:
        return op_timing.refuse(error)
    report = run(args)
    return op_timing.finish(report, format_report(report), args.json)


if __name__ == "__main__":
    sys.exit(main())
