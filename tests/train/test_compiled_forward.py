"""`train.compile=true` falls back to the eager forward, with one logged line, when the compiler
fails; the model's own errors still propagate. Backends here are plain functions (no C++ compiler)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

from tango_lm import ModelConfig, build_model
from tango_lm.train import trainer as trainer_module
from tango_lm.train.compiled_forward import CompiledForward, with_eager_fallback
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


def backward_fails_to_compile():
    """A backend whose forward graph compiles and whose backward graph, compiled by AOTAutograd at
    the first backward call (outside the forward's), fails as inductor's failures do."""

    def broken(graph, example_inputs):
        raise torch._inductor.exc.InductorError(RuntimeError("cannot lower this backward operator"), None)

    return aot_autograd(fw_compiler=lambda graph, example_inputs: graph, bw_compiler=broken)


def test_a_backward_that_fails_to_compile_runs_the_step_again_eagerly(caplog):
    model = tiny_model()
    forward = CompiledForward(model.nll, backend=backward_fails_to_compile())
    x, y = batch()

    def step():
        loss = forward(x, y)
        loss.backward()
        return loss

    with caplog.at_level(logging.WARNING, logger="tango_lm.train.compiled_forward"):
        loss = with_eager_fallback(step, forward)
    assert forward.failed and len(caplog.records) == 1 and "backward operator" in caplog.records[0].getMessage()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    want = model.nll(x, y)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    for name, p in model.named_parameters():  # the failed backward wrote nothing: no gradient twice
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=0, msg=name)


def test_with_eager_fallback_lets_other_errors_and_eager_failures_through():
    def fails():
        raise torch._dynamo.exc.TorchDynamoException("a compiler error")

    with pytest.raises(torch._dynamo.exc.TorchDynamoException):
        with_eager_fallback(fails, tiny_model().nll)  # no compiled forward to fall back from
    with pytest.raises(ValueError):
        with_eager_fallback(lambda: int("x"), CompiledForward(tiny_model().nll))


def _broken_forward_backend(graph, example_inputs):
    raise RuntimeError("inductor cannot lower this operator")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("broken", ["forward", "backward"])
def test_a_run_whose_compiler_fails_trains_as_the_eager_run(data_dir, tmp_path, monkeypatch, caplog, broken):
    broken_backend = _broken_forward_backend if broken == "forward" else backward_fails_to_compile()
    train(helpers.run_config(data_dir, tmp_path / "eager", steps=3))
    monkeypatch.setattr(trainer_module, "CompiledForward", functools.partial(CompiledForward, backend=broken_backend))
    with caplog.at_level(logging.WARNING, logger="tango_lm.train.compiled_forward"):
        train(helpers.run_config(data_dir, tmp_path / "compiled", steps=3, compile=True))
    assert len(caplog.records) == 1
    losses = [[r["loss"] for r in helpers.loss_records(tmp_path / run)] for run in ("eager", "compiled")]
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_the_ninth_model_shape_of_a_process_still_compiles():
    # Dynamo counts one code object's graphs over the process: a sweep's runs (one process) past the
    # eighth model shape trained eagerly, unsaid, with the per-run limit.
    from torch._dynamo.utils import counters

    counters.clear()
    x, y = batch()
    for width in range(8, 8 * 12, 8):
        torch.manual_seed(0)
        config = ModelConfig(
            arch="loop-transformer", d_model=16, head_dim=8, width=width, depth=1, vocab_size=23, context_length=8
        )
        model = build_model(config).double()
        forward = CompiledForward(model.nll, backend="eager")
        torch.testing.assert_close(forward(x, y), model.nll(x, y))
        assert not forward.failed
    assert counters["stats"]["unique_graphs"] == 11
