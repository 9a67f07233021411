"""evaluate_nll (eval/nll.py): the mean over scored targets, as model.nll."""

from __future__ import annotations

import pytest
import torch

from tango_lm import build_model
from tango_lm.eval.nll import evaluate_nll
from tango_lm.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def test_ignored_targets_are_neither_scored_nor_counted():
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="tango", d_model=32, head_dim=16, width=64, depth=2, vocab_size=50))
    x = torch.randint(0, 50, (3, 11))
    y = torch.randint(0, 50, (3, 11))
    y[:, ::2] = -100  # e.g. prompt tokens a caller does not score
    batches = [(x[:2], y[:2]), (x[2:], y[2:])]
    nll, count = evaluate_nll(model, batches, torch.device("cpu"))
    assert count == int((y != -100).sum())
    with torch.no_grad():
        assert nll == pytest.approx(float(model.eval().nll(x, y)), rel=1e-5)
