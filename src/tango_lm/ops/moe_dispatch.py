"""Running each routed assignment through its expert: two paths with the same result (docs/design.md §4.3, MoE).

An MoE layer hands over its N tokens x [N, d], the flat (token, rank)-ordered expert choices
`expert` [N*k], their weights [N*k], their place in the expert's queue `position` [N*k] and the
capacity C (assignments at `position >= C` are dropped and contribute 0).

- `dispatch_sorted`: kept assignments are sorted by expert and each expert runs on exactly its
  tokens. The least compute, but the per-expert counts are read on the host (a device sync per
  layer on a GPU) and the shapes depend on the routing, so `torch.compile` breaks the graph there.
- `dispatch_capacity`: every expert runs on a fixed [C, d] buffer (GShard / Switch style): slot
  `expert * C + position` holds the assignment's token, empty slots a zero row (an expert maps 0
  to 0: SwiGLU has no biases). No host sync and static shapes, so it compiles into one graph and
  a GPU never waits; the price is E*C = capacity_factor * N * k rows of expert compute instead of
  the kept assignments.

`use_capacity_dispatch` is the one place that chooses: the capacity path under `torch.compile` and
on CUDA, the sorted path in eager CPU runs. Both are tested against a token-by-token reference.
"""

from __future__ import annotations

import torch
from torch import nn


def use_capacity_dispatch(x: torch.Tensor) -> bool:
    """Static-shape dispatch under torch.compile and on GPUs; the sorted dispatch elsewhere."""
    return torch.compiler.is_compiling() or x.device.type != "cpu"


def dispatch_sorted(x: torch.Tensor, experts: nn.ModuleList, expert: torch.Tensor, weight: torch.Tensor,
                    position: torch.Tensor, capacity: int, top_k: int) -> torch.Tensor:
    """[N, d] outputs: each expert on the tokens of its kept assignments, weighted and summed."""
    kept = (position < capacity).nonzero().squeeze(-1)
    order = kept[expert[kept].argsort(stable=True)]  # kept assignments grouped by expert
    counts = torch.bincount(expert[order], minlength=len(experts)).tolist()
    out = torch.zeros_like(x)
    start = 0
    for i, count in enumerate(counts):
        if count:
            idx = order[start : start + count]
            tokens = idx // top_k
            y = experts[i](x[tokens]) * weight[idx, None].to(x.dtype)
            out.index_add_(0, tokens, y.to(out.dtype))  # autocast may have run the expert in bf16
            start += count
    return out


def dispatch_capacity(x: torch.Tensor, experts: nn.ModuleList, expert: torch.Tensor, weight: torch.Tensor,
                      position: torch.Tensor, capacity: int, top_k: int) -> torch.Tensor:
    """The same as `dispatch_sorted` with fixed [capacity, d] buffers per expert (static shapes)."""
    n, e = x.shape[0], len(experts)
    keep = position < capacity
    token = torch.arange(n * top_k, device=x.device) // top_k
    dump = e * capacity  # dropped assignments write (and later read) one spare slot past the buffers
    slot = torch.where(keep, expert * capacity + position, dump)
    # Which token fills each slot; n (a zero row appended to x) for empty slots.
    source = torch.full((dump + 1,), n, dtype=torch.long, device=x.device).scatter(0, slot, token)
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    buffers = padded[source[:dump]].view(e, capacity, x.shape[1])
    ys = [experts[i](buffers[i]) for i in range(e)]
    y = torch.cat([*ys, ys[0].new_zeros(1, x.shape[1])])  # the spare slot reads 0
    contrib = y[slot] * (weight * keep).to(y.dtype)[:, None]
    return torch.zeros_like(x).index_add_(0, token, contrib.to(x.dtype))
