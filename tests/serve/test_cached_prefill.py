"""TANGO's cached forward through the kernel door (layers/tango*.py `mix_cached`): a plain prefill
runs the training forward's implementation (`tango_mix` / `windowed_mix`) and then stores its keys
and gates; later positions attend through `causal_attention`'s choice (sliced on CUDA, over gates
cached slice-major). With the door forced to each implementation that runs on a CPU (reference,
sdpa-sliced, blocked, c, and triton interpreted), a prefill, single steps and a chunk give the full
forward's logits, for every TANGO architecture and under rotating narrow width; on CUDA no part of
it runs SDPA's math backend."""

from __future__ import annotations

import pytest
import torch

from tango_lm import build_model
from tango_lm.layers import tango as tango_layer
from tango_lm.layers.active_width import set_active_segment
from tango_lm.layers.tango import TangoBlock
from tango_lm.layers.tango_variants import CompactTangoBlock, ThreeSetTangoBlock
from tango_lm.layers.tango_windowed import WindowedTangoBlock
from tango_lm.ops import attention, dispatch
from tango_lm.serve.generate import generate
from tests import arch_cases, helpers
from tests.serve.test_generate import model_for

pytestmark = pytest.mark.usefixtures("one_thread")

TANGO_BLOCKS = (TangoBlock, ThreeSetTangoBlock, CompactTangoBlock)


def tango_archs() -> list[str]:
    """The registered architectures built of TANGO blocks (read from the models, not a list of names)."""
    return [
        name
        for name in arch_cases.names()
        if any(isinstance(m, TANGO_BLOCKS) for m in build_model(arch_cases.tiny_config(name)).modules())
    ]


def triton_interpreted() -> bool:
    try:
        from tango_lm.ops import tango_mix_triton
    except ImportError:
        return False
    return tango_mix_triton.INTERPRETED


KERNELS = [
    "reference",
    "sdpa-sliced",
    "blocked",
    "c",  # float32 (where no C compiler is installed: auto's choice)
    pytest.param("triton", marks=pytest.mark.skipif(not triton_interpreted(), reason="needs triton, interpreted")),
]


def tango_model(arch: str, dtype: torch.dtype, segment: int | None = None) -> torch.nn.Module:
    changes = {} if segment is None else {"active_width": 5}  # 12 gate columns per head: 3 segments
    model = model_for(arch_cases.tiny_config(arch, **changes)).to(dtype)
    for m in model.modules():
        if isinstance(m, WindowedTangoBlock):
            m.chunk_size = 4  # chunks of the window: the full forward's prefix sums run too
    set_active_segment(model, segment)
    return model


def cached_logits(model, x, prefill=11, steps_end=18):
    cache = model.new_cache()
    pieces = [model(x[:, :prefill], cache)]
    pieces += [model(x[:, i : i + 1], cache) for i in range(prefill, steps_end)]
    pieces.append(model(x[:, steps_end:], cache))  # a chunk after single steps: keys further back
    return torch.cat(pieces, 1)


@pytest.fixture
def sliced_calls(monkeypatch):
    """The query lengths the sliced SDPA ran at (the prefill's, the cached steps'), with slices of at
    most 8 columns: the tiny models' 12 gate columns per head run as two zero-padded slices."""
    seen = []
    monkeypatch.setattr(attention, "SDPA_SLICE", 8)
    real = attention.attention_over_slices
    for module in (attention, tango_layer):
        monkeypatch.setattr(
            module, "attention_over_slices", lambda *a, **kw: seen.append(a[0].shape[-2]) or real(*a, **kw)
        )
    return seen


@pytest.fixture
def triton_calls(monkeypatch):
    """The query lengths the Triton kernels (TANGO's and windowed TANGO's band) ran at."""
    seen = []
    if triton_interpreted():
        from tango_lm.ops import tango_mix, windowed_mix

        for module, name in (
            (tango_mix.tango_mix_triton, "tango_mix_triton"),
            (windowed_mix.windowed_triton, "windowed_band_mix_triton"),
        ):
            real = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _f=real: seen.append(a[-2].shape[1]) or _f(*a))
    return seen


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("arch", tango_archs())
def test_cached_decoding_through_each_door_equals_the_full_forward(
    monkeypatch, sliced_calls, triton_calls, arch, kernels
):
    monkeypatch.setenv(dispatch.ENV, kernels)
    dtype = torch.float32 if kernels in ("triton", "c") else torch.float64  # these kernels take no float64
    tol = 2e-5 if dtype == torch.float32 else 1e-10
    x = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(1))
    # Every column, and one segment of rotating narrow width (the same kernels at another width:
    # interpreted Triton is slow, so once).
    for segment in (None,) if kernels == "triton" else (None, 1):
        model = tango_model(arch, dtype, segment)
        full = model(x)
        torch.testing.assert_close(cached_logits(model, x), full, rtol=tol, atol=tol)
    if kernels == "sdpa-sliced" and arch != "tango-windowed":  # the windowed band attends by matmuls
        assert {11, 1, 6} <= set(sliced_calls)  # the prefill, the steps, the chunk
    if kernels == "triton":
        assert 11 in triton_calls  # the prefill ran the kernels


