"""Decode caches.

A `DecodeCache` holds one `LayerState` per block *application* (a looped block applied four
times keeps four states: each application sees different inputs). A block decides what its
state holds: Transformer++ its keys and values, TANGO its keys and source gates, recurrent
mixers a fixed-size summary. Growing tensors live in buffers preallocated to the cache's
capacity, so a decode step appends in place instead of copying the whole history.

Static steps (`serve/static_decode.py`, gpt-fast's scheme): after an ordinary prefill, the cache
switches to static mode (`begin_static`): `position` becomes a device tensor [1] that the decoder
advances, every `append` writes at that position into the full-capacity buffer and returns the whole
buffer (keys past the position are masked by `key_mask`), and fixed-size state is updated in place
(`write`), so one decode step has the same shapes and tensor addresses every time and can be
compiled once and replayed as a CUDA graph. A mixer whose eager state has a varying size keeps a
separate fixed-size layout in `static` (made from the eager state by the mixer at the first static
step); `reset` keeps every buffer for the next request.
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
    static: dict[str, torch.Tensor] = field(default_factory=dict)  # a mixer's own static-step layout
    position: torch.Tensor | None = None  # static steps: the query's position [1] (None: eager)

    def append(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Append x [..., n, w] along dim -2 and return everything cached so far ([..., len, w]).
        In a static step (n = 1): write x at `position` and return the whole buffer."""
        if self.position is not None:
            buf = self.buffers[name]
            buf.index_copy_(buf.dim() - 2, self.position, x)
            return buf
        n = x.shape[-2]
        length = self.lengths.get(name, 0)
        buf = self.buffers.get(name)
        if buf is not None and length and buf.shape[:-2] != x.shape[:-2]:  # a fresh buffer would drop the history
            raise ValueError(
                f"decode cache holds {tuple(buf.shape[:-2])} rows, the new positions {tuple(x.shape[:-2])}; "
                "a cache continues the batch it began with: start another with model.new_cache()"
            )
        if buf is not None and length and (buf.dtype != x.dtype or buf.device != x.device):
            buf = self.buffers[name] = buf.to(device=x.device, dtype=x.dtype)  # e.g. a bf16 prefill, fp32 steps
        if buf is None or buf.shape[:-2] != x.shape[:-2] or buf.dtype != x.dtype or buf.device != x.device:
            # zeros: a static step reads the whole buffer (masked), and garbage could be NaN
            buf = x.new_zeros(x.shape[:-2] + (self.capacity, x.shape[-1]))
            self.buffers[name] = buf
        if length + n > self.capacity:
            raise ValueError(f"decode cache is full ({self.capacity} positions)")
        buf[..., length : length + n, :] = x
        self.lengths[name] = length + n
        return buf[..., : length + n, :]

    def empty(self) -> bool:
        """Nothing cached yet (and not in a static step): the next forward is a plain prefill."""
        return self.position is None and not any(self.lengths.values()) and not self.extra

    def key_mask(self) -> torch.Tensor | None:
        """Static steps: [1, capacity] bool, the buffer positions the query sees (<= its position).
        None in eager decoding, where the returned keys end at the queries."""
        if self.position is None:
            return None
        return torch.arange(self.capacity, device=self.position.device)[None, :] <= self.position[:, None]

    def read(self, name: str) -> torch.Tensor | None:
        """Fixed-size state (None before it is first written)."""
        return self.static[name] if self.position is not None else self.extra.get(name)

    def write(self, name: str, value: torch.Tensor) -> None:
        """Set fixed-size state: in place in a static step (the tensor keeps its address)."""
        if self.position is not None:
            self.static[name].copy_(value)
        else:
            self.extra[name] = value

    def nbytes(self) -> int:
        """Bytes in use (appended positions plus fixed-size state)."""
        used = sum(
            buf[..., : self.lengths.get(name, 0), :].numel() * buf.element_size() for name, buf in self.buffers.items()
        )
        return used + sum(t.numel() * t.element_size() for t in self.extra.values())

    def reset(self) -> None:
        """Empty, keeping the allocated buffers (their contents are overwritten or masked)."""
        self.lengths.clear()
        self.extra.clear()
        self.position = None


class DecodeCache:
    """Per-application states plus the number of positions already processed (an int; in static
    steps a device tensor [1])."""

    def __init__(self, applications: int, capacity: int) -> None:
        self.states = [LayerState(capacity) for _ in range(applications)]
        self.capacity = capacity
        self.position: int | torch.Tensor = 0

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.states)

    def reset(self) -> None:
        """Back to no positions, keeping every buffer for the next request."""
        for state in self.states:
            state.reset()
        self.position = 0

    def begin_static(self, position: torch.Tensor) -> None:
        """Static steps from now on, at `position` [1] (a tensor the caller advances in place)."""
        self.position = position
        for state in self.states:
            state.position = position
