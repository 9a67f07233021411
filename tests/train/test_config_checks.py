"""config_checks.py at its bounds: a token id equal to the table's size has no row, and a model
whose training state fits only split over FSDP's processes is not refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tango_lm import config_checks
from tango_lm.errors import UserError


def _run_and_data(vocab_size: int, tokenizer_ids: int, max_token_id: int):
    run = SimpleNamespace(model=SimpleNamespace(vocab_size=vocab_size))
    tok = SimpleNamespace(name="custom", vocab_size=tokenizer_ids)
    return run, SimpleNamespace(path="data/x", tokenizer=tok, max_token_id=max_token_id)


def test_a_token_id_equal_to_the_vocab_size_is_refused():
    # The table has rows 0..vocab_size-1: id vocab_size was an index error in the embedding, mid-run.
    config_checks.check_data_fits_model(*_run_and_data(10, 10, 9))
    with pytest.raises(UserError, match="model.vocab_size is 10; set model.vocab_size=10"):
        config_checks.check_data_fits_model(*_run_and_data(10, 10, 10))
    with pytest.raises(UserError, match="with 11 ids but model.vocab_size is 10"):
        config_checks.check_data_fits_model(*_run_and_data(10, 11, 3))


def test_fsdp_splits_the_training_state_over_its_processes(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(config_checks, "_device_memory", lambda device: (10 * gib, "GPU 0"))
    model = SimpleNamespace(num_params=lambda: {"total": 2 * gib}, depth=1, d_model=8)  # 32 GiB of state
    config_checks.check_fits_memory(model, "cuda", shards=4)  # 8 GiB per process
    with pytest.raises(UserError, match=r"32.0 GiB, more than the 10.0 GiB of GPU 0"):
        config_checks.check_fits_memory(model, "cuda", shards=1)
    with pytest.raises(UserError, match=r"16.0 GiB per process of 2"):
        config_checks.check_fits_memory(model, "cuda", shards=2)


def test_a_budget_in_steps_leaves_tokens_and_tokens_per_param_unchecked(monkeypatch):
    # train.steps sets the run's length: a run directory's tokens and TPP, which disagree for a
    # changed model, are then no budget to refuse (train runs/x train.steps=100 model.width=...).
    from tango_lm.train import config as train_config

    monkeypatch.setattr(train_config, "tpp_reference_params", lambda model: 1000)
    t = SimpleNamespace(steps=None, tokens=30_000, tokens_per_param=20.0)
    run = SimpleNamespace(model=None, train=t)
    with pytest.raises(UserError, match="both set the budget and disagree"):
        config_checks.check_budget_agrees(run)
    t.tokens = 20_000
    config_checks.check_budget_agrees(run)
    t.steps, t.tokens = 100, 30_000
    config_checks.check_budget_agrees(run)
