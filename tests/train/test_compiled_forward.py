"""`train.compile=true` falls back to the eager forward, with one logged line, when the compiler
fails; the model's own errors still propagate. Backends here are plain functions (no C++ compiler)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from tango_lm import ModelConfig, build_model
from tango_lm.train import trainer as trainer_module
from tango_lm.train.compiled_forward import CompiledForward
from tango_lm.train.trainer import train
from tests import helpers


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny_model():
    torch.manual_seed(0)
    config = ModelConfig(
        arch="loop-transformer", d_model=16, head_dim=8, width=32, depth=1, vocab_size=23, context_length=8
    )
    return build_model(config).double()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 23, (2, 8), generator=g), torch.randint(0, 23, (2, 8), generator=g)


def test_a_compiler_failure_logs_one_line_and_trains_eagerly(caplog):
    calls = []

    def broken_backend(graph, example_inputs):
        calls.append(1)
        raise RuntimeError("no kernel for this operator on this GPU")

    model = tiny_model()
    forward = CompiledForward(model.nll, backend=broken_backend)
    x, y = batch()
    with caplog.at_level(logging.WARNING, logger="tango_lm.train.compiled_forward"):
        first, second = forward(x, y), forward(x, y)
    assert forward.failed and len(calls) == 1  # compiled once, never retried
    torch.testing.assert_close(first, model.nll(x, y), rtol=0, atol=0)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("train.compile: torch.compile failed, training eagerly") and "no kernel" in lines[0]


def test_a_working_compiler_is_used_and_matches_eager():
    traced = []

    def counting_backend(graph, example_inputs):
        traced.append(graph)
        return graph.forward

    model = tiny_model()
    forward = CompiledForward(model.nll, backend=counting_backend)
    x, y = batch()
    loss = forward(x, y)
    assert traced and not forward.failed
    torch.testing.assert_close(loss, model.nll(x, y))


def test_the_models_own_errors_are_not_swallowed():
    model = tiny_model()
    forward = CompiledForward(model.nll, backend="eager")
    x = torch.zeros(2, 9, dtype=torch.long)  # longer than the context: the model refuses it
    with pytest.raises(Exception) as raised:
        model.nll(x, x)
    with pytest.raises(type(raised.value)):
        forward(x, x)
    assert not forward.failed


@pytest.mark.usefixtures("one_thread")
def test_a_run_whose_compiler_fails_trains_as_the_eager_run(data_dir, tmp_path, monkeypatch, caplog):
    def broken_backend(graph, example_inputs):
        raise RuntimeError("inductor cannot lower this operator")

    train(helpers.run_config(data_dir, tmp_path / "eager", steps=3))
    monkeypatch.setattr(trainer_module, "CompiledForward", functools.partial(CompiledForward, backend=broken_backend))
    with caplog.at_level(logging.WARNING, logger="tango_lm.train.compiled_forward"):
        train(helpers.run_config(data_dir, tmp_path / "compiled", steps=3, compile=True))
    assert len(caplog.records) == 1
    losses = [[r["loss"] for r in helpers.loss_records(tmp_path / run)] for run in ("eager", "compiled")]
    assert losses[0] == losses[1] and len(losses[0]) == 3
