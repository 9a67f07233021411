"""What `train.loggers` costs a CPU training step: two trainers of the same model, one logging to
JSONL only and one to JSONL + TensorBoard + W&B (offline unless WANDB_MODE says otherwise),
alternate step by step in one process; every step is logged (`log_every: 1`, the worst case).

Prints the median step time (step + logging) of each, their ratio, and the median time of the
logging calls alone. Usage:

    python tools/logging_overhead.py [--steps 40] [--d-model 256] [--width 4096] [--seq-len 256] [--batch-size 8]
                                     [--log-every 1] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import string
import tempfile
import time
from pathlib import Path

import torch
from op_timing import positive_int

from tango_lm.data.shards import write_prepared
from tango_lm.data.tokenizers import get_tokenizer
from tango_lm.errors import run_script
from tango_lm.train.config import RunConfig
from tango_lm.train.loggers import LogContext, close_loggers, open_loggers
from tango_lm.train.trainer import Trainer
from tango_lm.train.utilization import matmul_peak, peak_memory_mib

ALL = ["jsonl", "tensorboard", "wandb"]


def synthetic_data(root: Path, tokens: int) -> Path:
    rng = random.Random(0)
    docs = ["".join(rng.choice(string.ascii_lowercase + " ") for _ in range(255)) for _ in range(tokens // 256 + 1)]
    path = root / "data"
    write_prepared(
        path,
        get_tokenizer("byte"),
        {"train": docs, "dev": docs[:8], "test": docs[:8]},
        {"name": "random"},
        progress=False,
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps", type=positive_int, default=40, help="timed steps of each trainer (default %(default)s)"
    )
    parser.add_argument("--d-model", type=int, default=256, help="model width d (default %(default)s)")
    parser.add_argument("--width", type=int, default=4096, help="TANGO's gate width F (default %(default)s)")
    parser.add_argument("--depth", type=int, default=4, help="block applications (default %(default)s)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default %(default)s)")
    parser.add_argument("--log-every", type=int, default=1, help="log every N-th step (the trainer's default is 10)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = synthetic_data(root, (args.steps + 2) * args.batch_size * (args.seq_len + 1))
        trainers = {}
        for name, loggers in (("jsonl", ["jsonl"]), ("all", ALL)):
            run = RunConfig.from_dict(
                {
                    "model": {
                        "arch": "tango",
                        "d_model": args.d_model,
                        "width": args.width,
                        "depth": args.depth,
                        "vocab_size": 257,
                        "context_length": args.seq_len,
                    },
                    "data": {"dir": str(data)},
                    "train": {
                        "out_dir": str(root / name),
                        "steps": args.steps + 2,
                        "batch_size": args.batch_size,
                        "log_every": args.log_every,
                        "device": "cpu",
                        "precision": "fp32",
                        "loggers": loggers,
                        "progress": False,
                    },
                }
            )
            trainer = Trainer(run)
            trainer.out.mkdir(parents=True)
            trainer.loggers = open_loggers(loggers, LogContext(trainer.out, run.to_dict(), "tango-lm-overhead"))
            trainer.peak_flops = matmul_peak(trainer.device, trainer.dtype)
            trainers[name] = trainer
        tokens_per_step = args.batch_size * args.seq_len
        step_s: dict[str, list[float]] = {n: [] for n in trainers}
        log_s: dict[str, list[float]] = {n: [] for n in trainers}
        for i in range(args.steps + 2):
            for name, trainer in trainers.items():  # the two trainers alternate: same machine state
                t0 = time.perf_counter()
                loss = trainer.train_step()
                dt = time.perf_counter() - t0
                tokens_per_s = tokens_per_step / dt
                t1 = time.perf_counter()
                if trainer.step % args.log_every == 0:
                    trainer._log(
                        {
                            "step": trainer.step,
                            "loss": loss,
                            "tokens": trainer.tokens_seen,
                            "tokens_per_s": tokens_per_s,
                            "mfu": trainer._mfu(tokens_per_s),
                            "peak_memory_mib": peak_memory_mib(trainer.device),
                            **trainer._last,
                        }
                    )
                t2 = time.perf_counter()
                if i >= 2:  # warm-up steps aside
                    step_s[name].append(t2 - t0)
                    log_s[name].append(t2 - t1)
        for trainer in trainers.values():
            close_loggers(trainer.loggers)
    base, full = statistics.median(step_s["jsonl"]), statistics.median(step_s["all"])
    print(
        f"tango d={args.d_model} F={args.width} depth={args.depth} T={args.seq_len} B={args.batch_size}, "
        f"{torch.get_num_threads()} threads, {args.steps} steps each, logged every {args.log_every}"
    )
    for name in trainers:
        print(
            f"  loggers {'+'.join(['jsonl'] if name == 'jsonl' else ALL):<24} step + log "
            f"{statistics.median(step_s[name]) * 1e3:8.2f} ms   log calls {statistics.median(log_s[name]) * 1e6:8.1f} us"
        )
    extra = (statistics.mean(log_s["all"]) - statistics.mean(log_s["jsonl"])) / base
    print(
        f"  ratio of medians (all loggers / jsonl): {full / base:.4f}; the added logging calls alone: "
        f"{extra:.3%} of a step (means over all steps)"
    )


if __name__ == "__main__":
    run_script(main)
