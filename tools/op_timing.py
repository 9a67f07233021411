"""What the single-op benches share (tools/gate_average_bench.py, tools/relu2_attention_bench.py,
tools/delta_rule_bench.py): each implementation checked against a reference, then forward +
backward (and the forward alone) timed in rounds that alternate the implementations, with the
memory a step allocates beyond its inputs on CUDA, and a bf16 matmul peak measured in the same process."""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tango_lm.bench.peak import measure_matmul_peak

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_relative_error(got, want) -> float:
    return max(
        float((x.detach().float() - y.detach().float()).abs().max() / y.detach().float().abs().max().clamp_min(1e-6))
        for x, y in zip(got, want, strict=True)
    )


def time_implementations(
    impls: dict[str, Callable[..., torch.Tensor]],
    xs: tuple[torch.Tensor, ...],
    dy: torch.Tensor,
    reference: str,
    rounds: int,
    device: torch.device,
) -> dict[str, dict[str, float | None]]:
    """Per implementation (each called as fn(*xs)): `error` (the largest normalized difference of the
    output and every gradient to `reference`'s), medians `fwd_bwd_s` and `fwd_s`, and `memory_bytes`
    (CUDA only, else None). The first call of each (it compiles and autotunes) is not timed."""

    def step(fn):
        y = fn(*xs)
        return (y, *torch.autograd.grad(y, xs, dy))

    want = step(impls[reference])
    errors = {}
    for name, fn in impls.items():  # warm-up (compiles and autotunes the kernels) and a check
        errors[name] = _max_relative_error(step(fn), want)
    del want
    times: dict[str, list[float]] = {name: [] for name in impls}
    forward_times: dict[str, list[float]] = {name: [] for name in impls}
    memory: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in impls.items():
            sync(device)
            if device.type == "cuda":
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                fn(*xs)
            sync(device)
            t1 = time.perf_counter()
            out = step(fn)
            sync(device)
            times[name].append(time.perf_counter() - t1)
            forward_times[name].append(t1 - t0)
            if device.type == "cuda":
                memory[name] = torch.cuda.max_memory_allocated(device) - base
            del out
    return {
        name: {
            "error": errors[name],
            "fwd_bwd_s": statistics.median(times[name]),
            "fwd_s": statistics.median(forward_times[name]),
            "memory_bytes": memory.get(name),
        }
        for name in impls
    }


