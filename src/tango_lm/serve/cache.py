"""Decode caches.

A `DecodeCache` holds one `LayerState` per block *application* (a looped block applied four
times keeps four states: each application sees different inputs). A block decides what its
state holds: Transformer++ its keys and values, TANGO its keys and source gates, recurrent
mixers a fixed-size summary. Growing tensors live in buffers preallocated to the cache's
capacity, so a decode step appends in place instead of copying the whole history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerState:
    """Named tensors of one application. `buffers` grow along `dim=-2` up to `capacity`."""

    capacity: int
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # fixed-size state (prefix sums, ...)

    def append(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Append x [..., n, w] along dim -2 and return everything cached so far ([..., len, w])."""
        n = x.shape[-2]
        length = self.lengths.get(name, 0)
        buf = self.buffers.get(name)
        if buf is None:
            buf = x.new_empty(x.shape[:-2] + (self.capacity, x.shape[-1]))
            self.buffers[name] = buf
        if length + n > self.capacity:
            raise ValueError(f"decode cache is full ({self.capacity} positions)")
        buf[..., length : length + n, :] = x
        self.lengths[name] = length + n
        return buf[..., : length + n, :]

    def nbytes(self) -> int:
        """Bytes in use (appended positions plus fixed-size state)."""
        used = sum(
            buf[..., : self.lengths.get(name, 0), :].numel() * buf.element_size() for name, buf in self.buffers.items()
        )
        return used + sum(t.numel() * t.element_size() for t in self.extra.values())


class DecodeCache:
    """Per-application states plus the number of positions already processed."""

    def __init__(self, applications: int, capacity: int) -> None:
        self.states = [LayerState(capacity) for _ in range(applications)]
        self.capacity = capacity
        self.position = 0

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.states)
