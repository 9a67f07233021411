"""Keep freed CPU memory in the process instead of returning it to the OS after every step.

PyTorch's CPU allocator is glibc's malloc. glibc serves every block above 32 MiB (and, with its
default dynamic threshold, many smaller ones) with a fresh `mmap` and unmaps it on free, so a
training step that allocates wide activations page-faults and zeroes all of them again on every
step. On the project's 2-core AMD EPYC that cost about 22% (12-32%) of a TANGO step (d=256, T=256, F=8192, batch 4:
[B, T, F] is 32 MiB) and ~14% of a Loop Transformer++ step (`tango-lm bench`, measured with and
without this setting, docs/benchmarks.md). GPU toolkits cache device memory for the same reason.

`keep_freed_memory()` sets glibc's `M_MMAP_MAX` to 0 (large blocks come from the heap) and raises
`M_TRIM_THRESHOLD` (freed heap memory is kept for the next step). The price: the process's
resident set stays at its peak instead of shrinking between steps. It does nothing on other C
libraries or platforms, and `TANGO_LM_CPU_ALLOCATOR=system` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 2**31 - 1  # the largest value mallopt takes: keep up to 2 GiB of free heap
ENV = "TANGO_LM_CPU_ALLOCATOR"

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the setting once per process; True when glibc accepted it."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(ENV, "keep") == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl): leave the allocator alone
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # Trim first: with mmap off, a freed block must stay in the heap rather than be trimmed away.
    _applied = bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)) and bool(mallopt(_M_MMAP_MAX, 0))
    return _applied
