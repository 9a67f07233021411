"""TANGO's gate average: the C kernels of ops/cpu_kernels.py against the blocked PyTorch path.

Usage: python tools/tango_kernels.py products T F [--threads N] | steps T [--steps N]

    products  each of the three probability-times-gates products for one sequence (H = 8, causal
              probabilities [H, T, T], gates [T, F]): the C kernel on PyTorch's OpenMP threads,
              the same kernel from a separate thread pool right after a PyTorch op (the
              library's fallback when built without OpenMP), and MKL in blocks of 64 destinations
              (the blocked path's pieces); GFLOP/s per counted FLOP (the causal half), medians
              of rounds that alternate the variants
    steps     training steps (forward, backward, AdamW) of the default bench's matched pair at
              d = 256, depth 4 (batch 4 up to T = 256, else 1): the Loop Transformer++ and TANGO on
              each path, alternating step by step; medians and FLOP/s as a fraction of Loop's
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from op_timing import positive_int

from tango_lm import ModelConfig, build_model
from tango_lm.errors import UserError, run_script
from tango_lm.ops import cpu_kernels, dispatch
from tango_lm.train.cpu_allocator import keep_freed_memory
from tango_lm.train.optim import adamw

HEADS = 8


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def products(t: int, f: int, rounds: int) -> None:
    w = f // HEADS
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    probs = torch.softmax(torch.randn(1, HEADS, t, t, generator=gen).masked_fill(mask, float("-inf")), -1)
    g, d, u = (torch.randn(1, t, f, generator=gen) for _ in range(3))
    wide_out, probs_out = torch.empty(1, t, f), torch.empty(1, HEADS, t, t)
    g_heads, d_heads = (x[0].view(t, HEADS, w).transpose(0, 1) for x in (g, d))
    blocks = [(r0, min(r0 + 64, t)) for r0 in range(0, t, 64)]
    piece = torch.empty(HEADS, 64, max(w, t))

    def mkl_average():
        for r0, r1 in blocks:
            torch.bmm(probs[0, :, r0:r1, :r1], g_heads[:, :r1], out=piece[:, : r1 - r0, :w])

    def mkl_grad_gates():
        for s0, s1 in blocks:
            torch.bmm(probs[0, :, s0:, s0:s1].transpose(-1, -2), d_heads[:, s0:], out=piece[:, : s1 - s0, :w])

    def mkl_grad_probs():
        for r0, r1 in blocks:
            torch.bmm(d_heads[:, r0:r1], g_heads[:, :r1].transpose(-1, -2), out=piece[:, : r1 - r0, :r1])

    kernels = {
        "average": (lambda: cpu_kernels.gate_average(probs, g, u, wide_out, wide_out), mkl_average),
        "gates' gradient": (lambda: cpu_kernels.gate_average_grad_gates(probs, d, wide_out), mkl_grad_gates),
        "probs' gradient": (lambda: cpu_kernels.gate_average_grad_probs(d, g, probs_out), mkl_grad_probs),
    }
    real_openmp = cpu_kernels.uses_openmp

    def from_pool(kernel):
        def run():
            F.silu(g)  # a PyTorch op just before, as in a training step
            cpu_kernels.uses_openmp = lambda: False
            try:
                start = time.perf_counter()
                kernel()
                return time.perf_counter() - start
            finally:
                cpu_kernels.uses_openmp = real_openmp

        return run

    def timed(fn):
        def run():
            F.silu(g)
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        return run

    counted = 2 * HEADS * t * (t + 1) / 2 * w
    print(
        f"gate-average products, one sequence, T = {t}, F = {f}, H = {HEADS}, {torch.get_num_threads()} threads, "
        f"median of {rounds} alternating rounds, each after a PyTorch op; GFLOP/s per counted FLOP"
    )
    for name, (kernel, mkl) in kernels.items():
        variants = {
            "C kernel": timed(kernel),
            "C kernel, thread pool": from_pool(kernel),
            "MKL blocks of 64": timed(mkl),
        }
        if not real_openmp():
            del variants["C kernel, thread pool"]  # the library itself runs that way
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(rounds):
            for k, run in variants.items():
                times[k].append(run())
        for k, ts in times.items():
            ms = _median_ms(ts)
            print(f"  {name:16s} {k:22s} {ms:7.2f} ms  {counted / ms / 1e6:6.1f} GFLOP/s")


def steps(t: int, n_steps: int) -> None:
    batch = 4 if t <= 256 else 1
    arms = {
        "loop-transformer": ("loop-transformer", 8024, None),
        "tango, C kernels": ("tango", 8192, "c"),  # as $TANGO_LM_KERNELS names them (ops/dispatch.py)
        "tango, blocked": ("tango", 8192, "blocked"),
    }
    models = {}
    for name, (arch, width, _) in arms.items():
        cfg = ModelConfig(arch=arch, d_model=256, depth=4, width=width, vocab_size=257, context_length=t)
        model = build_model(cfg)
        models[name] = (model, adamw(model.parameters(), model, lr=1e-4), cfg.flops_per_token(t))
    tokens = torch.randint(0, 257, (batch, t + 1), generator=torch.Generator().manual_seed(0))
    asked = os.environ.get(dispatch.ENV)
    times: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for step in range(n_steps + 2):  # two warm-up steps
            for name, (model, opt, _) in models.items():
                os.environ[dispatch.ENV] = arms[name][2] or "auto"
                start = time.perf_counter()
                model.nll(tokens[:, :-1], tokens[:, 1:]).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step >= 2:
                    times[name].append(time.perf_counter() - start)
    finally:  # the caller's setting back
        os.environ.pop(dispatch.ENV, None)
        if asked is not None:
            os.environ[dispatch.ENV] = asked
    print(
        f"training steps, d = 256, depth 4, T = {t}, batch {batch}, {torch.get_num_threads()} threads, "
        f"median of {n_steps} alternating steps after 2 warm-up"
    )
    base = None
    for name, (_, _, flops) in models.items():
        sec = statistics.median(times[name])
        rate = flops * batch * t / sec / 1e9
        base = base or rate
        print(f"  {name:18s} {sec * 1e3:8.1f} ms/step  {rate:6.1f} GFLOP/s  x {rate / base:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "kind", choices=["products", "steps"], help="products: the three products alone; steps: whole training steps"
    )
    parser.add_argument("sizes", nargs="+", type=positive_int, help="products: T F; steps: T")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's choice)")
    parser.add_argument("--rounds", type=positive_int, default=9, help="products: timed rounds (default %(default)s)")
    parser.add_argument(
        "--steps", type=positive_int, default=12, help="steps: timed steps per path (default %(default)s)"
    )
    args = parser.parse_args()
    if len(args.sizes) != (2 if args.kind == "products" else 1):
        raise UserError(f"{args.kind} takes {'T F' if args.kind == 'products' else 'T'} (got {len(args.sizes)} sizes)")
    if args.kind == "products" and args.sizes[1] % HEADS:
        raise UserError(f"products' F is split into {HEADS} heads: give a multiple of {HEADS} (got {args.sizes[1]})")
    if not cpu_kernels.available():
        raise SystemExit("the C kernels did not build here (see the warning above, or TANGO_LM_CPU_KERNELS)")
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    if args.kind == "products":
        products(*args.sizes, args.rounds)
    else:
        steps(*args.sizes, args.steps)


if __name__ == "__main__":
    run_script(main)
