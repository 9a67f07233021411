"""A matmul peak measured on the device in the same run, the denominator of MFU."""

from __future__ import annotations

import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    size: int | None = None,
    repeats: int = 5,
    products: int | None = None,
) -> float:
    """Best FLOP/s over `repeats` timings of `products` back-to-back square matmuls each (after a
    warm-up). On a GPU 8 per timing (None): one 8192 bf16 product takes ~1.4 ms on an H200, and the
    launch and the synchronizing read of the clock around a lone one made the peak 1-2% low."""
    n = size or (8192 if device.type == "cuda" else 2048)
    k = products or (8 if device.type == "cuda" else 1)
    # Its own generator: the global one, restored by a resume, must draw what it would have (the
    # trainer measures the peak after restoring it, and again when a step beats it).
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    for _ in range(2):
        a @ b
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(k):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / k)
    return 2 * n**3 / best
