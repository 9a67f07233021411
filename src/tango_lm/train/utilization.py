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
    """FLOP/s of the best of three timed square matmuls in the dtype the model computes in. On CPUs the
    matmuls are 1024 wide (2.1 GFLOP each; the benchmark uses 2048), on GPUs bench/peak.py's 8192
    (8 back to back per timing).
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
    set (everything the process holds, not only tensors). Both since `reset_peak_memory`."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_bytes() / 2**20


def reset_peak_memory(device: torch.device) -> bool:
    """Start the peak over (the trainer does at the start of each run: a sweep trains many in one
    process, each reported the largest before it). CUDA: the allocator's counter; CPUs: the peak
    resident set where Linux (>= 4.0) allows it; False where nothing could be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """This process's peak resident set. On Linux, VmHWM of /proc/self/status (what
    `reset_peak_memory` resets): `ru_maxrss` of a child started by fork + exec begins at the
    parent's peak (the kernel carries it over), and no call resets it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak if sys.platform == "darwin" else peak * 1024
