"""train/distributed.py's collectives on two gloo processes: the on-device mean the training step
reads its loss and MoE aux loss from gives, bit for bit, what averaging the Python floats gave."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tango_lm.train.distributed import DistEnv, mean_over_ranks, mean_over_ranks_on_device

# per rank: a loss and an aux loss whose float64 sums round (0.1 + 0.2 is not 0.3)
VALUES = {0: [0.1, 1e-3 / 3], 1: [0.2, 2.0 / 7]}


def _rank(rank: int, store_path: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        env = DistEnv(parallel="ddp", rank=rank, world_size=2)
        values = torch.tensor(VALUES[rank], dtype=torch.float64)
        means = mean_over_ranks_on_device(env, values)
        results[rank] = (means.tolist(), [mean_over_ranks(env, v) for v in VALUES[rank]], values.tolist())
    finally:
        dist.destroy_process_group()


def test_the_on_device_mean_is_the_float_mean_on_every_rank(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(str(tmp_path / "store"), results), nprocs=2)
        results = dict(results)
    expected = [(a + b) / 2 for a, b in zip(VALUES[0], VALUES[1], strict=True)]
    for rank in (0, 1):
        on_device, floats, inputs = results[rank]
        assert on_device == floats == expected  # exact: the same float64 sums and division
        assert inputs == VALUES[rank]  # the caller's tensor is not reduced in place


def test_one_process_returns_its_values():
    values = torch.tensor([0.25, 3.0], dtype=torch.float64)
    assert mean_over_ranks_on_device(DistEnv(), values) is values
