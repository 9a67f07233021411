"""Rotating narrow-width training (docs/design.md §2.6, seed 000 Table 8).

With `active_width = K`, a gated width of `units` equal parts (TANGO: the H heads, each with F/H
gate columns; Transformer++ and compact TANGO: the whole FFN / expansion width, one part) is cut
into `ceil(width_per_unit / K)` segments of K contiguous columns per part (the last one may be
shorter). At optimizer step n only segment `n mod segments` is active; evaluation runs with all
segments (the default) or with one chosen segment.

How a block runs one segment: `ActiveColumns.weights()` returns its projections narrowed to the
active columns (rows of the projections into the width, columns of the projection out of it), so
the block computes with packed narrow tensors. TANGO's per-head order is kept, so the narrowed
gates still split into H heads (of K columns) and the mixing ops need no change. Inactive columns
take no part in the forward, so autograd leaves their gradient at exactly zero.

Zero gradient is not enough to keep them unchanged: AdamW's decoupled weight decay and its
momentum still move a parameter entry whose gradient is zero. `keep_inactive_columns` wraps the
optimizer step and puts the inactive entries of the narrowed weights *and* of their same-shaped
optimizer state (AdamW's `exp_avg`, `exp_avg_sq`) back as they were, so an inactive segment is
exactly as if it were not in the optimizer that step and resumes where it left off. (The
per-tensor `step` counter, used by Adam's bias correction, still counts every step while a
segment's moments move once every S steps, so its updates differ from plain AdamW's for about S
times as long: with S = 5 and betas (0.9, 0.95), a constant gradient's update is 0.52 of the lr
at step 5, 0.79 at 25, 1.09 at 100 and within 1% of 1 from step ~400.)
Restoring, rather than masking AdamW's update, works with any optimizer and its fused kernels; the
price is, per step, one on-device copy of each narrowed weight and of its two moment tensors.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from tango_lm.errors import UserError


def num_segments(width_per_unit: int, active_width: int) -> int:
    """ceil(width_per_unit / K): segments per part."""
    return math.ceil(width_per_unit / active_width)


def segment_for_step(step: int, segments: int) -> int:
    """The segment trained at optimizer step `step` (0-based): step mod segments."""
    return step % segments


def trained_width(width: int, units: int, active_width: int | None) -> float:
    """The gated width a training step runs, averaged over one rotation: `width` split into `units`
    parts of `ceil(width / units / K)` segments each, so width / segments (with K dividing the part,
    units * K; otherwise the last, shorter segment counts what it runs). `width` without active_width."""
    if active_width is None:
        return width
    return width / num_segments(width // units, active_width)


def check_active_width(active_width: int | None, width_per_unit: int, what: str, fix: str) -> None:
    """UserError unless 1 <= active_width <= width_per_unit (`what` names that width)."""
    if active_width is None:
        return
    if not 1 <= active_width <= width_per_unit:
        raise UserError(f"model.active_width={active_width} must be between 1 and {what} ({width_per_unit}); {fix}")


class ActiveColumns(nn.Module):
    """Which columns of a gated width run, and the projections narrowed to them.

    `rows` are linears *into* the width (their weight rows are columns of the width: W_g, W_u,
    W_e); `cols` are linears *out of* it (their weight columns: W_o). The width is `units` equal
    parts; a segment takes the same K-column slice of every part. Holds no parameters; the
    linears are plain references (not submodules), so the state dict is unchanged.
    """

    def __init__(
        self, width: int, units: int, active_width: int, rows: Sequence[nn.Linear], cols: Sequence[nn.Linear]
    ) -> None:
        super().__init__()
        if width % units or not 1 <= active_width <= width // units:
            raise ValueError(f"active_width {active_width} does not fit {units} parts of width {width}")
        self.width, self.units, self.active_width = width, units, active_width
        self.per_unit = width // units
        self.num_segments = num_segments(self.per_unit, active_width)
        self.segment: int | None = None  # None: every column is active
        self.rows, self.cols = tuple(rows), tuple(cols)

    def extra_repr(self) -> str:
        return (
            f"width={self.width}, units={self.units}, active_width={self.active_width}, "
            f"segments={self.num_segments}, segment={self.segment}"
        )

    def select(self, segment: int | None) -> None:
        if segment is not None and not 0 <= segment < self.num_segments:
            raise UserError(
                f"segment {segment} does not exist: this model has {self.num_segments} segments "
                f"(0 to {self.num_segments - 1}); pick one of them or 'all'"
            )
        self.segment = segment

    def bounds(self) -> tuple[int, int] | None:
        """[start, end) of the active segment within each part, or None when all are active."""
        if self.segment is None:
            return None
        start = self.segment * self.active_width
        return start, min(start + self.active_width, self.per_unit)

    def narrow_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """[width, in] -> [units * k, in]: the active rows, part by part."""
        span = self.bounds()
        if span is None:
            return weight
        a, b = span
        if self.units == 1:
            return weight[a:b]
        return weight.view(self.units, self.per_unit, -1)[:, a:b].reshape(self.units * (b - a), -1)

    def narrow_cols(self, weight: torch.Tensor) -> torch.Tensor:
        """[out, width] -> [out, units * k]: the active columns, part by part."""
        span = self.bounds()
        if span is None:
            return weight
        a, b = span
        if self.units == 1:
            return weight[:, a:b]
        return weight.view(weight.shape[0], self.units, self.per_unit)[:, :, a:b].reshape(weight.shape[0], -1)

    def weights(self) -> list[torch.Tensor]:
        """The narrowed weights of `rows` then `cols`, in the order given at construction."""
        return [self.narrow_rows(m.weight) for m in self.rows] + [self.narrow_cols(m.weight) for m in self.cols]

    def inactive_mask(self, device: torch.device | None = None) -> torch.Tensor | None:
        """Bool [width], True for the columns the active segment leaves out (None: all active)."""
        span = self.bounds()
        if span is None:
            return None
        keep = torch.ones(self.units, self.per_unit, dtype=torch.bool, device=device)
        keep[:, span[0] : span[1]] = False
        return keep.view(-1)

    def inactive_entries(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(weight, mask broadcastable to it) of every narrowed weight; True marks inactive entries."""
        out: list[tuple[nn.Parameter, torch.Tensor]] = []
        for modules, shape in ((self.rows, (-1, 1)), (self.cols, (1, -1))):
            for m in modules:
                mask = self.inactive_mask(m.weight.device)
                if mask is not None:
                    out.append((m.weight, mask.view(shape)))
        return out


