"""Speed and peak memory of the output head alone: Standard against the twin (onóna) head, each on
its plain path and on the chunked fused loss of `ops/twin_loss.py` (docs/design.md §3, "Memory").

One step is a forward and backward of the summed NLL over `positions` hidden states:

- `standard`: `F.cross_entropy(h Eᵀ)`, the Standard head's current loss path;
- `standard-fused`: the same loss through the chunked op (`softmax_nll`);
- `twin-plain`: the paper's path (seed 001, Figure 2): `twin_log_probs` materializes both fp32
  [N, V] log-softmaxes and their mixture, then `nll_loss`;
- `twin-fused`: `twin_nll`, chunk by chunk (8 vocabulary matmuls instead of 6: the backward
  recomputes the logits).

The inputs are leaves: h [N, d], the tables [V, d] and, for the twin head, the gate logits [N]
(the gate itself, a d-vector dot product per position, is left out). Each variant runs in a fresh
subprocess so that no variant's freed memory or allocator state flatters another:

- time: the median of `steps` timed steps after one untimed step, as wall time and as the
  process's CPU time (all threads; steadier than wall time on a shared machine);
- memory on CUDA: `torch.cuda.max_memory_allocated()` during the first step minus what was
  allocated before it (the inputs);
- memory on CPU: torch's CPU allocations are invisible to `tracemalloc`, so the measure is the
  growth of the process's peak resident set (VmHWM on Linux, else `ru_maxrss`) over the first step,
  from a baseline taken after the inputs were created and written. It counts pages actually
  touched, including the gradient buffers the step leaves behind (for the twin head, two V x d
  table gradients instead of one), and allocator slack; it is an upper bound on the peak of
  live tensors, not an exact count.

Run `python -m tango_lm.bench.heads --positions 2048` (see `--help`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from tango_lm.bench.child import run_child
from tango_lm.bench.peak import _sync
from tango_lm.cli.output import DEVICE_HELP
from tango_lm.errors import UserError, run_script
from tango_lm.heads.onona import twin_log_probs
from tango_lm.ops.twin_loss import LOSS_CHUNK, softmax_nll, twin_nll
from tango_lm.train.device import pick_device
from tango_lm.train.utilization import peak_rss_bytes

VARIANTS = ("standard", "standard-fused", "twin-plain", "twin-fused")


def _inputs(variant: str, positions: int, vocab: int, d: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The leaves, drawn in place (no temporaries, so the memory baseline after setup is exact)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def leaf(*shape: int, scale: float) -> torch.Tensor:
        return torch.empty(*shape, device=device).normal_(0.0, scale, generator=gen).requires_grad_()

    out = {"y": torch.randint(0, vocab, (positions,), generator=gen, device=device)}
    out["h"] = leaf(positions, d, scale=1.0)
    out["a"] = leaf(vocab, d, scale=0.02)
    if variant.startswith("twin"):
        out["b"] = leaf(vocab, d, scale=0.02)
        out["z"] = leaf(positions, scale=1.0)
    return out


def _loss(variant: str, x: dict[str, torch.Tensor], chunk: int) -> torch.Tensor:
    h, y = x["h"], x["y"]
    if variant == "standard":
        logits = F.linear(h, x["a"])
        return F.cross_entropy(logits.float(), y, reduction="sum")
    if variant == "standard-fused":
        return softmax_nll(h, x["a"], y, chunk=chunk)
    if variant == "twin-plain":
        return F.nll_loss(twin_log_probs(h, x["a"], x["b"], x["z"]), y, reduction="sum")
    if variant == "twin-fused":
        return twin_nll(h, x["a"], x["b"], x["z"], y, chunk=chunk)
    raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")


def measure_variant(
    variant: str,
    positions: int,
    vocab: int,
    d: int,
    chunk: int,
    device: str = "auto",
    steps: int = 3,
    bf16: bool = False,
    threads: int | None = None,
) -> dict[str, Any]:
    """Peak extra memory of the first step and median time of `steps` more, in this process."""
    dev = pick_device(device)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    x = _inputs(variant, positions, vocab, d, dev)
    leaves = [t for t in x.values() if t.requires_grad]

    cpu_times: list[float] = []

    def step() -> float:
        for t in leaves:
            t.grad = None
        _sync(dev)
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = _loss(variant, x, chunk)
        loss.backward()
        _sync(dev)
        cpu_times.append(time.process_time() - c0)
        return time.perf_counter() - t0

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        first = step()
        peak = torch.cuda.max_memory_allocated(dev) - before
        method = "cuda max_memory_allocated"
    else:
        before = peak_rss_bytes()
        first = step()
        peak = peak_rss_bytes() - before
        method = "peak RSS growth (VmHWM)"
    times = [step() for _ in range(steps)]
    return {
        "variant": variant,
        "step_s": statistics.median(times) if times else first,
        "first_step_s": first,
        "cpu_s": statistics.median(cpu_times[1:] or cpu_times),
        "peak_bytes": peak,
        "memory_method": method,
        "device": str(dev),
        "threads": torch.get_num_threads(),
    }


def run_head_bench(
    positions: int = 8192,
    vocab: int = 50304,
    d: int = 768,
    chunk: int = LOSS_CHUNK,
    device: str = "auto",
    steps: int = 3,
    bf16: bool = False,
    variants: tuple[str, ...] = VARIANTS,
    threads: int | None = None,
    print_table: bool = True,
) -> dict[str, Any]:
    """Each variant in a fresh subprocess; ratios are to the plain Standard head. `threads` sets
    torch's CPU threads (1 gives steadier numbers on a machine shared with other jobs)."""
    rows = []
    for variant in variants:
        args = dict(
            variant=variant,
            positions=positions,
            vocab=vocab,
            d=d,
            chunk=chunk,
            device=device,
            steps=steps,
            bf16=bf16,
            threads=threads,
        )
        rows.append(run_child("tango_lm.bench.heads", args, f"head bench variant {variant}"))
    base = next((r for r in rows if r["variant"] == "standard"), rows[0])
    for r in rows:
        r["time_vs_standard"] = r["step_s"] / base["step_s"]
        r["cpu_vs_standard"] = r["cpu_s"] / base["cpu_s"]
        r["memory_vs_standard"] = r["peak_bytes"] / base["peak_bytes"] if base["peak_bytes"] > 0 else float("nan")
    report = {
        "positions": positions,
        "vocab": vocab,
        "d": d,
        "chunk": chunk,
        "steps": steps,
        "bf16": bf16,
        "device": rows[0]["device"],
        "threads": rows[0]["threads"],
        "memory_method": rows[0]["memory_method"],
        "variants": rows,
    }
    if print_table:
        print(format_report(report))
    return report


