"""Training windows in a seeded, resumable order, and fixed evaluation batches.

Window i covers tokens [i*seq_len, i*seq_len + seq_len + 1): its first seq_len tokens are the
inputs and the last seq_len the targets, so windows do not overlap in the tokens they predict
and there are (len(tokens) - 1) // seq_len of them.

The training order is a permutation per epoch drawn from its own `torch.Generator`, seeded from
the *data-order seed* and the epoch only, so it is separate from the model seed (the TANGO
paper's seed pairs such as 17/101) and does not touch the global torch RNG.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from tango_lm.errors import UserError

__all__ = ["WindowLoader", "eval_batches", "eval_window_ids", "count_eval_windows", "num_windows"]

# Multiplier that keeps (data_seed, epoch) pairs from colliding for any realistic epoch count.
_EPOCH_STRIDE = 1_000_003


def num_windows(n_tokens: int, seq_len: int) -> int:
    """Number of non-overlapping windows of `seq_len` (+1 target) tokens in `n_tokens` tokens."""
    return max(0, (n_tokens - 1) // seq_len)


def _check_tokens(tokens: np.ndarray, seq_len: int) -> None:
    if getattr(tokens, "ndim", None) != 1:
        raise ValueError("tokens must be a 1-D array")
    if seq_len < 1:
        raise UserError(f"seq_len must be at least 1, got {seq_len}; set a positive seq_len")


def _gather(tokens: np.ndarray, window_ids: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ([n, seq_len] int64) of the given windows."""
    starts = window_ids.astype(np.int64) * seq_len
    idx = starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
    windows = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class WindowLoader:
    """Shuffled non-overlapping training windows, split across ranks, resumable from a state dict.

    A global batch is the next `batch_size * world_size` windows of the epoch's order; rank r
    takes the contiguous slice [r*batch_size, (r+1)*batch_size) of it. An optimizer step takes
    `grad_accum` global batches. Windows left at the end of an epoch that do not fill a step are
    skipped and the next epoch begins, so trading batch_size for grad_accum trains on the same
    windows (a step never mixes two epochs); a split shorter than one step fills global batches.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        data_seed: int,
        rank: int = 0,
        world_size: int = 1,
        reshuffle: bool = True,
        grad_accum: int = 1,
    ) -> None:
        _check_tokens(tokens, seq_len)
        if batch_size < 1:
            raise UserError(f"batch_size must be at least 1, got {batch_size}; set a positive batch size")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank {rank} for world_size {world_size}")
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.data_seed = int(data_seed)
        self.reshuffle = bool(reshuffle)  # False: every epoch repeats epoch 0's permutation
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.global_batch = self.batch_size * self.world_size
        self.num_windows = num_windows(len(tokens), self.seq_len)
        if self.num_windows < self.global_batch:
            need = self.global_batch * self.seq_len + 1
            raise UserError(
                f"the training split has {len(tokens)} tokens but a global batch of {self.global_batch} "
                f"windows of seq_len {self.seq_len} needs at least {need}; "
                "use more data or a smaller seq_len or batch size"
            )
        step = self.global_batch * max(1, int(grad_accum))
        self.step_windows = step if step <= self.num_windows else self.global_batch  # what an epoch is cut into
        self.epoch = 0
        self.position = 0  # windows of this epoch's order already consumed (multiple of global_batch)
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in one epoch (trailing windows that do not fill a step are dropped)."""
        return self.num_windows // self.step_windows * (self.step_windows // self.global_batch)

    @property
    def tokens_per_batch(self) -> int:
        """Target tokens one global batch (one micro-batch over all ranks) consumes."""
        return self.global_batch * self.seq_len

    @property
    def tokens_per_rank_batch(self) -> int:
        """Target tokens in the batch this rank gets from `next_batch`."""
        return self.batch_size * self.seq_len

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of window ids used in `epoch` (same on every rank and every run)."""
        epoch = epoch if self.reshuffle else 0
        if epoch != self._order_epoch:
            g = torch.Generator().manual_seed(self.data_seed * _EPOCH_STRIDE + epoch)
            self._order = torch.randperm(self.num_windows, generator=g).numpy()
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (inputs, targets), each an int64 tensor [batch_size, seq_len]."""
        at_step = self.position % self.step_windows == 0  # (not so only in a state saved before steps were)
        if self.position + (self.step_windows if at_step else self.global_batch) > self.num_windows:
            self.epoch += 1
            self.position = 0
        order = self.epoch_order(self.epoch)
        lo = self.position + self.rank * self.batch_size
        ids = order[lo : lo + self.batch_size]
        self.position += self.global_batch
        return _gather(self.tokens, ids, self.seq_len)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Where the loader stands; `load_state_dict` on a fresh loader continues from here."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "data_seed": self.data_seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "reshuffle": self.reshuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; seq_len, global batch, data seed and reshuffling must match this loader's."""
        saved = {"reshuffle": True, **state}  # states saved before the option reshuffled
        mismatched = [
            f"{key} {saved.get(key)} (now {getattr(self, key)})"
            for key in ("seq_len", "global_batch", "data_seed", "reshuffle")
            if saved.get(key) != getattr(self, key)
        ]
        if mismatched:
            raise UserError(
                "the saved data position was made with different "
                + ", ".join(mismatched)
                + "; resume with the same train.seq_len, train.batch_size (the global micro-batch), train.data_seed "
                "and train.reshuffle_each_epoch"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0 or position % self.global_batch:
            raise UserError(
                f"invalid saved data position epoch={epoch} position={position}; "
                "the checkpoint is corrupt, resume from another one"
            )
        self.epoch, self.position = epoch, position


def count_eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int | None = None) -> int:
    """Number of windows `eval_batches` covers: all of them, or the first `max_windows`."""
    n = num_windows(len(tokens), seq_len)
    return n if max_windows is None else min(n, max(0, int(max_windows)))


