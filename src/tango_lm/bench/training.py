"""Training throughput of architectures at matched total parameters, side by side in one process.

Every model takes full training steps (forward, backward, AdamW) on the same random token batch;
steps alternate between the models (model 1, model 2, ..., model 1, ...) so all of them see the
same machine state, and each model's time is the median of its timed steps. Achieved FLOP/s uses
the analytic FLOPs per token (`cfg.flops_per_token(T)`, `tango_lm.models.flops`) and MFU divides
it by a matmul peak measured in the same run (`bench/peak.py`, before and after the steps; the
larger counts). Peak memory per model: on CUDA, `torch.cuda.max_memory_allocated()` reset before
each of the model's timed steps, minus what the other models and the batch hold (not the warm-up's:
Triton's autotuner and inductor allocate buffers of their own there); on CPU, the peak
resident-set growth of the same training steps in a fresh subprocess per model (`bench/memory.py`).
Every number is also given as a ratio to the Loop Transformer++ measured in the same process.
Stopped early (SIGTERM, Ctrl-C: `bench/stopping.py`), it reports each model from the timed steps
it finished.

Widths are matched with `tango_lm.models.matching.match_width` against the TANGO model's total;
an architecture that cannot be matched runs at width 4·d_model and its row says why.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from tango_lm.bench.checks import require_head_multiple, require_positive, require_tango_width_split
from tango_lm.bench.memory import MMAP_THRESHOLD, measure_in_subprocess
from tango_lm.bench.peak import _sync, measure_matmul_peak
from tango_lm.bench.progress import Progress
from tango_lm.bench.stopping import StopRecord, stopped_line
from tango_lm.errors import UserError, did_you_mean
from tango_lm.models.config import ModelConfig
from tango_lm.models.matching import match_width
from tango_lm.models.model import build_model
from tango_lm.ops import cpu_kernels
from tango_lm.stop_signals import STOPS
from tango_lm.train.compiled_forward import COMPILER_ERRORS, one_line
from tango_lm.train.cpu_allocator import keep_freed_memory
from tango_lm.train.device import autocast, autocast_dtype, pick_device
from tango_lm.train.optim import adamw

BASELINE = "loop-transformer"
PAIR = ("loop-transformer", "tango")  # `tango-lm bench` without --suite: the original comparison


def default_archs() -> list[str]:
    """The training and decode suites' architectures: those registered with `in_bench_suite`."""
    from tango_lm.models.registry import ARCHITECTURES

    return [name for name, arch in ARCHITECTURES.items() if arch.in_bench_suite]


def matched_configs(
    archs: tuple[str, ...] | list[str], d_model: int, depth: int, tango_width: int, vocab_size: int, seq_len: int
) -> list[tuple[str, ModelConfig | None, str]]:
    """(arch, config, note) per architecture: TANGO at `tango_width`, every other architecture at the
    width whose total parameter count is nearest TANGO's; the Loop Transformer++ baseline is added
    when missing. The note says how the width was chosen: an architecture that cannot be matched
    runs at width 4·d_model, and one that cannot be built at these sizes has config None."""
    from tango_lm.models.registry import ARCHITECTURES

    archs = list(dict.fromkeys(archs))
    unknown = [a for a in archs if a not in ARCHITECTURES]
    if unknown:
        raise UserError(
            f"unknown architecture {unknown[0]!r}{did_you_mean(unknown[0], ARCHITECTURES)}; "
            f"choose from: {', '.join(ARCHITECTURES)}"
        )
    if BASELINE not in archs:
        archs.append(BASELINE)
    tango = ModelConfig(
        arch="tango", d_model=d_model, depth=depth, width=tango_width, vocab_size=vocab_size, context_length=seq_len
    )
    target = tango.num_params()["total"]
    out: list[tuple[str, ModelConfig | None, str]] = []
    for arch in archs:
        if arch == "tango":
            out.append((arch, tango, f"reference, F={tango_width}"))
            continue
        try:
            cfg = match_width(tango.replace(arch=arch), target)
            gap = cfg.num_params()["total"] - target
            out.append((arch, cfg, f"matched ({gap / target:+.2%})"))
        except UserError as exc:
            try:
                out.append((arch, tango.replace(arch=arch, width=4 * d_model), f"NOT matched, width 4d: {exc}"))
            except UserError as exc2:
                out.append((arch, None, f"skipped: {exc2}"))
    base = out[archs.index(BASELINE)]
    if base[1] is None:
        raise UserError(f"the baseline {BASELINE} cannot be built at these sizes: {base[2]}")
    return out


