"""Training memory on the ops a GPU runs, predicted without one; and bytes autograd keeps for the
backward of a training forward (the activations that set peak memory at language-model sizes).

Usage:
  python tools/saved_for_backward.py gpu-path [--d-model 512 --depth 4 --tango-width 28480
      --vocab-size 50257 --seq-len 1024 --batch-size 16 --archs tango,loop-transformer,...
      --kernels triton|sdpa-sliced|reference]
  python tools/saved_for_backward.py heads [--backbone dense-142m --heads standard,onona,...
      --vocab-size 50304 --seq-len 1024 --batch-size 32]
  python tools/saved_for_backward.py probabilities [T]

`gpu-path`: every architecture of the train suite at matched parameters (as `tango-lm bench
--suite train` matches them; defaults: the 70M tier of the TANGO paper's Table 3), on the ops a
GPU runs (TANGO_LM_KERNELS=triton: the Triton custom ops; SDPA's flash kernel for attention),
under bf16 autocast. Nothing runs and no GPU is needed: memory depends on shapes, dtypes and which
implementation each op takes, not on values, so the models run under FakeTensorMode (shapes only;
the custom ops' fake implementations stand in for the kernels) on a CPU, a second or two per
model. Per model: a training step's peak (every storage alive: parameters, gradients, AdamW state,
activations, temporaries; not the caching allocator's rounding or fragmentation) and what the
forward saves for the backward (each storage once, parameters not counted, autocast's bf16 weight
copies counted). MoE dispatches through its fixed capacity buffers, as on GPUs; the gated delta
rule (gdn-hybrid) runs its chunked form, not fla's kernels, which CUDA takes where fla-core is
installed. Predictions, not measurements: `tango-lm bench --suite train` on a GPU measures.
(`--kernels sdpa-sliced` is not a CUDA prediction: on CPUs SDPA takes its math backend for unequal
query and value widths, which CUDA's fused backends accept.)

`heads`: every head on one backbone (the memory suite's comparison, at the paper's micro-batch),
a training step's predicted peak the same way, as a ratio to the Standard head's.

`probabilities`: TANGO's fused CPU op with its attention probabilities kept and recomputed
(ops/tango_mix.py `recompute_probs`), run for real at d = 256, F = 8192, depth 4 (default T = 2048).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
import weakref
from pathlib import Path

# Before triton is imported: CPU tensors pass the Triton ops' device check (the kernels never run).
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tango_lm import ModelConfig, build_model  # noqa: E402
from tango_lm.bench.training import BASELINE, default_archs, matched_configs  # noqa: E402
from tango_lm.errors import UserError, run_script  # noqa: E402
from tango_lm.layers import moe as moe_layer  # noqa: E402
from tango_lm.models.registry import ARCHITECTURES  # noqa: E402
from tango_lm.ops import dispatch  # noqa: E402
from tango_lm.train.optim import adamw  # noqa: E402


def triton_interpreted() -> bool:
    """Whether the Triton ops take CPU tensors here (TRITON_INTERPRET=1 before their import)."""
    try:
        from tango_lm.ops import triton_common
    except ImportError:  # triton is not installed
        return False
    return triton_common.INTERPRETED


@contextlib.contextmanager
def kernels_override(kernels: str):
    """Every op on `kernels` where it has that implementation (dispatch.py's environment override),
    the variable as it was afterwards."""
    previous = os.environ.get(dispatch.ENV)
    os.environ[dispatch.ENV] = kernels
    try:
        yield
    finally:
        if previous is None:
            del os.environ[dispatch.ENV]
        else:
            os.environ[dispatch.ENV] = previous


def autocast(dtype: torch.dtype | None):
    """CPU autocast to `dtype` (standing in for CUDA's), or none."""
    return torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None)


def saved_tensors(model: torch.nn.Module, input_ids: torch.Tensor, dtype: torch.dtype | None) -> list[dict]:
    """Every storage autograd saves in `model.nll` over `input_ids` (parameters left out), once:
    its bytes, the first shape and dtype saved from it, and the project's source line that saved it."""
    params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    seen: dict[StorageWeakRef, dict] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in params and ref not in seen:
            ours = [f for f in traceback.extract_stack() if "tango_lm" in f.filename]
            where = f"{ours[-1].filename.split('tango_lm/')[-1]}:{ours[-1].lineno}" if ours else "?"
            seen[ref] = {
                "bytes": t.untyped_storage().nbytes(),
                "shape": tuple(t.shape),
                "dtype": t.dtype,
                "where": where,
            }
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(dtype):
        model.nll(input_ids[:, :-1], input_ids[:, 1:])
    return list(seen.values())


@contextlib.contextmanager
def shapes_only(cfg: ModelConfig, kernels: str):
    """A model built from `cfg` under FakeTensorMode (shapes, no values, no memory), with every op
    on `kernels` where it has that implementation (dispatch.py's override); yields the model."""
    if kernels == "triton" and not triton_interpreted():
        raise RuntimeError(
            "the Triton ops need triton installed and, for the CPU's fake tensors, TRITON_INTERPRET=1 before import"
        )
    cpu_dispatch = moe_layer.use_capacity_dispatch
    moe_layer.use_capacity_dispatch = lambda x: True  # MoE as on GPUs: fixed capacity buffers, static shapes
    try:
        with kernels_override(kernels), FakeTensorMode():
            torch.manual_seed(0)
            model = build_model(cfg)
            model.check_ids = lambda ids: None  # it reads the ids' values, which fake tensors lack
            model.check_targets = lambda ids, targets: None  # so does this
            yield model
    finally:
        moe_layer.use_capacity_dispatch = cpu_dispatch


def kernel_path_saved(
    cfg: ModelConfig,
    batch_size: int,
    seq_len: int,
    kernels: str = "triton",
    dtype: torch.dtype | None = torch.bfloat16,
) -> list[dict]:
    """`saved_tensors` of one training forward under autocast to `dtype`, shapes only (`shapes_only`)."""
    with shapes_only(cfg, kernels) as model:
        ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1))
        return saved_tensors(model, ids, dtype)


