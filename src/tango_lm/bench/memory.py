"""Peak memory of whole training steps (forward, backward, AdamW), one model per fresh process.

`measure_training_step` builds one model, takes `steps` training steps on a random batch and
reports the peak memory the model needed on top of what the process held before it was built:

- on CUDA: `torch.cuda.max_memory_allocated()` (reset just before the model is built) minus the
  memory allocated at that point (the batch), so weights, gradients, AdamW's moments,
  activations and temporaries all count, and nothing else;
- on CPU: torch's CPU allocations are invisible to `tracemalloc`, so, as in `bench/heads.py`, the
  measure is the peak resident set (VmHWM, `train.utilization.peak_rss_bytes`) after the steps minus
  the resident set just before the model was built. It counts pages actually touched and
  allocator slack: an upper bound on the peak of live tensors, not an exact count. A small
  warm-up step runs first so that one-time runtime set-up (thread pools, the autograd engine) is
  not charged to the model, and then the peak is reset (`/proc/self/clear_refs`) where Linux
  allows it; `baseline_slack_bytes` says how far an earlier peak still sat above the baseline
  (growth below it would be hidden; 0 after a reset).

Two steps are the default: AdamW allocates its moments during the first `step()`, after the
activations are freed, so only the second step holds weights, moments, gradients and activations
at once (the steady state of training).

`measure_in_subprocess` runs it in a fresh interpreter (`python -m tango_lm.bench.memory --child`)
so that no model's freed memory, allocator caches or peak resident set flatter another's. On CPU
the child runs with glibc's `MALLOC_MMAP_THRESHOLD_=131072` (unless the environment sets it):
every block of 128 KiB or more is then its own mapping, returned to the system when freed, so the
resident set follows the live tensors instead of the heap's fragmentation (at the default, dynamic
threshold, the allocator slack in a 142M-parameter step varied by hundreds of MiB between runs
and models). It slows the child's steps (page faults), not the measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from tango_lm.bench.checks import require_head_multiple, require_positive
from tango_lm.bench.child import run_child
from tango_lm.bench.peak import _sync
from tango_lm.bench.progress import Progress
from tango_lm.bench.stopping import StopRecord, stopped_line
from tango_lm.errors import did_you_mean
from tango_lm.models.config import ModelConfig
from tango_lm.models.model import build_model
from tango_lm.stop_signals import STOPS
from tango_lm.train.device import autocast, autocast_dtype, pick_device
from tango_lm.train.optim import adamw
from tango_lm.train.utilization import peak_rss_bytes, reset_peak_memory

HEADS_COMPARED = ("standard", "onona")
MMAP_THRESHOLD = 131072  # bytes: glibc serves blocks this large by mmap in the CPU children


def _current_rss_bytes() -> int:
    """The resident set now (Linux /proc); the peak so far where /proc is unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def _warm_runtime(dev: torch.device) -> None:
    """One small training step (large enough to start the thread pool), so lazy runtime set-up is
    paid before the baseline is taken."""
    lin = torch.nn.Linear(256, 256).to(dev)
    opt = adamw(lin.parameters(), lin, lr=1e-3)
    x = torch.randn(256, 256, device=dev)
    F.cross_entropy(
        F.scaled_dot_product_attention(x[None], x[None], lin(x)[None], is_causal=True)[0],
        torch.zeros(256, dtype=torch.long, device=dev),
    ).backward()
    opt.step()
    _sync(dev)


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the weights, of their gradients (one per weight, as a step leaves them) and of the
    optimizer state."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    )
    return {"param_bytes": params, "grad_bytes": params, "optimizer_bytes": moments}