def _own_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    )


class _Runner:
    """One (model, mode) of the side-by-side steps, with what its steps measured: the timed steps'
    wall and CPU seconds, CUDA's peak beyond the other models, or why it could not compile."""

    def __init__(
        self, cfg: ModelConfig, note: str, mode: str, model: torch.nn.Module, opt: Any, compiled_models: int = 1
    ) -> None:
        self.cfg, self.note, self.mode, self.model, self.opt = cfg, note, mode, model, opt
        self.step_fn = torch.compile(model.nll) if mode == "compiled" else model.nll
        # Every model's `nll` is one code object to Dynamo, each model (architecture) an entry of its
        # cache: past the recompile limit (8) a model would run eagerly in the compiled rows.
        self.recompile_limit = max(torch._dynamo.config.recompile_limit, compiled_models + 1)
        self.label = f"{cfg.arch} {mode}"
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.cuda_peak = 0
        self.compile_error: str | None = None  # its rows are left out

    def step(self, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None, timed: bool) -> float:
        """One training step; its wall seconds (kept when `timed`)."""
        dev = x.device
        _sync(dev)
        if dev.type == "cuda":
            others = torch.cuda.memory_allocated(dev) - _own_bytes(self.model, self.opt)
            torch.cuda.reset_peak_memory_stats(dev)
        t0, c0 = time.perf_counter(), time.process_time()
        try:  # the backward too: AOTAutograd compiles its graph at the first backward call
            with autocast(dev, dtype), torch._dynamo.config.patch(recompile_limit=self.recompile_limit):
                loss = self.step_fn(x, y)
            loss.backward()
        except COMPILER_ERRORS as exc:
            if self.mode != "compiled":
                raise
            self.compile_error = one_line(exc)
            return time.perf_counter() - t0
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        _sync(dev)
        seconds = time.perf_counter() - t0
        if timed:
            self.times.append(seconds)
            self.cpu_times.append(time.process_time() - c0)
        if dev.type == "cuda" and timed:  # not the warm-up's: autotuning and compiling allocate too
            self.cuda_peak = max(self.cuda_peak, torch.cuda.max_memory_allocated(dev) - others)
        return seconds

    def release(self) -> None:
        """Drop the model, its optimizer and compiled step (their memory), keep the measurements."""
        self.model = self.opt = self.step_fn = None


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run_training_bench(
    d_model: int = 256,
    seq_len: int = 256,
    depth: int = 4,
    batch_size: int = 4,
    steps: int = 6,
    warmup: int = 2,
    tango_width: int = 8192,
    vocab_size: int = 257,
    device: str = "auto",
    print_table: bool = True,
    configs: list[ModelConfig] | None = None,
    archs: tuple[str, ...] | list[str] | None = None,
    memory: bool = True,
    memory_steps: int = 2,
    threads: int | None = None,
    peak_size: int | None = None,
    compile: bool = False,
    progress: str = "none",
) -> dict[str, Any]:
    """Train every model side by side (see the module doc). `archs` None and `configs` None: the
    original pair, Loop Transformer++ and TANGO. `memory` False skips the memory measurement;
    `peak_size` is the side of the peak's square matmuls (default: bench/peak.py's). `compile`:
    every model also trains through `torch.compile(model.nll)` (as `train.compile=true` does), its
    steps alternating with the eager ones; compiled rows are compared with the compiled baseline
    and with their own eager row (the warm-up steps, which compile, are not timed). `progress`:
    "bar", "lines" or "none" (`bench/progress.py`). SIGTERM (inside `bench.stopping.stop_on_sigterm`)
    or Ctrl-C during the steps ends them: the report then has "stopped" and a row per model from the
    timed steps it finished (no memory subprocess, no second peak)."""
    dev = pick_device(device)
    if threads:
        torch.set_num_threads(threads)
    allocator = "glibc, freed memory kept" if dev.type == "cpu" and keep_freed_memory() else "default"
    dtype = autocast_dtype("auto", dev)
    if configs is not None:  # the caller's own models, as given (no matching)
        triples = [(c.arch, c, "given") for c in configs]
    else:
        triples = matched_configs(archs or PAIR, d_model, depth, tango_width, vocab_size, seq_len)
    skipped = [{"arch": a, "note": note} for a, c, note in triples if c is None]
    pairs = [(c, note) for _, c, note in triples if c is not None]
    configs = [c for c, _ in pairs]
    modes = ("eager", "compiled") if compile else ("eager",)
    if compile and warmup < 1:
        raise UserError("--compile needs at least one --warmup step (the first compiled step compiles)")
    load_start = _load()
    peak_before = measure_matmul_peak(dev, dtype or torch.float32, peak_size)
    torch.manual_seed(0)
    runners = []
    for cfg, note in pairs:
        model = build_model(cfg).to(dev)
        opt = adamw(model.parameters(), model, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        # the modes share weights and optimizer
        runners += [_Runner(cfg, note, mode, model, opt, compiled_models=len(pairs)) for mode in modes]
    inputs = torch.randint(0, min(c.vocab_size for c in configs), (batch_size, seq_len + 1), device=dev)
    x, y = inputs[:, :-1], inputs[:, 1:]
    stops = StopRecord(steps)
    i = 0
    try:
        with Progress("train", warmup + steps, len(runners), warmup, progress) as progress_bar:
            for i in range(warmup + steps):
                for run in runners:
                    if run.compile_error is None:
                        progress_bar.run_start(run.label)
                        progress_bar.run_done(i, run.label, run.step(x, y, dtype, timed=i >= warmup))
                progress_bar.round_done(i)
    except STOPS as stop:  # a time limit or Ctrl-C: report the steps finished so far
        stops.stop(stop, i - warmup)
    unless_stopped = stops.unless_stopped  # what comes after the steps: skipped after a stop
    peak_after = unless_stopped(lambda: measure_matmul_peak(dev, dtype or torch.float32, peak_size))
    load_end = _load()
    peak = max(peak_before, peak_after or 0.0)
    for run in runners:  # free the models before the memory subprocesses
        run.release()
    if dev.type == "cuda":
        mem_method = "cuda max_memory_allocated per model step, minus the other models"
    elif memory:
        threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)
        mem_method = (
            f"peak RSS growth (VmHWM, MALLOC_MMAP_THRESHOLD_={threshold}) over {memory_steps} training "
            "steps, one fresh subprocess per model"
        )
    else:
        mem_method = "not measured"
    rows, not_measured, memory_failures = [], [], []
    for run in runners:
        cfg = run.cfg
        if run.compile_error is not None:
            continue
        if not run.times:  # stopped before this runner's first timed step
            not_measured.append({"arch": cfg.arch, "mode": run.mode})
            continue
        step_s = statistics.median(run.times)
        tok_s = batch_size * seq_len / step_s
        fpt = cfg.flops_per_token(seq_len)
        if dev.type == "cuda":
            mem = run.cuda_peak
        elif memory and run.mode == "eager":  # a subprocess measures an eager step
            try:
                measured = unless_stopped(
                    lambda cfg=cfg: measure_in_subprocess(cfg, batch_size, seq_len, str(dev), memory_steps, threads)
                )
            except MemoryError as exc:  # past the machine's memory: the row keeps its timings
                measured = None
                memory_failures.append(str(exc))
            mem = measured and measured["peak_bytes"]
        else:
            mem = None
        rows.append(
            {
                "arch": cfg.arch,
                "mode": run.mode,
                "width": cfg.width,
                "params_total": cfg.num_params()["total"],
                "note": run.note,
                "tokens_per_s": tok_s,
                "flops_per_token": fpt,
                "flop_per_s": tok_s * fpt,
                "mfu": tok_s * fpt / peak,
                "step_s": step_s,
                "step_s_all": run.times,
                "timed_steps": len(run.times),
                "cpu_s": statistics.median(run.cpu_times),
                "peak_bytes": mem,
            }
        )
    baseline = BASELINE if any(r["arch"] == BASELINE for r in rows) else (rows[0]["arch"] if rows else None)
    for r in rows:
        eager = next((e for e in rows if e["arch"] == r["arch"] and e["mode"] == "eager"), None)
        r["tokens_per_s_vs_eager"] = r["tokens_per_s"] / eager["tokens_per_s"] if eager else None
        # The baseline in the same mode only: where its compile failed (or a stop left it unmeasured)
        # that mode has no ratios, rather than ratios to another model under the baseline's name.
        base = next((b for b in rows if b["mode"] == r["mode"] and b["arch"] == baseline), None)
        r["tokens_per_s_vs_loop"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["flop_per_s_vs_loop"] = r["flop_per_s"] / base["flop_per_s"] if base else None
        r["mfu_vs_loop"] = r["mfu"] / base["mfu"] if base else None
        r["tokens_per_cpu_s_vs_loop"] = base["cpu_s"] / r["cpu_s"] if base and r["cpu_s"] > 0 else None
        r["memory_vs_loop"] = (
            r["peak_bytes"] / base["peak_bytes"]
            if base and r["peak_bytes"] is not None and base["peak_bytes"]
            else None
        )
    report = {
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "d_model": configs[0].d_model,
        "seq_len": seq_len,
        "depth": configs[0].depth,
        "batch_size": batch_size,
        "timed_steps": steps,
        "warmup_steps": warmup,
        "vocab_size": configs[0].vocab_size,
        "tango_width": tango_width,
        "precision": "bf16 autocast" if dtype is not None else "fp32",
        "matmul_peak_flop_per_s": peak,
        "matmul_peak_before": peak_before,
        "matmul_peak_after": peak_after,
        "matmul_peak_size": peak_size or (8192 if dev.type == "cuda" else 2048),
        "memory_method": mem_method,
        "allocator": allocator,
        "cpu_products": cpu_kernels.describe() if dev.type == "cpu" else None,
        "load_avg_start": load_start,
        "load_avg_end": load_end,
        "baseline": baseline,
        "modes": list(modes),
        "models": rows,
        "skipped": skipped,
        "compile_failed": [{"arch": run.cfg.arch, "error": run.compile_error} for run in runners if run.compile_error],
        "stopped": stops.record,  # None, or the signal that ended the steps early and how many rounds were timed
        "not_measured": not_measured,  # runners the stop left without a timed step
        "memory_failed": memory_failures,  # why a row's peak memory is missing (its child ran out of memory)
    }
    if print_table:
        print(format_report(report))
    return report


def _load_text(report: dict[str, Any]) -> str:
    if report.get("load_avg_start") is None:
        return ""
    return f", 1-min load avg {report['load_avg_start']:.1f} -> {report['load_avg_end']:.1f}"


def _giga(flop_per_s: float | None) -> str:
    return "not measured" if flop_per_s is None else f"{flop_per_s / 1e9:.1f}"


def _ratio(value: float | None, width: int) -> str:
    """A ratio column: '-' where the row has no baseline (or no eager row) to divide by."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.2f}"


def format_report(report: dict[str, Any]) -> str:
    mib = 2**20
    compiled = len(report.get("modes", ["eager"])) > 1
    mode_head = f"{'mode':<9}" if compiled else ""
    vs_eager_head = f"{'vs eager':>9}" if compiled else ""
    lines = [
        f"train: device {report['device']} ({report['threads']} threads{_load_text(report)}), "
        f"d={report['d_model']}, T={report['seq_len']}, depth {report['depth']}, batch {report['batch_size']}, "
        f"V={report['vocab_size']}, {report['precision']}, AdamW, CPU allocator: {report.get('allocator', 'default')}"
        + (f", causal products: {report['cpu_products']}" if report.get("cpu_products") else "")
        + "; "
        f"models alternate step by step in one process; "
        f"tok/s = median of {report['timed_steps']} timed steps after {report['warmup_steps']} warm-up",
        f"FLOPs: analytic cfg.flops_per_token(T) (3x forward); MFU against the measured matmul peak "
        f"{report['matmul_peak_flop_per_s'] / 1e9:.1f} GFLOP/s (best of 5 square matmuls, n={report['matmul_peak_size']}; "
        f"before "
        f"{report['matmul_peak_before'] / 1e9:.1f} / after {_giga(report['matmul_peak_after'])}); "
        f"tok/cpu-s x: by median process CPU time per step (steadier on a shared machine); "
        f"memory: {report['memory_method']}; ratios (x) to {report['baseline']}"
        + (
            " in the same mode; compiled: torch.compile(model.nll), vs eager = tok/s over the same model's eager tok/s"
            if compiled
            else ""
        ),
        # wide enough for a GPU's numbers (1,600,000 tok/s, 200000.0 GFLOP/s) to keep their columns apart
        f"{'arch':<19}{mode_head}{'width':>6}{'params':>12}{'tok/s':>11}{'MFLOP/tok':>10}{'GFLOP/s':>10}{'MFU':>8}"
        f"{'peak MiB':>9}{'tok/s x':>8}{'tok/cpu-s x':>12}{'MFU x':>7}{'mem x':>7}{vs_eager_head}  note",
    ]
    for r in report["models"]:
        mem = f"{r['peak_bytes'] / mib:>9.0f}" if r["peak_bytes"] is not None else f"{'-':>9}"
        mode = f"{r.get('mode', 'eager'):<9}" if compiled else ""
        vs_eager = _ratio(r["tokens_per_s_vs_eager"], 9) if compiled else ""
        lines.append(
            f"{r['arch']:<19}{mode}{r['width']:>6}{r['params_total']:>12,}{r['tokens_per_s']:>11,.0f}"
            f"{r['flops_per_token'] / 1e6:>10.1f}{r['flop_per_s'] / 1e9:>10.1f}{r['mfu']:>8.1%}{mem}"
            f"{_ratio(r['tokens_per_s_vs_loop'], 8)}{_ratio(r['tokens_per_cpu_s_vs_loop'], 12)}"
            f"{_ratio(r['mfu_vs_loop'], 7)}{_ratio(r['memory_vs_loop'], 7)}{vs_eager}  {r['note']}"
        )
    for r in report.get("skipped", []):
        lines.append(f"{r['arch']:<19}{'-':>6}  {r['note']}")
    for r in report.get("compile_failed", []):
        lines.append(f"{r['arch']:<19}{'compiled':<9}  no row: torch.compile failed ({r['error']})")
    for r in report.get("not_measured", []):
        lines.append(f"{r['arch']:<19}{r['mode']:<9}  no row: stopped before its first timed step")
    for failure in report.get("memory_failed", []):
        lines.append(f"peak memory not measured: {failure}")
    if report.get("stopped"):
        meaning = "each row is the median of the timed steps that model finished (its timed_steps in --json)"
        lines.append(stopped_line(report["stopped"], "timed rounds", meaning))
    return "\n".join(lines)


def add_suite_arguments(g: Any) -> None:
    """The train suite's own options (an argparse group); `tango-lm bench` without --suite reads them too."""
    g.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default %(default)s)")
    g.add_argument("--batch-size", type=int, default=4, help="sequences per step (default %(default)s)")
    g.add_argument("--steps", type=int, default=6, help="timed training steps per model (default %(default)s)")
    g.add_argument("--warmup", type=int, default=2, help="untimed training steps per model (default %(default)s)")
    g.add_argument("--no-memory", action="store_true", help="skip the per-model memory measurement")
    g.add_argument(
        "--peak-size",
        type=int,
        default=None,
        help="side of the square matmuls of the measured peak (default 2048 on CPU, 8192 on CUDA)",
    )


def check_suite_args(args: argparse.Namespace) -> None:
    """The train suite's options of `tango-lm bench` (`bench/registry.py`): it builds every model at --d-model."""
    require_positive(args, ["seq_len", "batch_size", "steps"] + (["peak_size"] if args.peak_size is not None else []))
    if args.warmup < 0:
        raise UserError(f"--warmup must be 0 or more (got {args.warmup})")
    require_head_multiple(args)
    require_tango_width_split(args)


def run_suite(
    args: argparse.Namespace,
    print_table: bool,
    progress: str = "none",
    archs: tuple[str, ...] | list[str] | None = None,
) -> dict[str, Any]:
    """The train suite of `tango-lm bench` at its options: `archs` (default --archs, else every
    architecture in the bench suite) trained side by side."""
    return run_training_bench(
        d_model=args.d_model,
        seq_len=args.seq_len,
        depth=args.depth,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup=args.warmup,
        tango_width=args.tango_width,
        vocab_size=args.vocab_size,
        device=args.device,
        archs=archs or args.archs or default_archs(),
        memory=not args.no_memory,
        memory_steps=args.memory_steps,
        threads=args.threads,
        peak_size=args.peak_size,
        print_table=print_table,
        compile=args.compile,
        progress=progress,
    )
