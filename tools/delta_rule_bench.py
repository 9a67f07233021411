"""The gated delta rule alone (gdn-hybrid's token mixing): its implementations side by side in one process.

Usage: PYTHONPATH=src python tools/delta_rule_bench.py [--batch 4 --heads 4 --seq-len 1024
       --head-dim 64 --chunk 64 --dtype fp32 --device cpu --rounds 9 --threads 1 --no-compile]

Forward + backward of all outputs and the final state (`ops/delta_rule.py`), alternating round
after round: `chunked` (the chunked PyTorch form, eager), `compiled` (the same through
`torch.compile`, inductor, as `train.compile=true` runs it) and, on CUDA where fla-core is
installed, `fla` (fla's Triton kernel, what `gdn_backend=auto` runs in eager mode). Reports the
median times and each as a ratio to `chunked`, after checking every output against `chunked`'s.
On CUDA, bf16 inputs are what autocast hands the layer (q, k, v in bf16; β and g in fp32).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tango_lm.ops import delta_rule  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_inputs(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    b, h, t, d = args.batch, args.heads, args.seq_len, args.head_dim
    dtype = DTYPES[args.dtype]
    q = torch.randn(b, h, t, d, generator=gen) * d**-0.5
    k = F.normalize(torch.randn(b, h, t, d, generator=gen), dim=-1)
    v = torch.randn(b, h, t, d, generator=gen)
    beta = torch.rand(b, h, t, generator=gen)
    g = -torch.rand(b, h, t, generator=gen) * 0.1
    state = torch.randn(b, h, d, d, generator=gen) * 0.1
    wide = [x.to(device) for x in (beta, g, state)]
    return [x.to(device, dtype).requires_grad_() for x in (q, k, v)] + [x.requires_grad_() for x in wide]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled row")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    inputs = make_inputs(args, device)

    def chunked(*x):
        return delta_rule.delta_rule_chunked(*x, chunk=args.chunk)

    variants = {"chunked": chunked}
    if not args.no_compile:
        variants["compiled"] = torch.compile(chunked, dynamic=False)
    if device.type == "cuda" and delta_rule._fla_kernel() is not None:
        variants["fla"] = lambda *x: delta_rule.gated_delta_rule(*x, backend="fla")

    reference = [y.detach().float() for y in chunked(*inputs)]
    grads = [torch.randn_like(y) for y in reference]
    for name, fn in variants.items():  # check, and warm up (the compile happens here)
        start = time.perf_counter()
        out = fn(*inputs)
        torch.autograd.backward(list(out), [g.to(y.dtype) for g, y in zip(grads, out, strict=True)])
        sync(device)
        for x in inputs:
            x.grad = None
        error = max(
            float((y.detach().float() - r).abs().max() / r.abs().max()) for y, r in zip(out, reference, strict=True)
        )
        print(f"{name:9s} first call {time.perf_counter() - start:6.2f} s, max relative error vs chunked {error:.1e}")

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            sync(device)
            start = time.perf_counter()
            out = fn(*inputs)
            sync(device)
            mid = time.perf_counter()
            torch.autograd.backward(list(out), [g.to(y.dtype) for g, y in zip(grads, out, strict=True)])
            sync(device)
            times[name].append((mid - start, time.perf_counter() - mid))
            for x in inputs:
                x.grad = None
    skip = min(2, args.rounds - 1)
    medians = {n: [statistics.median(r[i] for r in ts[skip:]) for i in (0, 1)] for n, ts in times.items()}
    base = sum(medians["chunked"])
    print(
        f"B={args.batch} H={args.heads} T={args.seq_len} d={args.head_dim} chunk={args.chunk} {args.dtype} "
        f"{device} (torch {torch.__version__}), median of {args.rounds - skip} rounds after {skip}"
    )
    for name, (fwd, bwd) in medians.items():
        print(f"{name:9s} forward {fwd * 1e3:8.2f} ms  backward {bwd * 1e3:8.2f} ms  x {(fwd + bwd) / base:.2f}")


if __name__ == "__main__":
    main()
