"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedules (docs/design.md §6)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tango_lm.train.config import TrainConfig


def use_fused_adamw(model: nn.Module) -> bool:
    """AdamW's fused kernel (one pass per tensor instead of a dozen foreach passes: 4.2-4.5 vs
    10.4-14.8 ms per step for 6.5M parameters on the project's CPU, `tools/op_speed.py adamw`) where
    it runs: plain (not FSDP-sharded) floating-point trainable parameters on a CPU or CUDA device."""
    from torch.distributed.tensor import DTensor

    return all(
        p.device.type in ("cpu", "cuda") and p.is_floating_point() and not isinstance(p, DTensor)
        for p in model.parameters()
        if p.requires_grad
    )


def set_fused(optimizer: torch.optim.Optimizer, fused: bool) -> None:
    """Loading a state dict restores its param groups' flags: keep the ones this run can use. The
    fused kernel also wants each step count on its parameter's device, in fp32, where loading
    leaves it on the CPU when the saved groups were not fused (an FSDP run's, resumed on one GPU)."""
    for group in optimizer.param_groups:
        group["fused"] = fused or None
        if fused:
            group["foreach"] = None
    if fused:
        for param, state in optimizer.state.items():
            step = state.get("step")
            if torch.is_tensor(step) and step.device != param.device:
                state["step"] = step.to(param.device, torch.float32)  # a count: exact in fp32


def adamw(params: Iterable[Any], model: nn.Module, **hyper: Any) -> torch.optim.AdamW:
    """AdamW over `params` (tensors or param groups of `model`), with the fused kernel where it runs.
    The trainer and the benchmarks build theirs here, so they time and measure the same update."""
    return torch.optim.AdamW(params, fused=use_fused_adamw(model) or None, **hyper)


def undecayed_ids(model: nn.Module) -> set[int]:
    """Parameters of two or more dimensions that are still not weights to decay: those a module
    names in its `no_weight_decay` (GAU's and FLASH's offset-scales, one [n_offsets, s] tensor of
    per-dimension scales and offsets). Read by attribute name, so FSDP's re-registered parameters count."""
    return {id(getattr(module, name)) for module in model.modules() for name in getattr(module, "no_weight_decay", ())}


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Decay weight matrices and tables; never norms, biases or offset-scales. Fused where it runs."""
    decay, no_decay = [], []
    vectors = undecayed_ids(model)
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 and id(p) not in vectors else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return adamw(groups, model, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


def lr_at(step: int, total_steps: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then
    - wsd: constant, then a linear decay to min_lr over the last `decay_fraction` of steps (at
      least one step unless decay_fraction is 0: no decay);
    - cosine: cosine decay to min_lr;
    - constant: constant.
    Warmup takes at most all steps but the last, where both decays land on min_lr."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        span = total_steps - 1 - warmup  # the last step lands on min_lr (the only one after warmup too)
        progress = min((step - warmup) / span, 1.0) if span > 0 else 1.0
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(int(round(cfg.decay_fraction * total_steps)), 1) if cfg.decay_fraction > 0 else 0
    decay_start = max(total_steps - decay_steps, warmup)
    if step < decay_start:
        return peak
    progress = min((step - decay_start + 1) / max(total_steps - decay_start, 1), 1.0)
    return peak + (floor - peak) * progress
