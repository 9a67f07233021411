"""Time per token of the windowed TANGO block against the full TANGO block as T grows.

At each length both blocks (same weights) run forward + backward on the same batch of
`max(tokens // T, 1)` sequences, so the tokens per step stay fixed (while T <= tokens). Every timed round runs every length
and both blocks, so a change in machine load hits all of them alike, and each time is the best
of `repeats` rounds (the least disturbed one, as in `peak.py`). Windowed TANGO's
time per token should stay flat in T (linear cost); full TANGO's grows with T.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from tango_lm.bench.checks import HEAD_DIM, int_list, require_int_list, require_positive
from tango_lm.bench.peak import _sync
from tango_lm.bench.progress import Progress
from tango_lm.bench.stopping import StopRecord, stopped_line
from tango_lm.errors import UserError
from tango_lm.layers.rope import rope_tables
from tango_lm.layers.tango import TangoBlock
from tango_lm.layers.tango_windowed import WindowedTangoBlock
from tango_lm.stop_signals import STOPS
from tango_lm.train.device import autocast, autocast_dtype, pick_device


def _step(
    block: torch.nn.Module,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    dy: torch.Tensor,
    clock,
    dtype: torch.dtype | None = None,
) -> float:
    _sync(x.device)
    t0 = clock()
    with autocast(x.device, dtype):
        y = block(x, rope)
    y.backward(dy.to(y.dtype))
    _sync(x.device)
    return clock() - t0


def windowed_time_per_token(
    seq_lens: tuple[int, ...] = (256, 512, 1024, 2048, 4096),
    window: int = 64,
    d_model: int = 256,
    width: int = 2048,
    head_dim: int = 32,
    tokens: int = 16384,
    feature_map: str = "elu+1",
    repeats: int = 3,
    warmup: int = 1,
    include_tango: bool = True,
    device: str = "auto",
    clock: str = "wall",
    progress: str = "none",
    stops: StopRecord | None = None,
    dtype: torch.dtype | None = None,
) -> list[dict[str, Any]]:
    """One row per length: microseconds per token (forward + backward) of each block, and the
    windowed block's time per token relative to the first length. clock "cpu" times CPU runs by
    this process's CPU time, which other processes on a shared machine disturb less than "wall".
    `progress`: "bar", "lines" or "none" (`bench/progress.py`). With `stops`, SIGTERM or Ctrl-C
    (`bench/stopping.py`) ends the rounds and is recorded there: rows for the lengths timed so far
    (a block not timed at a length has no keys in its row); without, it is raised. `dtype`: the
    autocast dtype the blocks run under (None: fp32; the suite passes bf16 where training uses it)."""
    dev = pick_device(device)
    if clock not in ("wall", "cpu") or (clock == "cpu" and dev.type != "cpu"):
        raise ValueError(f"clock must be 'wall', or 'cpu' on a CPU device (got {clock!r} on {dev.type})")
    timer = time.perf_counter if clock == "wall" else time.process_time
    n_heads = d_model // head_dim
    torch.manual_seed(0)
    windowed = WindowedTangoBlock(d_model, n_heads, width, 1e-6, window, feature_map).to(dev)
    blocks = {"windowed": windowed}
    if include_tango:
        tango = TangoBlock(d_model, n_heads, width, 1e-6).to(dev)
        tango.load_state_dict(windowed.state_dict())
        blocks["tango"] = tango
    cases = []
    for t in seq_lens:
        batch = max(tokens // t, 1)
        gen = torch.Generator(device=dev).manual_seed(t)
        x = torch.randn(batch, t, d_model, device=dev, generator=gen).requires_grad_(True)
        dy = torch.randn(batch, t, d_model, device=dev, generator=gen)
        cases.append((t, batch, x, dy, rope_tables(t, head_dim, 10000.0, dev)))
    times: dict[tuple[int, str], list[float]] = {(t, name): [] for t in seq_lens for name in blocks}
    i = 0
    try:
        with Progress("windowed", warmup + repeats, len(cases) * len(blocks), warmup, progress) as bar:
            for i in range(warmup + repeats):
                for t, _, x, dy, rope in cases:
                    for name, block in blocks.items():
                        bar.run_start(f"{name} T={t}")
                        elapsed = _step(block, x, rope, dy, timer, dtype)
                        bar.run_done(i, f"{name} T={t}", elapsed)
                        if i >= warmup:
                            times[t, name].append(elapsed)
                        block.zero_grad(set_to_none=True)
                        x.grad = None
                bar.round_done(i)
    except STOPS as stop:  # a time limit or Ctrl-C: the lengths timed so far are the rows
        if stops is None:
            raise
        stops.stop(stop, i - warmup)
    rows = []
    for t, batch, *_ in cases:
        if not times[t, "windowed"]:  # the rounds stopped before this length
            continue
        row: dict[str, Any] = {"seq_len": t, "batch": batch}
        for name in blocks:
            if times[t, name]:
                row[f"{name}_us_per_token"] = min(times[t, name]) / (batch * t) * 1e6
        rows.append(row)
    for row in rows:
        row["windowed_vs_first"] = row["windowed_us_per_token"] / rows[0]["windowed_us_per_token"]
        if "tango_us_per_token" in row:
            row["tango_vs_windowed"] = row["tango_us_per_token"] / row["windowed_us_per_token"]
    return rows


TARGET = 1.3  # the suite's target: windowed time/token at the longest T over its time at the shortest


def add_suite_arguments(g: Any) -> None:
    """The windowed suite's own options (an argparse group)."""
    g.add_argument("--window", type=int, default=64, help="windowed TANGO's window W (default %(default)s)")
    g.add_argument(
        "--windowed-lens",
        type=int_list,
        default=(256, 512, 1024, 2048, 4096),
        help="comma-separated sequence lengths, increasing (default 256,512,1024,2048,4096)",
    )
    g.add_argument("--windowed-width", type=int, default=2048, help="TANGO's F in the windowed comparison")
    g.add_argument("--windowed-tokens", type=int, default=16384, help="tokens per step at every T")
    g.add_argument("--no-full-tango", action="store_true", help="windowed suite: time the windowed block only")
    g.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="windowed suite timer")


