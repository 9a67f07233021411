"""The Triton kernels of windowed TANGO's wide part (ops/windowed_triton.py) against the float64
composition `windowed_mix_reference`: output and every gradient (through `band_weights` to the
rotated and un-rotated q and k, and to a and u), at odd T with a partial last chunk, several chunks
(so the running prefix sums carry across them), one chunk, in fp32 and bf16, NaN-filled buffers;
the custom ops' registration. Interpreted on CPU tensors without a GPU (conftest.py), on CUDA with
the `cuda` marker."""

from __future__ import annotations

import pytest
import torch

from tests import helpers

windowed_triton = pytest.importorskip(
    "tango_lm.ops.windowed_triton",
    exc_type=ImportError,
    reason="triton is not installed (pip install 'tango-lm[triton]')",
)

from tango_lm.ops.windowed import band_weights  # noqa: E402
from tango_lm.ops.windowed_mix import windowed_mix, windowed_mix_reference  # noqa: E402
from tests import triton_configurations  # noqa: E402

DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not windowed_triton.INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
    ),
    pytest.param("cuda", marks=pytest.mark.cuda),
]
# fp16: 1e-2, as its products round gates, band weights and gradients to 11 bits (and large
# inputs cancel in the feature map's gradients: the test of sums beyond fp16's range).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}


NAMES = ("y", "dq_rot", "dk_rot", "dq_raw", "dk_raw", "da", "du")


def check_against_float64(xs, dy, window, chunk):
    """The kernels' output and every gradient against the float64 composition."""
    got = windowed_mix(*xs, window, "elu+1", chunk, kernels="triton")
    got = (got, *torch.autograd.grad(got, xs, dy))
    xs64 = [x.detach().cpu().double().requires_grad_(True) for x in xs]
    want = windowed_mix_reference(*xs64, window, "elu+1", chunk)
    want = (want, *torch.autograd.grad(want, xs64, dy.cpu().double()))
    for g, ref, name in zip(got, want, NAMES, strict=True):
        assert g.dtype == xs[0].dtype and torch.isfinite(g).all(), name
        err = (g.detach().cpu().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-3)
        assert err <= TOLERANCE[xs[0].dtype], f"{name}: normalized error {err:.2e}"


def inputs(b, h, t, d, w, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [
        torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype) for s in [(b, h, t, d)] * 4 + [(b, t, h * w)] * 2
    ]
    dy = torch.randn(b, t, h * w, generator=gen, dtype=torch.float64).to(dtype)
    return [x.to(device).requires_grad_(True) for x in xs], dy.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("b", "h", "t", "d", "w", "window", "chunk", "dtype"),
    [
        (2, 1, 29, 8, 11, 5, 6, torch.float32),  # 5 chunks, the last partial: prefix sums over 3 of them
        (1, 2, 23, 16, 9, 4, 5, torch.bfloat16),
        (1, 2, 23, 16, 9, 4, 5, torch.float16),
        (1, 2, 19, 8, 12, 4, 5, torch.bfloat16),  # width 12 per head: ALIGN = 4, columns in vectors
        (1, 1, 7, 4, 5, 3, None, torch.float32),  # one chunk: the band alone
        (1, 1, 17, 37, 6, 3, 4, torch.float32),  # d_h 33-64 in fp32: pq S in two halves
    ],
)
def test_triton_windowed_forward_and_every_gradient_match_float64(
    monkeypatch, device, b, h, t, d, w, window, chunk, dtype
):
    nan_torch = helpers.NanEmptyTorch()
    monkeypatch.setattr(windowed_triton, "torch", nan_torch)
    xs, dy = inputs(b, h, t, d, w, dtype, device, seed=t)
    check_against_float64(xs, dy, window, chunk)
    assert nan_torch.calls >= 4  # y, avg, da, du