def eval_window_ids(n_windows: int, max_windows: int | None = None, sample_seed: int | None = None) -> np.ndarray:
    """The ids of the windows an evaluation scores, in the order it scores them.

    Without `sample_seed`: the first `max_windows` (all when None), in order. With it: `max_windows`
    windows drawn without replacement, the first entries of a permutation of all `n_windows` seeded
    with `sample_seed` alone (the onóna paper's "1,024 held-out windows sampled with seed 1234").
    A pure function of its arguments, so every run, every process and every process count scores
    the same windows in the same order; the sample of k windows is the first k of a larger one."""
    count = n_windows if max_windows is None else min(n_windows, max(0, int(max_windows)))
    if sample_seed is None:
        return np.arange(count, dtype=np.int64)
    g = torch.Generator().manual_seed(int(sample_seed))
    return torch.randperm(n_windows, generator=g)[:count].numpy()


def eval_batches(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    max_windows: int | None = None,
    sample_seed: int | None = None,
    split: str = "evaluation",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed evaluation batches over the windows `eval_window_ids` picks: the first `max_windows`
    (all when None) in order, or `max_windows` sampled with `sample_seed`.

    Every call yields the same batches; each target token of the covered windows appears exactly
    once. The last batch may hold fewer than `batch_size` windows.
    """
    _check_tokens(tokens, seq_len)
    if batch_size < 1:
        raise UserError(f"batch_size must be at least 1, got {batch_size}; set a positive batch size")
    n = count_eval_windows(tokens, seq_len, max_windows)
    if n == 0 and len(tokens) == 0:
        raise UserError(
            f"the {split} split is empty; prepare the data again with more documents or a larger "
            "--dev-fraction / --test-fraction"
        )
    if n == 0:
        raise UserError(
            f"the {split} split has {len(tokens)} tokens, fewer than one window of seq_len {seq_len} "
            f"needs ({seq_len + 1}); use more evaluation data or a smaller seq_len"
        )
    ids = eval_window_ids(num_windows(len(tokens), seq_len), n, sample_seed)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, n, batch_size):
            yield _gather(tokens, ids[start : start + batch_size], seq_len)

    return batches()
