"""Where a training step's time goes, op by op, for architectures measured side by side.

Every aten op of the forward and backward is timed as it runs (a TorchDispatchMode; CPU ops are
synchronous), grouped by op and, for matmuls, by operand shapes, with the achieved GFLOP/s of each
matmul group. The models alternate step by step, as in `tango-lm bench`. The timing adds some
overhead per op, the same for every model; compare rows, not the step time with the bench's.
Under the timing mode TANGO's mixing runs its blocked PyTorch products, not the C kernels of
`ops/cpu_kernels.py` (which no dispatch mode can see): its rows profile that path.

Usage: python tools/step_profile.py [ARCH:WIDTH ...] [--seq-len T] [--batch-size B] [--steps N] [--top K]
(default: tango:8192 loop-transformer:8024, the default bench's matched pair at d = 256, depth 4).
"""

from __future__ import annotations

import argparse
import collections
import math
import time
from typing import Any

import torch
from op_timing import positive_int
from torch.utils._python_dispatch import TorchDispatchMode

from tango_lm import ModelConfig, build_model
from tango_lm.errors import run_script
from tango_lm.train.cpu_allocator import keep_freed_memory
from tango_lm.train.optim import adamw

MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


class OpTimer(TorchDispatchMode):
    """Seconds and FLOPs per op group while active."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.flops: dict[str, float] = collections.defaultdict(float)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        elapsed = time.perf_counter() - start
        name = func.__name__.split(".")[0]
        if name in MATMULS:
            a, b = [x for x in args if isinstance(x, torch.Tensor)][-2:]
            name = f"{name} {tuple(a.shape)} x {tuple(b.shape)}"
            self.flops[name] += 2 * math.prod(a.shape) * b.shape[-1]
        self.seconds[name] += elapsed
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "models",
        nargs="*",
        default=["tango:8192", "loop-transformer:8024"],
        help="ARCH:WIDTH per model (default: the default bench's matched pair)",
    )
    parser.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sequence (default %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per step (default %(default)s)")
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=6,
        help="timed steps per model, after two warm-up steps (default %(default)s)",
    )
    parser.add_argument("--top", type=int, default=15, help="op groups listed per model (default %(default)s)")
    args = parser.parse_args()
    keep_freed_memory()
    configs = {}
    for spec in args.models:
        arch, _, width = spec.partition(":")
        if not width.isdigit():
            parser.error(f"model {spec!r} is not ARCH:WIDTH, e.g. tango:8192")
        configs[spec] = ModelConfig(
            arch=arch, d_model=256, depth=4, width=int(width), vocab_size=257, context_length=args.seq_len
        )
    models = {k: build_model(c) for k, c in configs.items()}
    opts = {k: adamw(m.parameters(), m, lr=1e-4) for k, m in models.items()}
    timers = {k: OpTimer() for k in configs}
    walls: dict[str, list[float]] = collections.defaultdict(list)
    tokens = torch.randint(0, 257, (args.batch_size, args.seq_len + 1))
    for step in range(args.steps + 2):  # two warm-up steps
        for k, model in models.items():
            timer = timers[k] if step >= 2 else OpTimer()
            start = time.perf_counter()
            with timer:
                model.nll(tokens[:, :-1], tokens[:, 1:]).backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            if step >= 2:
                walls[k].append(time.perf_counter() - start)
    for k, timer in timers.items():
        total = sum(timer.seconds.values()) / args.steps
        print(f"{k}: {sum(walls[k]) / args.steps * 1e3:.0f} ms per step, {total * 1e3:.0f} ms in timed ops")
        for name, secs in sorted(timer.seconds.items(), key=lambda kv: -kv[1])[: args.top]:
            rate = f"  {timer.flops[name] / secs / 1e9:6.1f} GFLOP/s" if name in timer.flops else ""
            print(f"  {name:56s} {secs / args.steps * 1e3:8.1f} ms{rate}")


if __name__ == "__main__":
    run_script(main)
