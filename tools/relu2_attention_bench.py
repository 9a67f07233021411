"""GAU's and FLASH's squared-ReLU attention alone on a GPU: the Triton kernels against the composition.

Usage: PYTHONPATH=src python tools/relu2_attention_bench.py [--batch 16 --seq-len 1024 --qk-dim 128
       --width 1536 --group-size 0 --dtype bf16 --rounds 10 --compiled --json FILE --device cuda]

`--group-size 0` is GAU's attention, one causal triangle over the whole sequence; `--group-size g`
FLASH's quadratic part, T/g groups of g folded into the batch. For each implementation of
`relu2_attention(q, k, v, rel_bias, scale)` (ops/relu2_attention.py): `triton` (the kernels of
ops/relu2_attention_triton.py), `reference` (the composition: the [T, T] scores and the square
product, what CUDA ran before the kernels) and, with `--compiled`, the reference under
`torch.compile`, it times forward + backward (and the forward alone), in rounds that alternate the
implementations, and reports the median, TFLOP/s per causal FLOP (3 x 2 (s + e) per visible
(query, key) pair, as `models/flops.py` counts GAU's attention), that as a fraction of a bf16
matmul peak measured in the same process, the time as a ratio to the reference's, and the memory
the step allocates beyond its inputs. Each output and gradient is checked against the reference
first. `--device cpu` runs tiny sizes for a smoke test (the Triton row under TRITON_INTERPRET=1 only).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import op_timing  # noqa: E402

from tango_lm.ops import relu2_attention as relu2_module  # noqa: E402

DTYPES = op_timing.DTYPES


def implementations(compiled: bool) -> dict:
    impls = {"reference": relu2_module.relu2_attention_reference}
    if relu2_module.relu2_attention_triton is not None:
        impls = {"triton": lambda *xs: relu2_module.relu2_attention(*xs, kernels="triton"), **impls}
    if compiled:
        impls["reference-compiled"] = torch.compile(relu2_module.relu2_attention_reference, dynamic=False)
    return impls


def _with_scale(fn, scale: float, *xs: torch.Tensor) -> torch.Tensor:
    return fn(*xs, scale)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    b, t, s, e, g = args.batch, args.seq_len, args.qk_dim, args.width, args.group_size
    lead, n = ((b,), t) if g == 0 else ((b, -(-t // g)), g)  # FLASH: groups folded into the batch
    gen = torch.Generator(device=device).manual_seed(0)

    def draw(*shape, std=1.0, dt=dtype):
        return (torch.randn(*shape, device=device, generator=gen) * std).to(dt).requires_grad_(True)

    q, k = draw(*lead, n, s, std=s**-0.25), draw(*lead, n, s, std=s**-0.25)
    v = draw(*lead, n, e)
    bias = draw(2 * n - 1, std=0.1, dt=torch.float32)  # the parameter stays fp32 under autocast
    dy = torch.randn(*lead, n, e, device=device, generator=gen).to(dtype)
    xs, scale = (q, k, v, bias), 1.0 / n
    impls = implementations(args.compiled)
    if "triton" in impls and not relu2_module.relu2_attention_triton.supported(q, k, v, bias):
        del impls["triton"]  # CPU tensors without the interpreter
    causal_flops = 3 * 2 * (s + e) * q.shape[:-2].numel() * n * (n + 1) / 2

    bound = {name: functools.partial(_with_scale, fn, scale) for name, fn in impls.items()}
    timed = op_timing.time_implementations(bound, xs, dy, "reference", args.rounds, device)
    # forward: q, k, v in, the output out; backward: q, k, v, dO in, dq, dk, dv out (the bias is small)
    min_bytes = (6 * q.numel() + 5 * v.numel()) * v.element_size()
    peak, floor, ceiling_fields = op_timing.ceilings(device, causal_flops, min_bytes)
    rows = op_timing.report_rows(timed, causal_flops, peak, "reference", "time_vs_reference", floor)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "batch": b,
        "seq_len": t,
        "qk_dim": s,
        "width": e,
        "group_size": g,
        "rounds": args.rounds,
        **ceiling_fields,
        "rows": rows,
        "autotuned": op_timing.autotuned_if_run(impls, "tango_lm.ops.relu2_attention_triton_kernels"),
    }


def format_report(report: dict) -> str:
    shape = "GAU (one triangle)" if not report["group_size"] else f"FLASH quad (groups of {report['group_size']})"
    lines = [
        f"relu2_attention alone, {shape}: {report['device']}, torch {report['torch']}, {report['dtype']}, "
        f"B={report['batch']}, T={report['seq_len']}, s={report['qk_dim']}, e={report['width']}; forward + "
        f"backward, median of {report['rounds']} alternating rounds; TFLOP/s per causal FLOP; peak = measured "
        f"square matmul ({report['matmul_peak_tflop_per_s']:.0f} TFLOP/s); error: max normalized difference to "
        "the reference",
        op_timing.floor_line(report),
        *op_timing.table_lines(report["rows"], "time_vs_reference", "x ref"),
        *op_timing.autotune_lines(report),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    op_timing.add_common_arguments(
        p, batch=16, dtype="bf16", rounds=10, device="cuda", device_help="torch device (default %(default)s)"
    )
    p.add_argument("--qk-dim", type=op_timing.positive_int, default=128, help="s, the query/key width")
    p.add_argument("--width", type=op_timing.positive_int, default=1536, help="e, the value width")
    p.add_argument("--group-size", type=int, default=0, help="FLASH's group size g; 0: GAU's full attention")
    p.add_argument("--compiled", action="store_true", help="also time the reference under torch.compile")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = op_timing.parse_with_cpu_sizes(p, argv, batch=1, seq_len=64, qk_dim=16, width=24, rounds=2)
    if args.group_size < 0:
        return op_timing.refuse(f"error: --group-size must be >= 0 (got {args.group_size})")
    error = op_timing.cannot_run(args.device, relu2_module.relu2_attention_triton is not None)
    if error:
        return op_timing.refuse(error)
    report = run(args)
    return op_timing.finish(report, format_report(report), args.json)


if __name__ == "__main__":
    sys.exit(main())