def format_report(report: dict[str, Any]) -> str:
    timing = f"median of {report['steps']} steps after one" if report["steps"] else "the first step only"
    lines = [
        f"head alone, forward + backward: N={report['positions']} positions, V={report['vocab']}, d={report['d']}, "
        f"chunk {report['chunk']}, {'bf16 autocast' if report['bf16'] else 'fp32'}, "
        f"device {report['device']} ({report['threads']} threads)",
        f"time: {timing}; memory: {report['memory_method']} over the first step",
        f"{'variant':<16}{'step s':>9}{'cpu s':>9}{'peak MiB':>10}{'time vs std':>13}{'cpu vs std':>12}"
        f"{'mem vs std':>12}",
    ]
    for r in report["variants"]:
        lines.append(
            f"{r['variant']:<16}{r['step_s']:>9.3f}{r['cpu_s']:>9.3f}{r['peak_bytes'] / 2**20:>10.0f}"
            f"{r['time_vs_standard']:>13.2f}{r['cpu_vs_standard']:>12.2f}{r['memory_vs_standard']:>12.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Output-head speed and memory: Standard vs twin, plain vs fused.")
    parser.add_argument(
        "--positions", type=int, default=8192, help="hidden states N scored per step (default %(default)s)"
    )
    parser.add_argument(
        "--vocab", type=int, default=50304, help="vocabulary V (default: the onóna paper's %(default)s)"
    )
    parser.add_argument("--d", type=int, default=768, help="hidden width d (default %(default)s)")
    parser.add_argument(
        "--chunk", type=int, default=LOSS_CHUNK, help="positions per chunk of the fused losses (default %(default)s)"
    )
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps per variant, after one untimed step (default %(default)s)"
    )
    parser.add_argument("--bf16", action="store_true", help="run under bf16 autocast")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: %(default)s")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        print(json.dumps(measure_variant(**json.loads(ns.child))))
        return
    small = [f"--{k}" for k in ("positions", "vocab", "d", "chunk", "steps") if getattr(ns, k) < 1]
    if small:
        raise UserError(f"{', '.join(small)} must be at least 1")
    unknown = [v for v in ns.variants.split(",") if v not in VARIANTS]
    if unknown:
        raise UserError(f"unknown --variants {', '.join(map(repr, unknown))}; choose from {', '.join(VARIANTS)}")
    report = run_head_bench(
        ns.positions,
        ns.vocab,
        ns.d,
        ns.chunk,
        ns.device,
        ns.steps,
        ns.bf16,
        tuple(ns.variants.split(",")),
        ns.threads,
        print_table=not ns.json,
    )
    if ns.json:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    run_script(main)