class LiveStorages(TorchDispatchMode):
    """Bytes of the storages alive, and their most, while it is active: each op's outputs are
    counted once per storage (views share theirs) from when they appear until freed. Agrees to the
    byte with torch's MemTracker (torch.distributed._tools), which refuses a module called twice in
    one forward (onóna's tables)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: set[StorageWeakRef] = set()
        for t in tensors:
            self._count(t)

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ref = StorageWeakRef(storage)
        if ref not in self._alive:
            self._alive.add(ref)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, ref, storage.nbytes())

    def _free(self, ref: StorageWeakRef, nbytes: int) -> None:
        self._alive.discard(ref)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


def kernel_path_peak(
    cfg: ModelConfig,
    batch_size: int,
    seq_len: int,
    kernels: str = "triton",
    dtype: torch.dtype | None = torch.bfloat16,
) -> int:
    """Peak bytes of a training step (forward, backward, AdamW as the benchmarks build it, zeroed
    gradients), shapes only: over two steps (the first creates AdamW's state), every storage alive
    (`LiveStorages`). The scope of the train suite's CUDA column (the model's parameters, gradients,
    optimizer state, activations and temporaries; not the batch); the caching allocator's rounding
    and fragmentation are not modelled."""
    with shapes_only(cfg, kernels) as model:
        opt = adamw(model.parameters(), model, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1))
        with LiveStorages(list(model.parameters())) as live:
            for _ in range(2):
                with autocast(dtype):
                    loss = model.nll(ids[:, :-1], ids[:, 1:])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del loss
        return live.peak


def quadratic(saved: list[dict], seq_len: int) -> list[dict]:
    """Saved tensors with two dimensions of T: attention scores or probabilities ([B, H, T, T])."""
    return [s for s in saved if sum(d == seq_len for d in s["shape"]) >= 2]


def model_sizes(cfg: ModelConfig | None) -> dict[str, int]:
    """The widths a model's [B, T, n] tensors have: a T equal to one would read them as [T, T]."""
    if cfg is None:
        return {}
    sizes = {"d": cfg.d_model, "width": cfg.width, "2 x width": 2 * cfg.width}
    if ARCHITECTURES[cfg.arch].uses_heads:
        sizes["head dim"] = cfg.head_dim
    else:  # GAU, FLASH: one head of qk_dim
        sizes["qk_dim"] = cfg.qk_dim
    if cfg.arch == "tango-compact":
        sizes["controller width"] = cfg.controller_width or cfg.d_model
    return sizes


