"""Mean NLL of a model over a fixed list of windows (dev/test evaluation, SPEC 6)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tango_lm.train.device import autocast


@torch.no_grad()
def evaluate_nll(
    model: torch.nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> tuple[float, int]:
    """(mean NLL in nats per target token, number of target tokens) over all batches."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for inputs, targets in batches:
            inputs, targets = inputs.to(device), targets.to(device)
            with autocast(device, dtype):
                total += float(model.nll(inputs, targets, reduction="sum"))
            count += targets.numel()
    finally:
        model.train(was_training)
    return (total / count if count else float("nan")), count