def matmul_peak(device: torch.device) -> float:
    """FLOP/s of square matmuls: bf16 at n = 8192 on CUDA, fp32 at 512 for a CPU smoke test."""
    cuda = device.type == "cuda"
    return measure_matmul_peak(device, torch.bfloat16 if cuda else torch.float32, 8192 if cuda else 512)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy, bytes read plus bytes written (best of 5): the
    memory ceiling, measured as METHOD.md of the device notes asks (1 GiB on CUDA, 16 MiB on a CPU)."""
    n = 2**30 if device.type == "cuda" else 2**24
    x = torch.empty(n // 4, device=device).uniform_()
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best


def floor_s(causal_flops: float, peak: float, min_bytes: float, bandwidth: float) -> float:
    """The fastest an implementation could run: the larger of its FLOPs at the matmul peak and the
    fewest bytes it must move (each input read once, each output written once) at copy bandwidth."""
    return max(causal_flops / peak, min_bytes / bandwidth)


def ceilings(device: torch.device, causal_flops: float, min_bytes: float) -> tuple[float, float, dict]:
    """The two ceilings measured here (`matmul_peak`, `copy_bandwidth`) and the floor they give an
    op of `causal_flops` that must move `min_bytes`: (peak FLOP/s, floor in seconds, the report's
    fields for them, which `floor_line` prints)."""
    peak, bandwidth = matmul_peak(device), copy_bandwidth(device)
    floor = floor_s(causal_flops, peak, min_bytes, bandwidth)
    fields = {
        "matmul_peak_tflop_per_s": peak / 1e12,
        "copy_gb_per_s": bandwidth / 1e9,
        "causal_flops": causal_flops,
        "min_bytes": min_bytes,
        "floor_ms": floor * 1e3,
    }
    return peak, floor, fields


def report_rows(
    timed: dict, causal_flops: float, peak: float, baseline: str, ratio_key: str, floor: float | None = None
) -> list[dict]:
    """One row per implementation: times in ms, TFLOP/s per causal FLOP, that as a share of `peak`,
    the time as a ratio to `baseline`'s (under `ratio_key`) and to `floor` (seconds; `floor_s`),
    memory in MiB, the error."""
    base_s = timed[baseline]["fwd_bwd_s"]
    return [
        {
            "impl": name,
            "fwd_bwd_ms": r["fwd_bwd_s"] * 1e3,
            "time_vs_floor": r["fwd_bwd_s"] / floor if floor else None,
            "fwd_ms": r["fwd_s"] * 1e3,
            "tflop_per_s": causal_flops / r["fwd_bwd_s"] / 1e12,
            "of_peak": causal_flops / r["fwd_bwd_s"] / peak,
            ratio_key: r["fwd_bwd_s"] / base_s,
            "memory_mib": (r["memory_bytes"] or 0) / 2**20 or None,
            "max_error_vs_reference": r["error"],
        }
        for name, r in timed.items()
    ]


def table_lines(rows: list[dict], ratio_key: str, ratio_title: str) -> list[str]:
    """`report_rows`' rows as a header and one line each (`ratio_key` under the title `ratio_title`)."""
    name_w = max(17, *(len(r["impl"]) + 2 for r in rows))
    ratio_w = max(7, len(ratio_title) + 1)
    lines = [
        f"{'impl':<{name_w}}{'fwd+bwd ms':>11}{'fwd ms':>8}{'TFLOP/s':>9}{'of peak':>9}{ratio_title:>{ratio_w}}"
        f"{'x floor':>9}{'MiB':>8}{'error':>9}"
    ]
    for r in rows:
        mem = f"{r['memory_mib']:>8.0f}" if r["memory_mib"] else f"{'-':>8}"
        floor = f"{r['time_vs_floor']:>9.1f}" if r.get("time_vs_floor") else f"{'-':>9}"
        lines.append(
            f"{r['impl']:<{name_w}}{r['fwd_bwd_ms']:>11.2f}{r['fwd_ms']:>8.2f}{r['tflop_per_s']:>9.1f}"
            f"{r['of_peak']:>9.1%}{r[ratio_key]:>{ratio_w}.2f}{floor}{mem}{r['max_error_vs_reference']:>9.1e}"
        )
    return lines


def floor_line(report: dict) -> str:
    """The header line of the two ceilings and the floor they give (`floor_s`)."""
    return (
        f"floor {report['floor_ms']:.2f} ms = max({report['causal_flops'] / 1e12:.2f} TFLOP at the matmul peak, "
        f"{report['min_bytes'] / 1e9:.2f} GB (inputs read once, outputs written once) at "
        f"{report['copy_gb_per_s']:.0f} GB/s, a measured device-to-device copy); x floor = time / floor"
    )


def autotuned(kernels_module: object) -> list[dict]:
    """What Triton's autotuner chose for each kernel of `kernels_module` (every autotuned kernel in
    it, in definition order) at the last shape it tuned there (the benches run one): the chosen
    configuration, and each configuration it timed with its median ms (Triton's own do_bench
    timing, fastest first). A kernel with one configuration (the interpreter's) is not tuned: its
    row has no timings, nor has any under TANGO_LM_TRITON_AUTOTUNE=0 (triton 3.6 records zeros for
    the one configuration left there). Shows which kernel takes the step's time and which
    configurations win."""
    from triton.runtime.autotuner import Autotuner

    from tango_lm.ops.triton_common import autotuning

    rows = []
    for name, kernel in vars(kernels_module).items():
        if not isinstance(kernel, Autotuner):
            continue
        timings = (getattr(kernel, "configs_timings", None) or {}) if autotuning() else {}
        ms = {_config_text(c): t[0] if isinstance(t, (list, tuple)) else t for c, t in timings.items()}
        chosen = list(kernel.cache.values())[-1] if kernel.cache else None
        rows.append(
            {
                "kernel": name,
                "chosen": _config_text(chosen) if chosen else None,
                "chosen_ms": ms.get(_config_text(chosen)) if chosen else None,
                "timings_ms": dict(sorted(ms.items(), key=lambda item: item[1])),
            }
        )
    return rows