def check_suite_args(args: argparse.Namespace) -> None:
    """The windowed suite's options of `tango-lm bench` (`bench/registry.py`)."""
    require_positive(args, ("window", "windowed_width", "windowed_tokens", "repeats"))
    require_int_list(args, "windowed_lens")
    if list(args.windowed_lens) != sorted(args.windowed_lens):
        # its target compares the time per token at the last (longest) length with the first (shortest)
        raise UserError(f"--windowed-lens must be in increasing order (got {','.join(map(str, args.windowed_lens))!r})")
    if args.clock == "cpu" and pick_device(args.device).type != "cpu":
        raise UserError(
            f"--clock cpu times this process's CPU, not a {pick_device(args.device).type} device; use --clock wall"
        )
    if args.d_model % HEAD_DIM or args.windowed_width % (args.d_model // HEAD_DIM):
        raise UserError(
            f"the windowed suite uses heads of {HEAD_DIM}: --d-model must be a multiple of {HEAD_DIM} and "
            f"--windowed-width a multiple of d_model / {HEAD_DIM} (got {args.d_model}, {args.windowed_width})"
        )


def run_suite(args: argparse.Namespace, print_table: bool, progress: str = "none") -> dict[str, Any]:
    """The windowed suite of `tango-lm bench`: `windowed_time_per_token` at its options, its
    report (the rows, and the target read at the longest length) printed unless `print_table` is False."""
    stops = StopRecord(args.repeats)
    dev = pick_device(args.device)
    dtype = autocast_dtype("auto", dev)  # bf16 autocast where training uses it (CUDA)
    rows = windowed_time_per_token(
        seq_lens=args.windowed_lens,
        window=args.window,
        d_model=args.d_model,
        width=args.windowed_width,
        head_dim=HEAD_DIM,
        tokens=args.windowed_tokens,
        repeats=args.repeats,
        include_tango=not args.no_full_tango,
        device=args.device,
        clock=args.clock,
        progress=progress,
        stops=stops,
        dtype=dtype,
    )
    # The target is read at the longest length against the first: not measured when a stop came before
    # it, nor with one length (which compares nothing).
    reached = rows and rows[-1]["seq_len"] == args.windowed_lens[-1] and len(args.windowed_lens) > 1
    longest = rows[-1]["windowed_vs_first"] if reached else None
    report = {
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "d_model": args.d_model,
        "width": args.windowed_width,
        "window": args.window,
        "tokens_per_step": args.windowed_tokens,
        "repeats": args.repeats,
        "clock": args.clock,
        "precision": "bf16 autocast" if dtype == torch.bfloat16 else "fp32",
        "rows": rows,
        "target": TARGET,
        "longest_vs_first": longest,
        "target_met": None if longest is None else longest <= TARGET,
        "stopped": stops.record,  # None, or the signal and after how many timed rounds
    }
    if print_table:
        print(format_report(report))
    return report


def format_report(report: dict[str, Any]) -> str:
    rows = report["rows"]
    full = any("tango_us_per_token" in r for r in rows) or not rows  # --no-full-tango times windowed alone
    blocks = "same weights for both blocks" if full else "the windowed block alone (--no-full-tango)"
    lines = [
        f"windowed: device {report['device']} ({report['threads']} threads), one block, d={report['d_model']}, "
        f"F={report['width']}, W={report['window']}, forward + backward on about {report['tokens_per_step']} "
        f"tokens per step (batch = max(tokens // T, 1)), {blocks}; each time is the best of {report['repeats']} "
        f"rounds that alternate every T and block ({report['clock']} clock, {report.get('precision', 'fp32')}, "
        "bench/windowed.py)",
        f"{'T':>6}{'batch':>7}{'windowed us/tok':>17}{'vs T=' + str(rows[0]['seq_len'] if rows else '-'):>11}"
        + (f"{'tango us/tok':>14}{'tango/windowed':>16}" if full else ""),
    ]
    for r in rows:
        tango = f"{r['tango_us_per_token']:>14.2f}{r['tango_vs_windowed']:>16.2f}" if "tango_us_per_token" in r else ""
        lines.append(
            f"{r['seq_len']:>6}{r['batch']:>7}{r['windowed_us_per_token']:>17.2f}{r['windowed_vs_first']:>11.2f}{tango}"
        )
    if report["longest_vs_first"] is not None:
        lines.append(
            f"target: windowed time/token at T={rows[-1]['seq_len']} <= {report['target']} x its time at "
            f"T={rows[0]['seq_len']}: {report['longest_vs_first']:.2f} "
            f"({'met' if report['target_met'] else 'NOT met'})"
        )
    if report.get("stopped"):
        meaning = "each time is the best of the rounds its length finished; the lengths not reached have no row"
        lines.append(stopped_line(report["stopped"], "timed rounds", meaning))
    return "\n".join(lines)
