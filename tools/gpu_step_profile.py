"""Where a training step's GPU time goes: torch.profiler's kernel times per step, per architecture.

Usage: PYTHONPATH=src python3 tools/gpu_step_profile.py [--archs tango,loop-transformer] [--d-model 512
       --seq-len 1024 --depth 4 --batch-size 16 --tango-width 28480 --vocab-size 50257] [--steps 3]
       [--compile] [--top 12] [--device cuda] [--json FILE]

The defaults are the train bench's 70M tier (TANGO paper Table 3; widths matched to TANGO's total
as `tango-lm bench` matches them), bf16 autocast, AdamW. Each model in turn: two warm-up steps
(Triton's autotuning, torch.compile), `--steps` steps timed with the device synchronized (wall ms
per step), then as many under torch.profiler. It reports the kernels' device time per step, the
step's wall time, and the share of the wall the device spent on no kernel (launch and host
overhead: one stream, so kernels do not overlap), the time by category (matmul libraries,
SDPA/attention, the project's Triton kernels, inductor's generated kernels, the optimizer,
elementwise and the rest) and the `--top` kernels. Where the MFU ratios of the train bench come
from, kernel by kernel. `--device cpu` profiles CPU ops (self time) at small sizes: a smoke test.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import op_timing  # noqa: E402

from tango_lm.bench.peak import _sync  # noqa: E402
from tango_lm.bench.training import matched_configs  # noqa: E402
from tango_lm.errors import UserError  # noqa: E402
from tango_lm.models.model import build_model  # noqa: E402
from tango_lm.train.device import autocast, autocast_dtype  # noqa: E402
from tango_lm.train.optim import adamw  # noqa: E402

# First match wins: attention before matmul, as SDPA's kernels are built on CUTLASS and say so in
# their names. The project's Triton kernels are named by their functions (ops/*_kernels.py).
CATEGORIES = [
    ("attention", re.compile(r"flash|fmha|cudnn|attention", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|aten::(mm|addmm|bmm|baddbmm)$", re.I)),
    ("inductor", re.compile(r"^triton_(poi|red|per|tem|for)_")),
    ("project triton", re.compile(r"_kernel$")),
    ("optimizer", re.compile(r"multi_tensor|adam|foreach", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|reduce|aten::", re.I)),
]


def category(name: str) -> str:
    return next((label for label, pattern in CATEGORIES if pattern.search(name)), "other")


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step, x, y, dev, dtype) -> None:
    with autocast(dev, dtype):
        loss = step(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def profile_model(cfg, args: argparse.Namespace, dev: torch.device) -> dict:
    """One model: wall ms per step (synchronized), then kernel (or, on CPU, op) time per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    dtype = autocast_dtype("auto", dev)
    torch.manual_seed(0)
    model = build_model(cfg).to(dev)
    opt = adamw(model.parameters(), model, lr=1e-4)
    step = torch.compile(model.nll) if args.compile else model.nll
    tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=dev)
    x, y = tokens[:, :-1], tokens[:, 1:]
    for _ in range(2):
        _train_step(model, opt, step, x, y, dev, dtype)
    _sync(dev)
    start = time.perf_counter()
    for _ in range(args.steps):
        _train_step(model, opt, step, x, y, dev, dtype)
    _sync(dev)
    wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            _train_step(model, opt, step, x, y, dev, dtype)
        _sync(dev)
    kernels: dict[str, float] = {}
    for evt in prof.key_averages():
        # CUDA: the kernels (device events); CPU: every op's self time (children not counted twice)
        us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        if (evt.device_type == DeviceType.CUDA) == cuda and us > 0:
            kernels[evt.key] = kernels.get(evt.key, 0.0) + us / 1e3 / args.steps
    busy_ms = sum(kernels.values())
    by_category: dict[str, float] = {}
    for name, ms in kernels.items():
        label = category(name)
        by_category[label] = by_category.get(label, 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]
    return {
        "arch": cfg.arch,
        "width": cfg.width,
        "params_total": cfg.num_params()["total"],
        "wall_ms": wall_ms,
        "kernel_ms": busy_ms,
        "idle_share": max(0.0, 1 - busy_ms / wall_ms) if cuda else None,
        "categories_ms": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top": [{"kernel": name, "ms": ms, "category": category(name)} for name, ms in top],
    }


