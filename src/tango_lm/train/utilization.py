"""MFU and peak memory for the trainer's log: the benchmark's measures (bench/peak.py), made cheap
enough to take at the start of every run."""

from __future__ import annotations

import resource
import sys

import torch

from tango_lm.bench.peak import measure_matmul_peak

# One measurement per (device, dtype, threads) and process: a sweep or a test session training many
# runs measures once.
_PEAKS: dict[tuple[str, str, int], float] = {}


def matmul_peak(device: torch.device, dtype: torch.dtype | None, again: bool = False) -> float:
    """FLOP/s of the best of three square matmuls in the dtype the model computes in. On CPUs the
    matmuls are 1024 wide (2.1 GFLOP each; the benchmark uses 2048), on GPUs bench/peak.py's 8192.
    `again`: measure once more and keep the better of the two (the trainer does when the run beats
    the peak: on a machine busy with other jobs, the start-up measurement came out at half the
    peak, and MFU read 112%)."""
    dtype = dtype or torch.float32
    key = (str(device), str(dtype), torch.get_num_threads())
    if key not in _PEAKS or again:
        measured = measure_matmul_peak(device, dtype, 1024 if device.type == "cpu" else None, repeats=3)
        _PEAKS[key] = max(measured, _PEAKS.get(key, 0.0))
    return _PEAKS[key]


def peak_memory_mib(device: torch.device) -> float:
    """CUDA: the most memory PyTorch has allocated on the device. CPU: the process's peak resident
    set (everything the process holds, not only tensors)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
