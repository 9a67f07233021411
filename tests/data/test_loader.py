"""Training windows (order, seeds, resume, ranks) and fixed evaluation batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tango_lm.data.loader import WindowLoader, count_eval_windows, eval_batches, eval_window_ids
from tango_lm.errors import UserError

SEQ = 8


def _tokens(n: int = 8 * 37 + 5) -> np.ndarray:
    # Distinct values make every window identifiable by its first token.
    return np.arange(n, dtype=np.uint16)


def _window_ids(inputs: torch.Tensor) -> list[int]:
    return [int(row[0]) // SEQ for row in inputs]


def test_windows_cover_tokens_as_specified():
    tokens = _tokens()
    loader = WindowLoader(tokens, SEQ, batch_size=4, data_seed=0)
    assert loader.num_windows == (len(tokens) - 1) // SEQ == 37
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, SEQ) and x.dtype == y.dtype == torch.int64
    order = loader.epoch_order(0)
    for row, (xi, yi) in enumerate(zip(x, y, strict=True)):
        i = int(order[row])
        window = torch.from_numpy(tokens[i * SEQ : i * SEQ + SEQ + 1].astype(np.int64))
        assert torch.equal(xi, window[:-1]) and torch.equal(yi, window[1:])


def test_trading_batch_size_for_grad_accum_trains_on_the_same_windows():
    # The epoch ended at a micro-batch: with batch 2 x accumulation 2 one step mixed the last
    # windows of an epoch with the first of the next, which batch 4 x 1 skips; from there on the
    # two settings trained on other windows.
    tokens = _tokens()[: 35 * SEQ + 1]  # 35 windows: 8 steps of 4 an epoch, 3 windows skipped

    def steps(batch: int, accum: int, n: int) -> list[list[int]]:
        loader = WindowLoader(tokens, SEQ, batch_size=batch, data_seed=3, grad_accum=accum)
        return [sorted(w for _ in range(accum) for w in _window_ids(loader.next_batch()[0])) for _ in range(n)]

    assert steps(2, 2, 20) == steps(4, 1, 20)
    assert steps(1, 4, 20) == steps(4, 1, 20)
    loader = WindowLoader(_tokens(), SEQ, batch_size=2, data_seed=3, grad_accum=2)
    assert loader.batches_per_epoch == 18
    tiny = WindowLoader(_tokens()[: 3 * SEQ + 1], SEQ, batch_size=2, data_seed=3, grad_accum=2)  # 3 windows
    assert [len(_window_ids(tiny.next_batch()[0])) for _ in range(4)] == [2, 2, 2, 2]  # a step spans epochs
    # A position saved mid-step by the old rule (an epoch ended at a micro-batch) still resumes.
    old = WindowLoader(tokens, SEQ, batch_size=2, data_seed=3, grad_accum=2)
    old.load_state_dict({**old.state_dict(), "epoch": 1, "position": 34})
    assert len(_window_ids(old.next_batch()[0])) == 2 and old.state_dict()["epoch"] == 2


def test_epoch_visits_each_window_once_and_drops_trailing():
    loader = WindowLoader(_tokens(), SEQ, batch_size=5, data_seed=3)
    assert loader.batches_per_epoch == 7  # 37 windows, 2 dropped
    seen = [w for _ in range(7) for w in _window_ids(loader.next_batch()[0])]
    assert len(set(seen)) == 35 and set(seen) <= set(range(37))
    assert set(seen) == set(loader.epoch_order(0)[:35].tolist())
    loader.next_batch()
    assert loader.state_dict()["epoch"] == 1


def test_data_seed_controls_order_independent_of_global_rng():
    def first_ids(seed: int) -> list[int]:
        loader = WindowLoader(_tokens(), SEQ, batch_size=6, data_seed=seed)
        return [w for _ in range(3) for w in _window_ids(loader.next_batch()[0])]

    torch.manual_seed(1)
    a = first_ids(17)
    torch.manual_seed(999)  # the model seed must not change the data order
    b = first_ids(17)
    assert a == b
    assert first_ids(101) != a
    loader = WindowLoader(_tokens(), SEQ, batch_size=6, data_seed=17)
    assert not np.array_equal(loader.epoch_order(0), loader.epoch_order(1))


@pytest.mark.parametrize("steps_before", [0, 3, 7, 8, 15])
def test_resume_yields_identical_batches(steps_before):
    # 7 batches per epoch: 7, 8 and 15 resume exactly at or just after epoch boundaries.
    original = WindowLoader(_tokens(), SEQ, batch_size=5, data_seed=11)
    for _ in range(steps_before):
        original.next_batch()
    state = original.state_dict()
    assert set(state) == {"epoch", "position", "data_seed", "seq_len", "global_batch", "reshuffle"}
    restored = WindowLoader(_tokens(), SEQ, batch_size=5, data_seed=11)
    restored.load_state_dict(dict(state))
    for _ in range(10):  # spans at least one epoch boundary
        (xa, ya), (xb, yb) = original.next_batch(), next(restored)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_resume_rejects_different_settings():
    state = WindowLoader(_tokens(), SEQ, batch_size=4, data_seed=1).state_dict()
    with pytest.raises(UserError, match="seq_len 8 .now 4.*data_seed 1 .now 2"):
        WindowLoader(_tokens(), 4, batch_size=4, data_seed=2).load_state_dict(state)
    with pytest.raises(UserError, match="global_batch 4 .now 6"):
        WindowLoader(_tokens(), SEQ, batch_size=3, data_seed=1, world_size=2).load_state_dict(state)
    # The same global batch over a different number of ranks is fine.
    WindowLoader(_tokens(), SEQ, batch_size=2, data_seed=1, world_size=2).load_state_dict(state)


def test_resume_refuses_a_position_inside_a_batch_or_before_the_start():
    # Only a damaged checkpoint holds one: trained on, it would read misaligned windows.
    state = WindowLoader(_tokens(), SEQ, batch_size=4, data_seed=1).state_dict()
    for epoch, position in ((0, 3), (0, -4), (-1, 0)):
        with pytest.raises(UserError, match="invalid saved data position.*corrupt"):
            WindowLoader(_tokens(), SEQ, batch_size=4, data_seed=1).load_state_dict(
                {**state, "epoch": epoch, "position": position}
            )


def test_without_reshuffling_every_epoch_repeats_the_first_permutation():
    # The onóna paper (Appendix C): "the same permutation repeats when the pool is exhausted".
    loader = WindowLoader(_tokens(), SEQ, batch_size=5, data_seed=3, reshuffle=False)
    first = [w for _ in range(7) for w in _window_ids(loader.next_batch()[0])]
    second = [w for _ in range(7) for w in _window_ids(loader.next_batch()[0])]
    assert first == second and loader.state_dict()["epoch"] == 1
    state = loader.state_dict()
    with pytest.raises(UserError, match="reshuffle False .now True"):
        WindowLoader(_tokens(), SEQ, batch_size=5, data_seed=3).load_state_dict(state)
    state.pop("reshuffle")  # saved before the option: it reshuffled
    WindowLoader(_tokens(), SEQ, batch_size=5, data_seed=3).load_state_dict(state)


def test_rank_slices_concatenate_to_global_batch():
    one = WindowLoader(_tokens(), SEQ, batch_size=6, data_seed=5)
    ranks = [WindowLoader(_tokens(), SEQ, batch_size=3, data_seed=5, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(15):  # crosses two epoch boundaries (6 batches per epoch)
        xg, yg = one.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), xg)
        assert torch.equal(torch.cat([p[1] for p in parts]), yg)
    assert ranks[0].tokens_per_batch == one.tokens_per_batch == 6 * SEQ
    assert ranks[0].tokens_per_rank_batch == 3 * SEQ


def test_too_few_tokens_says_how_many_needed():
    with pytest.raises(UserError, match="needs at least 65"):
        WindowLoader(np.arange(64, dtype=np.uint16), SEQ, batch_size=4, data_seed=0, world_size=2)
    WindowLoader(np.arange(65, dtype=np.uint16), SEQ, batch_size=4, data_seed=0, world_size=2)


def test_eval_batches_fixed_and_cover_every_target_once():
    tokens = _tokens()
    first = list(eval_batches(tokens, SEQ, batch_size=5))
    second = list(eval_batches(tokens, SEQ, batch_size=5))
    assert len(first) == 8 and first[-1][0].shape == (2, SEQ)  # 37 windows = 7*5 + 2
    for (xa, ya), (xb, yb) in zip(first, second, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    targets = torch.cat([y for _, y in first]).flatten()
    assert targets.tolist() == list(range(1, 37 * SEQ + 1))
    inputs = torch.cat([x for x, _ in first]).flatten()
    assert inputs.tolist() == list(range(37 * SEQ))


def test_eval_batches_max_windows():
    tokens = _tokens()
    assert count_eval_windows(tokens, SEQ, None) == 37
    assert count_eval_windows(tokens, SEQ, 10) == 10
    assert count_eval_windows(tokens, SEQ, 1000) == 37
    batches = list(eval_batches(tokens, SEQ, batch_size=4, max_windows=10))
    assert [x.shape[0] for x, _ in batches] == [4, 4, 2]
    assert torch.cat([y for _, y in batches]).flatten().tolist() == list(range(1, 10 * SEQ + 1))


def test_eval_batches_too_short():
    with pytest.raises(UserError, match="fewer than one window"):
        eval_batches(np.arange(SEQ, dtype=np.uint16), SEQ, batch_size=2)


# -- sampled evaluation windows (train.eval_sample_seed; the onóna paper's 1,024 windows, seed 1234) --
def test_sampled_window_ids_are_a_pure_function_of_seed_windows_and_count():
    first = eval_window_ids(37, 5, sample_seed=1234)
    torch.manual_seed(99)  # the global RNGs play no part
    np.random.seed(99)
    torch.rand(3)
    assert eval_window_ids(37, 5, sample_seed=1234).tolist() == first.tolist() == [20, 4, 23, 34, 18]
    everything = eval_window_ids(37, None, sample_seed=1234)
    assert sorted(everything.tolist()) == list(range(37))  # without replacement
    for k in (1, 5, 36):  # a sample of k is the first k of a larger one
        assert eval_window_ids(37, k, sample_seed=1234).tolist() == everything[:k].tolist()
    assert eval_window_ids(37, 5, sample_seed=1235).tolist() != first.tolist()
    assert eval_window_ids(37, 5).tolist() == [0, 1, 2, 3, 4]  # no seed: the first windows, in order
    assert eval_window_ids(37, 100, sample_seed=7).shape == (37,)


def test_eval_batches_with_a_sample_seed_score_the_sampled_windows():
    tokens = _tokens()
    batches = list(eval_batches(tokens, SEQ, batch_size=3, max_windows=7, sample_seed=1234))
    assert [x.shape[0] for x, _ in batches] == [3, 3, 1]
    ids = eval_window_ids(37, 7, sample_seed=1234).tolist()
    assert [w for x, _ in batches for w in _window_ids(x)] == ids
    for (x, y), start in zip(batches, range(0, 7, 3), strict=True):  # each window's targets follow its inputs
        assert torch.equal(y[:, :-1], x[:, 1:])
        assert [int(r[0]) for r in x] == [i * SEQ for i in ids[start : start + 3]]
    again = list(eval_batches(tokens, SEQ, batch_size=3, max_windows=7, sample_seed=1234))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
