"""Every autotune configuration of a Triton kernels module, run alone: the kernel tests' other cases
run the configuration the autotuner picks (under the interpreter one small one, blocks of 16 in
every direction), so without these a configuration with unequal query and key blocks, or one the
GPU's autotuner would pick only at some shape, had its arithmetic checked nowhere.

`configuration_params(module, devices)` gives one pytest parameter per (kernel, configuration): every one
on CUDA (warps and stages change the compiled code there), one per distinct block sizes and
launch interpreted (the interpreter ignores warps and stages). `launch_for(config)` picks inputs
whose launch that configuration's limits admit (triton_common.admitted) and that cross its
blocks; `force(monkeypatch, module, kernel, index)` leaves the kernel that configuration alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from triton.runtime.autotuner import Autotuner

# Position blocks (queries, keys, chunks) and column blocks (gate or value widths) by name.
POSITION_BLOCKS = ("BLOCK_M", "BLOCK_N", "BLOCK")
COLUMN_BLOCKS = ("BLOCK_W", "BLOCK_E")


@dataclass(frozen=True)
class Launch:
    """Inputs a configuration's limits admit: dtype (fp32 for the fp32 ones, else bf16), head
    dim (its BLOCK_D within the limits, not a power of two, so the last lanes are masked), the
    sequence length and the width per head (one past the blocks: a partial last block; odd where
    the configuration is for unaligned widths, a multiple of 4 otherwise, as TANGO's 1,780)."""

    dtype: torch.dtype
    head_dim: int
    seq_len: int
    width: int


def tuners(module) -> dict[str, Autotuner]:
    return {name: obj for name, obj in vars(module).items() if isinstance(obj, Autotuner)}


def launch_for(config) -> Launch:
    limits = config.limits
    if limits.get("min_d", 1) >= 128:
        head_dim = 100  # BLOCK_D 128
    elif limits.get("max_d", 128) <= 32:
        head_dim = 20  # BLOCK_D 32
    else:
        head_dim = 40  # BLOCK_D 64
    position = max((v for k, v in config.kwargs.items() if k in POSITION_BLOCKS), default=16)
    column = max((v for k, v in config.kwargs.items() if k in COLUMN_BLOCKS), default=16)
    aligned = limits.get("max_align", 16) > 1
    return Launch(
        dtype=torch.float32 if limits.get("fp32") else torch.bfloat16,
        head_dim=head_dim,
        seq_len=position + 3,
        width=column + 4 if aligned else column + 1,
    )


def configuration_params(module, devices: list) -> list:
    """pytest params (device, kernel name, configuration index) for `devices` (the kernel tests'
    DEVICES: an interpreted "cpu" and a "cuda" param, with their marks)."""
    params = []
    for device in devices:
        seen = set()
        for name, tuner in tuners(module).items():
            for index, config in enumerate(tuner.hardware_configs):
                same = (name, tuple(sorted(config.kwargs.items())), launch_for(config))
                if device.values[0] == "cpu" and same in seen:
                    continue  # the same computation interpreted: only warps and stages differ
                seen.add(same)
                params.append(
                    pytest.param(
                        *device.values, name, index, marks=device.marks, id=f"{device.values[0]}-{name}-{index}"
                    )
                )
    return params


def force(monkeypatch, module, kernel: str, index: int) -> Launch:
    """Until the test ends, leave `kernel` its `index`-th hardware configuration alone, and give the
    module's other kernels the first hardware configuration their limits admit, untimed
    (TANGO_LM_TRITON_AUTOTUNE=0: interpreted, blocks of 16 made these sizes minutes of Python).
    Returns the launch that configuration is for."""
    monkeypatch.setenv("TANGO_LM_TRITON_AUTOTUNE", "0")
    for name, tuner in tuners(module).items():
        monkeypatch.setattr(
            tuner, "configs", [tuner.hardware_configs[index]] if name == kernel else tuner.hardware_configs
        )
        monkeypatch.setattr(tuner, "cache", {})
        # what triton 3.6 records when it times the one configuration left (untimed: all zeros);
        # restored, so a later test's readout (tools/op_timing.autotuned) does not see it
        monkeypatch.setattr(tuner, "configs_timings", {}, raising=False)
    return launch_for(tuners(module)[kernel].hardware_configs[index])
