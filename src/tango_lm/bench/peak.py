"""A matmul peak measured on the device in the same run, the denominator of MFU."""

from __future__ import annotations

import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(
    device: torch.device, dtype: torch.dtype = torch.float32, size: int | None = None, repeats: int = 5
) -> float:
    """Best FLOP/s over `repeats` timed square matmuls (after a warm-up)."""
    n = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
