"""A split's tokens over its shards' read-only memmaps, indexed as one 1-D array without a copy.

A split over `shard_tokens` (2^24) tokens has several shards; concatenating them copied the whole
split into every process's memory (2.8 GB per rank for the presets' 1.4B GPT-2 tokens). This view
answers what the loaders ask of a split (`len`, `ndim`, `dtype`, integer-array and slice indexing)
by reading only the indexed tokens from the shard files; `np.asarray(view)` is the explicit copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class ShardedTokens:
    """Shards' token memmaps (in order) as one read-only 1-D token array."""

    ndim = 1

    def __init__(self, maps: list[np.ndarray], dtype: np.dtype) -> None:
        self.maps = maps
        self.dtype = np.dtype(dtype)
        self.offsets = np.cumsum([0] + [len(m) for m in maps], dtype=np.int64)  # shard i holds [o_i, o_i+1)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            return self._range(start, stop) if step == 1 else self[np.arange(start, stop, step)]
        idx = np.asarray(index)
        if idx.dtype.kind not in "iu":
            raise IndexError(f"token index must be integers or a slice (got {idx.dtype})")
        idx = idx.astype(np.int64)
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"token index out of range for a split of {n} tokens")
        idx = np.where(idx < 0, idx + n, idx)
        shard = np.searchsorted(self.offsets, idx, side="right") - 1
        out = np.empty(idx.shape, dtype=self.dtype)
        for s in np.unique(shard):  # only the shards the index touches are read
            at = shard == s
            out[at] = self.maps[s][idx[at] - self.offsets[s]]
        return out[()] if out.ndim == 0 else out

    def _range(self, start: int, stop: int) -> np.ndarray:
        parts = []
        for m, lo in zip(self.maps, self.offsets[:-1], strict=True):
            a, b = max(start - lo, 0), min(stop - lo, len(m))
            if a < b:
                parts.append(np.asarray(m[a:b]))
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self._range(0, len(self))
        return arr if dtype is None else arr.astype(dtype)

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()

    def __repr__(self) -> str:
        return f"ShardedTokens({len(self)} tokens in {len(self.maps)} shards, dtype={self.dtype})"
