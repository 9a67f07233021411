"""Time per token of the windowed TANGO block against the full TANGO block as T grows.

At each length both blocks (same weights) run forward + backward on the same batch of
`max(tokens // T, 1)` sequences, so the tokens per step stay fixed (while T <= tokens). Every timed round runs every length
and both blocks, so a change in machine load hits all of them alike, and each time is the best
of `repeats` rounds (the least disturbed one, as in `peak.py`). Windowed TANGO's
time per token should stay flat in T (linear cost); full TANGO's grows with T.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tango_lm.bench.peak import _sync
from tango_lm.bench.progress import Progress
from tango_lm.bench.stopping import STOPS, StopRecord
from tango_lm.layers.rope import rope_tables
from tango_lm.layers.tango import TangoBlock
from tango_lm.layers.tango_windowed import WindowedTangoBlock
from tango_lm.train.device import autocast, pick_device


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
    print_table: bool = True,
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
    if print_table:
        print(format_rows(rows, dev, window, d_model, width, clock))
    return rows


def format_rows(
    rows: list[dict[str, Any]], device: torch.device, window: int, d_model: int, width: int, clock: str = "wall"
) -> str:
    lines = [
        f"device {device} ({torch.get_num_threads()} threads), d={d_model}, F={width}, W={window}, "
        f"forward+backward, {clock} clock, best of the timed rounds",
        f"{'T':>6}{'batch':>7}{'windowed us/tok':>17}{'vs first T':>12}{'tango us/tok':>14}{'tango/windowed':>16}",
    ]
    for r in rows:
        tango = f"{r['tango_us_per_token']:>14.2f}{r['tango_vs_windowed']:>16.2f}" if "tango_us_per_token" in r else ""
        lines.append(
            f"{r['seq_len']:>6}{r['batch']:>7}{r['windowed_us_per_token']:>17.2f}{r['windowed_vs_first']:>12.2f}{tango}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    windowed_time_per_token()