def gpu_path(args: argparse.Namespace) -> None:
    archs = args.archs.split(",") if args.archs else default_archs()
    rows = matched_configs(archs, args.d_model, args.depth, args.tango_width, args.vocab_size, args.seq_len)
    for arch, cfg, _ in rows:
        same = [name for name, size in model_sizes(cfg).items() if size == args.seq_len]
        if same:  # a [B, T, d] tensor would then read as a [T, T] one
            raise UserError(
                f"--seq-len {args.seq_len} is {arch}'s {same[0]} too, so the [T, T] column cannot tell them "
                "apart; choose another --seq-len"
            )
    print(
        f"GPU ops, shapes only (FakeTensorMode on a CPU): TANGO_LM_KERNELS={args.kernels} where an op has it "
        f"(attention: SDPA flash), bf16 autocast, d={args.d_model}, depth {args.depth}, V={args.vocab_size}, "
        f"batch {args.batch_size} x T={args.seq_len}; peak = a training step's (predicted, not measured); saved = what the forward keeps for the backward, parameters not counted"
    )
    print(
        f"{'arch':<20}{'width':>7}{'peak GiB':>10}{'x loop':>8}{'saved GiB':>11}{'x loop':>8}  "
        f"{'[T, T] saved':<14}largest saved (where)"
    )
    results, skipped = {}, []
    for arch, cfg, note in rows:
        if cfg is None:
            skipped.append(note)
            continue
        saved = kernel_path_saved(cfg, args.batch_size, args.seq_len, args.kernels)
        peak = kernel_path_peak(cfg, args.batch_size, args.seq_len, args.kernels)
        results[arch] = (cfg, saved, sum(s["bytes"] for s in saved), peak)
    _, _, base_saved, base_peak = results[BASELINE]
    for arch, (cfg, saved, total, peak) in results.items():
        top = max(saved, key=lambda s: s["bytes"])
        count = sum(s["bytes"] == top["bytes"] for s in saved)
        square = "yes" if quadratic(saved, args.seq_len) else "no"
        print(
            f"{arch:<20}{cfg.width:>7}{peak / 2**30:>10.2f}{peak / base_peak:>8.2f}{total / 2**30:>11.2f}"
            f"{total / base_saved:>8.2f}  {square:<14}{count} x {list(top['shape'])} "
            f"{str(top['dtype']).removeprefix('torch.')} ({top['where']})"
        )
    for note in skipped:  # "skipped: ...", as the train bench says it
        print(note)