@pytest.mark.parametrize("device", DEVICES)
def test_triton_windowed_fp16_prefix_sums_beyond_fp16_range(device):
    # The running sums S = sum phi(k) g grow with T; gates ~60 and phi ~61 pass fp16's 65504 within
    # 20 sources, while the averages stay ~60. fp16 products of S would make them inf.
    b, h, t, d, w = 1, 1, 48, 4, 5
    xs, dy = inputs(b, h, t, d, w, torch.float16, "cpu", seed=3)
    with torch.no_grad():
        xs[2].add_(60.0)  # q_raw, k_raw: phi = elu + 1 ~ 61
        xs[3].add_(60.0)
        xs[4].add_(60.0)  # a: silu(a) ~ 60
    xs = [x.detach().to(device).requires_grad_(True) for x in xs]
    check_against_float64(xs, dy.to(device), window=4, chunk=4)


@pytest.mark.parametrize(
    ("device", "kernel", "index"), triton_configurations.configuration_params(windowed_triton, DEVICES)
)
def test_triton_windowed_every_configuration_matches_float64(monkeypatch, device, kernel, index):
    # Each kernel's every autotune configuration, alone, at a launch its limits admit and past its
    # column block, over 4 chunks of 8 (the last partial); the other kernels' first admitted ones.
    launch = triton_configurations.force(monkeypatch, windowed_triton, kernel, index)
    xs, dy = inputs(1, 2, 29, launch.head_dim, launch.width, launch.dtype, device, seed=index)
    check_against_float64(xs, dy, 5, 8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the band weights' cast is an output
def test_triton_windowed_custom_op_registration(device, dtype):
    xs, _ = inputs(1, 2, 11, 4, 3, dtype, device, seed=1)
    weights, prefix_q, pk = (x.detach().contiguous() for x in band_weights(*xs[:4], 3, "elu+1", 4))
    a, u = (x.detach() for x in xs[4:])
    torch.library.opcheck(
        torch.ops.tango_lm.windowed_mix_triton_forward,
        (weights, prefix_q, pk, a, u, True),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "small"), [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_triton_windowed_op_saves_the_small_tensors_as_its_kernels_multiply_them(device, dtype, small):
    # The kernels multiply the fp32 band weights in the gates' dtype, and prefix_q and pk in bf16
    # for bf16 gates (fp32 for fp16 ones, whose prefix sums pass fp16's range): the op rounds them
    # once, the kernels read those copies and the backward saves them, not the fp32 tensors; their
    # gradients stay in fp32.
    xs, dy = inputs(1, 2, 13, 4, 3, dtype, device, seed=4)
    args = [x.detach().contiguous().requires_grad_(True) for x in band_weights(*xs[:4], 3, "elu+1", 4)]
    args += [x.detach().requires_grad_(True) for x in xs[4:]]
    assert all(x.dtype == torch.float32 for x in args[:3])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        y = torch.ops.tango_lm.windowed_mix_triton_forward(*args, True)[0]
    copies, (a, u, avg) = saved[:3], saved[3:]
    assert [x.dtype for x in copies] == [dtype, small, small]
    for copy, x in zip(copies, args[:3], strict=True):
        torch.testing.assert_close(copy, x.detach().to(copy.dtype), rtol=0, atol=0)
    # The same arithmetic as from fp32 tensors, given ones the rounding keeps exactly (interpreted,
    # triton's own fp32-to-bf16 conversion truncates where torch's, and the GPU's, rounds).
    exact = [x.float() for x in copies]
    y_exact = torch.ops.tango_lm.windowed_mix_triton_forward(*exact, a, u, True)[0]
    torch.testing.assert_close(y, y_exact, rtol=0, atol=0)
    got = windowed_triton._backward(dy, *copies, a, u, avg)
    want = windowed_triton._backward(dy, *exact, a, u, avg)
    assert [g.dtype for g in got[:3]] == [torch.float32] * 3
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert [g.dtype for g in torch.autograd.grad(y, args[:3], dy)] == [torch.float32] * 3


@pytest.mark.parametrize("device", DEVICES)
def test_triton_windowed_op_without_the_stored_average_still_differentiates(device):
    # store_avg=False saves an empty average; the backward recomputes it (it read the empty tensor).
    xs, _ = inputs(1, 2, 11, 4, 3, torch.float32, device, seed=2)
    args = [x.detach().contiguous().requires_grad_(True) for x in band_weights(*xs[:4], 3, "elu+1", 4)]
    args += [x.detach().requires_grad_(True) for x in xs[4:]]
    dy = torch.randn_like(args[-1])
    got = torch.autograd.grad(torch.ops.tango_lm.windowed_mix_triton_forward(*args, False)[0], args, dy)
    want = torch.autograd.grad(torch.ops.tango_lm.windowed_mix_triton_forward(*args, True)[0], args, dy)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_triton_windowed_dispatch():
    xs, _ = inputs(1, 1, 5, 4, 3, torch.float32, "cpu")
    assert windowed_triton.supported(*xs[:2], *xs[4:]) == windowed_triton.INTERPRETED
    assert not windowed_triton.supported(xs[0].double(), xs[1], *xs[4:])  # band weights in float64
    assert not windowed_triton.supported(*xs[:2], xs[4].double(), xs[5].double())


def test_triton_windowed_takes_no_shape_its_kernels_would_read_past():
    # The kernels index a and u by q's batch, positions and heads: other shapes wrote part of the
    # output (garbage in the rest) or read past a's end; they fall back to the composition now.
    (q, k, *_), _ = inputs(2, 2, 5, 4, 3, torch.float32, "cpu")
    ok = torch.zeros(2, 5, 6)
    assert windowed_triton.supported(q, k, ok, ok) == windowed_triton.INTERPRETED
    for bad in (torch.zeros(2, 5, 7), torch.zeros(1, 5, 6), torch.zeros(4, 5, 6), torch.zeros(2, 4, 6)):
        assert not windowed_triton.supported(q, k, bad, bad), bad.shape
    # B * H is a CUDA grid axis (at most 65,535): more would fail to launch, so they fall back.
    big_q, big_a = torch.zeros(1, 1, 5, 4).expand(32768, 2, 5, 4), torch.zeros(1, 5, 6).expand(32768, 5, 6)
    assert windowed_triton.supported(big_q[:1], big_q[:1], big_a[:1], big_a[:1]) == windowed_triton.INTERPRETED
    assert not windowed_triton.supported(big_q, big_q, big_a, big_a)


def test_triton_windowed_takes_no_chunk_longer_than_its_tiles_allow(monkeypatch):
    # Chunks of 256 (window 256) need 576 KiB of shared memory on sm_90 (227 there): windows whose
    # chunks pass MAX_CHUNK run the composition instead of failing to launch.
    (q, k, *_), _ = inputs(1, 1, 5, 4, 3, torch.float32, "cpu")
    a = torch.zeros(1, 5, 3)
    assert windowed_triton.supported(q, k, a, a, windowed_triton.MAX_CHUNK) == windowed_triton.INTERPRETED
    assert not windowed_triton.supported(q, k, a, a, windowed_triton.MAX_CHUNK + 1)
    if not windowed_triton.INTERPRETED:
        return
    ran = []
    real = windowed_triton.windowed_band_mix_triton
    monkeypatch.setattr(windowed_triton, "windowed_band_mix_triton", lambda *xs: ran.append(1) or real(*xs))
    t, window = windowed_triton.MAX_CHUNK + 3, windowed_triton.MAX_CHUNK + 1
    xs, _ = inputs(1, 1, t, 4, 2, torch.float32, "cpu")
    want = windowed_mix_reference(*xs, window, "elu+1")
    torch.testing.assert_close(windowed_mix(*xs, window, "elu+1", kernels="triton"), want)
    assert not ran
    windowed_mix(*xs, windowed_triton.MAX_CHUNK, "elu+1", kernels="triton")
    assert ran  # the longest chunk the kernels take still runs on them


@pytest.mark.parametrize("device", DEVICES)
def test_triton_windowed_inside_a_compiled_graph(device):
    # One graph (fullgraph) through the band weights' recomputation (a checkpoint) and the custom
    # op, with the eager path's values and every gradient.
    xs, dy = inputs(1, 2, 13, 4, 5, torch.float32, device, seed=5)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda *xs: windowed_mix(*xs, 3, "elu+1", 4, kernels="triton"),
        fullgraph=True,
        dynamic=False,
        backend="aot_eager",
    )
    got = compiled(*xs)
    want = windowed_mix(*xs, 3, "elu+1", 4, kernels="triton")
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got, xs, dy), torch.autograd.grad(want, xs, dy), strict=True):
        torch.testing.assert_close(g, w)
    torch._dynamo.reset()
