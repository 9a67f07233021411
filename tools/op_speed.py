"""Forward + backward time of the blocked CPU ops against their compositions, alternating in one
process (median of rounds). Usage: python tools/op_speed.py causal N T E | tango B T F [BLOCK] |
windowed B T F | pieces T F | adamw

    causal    ops/causal_matmul.py: tril(p) @ v, p [N, T, T], v [N, T, E]: blocked, and on the C kernels
              of ops/cpu_kernels.py where they build
    tango     ops/tango_mix.py: TANGO's mixing (H = 8, d_h = 32): the blocked PyTorch products (in
              blocks of BLOCK positions) and the C kernels of ops/cpu_kernels.py where they build
    windowed  ops/windowed_mix.py: the band part of windowed TANGO (H = 8, d_h = 32, W = 64)
    pieces    the matmul pieces of TANGO's gate average alone (probabilities [H, T, T] times one
              sequence's gates, a strided [T, F] matrix, H = 8), for blocks of 32, 64 and 128
              destinations and one full-square matmul: GFLOP/s of the work run and of the causal
              half the model FLOPs count
    adamw     one AdamW step, fused kernel against the default (foreach) path, on the bench's
              matched GAU model (6.5M parameters, random gradients)
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable

import torch

import tango_lm.ops.tango_mix as tango_mix
from tango_lm.errors import UserError, run_script
from tango_lm.ops import cpu_kernels
from tango_lm.ops.causal_matmul import causal_matmul_fused, causal_matmul_reference
from tango_lm.ops.windowed_mix import windowed_mix_fused, windowed_mix_reference
from tango_lm.train.cpu_allocator import keep_freed_memory


def time_pair(make_inputs, fused, reference, rounds: int = 12) -> None:
    time_variants(make_inputs, {"fused": fused, "composition": reference}, rounds)


def time_variants(make_inputs, variants: dict, rounds: int = 12) -> None:
    """Forward and backward medians of each variant, run in turn round after round; the x column
    is to the "composition" variant."""
    inputs = make_inputs()
    dy = torch.randn_like(variants["composition"](*inputs).detach())
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            out = fn(*inputs)
            mid = time.perf_counter()
            out.backward(dy)
            times[name].append((mid - start, time.perf_counter() - mid))
            for x in inputs:
                if isinstance(x, torch.Tensor):
                    x.grad = None
    medians = {k: [statistics.median(r[i] for r in v[2:]) for i in (0, 1)] for k, v in times.items()}
    base = sum(medians["composition"])
    for name, (fwd, bwd) in medians.items():
        print(f"{name:12s} forward {fwd * 1e3:7.2f} ms  backward {bwd * 1e3:7.2f} ms  x {(fwd + bwd) / base:.2f}")


def paths(fused, reference) -> dict:
    """An op's blocked PyTorch path, its C-kernel path where the kernels build, and the composition."""
    variants = {"blocked": functools.partial(fused, kernels=False)}
    if cpu_kernels.available():
        variants["C kernels"] = functools.partial(fused, kernels=True)
    return {**variants, "composition": reference}


def time_adamw(rounds: int = 20) -> None:
    from tango_lm import ModelConfig, build_model

    model = build_model(ModelConfig(arch="gau", d_model=256, depth=4, width=2048, vocab_size=257, context_length=256))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opts = {
        "fused": torch.optim.AdamW(model.parameters(), fused=True),
        "default": torch.optim.AdamW(model.parameters()),
    }
    times: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(rounds):
        for name, opt in opts.items():
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    for name, ts in times.items():
        print(f"{name:8s} {statistics.median(ts[3:]) * 1e3:6.2f} ms per step ({params:,} parameters)")