def run(args: argparse.Namespace) -> dict:
    dev = torch.device(args.device)
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    triples = matched_configs(archs, args.d_model, args.depth, args.tango_width, args.vocab_size, args.seq_len)
    rows = []
    for _, cfg, _ in triples:
        if cfg is not None:
            rows.append(profile_model(cfg, args, dev))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "d_model": args.d_model,
        "seq_len": args.seq_len,
        "depth": args.depth,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "compile": args.compile,
        "models": rows,
    }


def format_report(report: dict) -> str:
    unit = "kernel time" if report["device"] != "cpu" else "op self time"
    lines = [
        f"step profile: {report['device']}, torch {report['torch']}, d={report['d_model']}, T={report['seq_len']}, "
        f"depth {report['depth']}, batch {report['batch_size']}, {'compiled' if report['compile'] else 'eager'}; "
        f"ms per step (wall: synchronized, unprofiled; {unit}: torch.profiler, {report['steps']} steps)"
    ]
    for r in report["models"]:
        idle = f", device idle {r['idle_share']:.0%} of the wall" if r["idle_share"] is not None else ""
        cats = ", ".join(f"{c} {ms:.2f}" for c, ms in r["categories_ms"].items())
        lines += [
            f"{r['arch']} (width {r['width']}, {r['params_total']:,} params): wall {r['wall_ms']:.2f} ms, "
            f"{unit} {r['kernel_ms']:.2f} ms{idle}",
            f"  by category (ms): {cats}",
        ]
        lines += [f"  {t['ms']:8.3f} ms  {t['category']:<15} {t['kernel'][:100]}" for t in r["top"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--archs", default="tango,loop-transformer", help="comma-separated architectures (default %(default)s)"
    )
    p.add_argument("--d-model", type=int, default=512, help="model width d (default: the 70M tier's %(default)s)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default %(default)s)")
    p.add_argument("--depth", type=int, default=4, help="block applications or layers (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default %(default)s)")
    p.add_argument(
        "--tango-width",
        type=int,
        default=28480,
        help="TANGO's F; the other widths are matched to it (default %(default)s)",
    )
    p.add_argument("--vocab-size", type=int, default=50257, help="vocabulary (default: GPT-2's %(default)s)")
    p.add_argument(
        "--steps",
        type=int,
        default=3,
        help="timed and then profiled training steps per model, after two warm-up steps (default %(default)s)",
    )
    p.add_argument("--compile", action="store_true", help="profile torch.compile(model.nll)")
    p.add_argument("--top", type=int, default=12, help="kernels listed per model")
    p.add_argument("--device", default="cuda", help="torch device (default %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = op_timing.parse_with_cpu_sizes(
        p, argv, d_model=64, seq_len=64, batch_size=2, tango_width=512, vocab_size=257, steps=1
    )
    if args.device.split(":")[0] not in ("cuda", "cpu"):
        return op_timing.refuse(f"error: --device {args.device!r}: cuda (cuda:N) or cpu")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return op_timing.refuse(
            "error: no CUDA device: run this on a GPU machine, or pass --device cpu for a smoke test"
        )
    sizes = ("steps", "top", "batch_size", "seq_len", "d_model", "depth", "tango_width", "vocab_size")
    if min(getattr(args, name) for name in sizes) < 1:
        return op_timing.refuse("error: --" + ", --".join(n.replace("_", "-") for n in sizes) + " must be at least 1")
    if args.json and not args.json.parent.is_dir():  # found now, not after the profile
        return op_timing.refuse(f"error: --json {args.json}: no directory {args.json.parent}")
    try:
        report = run(args)
    except UserError as exc:  # an architecture it cannot build at these sizes, an unknown one
        return op_timing.refuse(f"error: {exc}")
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
