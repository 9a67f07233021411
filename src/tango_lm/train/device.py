"""Device and precision choices shared by training, evaluation and benchmarks."""

from __future__ import annotations

import contextlib

import torch

from tango_lm.errors import UserError


def pick_device(name: str = "auto", setting: str = "--device") -> torch.device:
    """The device `name` names ("auto": CUDA, else MPS, else the CPU); `setting` is what the user
    set it with (an option or a config key), for the error message."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if _mps_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    cpu = f"{setting} cpu" if setting.startswith("--") else f"{setting}=cpu"
    if device.type not in ("cpu", "cuda", "mps"):  # meta, xpu, ...: no kernels or tests here
        raise UserError(f"device {name!r} is not supported; use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r} was asked for but CUDA is not available; use {cpu}")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"device {name!r} does not exist: {torch.cuda.device_count()} CUDA device(s) are visible")
    if device.type == "mps" and not _mps_available():
        raise UserError(f"device {name!r} was asked for but MPS (Apple's GPU) is not available; use {cpu}")
    return device


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)  # absent from some builds
    return mps is not None and mps.is_available()


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 under `auto` only where the device supports it natively (CUDA with bf16)."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on `device`. To a GPU from pinned memory, without waiting: a copy from pageable
    memory blocks the host until the GPU has run everything queued before it, once per tensor."""
    if device.type != "cuda" or x.device.type != "cpu":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextlib.contextmanager
def deterministic_kernels(on: bool):
    """PyTorch's deterministic algorithms while the block runs, if `on`. Compiled training on CPUs
    needs them for exact resume: inductor's embedding backward adds rows with parallel atomics, so
    two runs' gradients differed by ~1e-9 (eager CPU kernels are deterministic already)."""
    if not on:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
