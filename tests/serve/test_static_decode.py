"""Static decode steps (serve/static_decode.py) against the eager cached decode, for every
architecture: the same log-probs at every position (float64), across group and window boundaries
and over several requests on one decoder; under torch.compile one graph serves every position and
request (Dynamo's counters); the in-graph samplers are exact; a failing compiled step falls back."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from tango_lm import ModelConfig, UserError, build_model
from tango_lm.models.registry import ARCHITECTURES
from tango_lm.serve.generate import generate
from tango_lm.serve.static_decode import StaticDecoder, capacity_bucket, sample_from_noise
from tests import arch_cases
from tests.serve.test_generate import model_for, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
# Prefill lengths: inside a FLASH group (tiny g = 4), at a group boundary, inside the first window
# of windowed TANGO (tiny W = 4); the steps then cross groups and windows.
REQUESTS = (11, 8, 2)


def eager_log_probs(model, x, prefill):
    cache = model.new_cache()
    out = [model(x[:, :prefill], cache)[:, -1]]
    out += [model(x[:, i : i + 1], cache)[:, -1] for i in range(prefill, x.shape[1] - 1)]
    return torch.stack(out, 1)


def static_log_probs(decoder, x, prefill):
    model = decoder.model
    h = decoder.prefill(x[:, :prefill])[:, -1:]
    out = [model.head.log_probs(h, x[:, prefill - 1 : prefill])[:, 0]]
    noise = torch.rand(x.shape[0], model.config.vocab_size, dtype=torch.float64)
    for i in range(prefill, x.shape[1] - 1):
        _, log_probs = decoder.step(x[:, i : i + 1], noise, 0.0)
        out.append(log_probs)
    return torch.stack(out, 1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def check_static_decoding(cfg: ModelConfig) -> None:
    """Static steps (run eagerly) give the eager decode's log-probs (float64) at every position of
    three requests on one decoder, whose buffers every request reuses."""
    model = model_for(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    decoder = StaticDecoder(model, 2, "eager")
    for prefill in REQUESTS:
        want = eager_log_probs(model, x, prefill)
        torch.testing.assert_close(static_log_probs(decoder, x, prefill), want, rtol=1e-10, atol=1e-10)


def check_one_graph(cfg: ModelConfig) -> None:
    """Traced by Dynamo (fullgraph, its "eager" backend: the same graph a compiled or CUDA-graph
    step needs, run op by op) the step gives the same log-probs, and one graph serves every
    position of two requests."""
    torch._dynamo.reset()
    counters.clear()
    model = model_for(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(1))
    decoder = StaticDecoder(model, 2, "compile", backend="eager")
    for prefill in (9, 11):  # a second request, at another position: no new graph
        want = eager_log_probs(model, x, prefill)
        torch.testing.assert_close(static_log_probs(decoder, x, prefill), want, rtol=1e-10, atol=1e-10)
    assert not decoder.compiled_failed
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("arch", arch_cases.names())
def test_static_steps_equal_the_eager_decode(arch):
    check_static_decoding(arch_cases.tiny_config(arch))


@pytest.mark.parametrize("arch", arch_cases.names())
def test_compiled_static_step_is_one_graph_for_every_position(arch):
    # One application per block kind keeps the tracing quick (the architectures that need more
    # say so in their tiny depth).
    check_one_graph(arch_cases.tiny_config(arch, depth=ARCHITECTURES[arch].tiny.get("depth", 1)))


def test_generate_static_greedy_equals_eager_and_reuses_the_decoder():
    model = tiny_model("tango-windowed")  # context 48: one capacity bucket
    prompt = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(2))
    for n in (9, 4):
        want = generate(model, prompt[:, : n - 2], n, temperature=0, static=None)
        got = generate(model, prompt[:, : n - 2], n, temperature=0, static="eager")
        assert torch.equal(got, want)
    assert len(model._static_decoders) == 1


def test_a_window_past_the_cache_sizes_the_ring_by_the_cache():
    # The ring had W slots: window=4,000,000 ("no window") took 4.4 GB and 4.6 s for 5 tokens of a
    # 13k-parameter model; no position past the cache's capacity exists to fill more.
    cfg = arch_cases.tiny_config("tango-windowed").replace(window=4_000_000)
    check_static_decoding(cfg)  # the static steps still equal the eager decode
    model = model_for(cfg)
    decoder = StaticDecoder(model, 2, "eager", capacity=16)
    decoder.prefill(torch.zeros(2, 3, dtype=torch.long))
    rings = [t for state in decoder.cache.states for name, t in state.static.items() if name.startswith("ring")]
    assert rings and all(t.shape[-2] == 16 for t in rings)


def test_every_top_p_and_temperature_is_one_compiled_step():
    # top_p was a constant of the step's graph: every value a server's requests sent compiled a
    # graph of its own, and after 64 (a budget the process's decoders share) it decoded uncompiled.
    model = tiny_model("loop-transformer")
    prompt = torch.randint(0, 61, (1, 3), generator=torch.Generator().manual_seed(0))
    counters.clear()
    for i in range(5):
        kwargs = {"temperature": 0.5 + 0.1 * i, "top_p": round(0.3 + 0.1 * i, 2), "seed": i}
        want = generate(model, prompt, 4, static="eager", **kwargs)
        (eager_key,) = model._static_decoders
        key = (1, eager_key[1], "compile", *eager_key[3:])  # the decoder generate takes: Dynamo's eager backend
        model._static_decoders[key] = decoder = StaticDecoder(model, 1, "compile", backend="eager", capacity=key[1])
        assert torch.equal(generate(model, prompt, 4, static="compile", **kwargs), want)
        assert model._static_decoders[key] is decoder and not decoder.compiled_failed and decoder.length == 6
        del model._static_decoders[key]
    assert counters["stats"]["unique_graphs"] == 1


def test_capacity_buckets():
    assert [capacity_bucket(n, 1024) for n in (1, 64, 65, 500, 513, 768, 2000)] == [64, 64, 128, 512, 1024, 1024, 1024]
    assert capacity_bucket(100, 48) == 48


def test_seeded_sampling_is_the_same_eager_and_compiled():
    # onóna's one-projection sampling at batch 1 (the table picked by index inside the product),
    # compiled with inductor (no CUDA graphs on a CPU; once: each inductor build costs seconds),
    # against the static step run eagerly; and top-k / top-p sampling through Dynamo's graph.
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(
            arch="tango", head="onona", d_model=16, head_dim=8, width=32, depth=1, vocab_size=37, context_length=16
        )
    ).eval()
    for rows, backend, kwargs in (
        (1, "inductor", {"temperature": 1.0, "vocab_size": 30}),  # ids 30-36: the table's padding
        (1, "eager", {"temperature": 1.0}),
        (2, "eager", {"temperature": 0.7, "top_k": 5, "top_p": 0.9}),
        (2, "eager", {"temperature": 1.0, "vocab_size": 30}),
    ):
        prompt = torch.randint(0, 37, (rows, 3), generator=torch.Generator().manual_seed(rows))
        runs = [generate(model, prompt, 6, seed=3, static="eager", **kwargs)]
        key = (rows, 16, "compile", torch.device("cpu"), torch.float32, None)  # capacity: the context (16)
        model._static_decoders[key] = StaticDecoder(model, rows, "compile", backend=backend, capacity=16)
        runs.append(generate(model, prompt, 6, seed=3, static="compile", **kwargs))
        assert torch.equal(runs[0], runs[1]), kwargs
        assert not model._static_decoders[key].compiled_failed and model._static_decoders[key].length == 8
        assert (runs[0][:, 3:] < kwargs.get("vocab_size", 37)).all()
        del model._static_decoders[key]  # the next case compiles its own


def test_a_failing_compiled_step_falls_back_with_one_line(caplog):
    model = tiny_model("loop-transformer")
    x = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(4))
    decoder = StaticDecoder(model, 1, "compile", backend="eager")

    def broken(*args):
        raise RuntimeError("no graph for this shape\nsecond line")

    decoder._compiled = broken
    with caplog.at_level(logging.WARNING, logger="tango_lm.serve.static_decode"):
        got = static_log_probs(decoder, x, 5)
    torch.testing.assert_close(got, eager_log_probs(model, x, 5), rtol=1e-10, atol=1e-10)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "decoding eagerly" in lines[0] and "second line" not in lines[0]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_gumbel_sampler_draws_from_the_softmax(temperature):
    # At T != 1 the softmax of log_probs / T (a sampler that ignored T drew as at T = 1).
    log_probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().expand(40000, 4)
    noise = torch.rand(40000, 4, generator=torch.Generator().manual_seed(5))
    draws = sample_from_noise(log_probs, noise, torch.tensor(temperature))
    freq = torch.bincount(draws, minlength=4) / 40000
    torch.testing.assert_close(freq, (log_probs[0] / temperature).softmax(-1), rtol=0, atol=0.01)
    assert torch.equal(sample_from_noise(log_probs[:3], noise[:3], torch.tensor(0.0)), torch.full((3,), 3))


def test_onona_static_sample_is_the_one_projection_sample():
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(
            arch="loop-transformer",
            head="onona",
            d_model=16,
            head_dim=8,
            width=32,
            depth=1,
            vocab_size=29,
            context_length=8,
        )
    ).double()
    head = model.head
    h = torch.randn(3, 16, dtype=torch.float64)
    ids = torch.tensor([4, 17, 8])
    noise = torch.rand(3, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    with head.serving():
        g = torch.sigmoid(head.gate_logit(ids))
        together = head.sample_static(h, ids, noise)
        one_by_one = torch.cat([head.sample_static(h[i : i + 1], ids[i : i + 1], noise[i : i + 1]) for i in range(3)])
        first_20 = head.sample_static(h, ids, noise, vocab_size=20)  # the rest: a padded table's rows
        one_by_one_20 = [head.sample_static(h[i : i + 1], ids[i : i + 1], noise[i : i + 1], 20) for i in range(3)]
    for i in range(3):
        table = head.table_a.weight if noise[i, 0] < g[i] else head.table_b.weight
        want = (h[i] @ table.T - torch.log(-torch.log(noise[i, 1:]))).argmax()
        assert together[i] == want == one_by_one[i]
        want_20 = (h[i] @ table[:20].T - torch.log(-torch.log(noise[i, 1:21]))).argmax()
        assert first_20[i] == want_20 == one_by_one_20[i]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", arch_cases.names())
def test_cuda_graph_decode_equals_the_eager_decode(arch):
    from torch._dynamo.utils import counters

    counters.clear()  # inductor falls back to no graph silently, counting a skip: none may
    model = tiny_model(arch).float().cuda()
    prompt = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(1)).cuda()
    want = generate(model, prompt, 12, temperature=0, static=None)
    for _ in range(2):  # the second request replays the recorded graph
        got = generate(model, prompt, 12, temperature=0, static="cuda-graphs")
        assert torch.equal(got, want)
    # The stop checks read each step's tokens on the host while the next step runs (HostTokens).
    seen = []
    streamed = generate(
        model, prompt, 12, temperature=0, static="cuda-graphs", on_token=lambda t: seen.append(t) and False
    )
    assert torch.equal(streamed, want) and torch.equal(torch.stack(seen, 1).to(want.device), want[:, 11:])
    eos = int(want[0, 14])
    stopped = generate(model, prompt, 12, temperature=0, static="cuda-graphs", eos_id=eos)
    assert torch.equal(stopped, generate(model, prompt, 12, temperature=0, static=None, eos_id=eos))
    assert not next(iter(model._static_decoders.values())).compiled_failed
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_a_full_cache_names_the_decoders_capacity_not_the_models_context():
    model = tiny_model("tango")  # context 48: the decoder's own 8 positions run out first
    decoder = StaticDecoder(model, 1, "eager", capacity=8)
    x = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    decoder.prefill(x[:, :8])
    noise = torch.rand(1, model.config.vocab_size, dtype=torch.float64)
    with pytest.raises(UserError, match=r"cache of 8 positions \(model.context_length=48\)"):
        decoder.step(x[:, 8:9], noise, 0.0)