def autotuned_if_run(impls: dict, kernels_module: str) -> list[dict]:
    """`autotuned` for the kernels module named (e.g. 'tango_lm.ops.tango_mix_triton_kernels') when
    the bench's "triton" implementation ran; none otherwise."""
    return autotuned(importlib.import_module(kernels_module)) if "triton" in impls else []


def _config_text(config: object) -> str:
    """'BLOCK_M=64, BLOCK_N=64, warps 4, stages 2' for a triton.Config."""
    blocks = ", ".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"{blocks}, warps {config.num_warps}, stages {config.num_stages}"


def autotune_lines(report: dict) -> list[str]:
    """The report's `autotuned` rows as text (none where Triton did not run): each kernel's chosen
    configuration and its time, then the sum of the chosen times beside the triton row's measured
    forward + backward (the rest is launches and the ops around the kernels)."""
    rows = report.get("autotuned") or []
    if not rows:
        return []
    step_ms = next((r["fwd_bwd_ms"] for r in report["rows"] if r["impl"] == "triton"), None)
    lines = ["autotuned (Triton's do_bench median per configuration; chosen, then every one tried):"]
    for r in rows:
        if not r["timings_ms"]:
            lines.append(f"  {r['kernel']}: not tuned (one configuration)")
            continue
        tried = ", ".join(f"{t:.3f}" for t in r["timings_ms"].values())
        chosen = f"{r['chosen_ms']:.3f} ms" if r["chosen_ms"] is not None else "not timed at this shape"
        lines.append(f"  {r['kernel']}: {chosen} with {r['chosen']} (tried {tried} ms)")
    total = sum(r["chosen_ms"] for r in rows if r["chosen_ms"] is not None)
    if total and step_ms:
        lines.append(f"  the chosen kernels add up to {total:.3f} ms of the {step_ms:.3f} ms forward + backward")
    return lines


def cannot_run(device: str, triton_installed: bool) -> str | None:
    """The one-line error for a CUDA bench without a GPU or without triton; None when it can run."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "error: no CUDA device: run this on a GPU machine, or pass --device cpu for a smoke test"
    if not triton_installed:
        return "error: triton is not installed: pip install 'tango-lm[triton]'"
    return None


def finish(report: dict, text: str, json_path: Path | None) -> int:
    """Prints the table, writes the report as JSON where asked; the exit code."""
    print(text)
    if json_path:
        json_path.write_text(json.dumps(report, indent=2))
    return 0


def positive_int(text: str) -> int:
    """argparse type of a size or count: an int >= 1 (0 rounds or a 0-long axis has no timing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def add_common_arguments(
    parser: argparse.ArgumentParser, *, batch: int, dtype: str, rounds: int, device: str, device_help: str
) -> None:
    """The arguments every single-op bench takes, with that bench's defaults: the batch and sequence
    length, the input dtype, the timed rounds and the device."""
    parser.add_argument("--batch", type=positive_int, default=batch, help="sequences (default %(default)s)")
    parser.add_argument("--seq-len", type=positive_int, default=1024, help="tokens per sequence (default %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=dtype, help="input dtype (default %(default)s)")
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=rounds,
        help="timed rounds, alternating the implementations (default %(default)s)",
    )
    parser.add_argument("--device", default=device, help=device_help)


def parse_with_cpu_sizes(parser: argparse.ArgumentParser, argv: list[str] | None, **sizes) -> argparse.Namespace:
    """The arguments, where `--device cpu` (a smoke test) makes each size in `sizes` (dest=value)
    default to that small value instead of the GPU's (whose sizes took ~23 GB of host memory and
    were killed); a size given in any spelling argparse takes (--seq-len 64, --seq-len=64, --seq 64)
    stays."""
    if str(parser.parse_known_args(argv)[0].device).startswith("cpu"):
        parser.set_defaults(**sizes)
    return parser.parse_args(argv)


def refuse(message: str) -> int:
    print(message, file=sys.stderr)
    return 2
