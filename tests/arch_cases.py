"""Tiny models of every registered architecture, for the generic tests.

The generic tests (parameter counts against `numel`, FLOPs against FlopCounterMode, causality,
cached decoding against the full forward, activation checkpointing, training from a preset, the
Hugging Face export) build each architecture from `tiny_config`: the shared `BASE` below plus the
fields the architecture class declares in `tiny`. Nothing here names an architecture, so a newly
registered one is covered with no edit to the tests (tests/models/test_toy_architecture.py shows it).
"""

from __future__ import annotations

from typing import Any

from tango_lm import ModelConfig
from tango_lm.models.registry import ARCHITECTURES

# d = 32 in 4 heads of 8, three block applications; an architecture's `tiny` fields go on top.
BASE: dict[str, Any] = {"d_model": 32, "head_dim": 8, "width": 48, "depth": 3, "vocab_size": 61, "context_length": 48}


def names() -> list[str]:
    """Every registered architecture, sorted (read at call time, so one registered by a test counts)."""
    return sorted(ARCHITECTURES)


def tiny_fields(arch: str, **changes: Any) -> dict[str, Any]:
    """The config fields of the tiny `arch` model: BASE, the architecture's `tiny`, then `changes`."""
    return {**BASE, "arch": arch, **ARCHITECTURES[arch].tiny, **changes}


def tiny_config(arch: str, **changes: Any) -> ModelConfig:
    return ModelConfig(**tiny_fields(arch, **changes))
