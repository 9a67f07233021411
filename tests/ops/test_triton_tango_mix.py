"""The Triton kernels of TANGO's mixing (ops/tango_mix_triton.py) against the float64 reference:
the output and every gradient, at odd sizes (T and widths that end blocks part-way, T = 1), in
fp32, bf16 and fp16, with and without u, with strided inputs and NaN-filled buffers; the custom
op's registration (fake tensors, autograd, torch.compile). Without a GPU they run on CPU tensors in
triton's interpreter (TRITON_INTERPRET=1, set by conftest.py; blocks of 16, so these sizes cross
several blocks in every direction); with one, the same tests run on CUDA (`cuda` marker)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests import helpers

triton_ops = pytest.importorskip(
    "tango_lm.ops.tango_mix_triton",
    exc_type=ImportError,
    reason="triton is not installed (pip install 'tango-lm[triton]')",
)

from tango_lm.ops import tango_mix_triton_kernels  # noqa: E402
from tango_lm.ops.tango_mix import tango_mix, tango_mix_reference  # noqa: E402
from tests import triton_configurations  # noqa: E402

DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not triton_ops.INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
    ),
    pytest.param("cuda", marks=pytest.mark.cuda),
]
# Normalized max error (max |got - want| / max |want|) allowed per input dtype: bf16 and fp16 round
# the probabilities and gates to 8 and 11 bits before the tensor-core products, as flash attention does.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


NAMES = ("y", "dq", "dk", "da", "du")


def inputs(b, h, t, d, w, dtype, device, with_u=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [((b, h, t, d), 1.5), ((b, h, t, d), 1.5), ((b, t, h * w), 1.0)] + [((b, t, h * w), 1.0)] * with_u
    xs = [(torch.randn(*s, generator=gen, dtype=torch.float64) * sc).to(dtype) for s, sc in shapes]
    dy = torch.randn(b, t, h * w, generator=gen, dtype=torch.float64).to(dtype)
    return [x.to(device).requires_grad_(True) for x in xs], dy.to(device)


def value_and_grads(fn, xs, dy):
    y = fn(*xs) if len(xs) == 4 else fn(*xs, None)
    return (y, *torch.autograd.grad(y, xs, dy))


def check_against_float64(got, xs, dy):
    xs64 = [x.detach().cpu().double().requires_grad_(True) for x in xs]
    want = value_and_grads(tango_mix_reference, xs64, dy.cpu().double())
    tol = TOLERANCE[xs[0].dtype]
    for g, w, name in zip(got, want, NAMES, strict=False):
        assert g.dtype == xs[0].dtype and g.shape == w.shape, name
        err = (g.detach().cpu().double() - w).abs().max() / w.abs().max().clamp_min(1e-3)  # dq = 0 at T = 1
        assert err <= tol, f"{name}: normalized error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("b", "h", "t", "d", "w", "dtype"),
    [
        (2, 2, 37, 8, 21, torch.float32),  # T and W end blocks part-way; several query, key and column blocks
        (1, 2, 33, 16, 19, torch.bfloat16),
        (1, 2, 21, 8, 12, torch.bfloat16),  # width 12 per head: ALIGN = 4, columns in vectors
        (1, 2, 53, 8, 12, torch.bfloat16),  # and unmasked blocks between the diagonal and T's end, both ways
        (1, 2, 17, 32, 9, torch.float16),  # d_h = 32, the TANGO paper's
        (1, 1, 1, 4, 3, torch.float32),  # one position
    ],
)
@pytest.mark.parametrize("silu_on_load", [False, True], ids=["gates-written", "silu-on-load"])
def test_triton_forward_and_every_gradient_match_float64(monkeypatch, device, b, h, t, d, w, dtype, silu_on_load):
    nan_torch = helpers.NanEmptyTorch()
    monkeypatch.setattr(triton_ops, "torch", nan_torch)
    xs, dy = inputs(b, h, t, d, w, dtype, device, seed=t)
    mix = functools.partial(triton_ops.tango_mix_triton, silu_on_load=silu_on_load)
    check_against_float64(value_and_grads(mix, xs, dy), xs, dy)
    # y, lse, avg; dk, da, du, delta; and the gates and dy * u the gates backward writes for the
    # scores backward: every buffer the kernels fill
    assert nan_torch.calls >= 6 + 2 * (not silu_on_load)


@pytest.mark.parametrize(
    ("device", "kernel", "index"), triton_configurations.configuration_params(tango_mix_triton_kernels, DEVICES)
)
def test_triton_every_configuration_matches_float64(monkeypatch, device, kernel, index):
    # Each kernel's every autotune configuration, alone, at a launch its limits admit and past its
    # blocks (unequal query and key blocks included); the other kernels their first admitted ones.
    launch = triton_configurations.force(monkeypatch, tango_mix_triton_kernels, kernel, index)
    # past two blocks in bf16: the loops without masks run too (the gates backward's after the diagonal)
    t = launch.seq_len if launch.dtype == torch.float32 else 2 * launch.seq_len
    xs, dy = inputs(1, 2, t, launch.head_dim, launch.width, launch.dtype, device, seed=index)
    check_against_float64(value_and_grads(triton_ops.tango_mix_triton, xs, dy), xs, dy)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_average_alone_for_the_compact_controller(device):
    xs, dy = inputs(1, 3, 20, 8, 13, torch.float32, device, with_u=False, seed=1)
    got = value_and_grads(triton_ops.tango_mix_triton, xs, dy)
    check_against_float64(got, xs, dy)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_takes_strided_inputs(device):
    # q, k as the per-head views the block makes ([B, T, H, d] transposed), a gradient with stride 0.
    b, h, t, d, w = 1, 2, 19, 8, 11
    (q, k, a, u), _ = inputs(b, h, t, d, w, torch.float32, device, seed=2)
    q_view = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
    k_view = k.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
    assert not q_view.is_contiguous()
    xs = [q_view, k_view, a, u]
    dy = torch.ones(1, 1, 1, device=device, dtype=torch.float32).expand(b, t, h * w)
    check_against_float64(value_and_grads(triton_ops.tango_mix_triton, xs, dy), xs, dy)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_custom_op_registration(device):
    # Fake (meta) implementations, the autograd formula and schema, as torch.compile relies on them.
    (q, k, a, u), _ = inputs(1, 2, 9, 4, 5, torch.float32, device, seed=3)
    for silu_on_load in (False, True):
        torch.library.opcheck(
            torch.ops.tango_lm.tango_mix_triton_forward,
            (q, k, a, u, True, silu_on_load),
            test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
        )
        y, lse, avg = torch.ops.tango_lm.tango_mix_triton_forward(q, k, a, u, True, silu_on_load)
        torch.library.opcheck(
            torch.ops.tango_lm.tango_mix_triton_backward,
            (torch.ones_like(y), q, k, a, u, y, avg, lse, silu_on_load),
            test_utils=("test_schema", "test_faketensor"),
        )


@pytest.mark.parametrize("device", DEVICES)
def test_triton_op_without_the_stored_average_still_differentiates(device):
    # store_avg=False saves an empty average; the backward recomputes it (it read the empty tensor
    # at [B, T, F] offsets: a segfault interpreted, out-of-bounds reads on a GPU).
    xs, dy = inputs(1, 2, 9, 4, 5, torch.float32, device, seed=6)
    y = torch.ops.tango_lm.tango_mix_triton_forward(*xs, False, False)[0]
    got = torch.autograd.grad(y, xs, dy)
    want = torch.autograd.grad(triton_ops.tango_mix_triton(*xs), xs, dy)
    for g, w, name in zip(got, want, NAMES[1:], strict=True):
        torch.testing.assert_close(g, w, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_output_may_be_changed_in_place_before_the_backward(device):
    # As with any other implementation: with u the backward reads the stored average, not y.
    xs, dy = inputs(1, 2, 9, 4, 5, torch.float32, device, seed=7)
    y = triton_ops.tango_mix_triton(*xs)
    y.mul_(2.0)
    got = torch.autograd.grad(y, xs, dy)
    want = torch.autograd.grad(tango_mix_reference(*xs) * 2.0, xs, dy)
    for g, w, name in zip(got, want, NAMES[1:], strict=True):
        torch.testing.assert_close(g, w, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_inside_a_compiled_graph(device):
    # The custom op keeps the graph whole (fullgraph) and gives the eager kernels' values and gradients.
    xs, dy = inputs(1, 2, 9, 4, 5, torch.float32, device, seed=4)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, a, u: tango_mix(q, k, a, u, kernels="triton").sum(-1),
        fullgraph=True,
        dynamic=False,
        backend="aot_eager",
    )
    got = compiled(*xs)
    grads = torch.autograd.grad(got, xs, torch.ones_like(got))
    want = triton_ops.tango_mix_triton(*xs).sum(-1)
    torch.testing.assert_close(got, want)
    for x, y in zip(grads, torch.autograd.grad(want, xs, torch.ones_like(want)), strict=True):
        torch.testing.assert_close(x, y)
    torch._dynamo.reset()


def test_triton_takes_only_what_it_supports():
    q, k = torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4)
    a = torch.zeros(1, 5, 6)
    assert triton_ops.supported(q, k, a, a) == triton_ops.INTERPRETED  # CPU tensors only when interpreted
    assert not triton_ops.supported(q.double(), k.double(), a.double(), a.double())  # no float64 kernels
    assert not triton_ops.supported(q, k, a.half(), a)  # one dtype for all inputs
    assert not triton_ops.supported(q, k, torch.zeros(1, 5, 7), torch.zeros(1, 5, 7))  # F a multiple of H
    # B * H is a CUDA grid axis (at most 65,535): more would fail to launch, so they fall back.
    big_q, big_a = torch.zeros(1, 1, 5, 4).expand(32768, 2, 5, 4), torch.zeros(1, 5, 6).expand(32768, 5, 6)
    assert triton_ops.supported(big_q[:32767], big_q[:32767], big_a[:32767], big_a[:32767]) == triton_ops.INTERPRETED
    assert not triton_ops.supported(big_q, big_q, big_a, big_a)
