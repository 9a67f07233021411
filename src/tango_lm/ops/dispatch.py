"""One door for the ops that have several implementations, and one override.

Every op below has a single public function that decides which implementation runs
(`tango_mix`, with or without u, `gate_average`, `windowed_mix`, `causal_matmul`, GAU's and
FLASH's `relu2_attention`, and `causal_attention`); each asks `choose` here. The names:

| name | what | ops that have it |
|---|---|---|
| `reference` | the plain composition of library ops (runs anywhere, and under `torch.compile`) | all |
| `blocked` | the fused eager CPU ops (blocked over the causal triangle, or chunked) | tango_mix, windowed_mix, causal_matmul, relu2_attention (its product on causal_matmul) |
| `c` | those ops with their products on the C kernels (`ops/cpu_kernels.py`): float32 on CPUs | tango_mix, causal_matmul, relu2_attention |
| `triton` | the Triton kernels: CUDA tensors, or CPU tensors under `TRITON_INTERPRET=1` | tango_mix, windowed_mix, relu2_attention |
| `sdpa-sliced` | SDPA with the gates cut into slices of at most 128 columns run as extra heads | tango_mix, gate_average, causal_attention |

`auto` (the default) picks per call, from the inputs: on CPUs the C kernels in float32 where they
build and `cpu_kernels.preferred()` says they win (not on Intel CPUs with MKL), else the blocked
op, in eager mode, and the reference under `torch.compile`; on CUDA the Triton kernels when
triton imports and takes the inputs' dtypes, else the sliced SDPA (never SDPA's math backend,
which holds [B, H, T, T] in fp32; relu2_attention: its reference; causal_attention slices only
values wider or narrower than its keys); elsewhere the reference (for windowed_mix on CUDA
without triton: its chunked composition).
relu2_attention's decode steps always run its reference.

The override is the op's `kernels=` argument, else the environment variable `TANGO_LM_KERNELS`.
A named implementation runs wherever the op has it and it can take the inputs (device, dtype,
eager or compiled); anywhere else the op falls back to `auto`'s choice without an error, so
`TANGO_LM_KERNELS=c` means "the C kernels wherever they apply". Only asking for `triton` where
the package is not installed is an error (`UserError`, naming the extra that installs it), and a
name that is not one of `KERNELS` (`UserError` for the variable, which `tango-lm` checks before
any command runs; `ValueError` for the argument).
`TANGO_LM_CPU_KERNELS=0` still keeps the C kernels from being built or used at all (as if no
compiler were installed); where `auto` does not prefer them they are built only when asked for.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

import torch

from tango_lm.errors import UserError

ENV = "TANGO_LM_KERNELS"
KERNELS = ("auto", "reference", "blocked", "c", "triton", "sdpa-sliced")


def requested(kernels: str | None = None) -> str:
    """The implementation asked for: the argument, else $TANGO_LM_KERNELS, else 'auto'."""
    name = kernels if kernels is not None else (os.environ.get(ENV) or "auto")
    if name not in KERNELS:
        choices = ", ".join(KERNELS)
        if kernels is not None:  # a caller's argument: a programming error
            raise ValueError(f"unknown kernel implementation kernels={name!r}; choose one of: {choices}")
        raise UserError(f"unknown kernel implementation {ENV}={name!r}; set it to one of: {choices}")
    return name


def choose(usable: Mapping[str, bool], auto: str, kernels: str | None = None) -> str:
    """The op's implementation: the requested one where the op has it (a key of `usable`) and it
    can take these inputs (its value), else `auto`."""
    name = requested(kernels)
    return name if usable.get(name, False) else auto


def check_installed(name: str, installed: bool, kernels: str | None = None) -> None:
    """A `UserError` when the implementation asked for needs a package that is not installed."""
    if not installed and requested(kernels) == name:
        raise UserError(f"{ENV}={name} needs the {name} package: pip install 'tango-lm[{name}]'")


def check_requested_installed() -> None:
    """$TANGO_LM_KERNELS=triton without triton, said before a command writes anything (the ops
    check at their first call, after a run has written its config)."""
    if requested() == "triton":
        check_installed("triton", _installed("triton"))


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_devices(op: str, **tensors: torch.Tensor | None) -> None:
    """One line that names the devices, instead of a kernel's out-of-bounds read or a long trace."""
    devices = {name: x.device for name, x in tensors.items() if x is not None}
    if len(set(devices.values())) > 1:
        where = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"{op}: inputs on different devices ({where}); move them to one device")


def eager() -> bool:
    """Not being traced by torch.compile: the eager CPU ops write into views inductor cannot compile."""
    return not torch.compiler.is_compiling()
