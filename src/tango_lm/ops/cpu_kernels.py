"""TANGO's gate-average products as C kernels (`cpu_kernels.c`), built for this machine at first use.

BLAS has no GEMM for a causal (lower-triangular) left factor, so the PyTorch path of
`ops/tango_mix.py` splits each product into blocks and still computes 5/8 of the T x T square at
T = 256; these kernels compute the triangle only, with the machine's own vector width
(`-march=native`, or `$TANGO_LM_KERNEL_MARCH`). They are compiled once with the C compiler (`$CC`,
which may carry flags or a wrapper such as `ccache gcc`, else `cc`) into `$TANGO_LM_KERNEL_DIR`
(default `kernels/` under `tango_lm.cache_root`), keyed by the source, the compiler, the flags and
the CPU's features, so a cluster with mixed CPUs and a shared home gets one library per CPU kind.
Without a compiler, or with `TANGO_LM_CPU_KERNELS=0`, `available()` is False and the PyTorch path
runs (one warning says why when a build fails).
The ops' `auto` runs them only where `preferred()`: not on Intel CPUs whose torch links MKL, whose
GEMMs beat them there; `TANGO_LM_KERNELS=c` runs them anywhere (and only then are they built there).
Each call runs its (batch element, head, column block) tasks on `torch.get_num_threads()`
threads: PyTorch's own OpenMP threads when the library is built with OpenMP (threads of a second pool compete with
PyTorch's, which spin for a while after each op: `python tools/tango_kernels.py products 256
8192` shows about half the speed that way), else a thread pool (ctypes releases the GIL while the
C code runs)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tango_lm.cache_root import cache_root
from tango_lm.ops.dispatch import ENV, requested

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-ffp-contract=fast", "-fPIC", "-shared"]
OPENMP = ["-fopenmp"]  # tried first; compilers without it (Apple clang) build the serial library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def _cache_dir() -> Path:
    if os.environ.get("TANGO_LM_KERNEL_DIR"):
        return Path(os.environ["TANGO_LM_KERNEL_DIR"])
    return cache_root() / "kernels"


def _cpuinfo_line(*keys: str) -> str | None:
    """The first line of Linux's /proc/cpuinfo that starts with one of `keys`, or None."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(keys)), None)
    except OSError:
        return None


def _cpu_description() -> str:
    """The CPU's feature flags (Linux), so that -march=native builds are not shared across CPU kinds."""
    return _cpuinfo_line("flags", "Features") or f"{platform.machine()} {platform.processor()}"


@functools.cache
def _cpu_vendor() -> str:
    """'GenuineIntel', 'AuthenticAMD', ... (Linux's /proc/cpuinfo), else what `platform` says (on
    Windows a description that ends with the vendor)."""
    line = _cpuinfo_line("vendor_id")
    return line.partition(":")[2].strip() if line else platform.processor()


def preferred() -> bool:
    """Whether the ops' `auto` runs the kernels (where they build) rather than the blocked products.
    Not on an Intel CPU where torch's BLAS is MKL: MKL's GEMMs, tuned for Intel's cores, run the
    blocked products faster there (a 2-core Xeon with AMX, TANGO's training steps at T = 1024: 0.89
    of a matched Loop Transformer++'s FLOP/s blocked, 0.74 on the kernels); elsewhere they win
    (a 2-core AMD EPYC, the same steps: 1.05 against 0.96). docs/benchmarks.md has both runs."""
    return not ("GenuineIntel" in _cpu_vendor() and torch.backends.mkl.is_available())


def choices(x: torch.Tensor, kernels: str | None = None) -> tuple[bool, bool]:
    """For an op whose fused CPU path takes x: whether the kernels can run it (for `kernels`, else
    $TANGO_LM_KERNELS, = 'c'), and whether its `auto` runs them. They are looked at (and built, at
    first use) only where `auto` prefers them or they are asked for by name."""
    can = (preferred() or requested(kernels) == "c") and usable(x)
    return can, can and preferred()