def heads(args: argparse.Namespace) -> None:
    """Every head on one backbone (the memory suite's comparison), the step's predicted peak."""
    from tango_lm.bench.memory import memory_config

    base = memory_config(args.backbone, 256, 4, args.vocab_size, args.seq_len)
    names = args.heads.split(",")
    if "standard" not in names:
        names.insert(0, "standard")
    configs = {name: base.replace(head=name) for name in names}  # an unknown head fails before the table starts
    print(
        f"GPU ops, shapes only (FakeTensorMode on a CPU): {args.backbone} ({base.arch}, d={base.d_model}, depth "
        f"{base.depth}), V={args.vocab_size}, batch {args.batch_size} x T={args.seq_len}, bf16 autocast, default "
        f"chunked loss (chunk {base.loss_chunk}); peak = a training step's (predicted, not measured)"
    )
    print(f"{'head':<12}{'params':>13}{'peak GiB':>10}{'x standard':>12}")
    peaks = {}
    for name, cfg in configs.items():
        peaks[name] = (cfg, kernel_path_peak(cfg, args.batch_size, args.seq_len, args.kernels))
    for name, (cfg, peak) in peaks.items():
        total = cfg.num_params()["total"]
        print(f"{name:<12}{total:>13,}{peak / 2**30:>10.2f}{peak / peaks['standard'][1]:>12.2f}")


def probabilities(args: argparse.Namespace) -> None:
    import tango_lm.ops.tango_mix as tango_mix

    t = args.seq_len
    cfg = ModelConfig(arch="tango", d_model=256, depth=4, width=8192, vocab_size=257, context_length=t)
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (1, t + 1))
    policy = tango_mix.recompute_probs
    try:
        for name, rule in (("kept", lambda t, w: False), ("recomputed", lambda t, w: True), ("default", policy)):
            tango_mix.recompute_probs = rule
            with kernels_override("blocked"):  # the fused CPU op whose policy this reports
                total = sum(s["bytes"] for s in saved_tensors(model, x, None))
            print(
                f"T={t}, F={cfg.width}, depth {cfg.depth}, probabilities {name}: {total / 2**20:,.0f} MiB saved for the backward"
            )
    finally:
        tango_mix.recompute_probs = policy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="report", required=True)
    gpu = sub.add_parser("gpu-path", help="every architecture on the GPU's kernels, shapes only")
    gpu.add_argument("--d-model", type=int, default=512, help="model width d (default: the 70M tier's %(default)s)")
    gpu.add_argument("--depth", type=int, default=4, help="block applications or layers (default %(default)s)")
    gpu.add_argument(
        "--tango-width",
        type=int,
        default=28480,
        help="TANGO's F; the other widths are matched to it (default %(default)s)",
    )
    gpu.add_argument("--vocab-size", type=int, default=50257, help="vocabulary (default: GPT-2's %(default)s)")
    gpu.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default %(default)s)")
    gpu.add_argument("--batch-size", type=int, default=16, help="sequences per step (default %(default)s)")
    gpu.add_argument("--archs", default=None, help="comma-separated (default: the train suite's)")
    gpu.add_argument("--kernels", default="triton", choices=dispatch.KERNELS, help="dispatch.py's override")
    on_heads = sub.add_parser("heads", help="every head on one backbone (the memory suite's), shapes only")
    on_heads.add_argument("--backbone", default="dense-142m", help="a preset or an architecture")
    on_heads.add_argument(
        "--heads",
        default="standard,onona,untied,mos,sigsoftmax,moss",
        help="comma-separated heads; Standard, the ratios' base, is added when missing (default %(default)s)",
    )
    on_heads.add_argument(
        "--vocab-size", type=int, default=50304, help="vocabulary (default: the onóna paper's %(default)s)"
    )
    on_heads.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default %(default)s)")
    on_heads.add_argument(
        "--batch-size", type=int, default=32, help="sequences per step (default: the paper's micro-batch, %(default)s)"
    )
    on_heads.add_argument("--kernels", default="triton", choices=dispatch.KERNELS, help="dispatch.py's override")
    probs = sub.add_parser("probabilities", help="TANGO's fused CPU op, probabilities kept or recomputed")
    probs.add_argument(
        "seq_len", type=int, nargs="?", default=2048, help="tokens in the sequence (default %(default)s)"
    )
    args = parser.parse_args(argv)
    {"gpu-path": gpu_path, "heads": heads, "probabilities": probabilities}[args.report](args)


if __name__ == "__main__":
    run_script(main)
