"""The gated delta rule alone (gdn-hybrid's token mixing): its implementations side by side in one process.

Usage: PYTHONPATH=src python tools/delta_rule_bench.py [--batch 4 --heads 4 --seq-len 1024
       --head-dim 64 --chunk 64 --dtype fp32 --device cpu --rounds 7 --threads 1 --no-compile]

Forward + backward of all outputs and the final state (`ops/delta_rule.py`), alternating round
after round (tools/op_timing.py): `chunked` (the chunked PyTorch form, eager), `compiled` (the same
through `torch.compile`, inductor, as `train.compile=true` runs it on CPUs) and, on CUDA where fla-core is
installed, `fla` (fla's Triton kernels, what `gdn_backend=auto` runs there) and `fla-comp` (the same
compiled, fla's kernels as custom ops inside the graph: ops/delta_rule_fla.py). Reports the
medians (forward + backward, and the forward alone), the first as a ratio to `chunked`, and on CUDA the
memory a step allocates beyond its inputs, after checking every output and gradient against
`chunked`'s. `--dtype bf16` gives q, k, v in bf16 and β, g and the state in fp32, as autocast hands
them to the GDN layer's delta rule.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import op_timing  # noqa: E402

from tango_lm.errors import UserError, run_script  # noqa: E402
from tango_lm.ops import delta_rule, delta_rule_fla  # noqa: E402

DTYPES = op_timing.DTYPES


def make_inputs(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    b, h, t, d = args.batch, args.heads, args.seq_len, args.head_dim
    q = torch.randn(b, h, t, d, generator=gen) * d**-0.5
    k = F.normalize(torch.randn(b, h, t, d, generator=gen), dim=-1)
    v = torch.randn(b, h, t, d, generator=gen)
    beta = torch.rand(b, h, t, generator=gen)
    g = -torch.rand(b, h, t, generator=gen) * 0.1
    state = torch.randn(b, h, d, d, generator=gen) * 0.1
    narrow = [x.to(device, DTYPES[args.dtype]).requires_grad_() for x in (q, k, v)]
    return (*narrow, *(x.to(device).requires_grad_() for x in (beta, g, state)))


def flat(fn):
    """One tensor of all outputs and the final state (fp32), the form op_timing times and checks."""
    return lambda *x: torch.cat([y.float().flatten() for y in fn(*x)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    op_timing.add_common_arguments(
        parser,
        batch=4,
        dtype="fp32",
        rounds=7,
        device="cuda" if torch.cuda.is_available() else "cpu",
        device_help="torch device (default: cuda when there is one, else cpu)",
    )
    parser.add_argument("--heads", type=op_timing.positive_int, default=4, help="heads (default %(default)s)")
    parser.add_argument(
        "--head-dim", type=op_timing.positive_int, default=64, help="key and value width per head (default %(default)s)"
    )
    parser.add_argument(
        "--chunk", type=op_timing.positive_int, default=64, help="the chunked form's chunk length (default %(default)s)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled row")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("no CUDA device: run this on a GPU machine, or pass --device cpu")
    device = torch.device(args.device)
    xs = make_inputs(args, device)

    def chunked(*x):
        return delta_rule.delta_rule_chunked(*x, chunk=args.chunk)

    impls = {"chunked": flat(chunked)}
    if not args.no_compile:
        impls["compiled"] = flat(torch.compile(chunked, dynamic=False))
    if device.type == "cuda" and delta_rule_fla.fla_available():

        def fla(*x):
            return delta_rule.gated_delta_rule(*x, backend="fla")

        impls["fla"] = flat(fla)
        if not args.no_compile:  # fla's kernels as custom ops inside the graph, as train.compile=true runs them
            impls["fla-comp"] = flat(torch.compile(fla, dynamic=False, fullgraph=True))
    dy = torch.randn_like(impls["chunked"](*xs).detach())
    timed = op_timing.time_implementations(impls, xs, dy, "chunked", args.rounds, device)
    base = timed["chunked"]["fwd_bwd_s"]
    print(
        f"gated delta rule, B={args.batch} H={args.heads} T={args.seq_len} d={args.head_dim} chunk={args.chunk} "
        f"{args.dtype} on {device} (torch {torch.__version__}); forward + backward, median of {args.rounds} "
        "alternating rounds after a checked, untimed first call"
    )
    for name, r in timed.items():
        memory = f"  {r['memory_bytes'] / 2**20:8.1f} MiB" if r["memory_bytes"] is not None else ""
        print(
            f"{name:9s} fwd+bwd {r['fwd_bwd_s'] * 1e3:8.2f} ms  fwd {r['fwd_s'] * 1e3:8.2f} ms  "
            f"x {r['fwd_bwd_s'] / base:.2f}  max error vs chunked {r['error']:.1e}{memory}"
        )


if __name__ == "__main__":
    run_script(main)