def active_columns(model: nn.Module) -> list[ActiveColumns]:
    return [m for m in model.modules() if isinstance(m, ActiveColumns)]


def model_num_segments(model: nn.Module) -> int | None:
    """Segments per part of the model's gated widths (None: no rotating narrow width)."""
    counts = {m.num_segments for m in active_columns(model)}
    if len(counts) > 1:  # every block of one model shares width and K
        raise ValueError(f"blocks disagree on the number of segments: {sorted(counts)}")
    return counts.pop() if counts else None


def set_active_segment(model: nn.Module, segment: int | None) -> None:
    """Run only `segment` of every block's gated width (None: all columns)."""
    parts = active_columns(model)
    if not parts:
        if segment is None:
            return
        raise UserError(
            "this model was built without model.active_width, so it has no segments; "
            "evaluate it with all columns ('all')"
        )
    for p in parts:
        p.select(segment)


@contextlib.contextmanager
def keep_inactive_columns(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around `optimizer.step()`: the inactive entries of the narrowed weights and of their
    same-shaped optimizer state come out exactly as they went in (see the module docstring)."""
    masks: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
    for part in active_columns(model):
        for weight, mask in part.inactive_entries():
            masks[id(weight)] = (weight, mask)  # a looped block's weights appear once
    saved = [
        (weight, mask, {key: t.clone() for key, t in _same_shaped(weight, optimizer).items()})
        for weight, mask in masks.values()
    ]
    yield
    with torch.no_grad():
        for weight, mask, before in saved:
            # State this step created (on the first step) starts at zero and, with a zero
            # gradient, stays zero in the inactive entries; only what existed is restored.
            after = _same_shaped(weight, optimizer)
            for key, old in before.items():
                torch.where(mask, old, after[key], out=after[key])


def _same_shaped(weight: nn.Parameter, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The weight and its optimizer state tensors of the same shape (AdamW's two moments)."""
    state = optimizer.state.get(weight, {})
    found = {f"state.{k}": t for k, t in state.items() if torch.is_tensor(t) and t.shape == weight.shape}
    return {"weight": weight.data, **found}
