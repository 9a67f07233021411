"""Training throughput of TANGO and Loop Transformer++ at matched parameters, side by side.

Both models take full training steps (forward, backward, AdamW) on the same random token batch;
steps alternate between the models so both see the same machine state, and each model's time
is the median of its timed steps. Achieved FLOP/s uses the analytic FLOPs per token
(`tango_lm.models.flops`) and is also given as a fraction of a matmul peak measured here.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from tango_lm.bench.peak import _sync, measure_matmul_peak
from tango_lm.models.config import ModelConfig
from tango_lm.models.matching import match_width
from tango_lm.models.model import build_model
from tango_lm.train.device import autocast, autocast_dtype, pick_device


def matched_pair(d_model: int, depth: int, tango_width: int, vocab_size: int, seq_len: int) -> list[ModelConfig]:
    """TANGO at `tango_width` and a Loop Transformer++ whose width matches its total parameters."""
    tango = ModelConfig(arch="tango", d_model=d_model, depth=depth, width=tango_width,
                        vocab_size=vocab_size, context_length=seq_len)
    loop = match_width(tango.replace(arch="loop-transformer"), tango.num_params()["total"])
    return [loop, tango]


def run_training_bench(d_model: int = 256, seq_len: int = 256, depth: int = 4, batch_size: int = 4,
                       steps: int = 6, warmup: int = 2, tango_width: int = 8192, vocab_size: int = 257,
                       device: str = "auto", print_table: bool = True, configs: list[ModelConfig] | None = None
                       ) -> dict[str, Any]:
    dev = pick_device(device)
    dtype = autocast_dtype("auto", dev)
    configs = configs or matched_pair(d_model, depth, tango_width, vocab_size, seq_len)
    torch.manual_seed(0)
    models = [build_model(c).to(dev) for c in configs]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in models]
    inputs = torch.randint(0, configs[0].vocab_size, (batch_size, seq_len + 1), device=dev)
    x, y = inputs[:, :-1], inputs[:, 1:]
    times: list[list[float]] = [[] for _ in models]
    for i in range(warmup + steps):
        for j, (model, opt) in enumerate(zip(models, opts, strict=True)):
            _sync(dev)
            t0 = time.perf_counter()
            with autocast(dev, dtype):
                loss = model.nll(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(dev)
            if i >= warmup:
                times[j].append(time.perf_counter() - t0)
    peak = measure_matmul_peak(dev, dtype or torch.float32)
    rows = []
    for cfg, ts in zip(configs, times, strict=True):
        step_s = statistics.median(ts)
        tok_s = batch_size * seq_len / step_s
        fpt = cfg.flops_per_token(seq_len)
        rows.append({"arch": cfg.arch, "width": cfg.width, "params_total": cfg.num_params()["total"],
                     "tokens_per_s": tok_s, "flops_per_token": fpt, "flop_per_s": tok_s * fpt,
                     "mfu": tok_s * fpt / peak, "step_s": step_s})
    base = rows[0]
    for r in rows:
        r["tokens_per_s_vs_loop"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["flop_per_s_vs_loop"] = r["flop_per_s"] / base["flop_per_s"]
    report = {"device": str(dev), "threads": torch.get_num_threads(), "d_model": configs[0].d_model,
              "seq_len": seq_len, "depth": configs[0].depth, "batch_size": batch_size, "timed_steps": steps,
              "matmul_peak_flop_per_s": peak, "models": rows}
    if print_table:
        print(format_report(report))
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"device {report['device']} ({report['threads']} threads), d={report['d_model']}, T={report['seq_len']}, "
        f"depth {report['depth']}, batch {report['batch_size']}, median of {report['timed_steps']} steps",
        f"measured matmul peak: {report['matmul_peak_flop_per_s'] / 1e9:.1f} GFLOP/s",
        f"{'arch':<18}{'width':>7}{'params':>12}{'tok/s':>9}{'MFLOP/tok':>11}{'GFLOP/s':>9}{'MFU':>7}"
        f"{'tok/s vs loop':>15}{'FLOP/s vs loop':>16}",
    ]
    for r in report["models"]:
        lines.append(
            f"{r['arch']:<18}{r['width']:>7}{r['params_total']:>12,}{r['tokens_per_s']:>9,.0f}"
            f"{r['flops_per_token'] / 1e6:>11.1f}{r['flop_per_s'] / 1e9:>9.1f}{r['mfu']:>7.1%}"
            f"{r['tokens_per_s_vs_loop']:>15.2f}{r['flop_per_s_vs_loop']:>16.2f}"
        )
    return "\n".join(lines)