def describe() -> str:
    """What float32 eager CPU ops run their causal products on here, in a report's words."""
    name = requested()
    if name not in ("auto", "c"):
        return f"{ENV}={name}"
    if name == "auto" and not preferred():
        return "blocked (MKL, an Intel CPU)"
    return "C kernels" if available() else "blocked (no C kernels built)"


def _flags() -> list[str]:
    """The build flags; `TANGO_LM_KERNEL_MARCH` (default native) picks the instruction set, so that
    the tests also build and check the AVX2 and plain-SSE code paths on an AVX-512 machine."""
    return [f"-march={os.environ.get('TANGO_LM_KERNEL_MARCH', 'native')}", *FLAGS]


def _compiler() -> list[str] | None:
    """$CC (else cc) as a command: a program and its arguments ("gcc -m64", "ccache gcc"); None when
    the program is not found, warned when $CC named it (the kernels had been turned off silently)."""
    try:
        command = shlex.split(os.environ.get("CC") or "cc")
    except ValueError:  # an unbalanced quote
        command = []
    program = shutil.which(command[0]) if command else None
    if program is None:
        if os.environ.get("CC"):
            warnings.warn(
                f"tango-lm: CPU kernels not built ($CC={os.environ['CC']!r} names no program on PATH); "
                "TANGO uses the PyTorch path",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    return [program, *command[1:]]


def _umask() -> int:
    """The process's umask, read without setting it (os.umask would change it for other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _build(compiler: list[str]) -> Path:
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    flags = _flags()
    key = hashlib.sha256("\n".join([SOURCE.read_text(), *compiler, version, _cpu_description(), *flags]).encode())
    target = _cache_dir() / f"tango_kernels_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent ranks never load a half-written library.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        for extra in (OPENMP, []):
            proc = subprocess.run(
                [*compiler, *flags, *extra, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300
            )
            if proc.returncode == 0:
                # mkstemp's 0600 (plus the linker's x bits) let no other user of a shared cache load it
                os.chmod(tmp, 0o777 & ~_umask())
                os.replace(tmp, target)
                return target
        raise RuntimeError(f"{' '.join(compiler)} failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None (disabled, no compiler, or the build failed: warned once)."""
    if os.environ.get("TANGO_LM_CPU_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        warnings.warn(
            f"tango-lm: CPU kernels not built ({exc}); TANGO uses the PyTorch path", RuntimeWarning, stacklevel=2
        )
        return None
    lib.tango_average.argtypes = [_I64, _I64, _I64, *[_PTR] * 5, _I64, _I64, ctypes.c_int]
    lib.tango_average.restype = None
    lib.tango_grad_gates.argtypes = [_I64, _I64, _I64, *[_PTR] * 3, _I64, _I64, ctypes.c_int]
    lib.tango_grad_gates.restype = None
    lib.tango_grad_probs.argtypes = [_I64, _I64, _I64, *[_PTR] * 3, _I64, _I64, ctypes.c_int]
    lib.tango_grad_probs.restype = ctypes.c_int
    lib.tango_openmp.restype = ctypes.c_int
    return lib


def available() -> bool:
    return library() is not None


def usable(a: torch.Tensor) -> bool:
    """Whether the kernels can run TANGO's mixing of gate pre-activations a [B, T, F]. Not under
    a dispatch mode: FLOP counters and profilers must see the op's matmuls, and fake tensors
    (which report device cpu) have no data for C code to read."""
    return (
        a.device.type == "cpu"
        and a.dtype == torch.float32
        and torch._C._len_torch_dispatch_stack() == 0
        and available()
    )


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def uses_openmp() -> bool:
    return bool(library().tango_openmp())


def _parallel(fn, n_items: int, *args) -> None:
    """fn(*args, i0, i1, n_threads) over all items on torch.get_num_threads() threads: inside the
    library with OpenMP (which splits each item by column blocks too, so fewer items than threads
    still fill them), else over contiguous ranges of items, one per thread (the caller runs one)."""
    global _pool
    if uses_openmp():
        results = [fn(*args, 0, n_items, torch.get_num_threads())]
    else:
        n = max(1, min(torch.get_num_threads(), n_items))
        bounds = [n_items * i // n for i in range(n + 1)]
        if n > 1:
            with _pool_lock:
                if _pool is None or _pool._max_workers < n - 1:
                    _pool = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="tango-kernels")
            futures = [_pool.submit(fn, *args, bounds[i], bounds[i + 1], 1) for i in range(1, n)]
        results = [fn(*args, bounds[0], bounds[1], 1)]
        if n > 1:
            results += [f.result() for f in futures]
    if any(results):
        raise MemoryError("tango-lm CPU kernel could not allocate its scratch buffer")


def _check(square: torch.Tensor, *wide: torch.Tensor) -> None:
    """Everything the C code assumes about its arguments, checked before a pointer reaches it (a
    wrong shape would otherwise read or write out of bounds): contiguous float32 CPU tensors, `square`
    [B, H, T, T], every wide tensor [B, T, F] with one F, a multiple of H."""
    for x in (square, *wide):
        if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(
                f"the CPU kernels take contiguous float32 CPU tensors, got {x.dtype} on {x.device}"
                f"{'' if x.is_contiguous() else ' (not contiguous)'}"
            )
    if square.dim() != 4 or square.shape[2] != square.shape[3]:
        raise ValueError(f"the CPU kernels take probabilities [B, H, T, T], got {list(square.shape)}")
    b, h, t, _ = square.shape
    f = wide[0].shape[-1]
    for x in wide:
        if x.dim() != 3 or tuple(x.shape) != (b, t, f) or h == 0 or f % h:
            raise ValueError(
                f"the CPU kernels take [B, T, F] tensors with B = {b}, T = {t} and one F that {h} "
                f"heads divide, beside probabilities {list(square.shape)}; got {list(x.shape)}"
            )


def gate_average(
    probs: torch.Tensor, g: torch.Tensor, u: torch.Tensor | None, avg: torch.Tensor, y: torch.Tensor | None
) -> None:
    """avg = tril(probs) @ g per head and, given u and y, y = avg * u. probs [B, H, T, T] (zero
    above the diagonal); g, u, avg, y [B, T, H * W]; avg and y are written."""
    if (u is None) != (y is None):
        raise ValueError("the CPU kernels take u and y together (y = avg * u) or neither")
    _check(probs, g, avg, *(x for x in (u, y) if x is not None))
    b, h, t, _ = probs.shape
    lib = library()
    _parallel(
        lib.tango_average,
        b * h,
        h,
        t,
        g.shape[-1] // h,
        probs.data_ptr(),
        g.data_ptr(),
        None if u is None else u.data_ptr(),
        avg.data_ptr(),
        None if y is None else y.data_ptr(),
    )


def gate_average_grad_gates(probs: torch.Tensor, grad_avg: torch.Tensor, out: torch.Tensor) -> None:
    """out = tril(probs)^T @ grad_avg per head (the gates' gradient), layouts as `gate_average`."""
    _check(probs, grad_avg, out)
    b, h, t, _ = probs.shape
    lib = library()
    _parallel(
        lib.tango_grad_gates,
        b * h,
        h,
        t,
        grad_avg.shape[-1] // h,
        probs.data_ptr(),
        grad_avg.data_ptr(),
        out.data_ptr(),
    )


def gate_average_grad_probs(grad_avg: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> None:
    """out [B, H, T, T] = grad_avg @ g^T per head on and below the diagonal, 0 above it."""
    _check(out, grad_avg, g)
    b, h, t, _ = out.shape
    lib = library()
    _parallel(lib.tango_grad_probs, b * h, h, t, g.shape[-1] // h, grad_avg.data_ptr(), g.data_ptr(), out.data_ptr())