def time_pieces(t: int, f: int, rounds: int = 9, n_heads: int = 8) -> None:
    w = f // n_heads
    probs = torch.rand(n_heads, t, t).tril_()
    gates = torch.randn(t, f).view(t, n_heads, w).transpose(0, 1)  # strided per-head view, as in the op
    counted = 2 * n_heads * t * (t + 1) / 2 * w

    def blocked(block: int) -> tuple[Callable[[], None], float]:
        blocks = [(r0, min(r0 + block, t)) for r0 in range(0, t, block)]
        out = torch.empty(n_heads, block, w)

        def run() -> None:
            for r0, r1 in blocks:
                torch.bmm(probs[:, r0:r1, :r1], gates[:, :r1], out=out[:, : r1 - r0])

        return run, sum(2 * n_heads * (r1 - r0) * r1 * w for r0, r1 in blocks)

    full_out = torch.empty(n_heads, t, w)
    cases = {f"blocks of {n}": blocked(n) for n in (32, 64, 128) if n < t}
    cases["full square"] = (lambda: torch.bmm(probs, gates, out=full_out), 2 * n_heads * t * t * w)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (run, _) in cases.items():
            run()  # warm: operands in cache, as when a block's pieces run back to back
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    print(f"gate average forward pieces, T = {t}, F = {f}, H = {n_heads} (median of {rounds} rounds, alternating)")
    for name, (_, flops) in cases.items():
        sec = statistics.median(times[name])
        print(
            f"{name:14s} {sec * 1e3:7.2f} ms  computes {flops / (n_heads * t * t * w * 2):.3f} of the square  "
            f"{flops / sec / 1e9:6.1f} GFLOP/s run  {counted / sec / 1e9:6.1f} GFLOP/s counted"
        )


# The sizes each kind takes (the module docstring's usage): (required, optional).
_SIZES = {"causal": (3, 0), "tango": (3, 1), "windowed": (3, 0), "pieces": (2, 0), "adamw": (0, 0)}


def parse(argv: list[str]) -> tuple[str, list[int]]:
    """The kind and its sizes; a UserError naming the usage for anything else."""
    usage = "usage: python tools/op_speed.py causal N T E | tango B T F [BLOCK] | windowed B T F | pieces T F | adamw"
    if not argv or argv[0] not in _SIZES:
        raise UserError(f"{usage} (got {' '.join(argv) or 'nothing'}); --help says what each does")
    kind, words = argv[0], argv[1:]
    need, optional = _SIZES[kind]
    if not need <= len(words) <= need + optional or not all(w.isdigit() and int(w) > 0 for w in words):
        raise UserError(f"{usage}: {kind} takes {need}{f'-{need + optional}' if optional else ''} sizes of 1 or more")
    sizes = [int(w) for w in words]
    width = {"tango": 2, "windowed": 2, "pieces": 1}.get(kind)  # the F each splits into 8 heads
    if width is not None and sizes[width] % 8:
        raise UserError(f"{kind}'s F is split into 8 heads: give a multiple of 8 (got {sizes[width]})")
    return kind, sizes


def main() -> None:
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(__doc__)
        return
    kind, sizes = parse(sys.argv[1:])
    keep_freed_memory()
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_(True)

    if kind == "causal":
        n, t, e = sizes
        time_variants(lambda: (leaf(n, t, t), leaf(n, t, e)), paths(causal_matmul_fused, causal_matmul_reference))
    elif kind == "tango":
        b, t, f, *block = sizes
        if block:
            tango_mix._block_size = lambda t: block[0]
        time_variants(
            lambda: (leaf(b, 8, t, 32), leaf(b, 8, t, 32), leaf(b, t, f), leaf(b, t, f)),
            paths(tango_mix.tango_mix_fused, tango_mix.tango_mix_reference),
        )
    elif kind == "windowed":
        b, t, f = sizes
        qk = [leaf(b, 8, t, 32) for _ in range(4)]
        time_pair(
            lambda: (*qk, leaf(b, t, f), leaf(b, t, f), 64),
            lambda *x: windowed_mix_fused(*x),
            lambda *x: windowed_mix_reference(*x),
        )
    elif kind == "pieces":
        t, f = sizes
        time_pieces(t, f)
    else:
        time_adamw()


if __name__ == "__main__":
    run_script(main)