def test_the_prefill_runs_the_door_and_cpu_auto_keeps_the_one_sdpa_call(monkeypatch):
    from tango_lm.ops import tango_mix as tango_mix_module

    seen = []
    real = tango_mix_module.tango_mix_reference
    monkeypatch.setattr(tango_mix_module, "tango_mix_reference", lambda *a: seen.append(a[0].shape[-2]) or real(*a))
    model = tango_model("tango", torch.float64)
    x = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(2))
    monkeypatch.delenv(dispatch.ENV, raising=False)
    cached_logits(model, x, prefill=5, steps_end=8)
    assert seen == []  # CPUs on 'auto': the cached path's SDPA, as before
    monkeypatch.setenv(dispatch.ENV, "reference")
    cached_logits(model, x, prefill=5, steps_end=8)
    assert seen == [5] * model.config.depth  # the prefill only, once per application


@pytest.mark.parametrize("t", [1, 5, 9])
@pytest.mark.parametrize("width", [3, 21, 130])
def test_sliced_attention_with_offset_equals_one_sdpa_call(t, width):
    # Queries at the end of S = 9 keys (T < S), a static step's [1, S] mask, odd widths cut into
    # zero-padded slices of at most 16 columns (so 130 runs as 9 slices of 16), and the gradients.
    gen = torch.Generator().manual_seed(t * width)
    q, k = (torch.randn(2, 3, n, 4, generator=gen, dtype=torch.float64).requires_grad_(True) for n in (t, 9))
    v = torch.randn(2, 3, 9, width, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 3, t, width, generator=gen, dtype=torch.float64)
    masks = [None, torch.arange(9)[None, :] <= 6] if t == 1 else [None]
    for mask in masks:
        want = attention.sdpa_attention(q, k, v, mask)
        got = attention.sliced_attention(q, k, v, mask, max_slice=16)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for gg, gw in zip(
            torch.autograd.grad(got, (q, k, v), dy), torch.autograd.grad(want, (q, k, v), dy), strict=True
        ):
            torch.testing.assert_close(gg, gw, rtol=1e-12, atol=1e-12)
    if t == 1 and width == 130:  # a decode step: no copy of the keys per slice
        with helpers.LargestTensor() as made:
            attention.attention_over_slices(q, k, attention.value_slices(v, 16), width)
        assert (2, 3 * 9, 9, 4) not in made.shapes and made.shapes
    if t == 9:  # T == S: the training forward's causal average
        torch.testing.assert_close(
            attention.sdpa_attention(q, k, v), attention.causal_attention(q, k, v, kernels="reference")
        )


def test_a_decode_steps_scores_stay_float32_under_autocast():
    # bf16 autocast would round the scores (here tens of units: steps of 1/8) before the softmax,
    # off by ~10% in the probabilities; only the product with the gates runs in bf16 (~0.4%).
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 3, n, 8, generator=gen) * 4 for n in (1, 40))
    v = attention.value_slices(torch.randn(2, 3, 40, 21, generator=gen), 8)
    want = attention.step_over_slices(q, k, v, 21)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attention.step_over_slices(q, k, v, 21)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_causal_attention_door():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 12)
    assert not attention.runs_sliced(q, v) and attention.runs_sliced(q, v, kernels="sdpa-sliced")
    assert not attention.runs_sliced(q[0], v[0], kernels="sdpa-sliced")  # slices are extra heads: 4-D only
    mask = attention.offset_mask(3, 5, q.device)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    torch.testing.assert_close(
        attention.causal_attention(q, k, v, kernels="sdpa-sliced"), attention.causal_attention(q, k, v)
    )
    with pytest.raises(ValueError, match="different devices"):
        attention.causal_attention(q, k.to("meta"), v)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernels", ["auto", "sdpa-sliced"])
@pytest.mark.parametrize("arch", tango_archs())
def test_cuda_cached_decoding_never_runs_the_math_backend(monkeypatch, arch, kernels):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.setenv(dispatch.ENV, kernels)
    model = tango_model(arch, torch.float32).cuda()
    x = torch.randint(0, 61, (2, 37), generator=torch.Generator().manual_seed(1)).cuda()
    full = model(x)
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):  # raises where only the math backend could run
        got = cached_logits(model, x)
        for static in (None, "eager"):  # the eager decode, and the static steps' masked attention
            generate(model, x[:, :11], 8, temperature=0, static=static)
    torch.testing.assert_close(got, full, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("arch", ["tango", "tango-compact"])
def test_sliced_static_step_is_one_graph(monkeypatch, arch):
    # The CUDA path of a static decode step (masked attention over slice-major gates), traced by
    # Dynamo: the eager decode's log-probs, one graph for every position.
    from tests.serve.test_static_decode import check_one_graph

    monkeypatch.setenv(dispatch.ENV, "sdpa-sliced")
    monkeypatch.setattr(attention, "SDPA_SLICE", 8)
    check_one_graph(arch_cases.tiny_config(arch, depth=1))


@pytest.mark.parametrize("kernels", ["reference", "sdpa-sliced"])
@pytest.mark.parametrize("arch", tango_archs())
def test_static_steps_after_a_prefill_through_the_door(monkeypatch, arch, kernels):
    # The static decoder's prefill through the door (windowed TANGO's ring built from the state it
    # leaves), then masked steps (over slice-major gates for sdpa-sliced): the eager decode's log-probs.
    from tests.serve.test_static_decode import check_static_decoding

    monkeypatch.setenv(dispatch.ENV, kernels)
    monkeypatch.setattr(attention, "SDPA_SLICE", 8)
    check_static_decoding(arch_cases.tiny_config(arch))
