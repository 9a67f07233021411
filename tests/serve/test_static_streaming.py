"""Streaming through the static decode (serve/static_decode.py `decode_static` with `on_token`):
the tokens streamed are the tokens returned, `on_token` returning True stops the decode there,
and for every architecture the static steps with streaming give the eager decode's greedy tokens
(the server's batcher streams, so on CUDA it decodes on CUDA graphs)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tango_lm.serve import static_decode
from tango_lm.serve.generate import generate
from tango_lm.serve.static_decode import StaticDecoder, static_decoder
from tests import arch_cases
from tests.serve.test_generate import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Stream:
    """An `on_token` that keeps what it sees and asks to stop after `stop_after` steps."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.seen: list[torch.Tensor] = []
        self.stop_after = stop_after

    def __call__(self, tokens: torch.Tensor) -> bool:
        self.seen.append(tokens.clone())
        return self.stop_after is not None and len(self.seen) >= self.stop_after

    def tokens(self) -> torch.Tensor:
        return torch.stack(self.seen, 1)


def compiled_on_dynamo(model, rows: int, positions: int) -> StaticDecoder:
    """The model's "compile" decoder, traced by Dynamo with its cheap "eager" backend (the graph a
    compiled or CUDA-graph step runs)."""
    decoder = static_decoder(model, rows, "eager", positions)
    key = next(k for k, v in model._static_decoders.items() if v is decoder)
    model._static_decoders[(*key[:2], "compile", *key[3:])] = compiled = StaticDecoder(
        model, rows, "compile", backend="eager", capacity=decoder.cache.capacity
    )
    return compiled


@pytest.fixture(params=[False, True], ids=["read-at-once", "read-one-step-late"])
def late(request, monkeypatch):
    """The host's reads as on CPUs (at once) and as on CUDA (after the next step is queued)."""
    monkeypatch.setattr(static_decode, "reads_one_step_late", lambda device: request.param)
    return request.param


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_streamed_tokens_are_the_returned_tokens_and_early_stop_works(mode, late):
    model = tiny_model("tango")
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(3))
    if mode == "compile":
        compiled = compiled_on_dynamo(model, 2, 5 + 9 - 1)
    for kwargs in ({"temperature": 0}, {"temperature": 0.8, "top_k": 7, "seed": 4}):
        stream = Stream()
        out = generate(model, prompt, 9, static=mode, on_token=stream, **kwargs)
        assert out.shape == (2, 14) and torch.equal(stream.tokens(), out[:, 5:])
        assert torch.equal(out, generate(model, prompt, 9, static=mode, **kwargs))  # streaming changes nothing
        stop = Stream(stop_after=3)
        early = generate(model, prompt, 9, static=mode, on_token=stop, **kwargs)
        assert len(stop.seen) == 3 and torch.equal(early, out[:, :8])
    if mode == "compile":
        assert compiled.length > 0 and not compiled.compiled_failed  # its steps ran, traced


@pytest.mark.parametrize("arch", arch_cases.names())
def test_streaming_static_decode_equals_the_eager_decode(arch):
    model = tiny_model(arch)
    prompt = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(5))
    eager, static = Stream(), Stream()
    want = generate(model, prompt, 10, temperature=0, static=None, on_token=eager)
    got = generate(model, prompt, 10, temperature=0, static="eager", on_token=static)
    assert torch.equal(got, want) and torch.equal(static.tokens(), eager.tokens())
    assert [d.length for d in model._static_decoders.values()] == [6 + 9]  # the static steps ran


@pytest.mark.parametrize("rows", [1, 3])
def test_end_of_text_stops_the_static_decode_where_it_stops_the_eager_one(late, rows):
    # Greedy, the first row draws 16 at its 4th new token, the others at their 1st: all three stop at the 4th.
    model = tiny_model("loop-transformer")
    prompt = torch.tensor([[46, 43, 42, 19], [59, 0, 19, 28], [2, 54, 3, 7]])[:rows]
    want = generate(model, prompt, 12, temperature=0, static=None, eos_id=16)
    got = generate(model, prompt, 12, temperature=0, static="eager", eos_id=16)
    assert torch.equal(got, want) and got.shape == (rows, 4 + 4) and (got[:, -1] == 16).all()
    seeded = {"temperature": 0.9, "seed": 2, "eos_id": 16}
    once, again = (generate(model, prompt, 12, static="eager", **seeded) for _ in range(2))
    assert torch.equal(once, again)


def test_the_next_step_is_queued_before_the_host_reads_a_step_late(monkeypatch):
    # On CUDA the stop checks read a step's tokens after the next step is queued, so the GPU runs
    # it while the host reads and decides (HostTokens); the last step has no next one.
    monkeypatch.setattr(static_decode, "reads_one_step_late", lambda device: True)
    model = tiny_model("loop-transformer")
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(9))
    events = []
    real_step = StaticDecoder.step

    def step(self, *args, **kwargs):
        events.append("step")
        return real_step(self, *args, **kwargs)

    def on_token(tokens):
        events.append("read")
        return False

    monkeypatch.setattr(StaticDecoder, "step", step)
    out = generate(model, prompt, 5, temperature=0, static="eager", on_token=on_token)
    assert events == ["step", "read"] * 4 + ["read"]
    assert torch.equal(out, generate(model, prompt, 5, temperature=0, static=None))


def test_a_model_keeps_its_most_recent_decoders_and_frees_the_others(monkeypatch):
    # A server meets many batch sizes; every decoder holds a whole decode cache. The dropped one
    # is freed, compiled step and all (Dynamo keeps no reference to it).
    monkeypatch.setattr(static_decode, "MAX_DECODERS", 2)
    model = tiny_model("loop-transformer")
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(6))
    first = static_decoder(model, 1, "eager", 10)
    second = compiled_on_dynamo(model, 2, 10)
    generate(model, prompt, 3, temperature=0, static="compile")  # traces the second's step
    assert second.length > 0 and not second.compiled_failed
    assert static_decoder(model, 1, "eager", 10) is first  # used again: now the most recent
    second_key = next(k for k, v in model._static_decoders.items() if v is second)
    freed = weakref.ref(second)
    del second
    third = static_decoder(model, 3, "eager", 10)  # drops the least recently used: the second
    gc.collect()
    assert list(model._static_decoders.values()) == [first, third] and freed() is None
    assert second_key not in model._static_decoders


def test_each_active_segment_of_narrow_width_gets_its_own_decoder():
    # A decoder's buffers hold the active segment's gate columns: one built with every column active
    # was reused for a narrow segment (and failed on its narrower gates).
    model = tiny_model("tango", active_width=5)  # 12 gate columns per head: 3 segments
    prompt = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(7))
    for segment in (None, 1, None, 2):
        model.set_active_segment(segment)
        want = generate(model, prompt, 5, temperature=0, static=None)
        assert torch.equal(generate(model, prompt, 5, temperature=0, static="eager"), want), segment
    assert len(model._static_decoders) == 3
