"""Mean NLL of a model over a fixed list of windows (dev/test evaluation, docs/design.md §6).

Under torchrun (`env` with more than one process) the batches are dealt round-robin: rank r
scores batches r, r + N, r + 2N, ... and the (NLL sum, token count) pairs are all-reduced, so every
rank returns the same result, equal to one process's up to the order of the float sums. Under FSDP
every rank must run the model the same number of times (each forward gathers weights collectively),
so a rank left without a batch in the last round scores a copy of that round's first batch and
discards the result.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice

import torch

from tango_lm.ops.twin_loss import IGNORE_INDEX
from tango_lm.train.device import autocast, to_device
from tango_lm.train.distributed import DistEnv, all_reduce_sum


def scored(targets: torch.Tensor) -> int:
    """How many targets `model.nll` scores (those not IGNORE_INDEX)."""
    return int((targets != IGNORE_INDEX).sum())


@torch.no_grad()
def evaluate_nll(
    model: torch.nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    dtype: torch.dtype | None = None,
    env: DistEnv | None = None,
) -> tuple[float, int]:
    """(mean NLL in nats per scored target token, number of scored target tokens) over all batches;
    targets equal to IGNORE_INDEX (-100) are not scored, as in `model.nll`."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        if env is None or not env.active:
            # Summed on the device in float64, as Python's floats did, and read once at the end;
            # targets counted before their copy: no wait for the GPU per batch.
            summed = torch.zeros((), dtype=torch.float64, device=device)
            for inputs, targets in batches:
                count += scored(targets)
                inputs, targets = to_device(inputs, device), to_device(targets, device)
                with autocast(device, dtype):
                    summed += model.nll(inputs, targets, reduction="sum").double()
            total = float(summed)
        else:
            lockstep = env.parallel == "fsdp"
            for group in _rounds(batches, env.world_size):
                mine = group[env.rank] if env.rank < len(group) else None
                if mine is None and not lockstep:
                    continue
                inputs, targets = mine if mine is not None else group[0]
                inputs, targets = to_device(inputs, device), to_device(targets, device)
                with autocast(device, dtype):
                    nll = float(model.nll(inputs, targets, reduction="sum"))
                if mine is not None:
                    total += nll
                    count += scored(targets)
            total, summed = all_reduce_sum(env, [total, float(count)])
            count = int(summed)
    finally:
        model.train(was_training)
        if env is not None and env.parallel == "fsdp":
            model.reshard()  # FSDP keeps the root unit gathered after a forward, awaiting a backward
    return (total / count if count else float("nan")), count


def _rounds(batches: Iterable, size: int) -> Iterator[list]:
    it = iter(batches)
    while group := list(islice(it, size)):
        yield group