def measure_training_step(
    config: dict[str, Any],
    batch_size: int,
    seq_len: int,
    device: str = "auto",
    steps: int = 2,
    threads: int | None = None,
    seed: int = 0,
    compile: bool = False,
) -> dict[str, Any]:
    """Peak memory of `steps` training steps of one model, in this process (see the module doc);
    `compile`: through `torch.compile(model.nll)`, as `train.compile=true` trains."""
    dev = pick_device(device)
    if threads:
        torch.set_num_threads(threads)
    cfg = ModelConfig.from_dict(config)
    dtype = autocast_dtype("auto", dev)
    _warm_runtime(dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1), generator=gen, device=dev)
    x, y = ids[:, :-1], ids[:, 1:]
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        reset_peak_memory(dev)
        method = "cuda max_memory_allocated"
    else:
        reset_peak_memory(dev)
        before = _current_rss_bytes()
        slack = max(0, peak_rss_bytes() - before)  # an earlier peak above the baseline hides growth below it
        threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        method = "peak RSS growth (VmHWM" + (f", MALLOC_MMAP_THRESHOLD_={threshold})" if threshold else ")")
    torch.manual_seed(seed)
    model = build_model(cfg).to(dev)
    model.train()
    opt = adamw(model.parameters(), model, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    step = torch.compile(model.nll) if compile else model.nll
    times = []
    for _ in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        with autocast(dev, dtype):
            loss = step(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) - before
        slack = 0
    else:
        peak = peak_rss_bytes() - before
    state = state_bytes(model, opt)
    persistent = sum(state.values())
    return {
        "arch": cfg.arch,
        "head": cfg.head,
        "mode": "compiled" if compile else "eager",
        "params_total": cfg.num_params()["total"],
        "peak_bytes": peak,
        **state,
        "state_bytes": persistent,
        "other_bytes": peak - persistent,
        "baseline_slack_bytes": slack,
        "memory_method": method,
        "steps": steps,
        "step_s": times,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "precision": "bf16 autocast" if dtype is not None else "fp32",
    }


def measure_in_subprocess(
    cfg: ModelConfig,
    batch_size: int,
    seq_len: int,
    device: str = "auto",
    steps: int = 2,
    threads: int | None = None,
    seed: int = 0,
    compile: bool = False,
) -> dict[str, Any]:
    """`measure_training_step` in a fresh interpreter (threads default to this process's)."""
    args = dict(
        config=cfg.to_dict(),
        batch_size=batch_size,
        seq_len=seq_len,
        device=device,
        steps=steps,
        threads=threads or torch.get_num_threads(),
        seed=seed,
        compile=compile,
    )
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    return run_child("tango_lm.bench.memory", args, f"the memory measurement of {cfg.arch}/{cfg.head}", env)


def memory_config(backbone: str, d_model: int, depth: int, vocab_size: int, seq_len: int) -> ModelConfig:
    """The backbone of the head comparison: a preset name (its model section, e.g. dense-142m) or
    an architecture at `d_model`, `depth` and width 4·d_model; with the given vocabulary."""
    from tango_lm.models.registry import ARCHITECTURES

    if backbone in ARCHITECTURES:
        return ModelConfig(
            arch=backbone,
            d_model=d_model,
            depth=depth,
            width=4 * d_model,
            vocab_size=vocab_size,
            context_length=seq_len,
        )
    from tango_lm.train.config import read_yaml

    model = dict(read_yaml(backbone).get("model") or {})
    model.update(head="standard", vocab_size=vocab_size, context_length=max(seq_len, model.get("context_length", 0)))
    return ModelConfig.from_dict(model)


def run_memory_bench(
    backbone: str = "dense-142m",
    d_model: int = 256,
    depth: int = 4,
    vocab_size: int = 50304,
    batch_size: int = 1,
    seq_len: int = 512,
    steps: int = 2,
    device: str = "auto",
    threads: int | None = None,
    heads: tuple[str, ...] = HEADS_COMPARED,
    print_table: bool = True,
    compile: bool = False,
    progress: str = "none",
) -> dict[str, Any]:
    """The `heads` (onóna against Standard by default) on the same backbone and batch, each model in a fresh subprocess,
    both on the default (chunked) loss path; ratios are to the Standard head in the same mode.
    `compile`: every head also through torch.compile (the first step compiles; the peak covers it).
    `progress`: "bar", "lines" or "none" (`bench/progress.py`), a line per subprocess. The heads of
    one mode run one after the other, eager first: SIGTERM or Ctrl-C (`bench/stopping.py`) keeps the
    rows measured before it ("stopped": after how many of the models)."""
    base_cfg = memory_config(backbone, d_model, depth, vocab_size, seq_len)
    modes = (False, True) if compile else (False,)
    rows: list[dict[str, Any]] = []
    stops = StopRecord(len(heads) * len(modes))
    failed = None  # a model past the machine's memory: the ones measured before it are the report
    try:
        with Progress("memory", 1, len(heads) * len(modes), 0, progress, every_run=True) as bar:
            for compiled in modes:
                for head in heads:
                    label = f"{head} {'compiled' if compiled else 'eager'}"
                    bar.run_start(label)
                    start = time.perf_counter()
                    try:
                        row = measure_in_subprocess(
                            base_cfg.replace(head=head), batch_size, seq_len, device, steps, threads, compile=compiled
                        )
                    except MemoryError as exc:
                        failed = str(exc)
                        break
                    bar.run_done(0, label, time.perf_counter() - start)
                    # after the first step, which allocates AdamW's moments and, compiled, compiles
                    row["step_s_median"] = statistics.median(row["step_s"][1:] or row["step_s"])
                    rows.append(row)
                if failed:
                    break
    except STOPS as stop:  # a time limit or Ctrl-C: the models measured so far are the report
        stops.stop(stop, len(rows))
    for r in rows:
        same_mode = [b for b in rows if b["mode"] == r["mode"]]
        base = next((b for b in same_mode if b["head"] == "standard"), same_mode[0])
        for key in ("peak_bytes", "state_bytes", "other_bytes"):
            r[f"{key.removesuffix('_bytes')}_vs_standard"] = r[key] / base[key] if base[key] > 0 else float("nan")
    report = {
        "backbone": backbone,
        "arch": base_cfg.arch,
        "d_model": base_cfg.d_model,
        "depth": base_cfg.depth,
        "width": base_cfg.width,
        "vocab_size": vocab_size,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "loss_chunk": base_cfg.loss_chunk,
        "steps": steps,
        **{key: rows[0][key] if rows else None for key in ("device", "threads", "precision", "memory_method")},
        "heads": rows,
        "stopped": stops.record,  # None, or the signal and after how many of the models ("timed_rounds")
        "failed": failed,  # None, or why the next model could not be measured (out of memory)
    }
    if print_table:
        print(format_report(report))
    return report


def format_report(report: dict[str, Any]) -> str:
    mib = 2**20
    width = max([10, *(len(r["head"]) + 2 for r in report["heads"])])  # factorial-m-mix is 15 wide
    lines = [
        f"memory: whole training step (forward + backward + AdamW), {report['backbone']} backbone "
        f"({report['arch']}, d={report['d_model']}, depth {report['depth']}, width {report['width']}), "
        f"V={report['vocab_size']}, batch {report['batch_size']} x T={report['seq_len']}, "
        f"default chunked loss (chunk {report['loss_chunk']}), {report['precision']}, "
        f"device {report['device']} ({report['threads']} threads)",
        f"peak: {report['memory_method']} over {report['steps']} steps, one fresh subprocess per model; "
        "state = weights + gradients + AdamW moments (counted from the tensors); other = peak - state "
        "(activations, temporaries, allocator slack); step s = median "
        + (
            "of the steps after the first (which allocates AdamW's moments, and compiles a compiled mode)"
            if report["steps"] > 1
            else "of one step (AdamW's allocation and any compile included)"
        ),
        f"{'head':<{width}}{'mode':<9}{'params':>13}{'peak MiB':>10}{'state MiB':>11}{'other MiB':>11}{'step s':>8}"
        f"{'peak vs std':>13}{'state vs std':>14}{'other vs std':>14}",
    ]
    for r in report["heads"]:
        lines.append(
            f"{r['head']:<{width}}{r.get('mode', 'eager'):<9}{r['params_total']:>13,}{r['peak_bytes'] / mib:>10.0f}{r['state_bytes'] / mib:>11.0f}"
            f"{r['other_bytes'] / mib:>11.0f}{r['step_s_median']:>8.1f}{r['peak_vs_standard']:>13.2f}"
            f"{r['state_vs_standard']:>14.2f}{r['other_vs_standard']:>14.2f}"
        )
    if report.get("stopped"):
        lines.append(stopped_line(report["stopped"], "models"))
    if report.get("failed"):
        lines.append(f"FAILED after {len(report['heads'])} models: {report['failed']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Peak memory of a training step, one model per subprocess.")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        print(json.dumps(measure_training_step(**json.loads(ns.child))))
        return
    parser.error("use `tango-lm bench --suite memory`")


def head_names(text: str) -> tuple[str, ...]:
    """--memory-heads: registered heads, with Standard (what the ratios are to) first."""
    from tango_lm.heads.registry import HEADS

    names = tuple(v.strip() for v in text.split(","))
    for name in names:
        if name not in HEADS:
            raise argparse.ArgumentTypeError(
                f"unknown head {name!r}{did_you_mean(name, HEADS)}; choose from {', '.join(HEADS)}"
            )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a head is listed twice (got {text!r})")
    return ("standard", *(n for n in names if n != "standard"))


def add_suite_arguments(g: Any) -> None:
    """The memory suite's own options (an argparse group)."""
    g.add_argument(
        "--memory-backbone",
        default="dense-142m",
        help="a preset (its model section) or an architecture at --d-model/--depth",
    )
    g.add_argument("--memory-batch-size", type=int, default=1, help="sequences per measured step (default %(default)s)")
    g.add_argument("--memory-seq-len", type=int, default=512, help="tokens per sequence (default %(default)s)")
    g.add_argument(
        "--memory-heads",
        type=head_names,
        default=HEADS_COMPARED,
        help=f"comma-separated heads, Standard first as the ratios' reference (default {','.join(HEADS_COMPARED)})",
    )


def check_suite_args(args: argparse.Namespace) -> None:
    """The memory suite's options of `tango-lm bench` (`bench/registry.py`)."""
    from tango_lm.models.registry import ARCHITECTURES

    require_positive(args, ("memory_batch_size", "memory_seq_len"))
    if args.memory_backbone in ARCHITECTURES:  # built at --d-model; a preset keeps its own
        require_head_multiple(args)
    memory_config(args.memory_backbone, args.d_model, args.depth, args.head_vocab, args.memory_seq_len)


def run_suite(args: argparse.Namespace, print_table: bool, progress: str = "none") -> dict[str, Any]:
    """The memory suite of `tango-lm bench` at its options."""
    return run_memory_bench(
        backbone=args.memory_backbone,
        d_model=args.d_model,
        depth=args.depth,
        vocab_size=args.head_vocab,
        batch_size=args.memory_batch_size,
        seq_len=args.memory_seq_len,
        steps=args.memory_steps,
        device=args.device,
        threads=args.threads,
        print_table=print_table,
        compile=args.compile,
        progress=progress,
        heads=args.memory_heads,
    )


if __name__ == "__main__":
    main()
