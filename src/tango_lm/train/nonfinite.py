"""Updates that cannot be trusted are skipped; weights that are not finite are never saved.

A step whose loss or gradient norm is not finite (NaN or infinite) skips the optimizer update, with
a warning on stderr and a `"skipped": true` record in `metrics.jsonl` (its non-finite values
written as null). A skipped step still counts as a step: it consumes its batch (the data order
moves on), the schedule advances and `tokens_seen` counts its tokens; only the weights and AdamW's
state (moments and step count) stay as they were. The guard's count of skips in a row is saved in
every checkpoint, so a resumed run skips exactly the steps the uninterrupted run skips, and every
later step sees the same data, learning rate and weights.

Under DDP and FSDP all ranks decide alike: the gradient norm is the global one (of all-reduced
gradients, or over every shard) and the loss is the all-reduced mean, so a NaN on one rank makes
every rank skip.

More than `train.max_nonfinite_steps` skips in a row (default 5; 0 stops at the first) stop the
run with an error (after the last one's record). It names the checkpoints that hold the weights
the streak kept failing from (those of the step before it on: a skipped step changes no weight)
and the newest one before them, to resume from. Before a checkpoint is written the weights are
checked (every rank's shard); non-finite weights stop the run instead of being saved.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

from tango_lm.errors import UserError
from tango_lm.train.checkpoint import complete_steps, step_of

__all__ = ["NonFiniteGuard", "finite_weights", "check_weights"]

_ADVICE = "lower train.lr, raise train.warmup_steps or lower train.grad_clip, then continue with --resume"


class NonFiniteGuard:
    """Decides whether a step's update is skipped, and stops a run that keeps skipping."""

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.skipped = 0

    def skip(self, loss: float, grad_norm: float) -> bool:
        """Whether to skip this update (the values must be the same on every rank)."""
        bad = not (math.isfinite(loss) and math.isfinite(grad_norm))
        self.in_a_row = self.in_a_row + 1 if bad else 0
        self.skipped += bad
        return bad

    def report(self, step: int, loss: float, grad_norm: float, ckpt_root: Path, warn: bool) -> UserError | None:
        """After a skipped `step`: warn (rank 0), or return the error that stops a streak too long
        (raised once the step's record is logged)."""
        what = " and the ".join(
            f"{name} is {value}"
            for name, value in (("loss", loss), ("gradient norm", grad_norm))
            if not math.isfinite(value)
        )
        if self.in_a_row > self.max_in_a_row:
            first = step - self.in_a_row + 1
            return UserError(
                f"training stopped at step {step}: the {self.in_a_row} updates of steps {first}-{step} had a "
                f"non-finite loss or gradient norm (train.max_nonfinite_steps={self.max_in_a_row}; this time the "
                f"{what}); {_streak_advice(ckpt_root, first)}"
            )
        if warn:
            from tqdm.auto import tqdm

            tqdm.write(
                f"warning: step {step}: the {what}; its update was skipped ({self.in_a_row} in a row, the run "
                f"stops after {self.max_in_a_row})",
                file=sys.stderr,
            )
        return None

    def state_dict(self) -> dict[str, int]:
        return {"in_a_row": self.in_a_row, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Checkpoints from before the guard have no state: nothing was skipped."""
        self.in_a_row, self.skipped = int(state.get("in_a_row", 0)), int(state.get("skipped", 0))


def checkpoints_around_streak(ckpt_root: Path, first: int) -> tuple[list[Path], list[Path]]:
    """(the complete checkpoints before a streak from step `first`, those from step `first` - 1 on):
    a skipped step changes no weight, so the latter all hold the weights the streak failed from."""
    steps = complete_steps(ckpt_root)
    return [p for p in steps if step_of(p) < first - 1], [p for p in steps if step_of(p) >= first - 1]


def _streak_advice(ckpt_root: Path, first: int) -> str:
    """How to go on after a streak from step `first`: a skipped step changes no weight, so the
    checkpoints of step `first` - 1 on all hold the weights every update of the streak failed from
    (a resume from them replays it: same weights, same batches), and the advice resumes from the
    newest one before them."""
    before, during = checkpoints_around_streak(ckpt_root, first)
    move = (
        f"move {', '.join(p.name for p in during)} (their weights failed) out of {ckpt_root}, then " if during else ""
    )
    if not before:
        return (  # --resume, not a fresh command: the run's config and records are there, and refuse one
            f"{move}lower train.lr, raise train.warmup_steps or lower train.grad_clip and train again with --resume "
            "(no checkpoint is left, so it starts from step 0)"
        )
    return (
        f"{move}lower train.lr, raise train.warmup_steps or lower train.grad_clip and continue with --resume from "
        f"{before[-1]} (should it stop again at once, its weights are past training too: move it out as well)"
    )


def finite_weights(model: torch.nn.Module) -> bool:
    """Whether every parameter this process holds (its shard under FSDP) is finite."""
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if not bool(torch.isfinite(local.detach()).all()):
            return False
    return True


def check_weights(all_finite: bool, step: int, latest: str) -> None:
    """Raise before a save when `all_finite` (every rank's `finite_weights`) is False."""
    if not all_finite:
        raise UserError(
            f"the weights became non-finite by step {step}, so no checkpoint was written; {latest} stays "
            f"the latest checkpoint: {_ADVICE}"
        )
