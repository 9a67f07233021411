"""The SiLU and sigmoid every Triton kernel applies (`triton_common.silu_f32`, `sigmoid_f32`):
exp2 and, compiled, the fast division (__fdividef), within a few ulp of float64's values over the
whole fp32 range, out to where e^-a overflows. Under the interpreter (CPU tensors) they divide
exactly; on a GPU (`cuda` marker) the compiled form runs."""

from __future__ import annotations

import pytest
import torch

triton_common = pytest.importorskip(
    "tango_lm.ops.triton_common", exc_type=ImportError, reason="triton is not installed"
)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not triton_common.INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1"),
    ),
    pytest.param("cuda", marks=pytest.mark.cuda),
]


@triton.jit
def _activations_kernel(X, SILU, SIGMOID, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0)
    tl.store(SILU + offs, triton_common.silu_f32(x), mask=offs < N)
    tl.store(SIGMOID + offs, triton_common.sigmoid_f32(x), mask=offs < N)


# The interpreter runs exp2 in numpy, which warns where e^-a passes fp32's range (a < -88.7): this test
# goes there on purpose, and the kernels' division turns the inf into the right 0.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.parametrize("device", DEVICES)
def test_triton_silu_and_sigmoid_match_float64_over_fp32s_range(device):
    # Every magnitude from 1e-30 to 1e4 both ways and the values around zero. Below about -87.3 e^-a
    # passes 2^126 (the fast division returns 0) and below -88.7 fp32's range (either division
    # returns 0): there the true values are below 1e-35, so the error is taken relative to at least
    # 1e-30 (as the kernels' `a / (1 + tl.exp(-a))` was, to the same 0).
    mags = torch.logspace(-30, 4, 997, dtype=torch.float64)
    x = torch.cat([-mags, mags, torch.linspace(-100, 100, 2001, dtype=torch.float64), torch.zeros(1)])
    x32 = x.float().to(device)
    silu, sigmoid = torch.empty_like(x32), torch.empty_like(x32)
    _activations_kernel[(triton.cdiv(x32.numel(), 256),)](x32, silu, sigmoid, x32.numel(), BLOCK=256)
    xs = x32.double().cpu()  # the fp32 inputs the kernel saw
    want_sigmoid = torch.sigmoid(xs)
    want_silu = xs * want_sigmoid
    for got, want in ((silu, want_silu), (sigmoid, want_sigmoid)):
        err = (got.double().cpu() - want).abs() / want.abs().clamp_min(1e-30)
        # exp2(-a log2 e) rounds its argument to fp32 first: up to |a| 2^-24 ln 2 relative in e^-a (4e-6 at
        # |a| = 88), as compiled `tl.exp` (an ex2 of the same product) does too
        assert err.max() < 5e-6, (xs[err.argmax()].item(), got.cpu()[err.argmax()].item(), want[err.argmax()].item())
        assert err[xs.abs() < 10].max() < 1e-6
    assert torch.equal(sigmoid.cpu()[xs > 20], torch.ones_like(sigmoid.cpu()[xs > 20]))  # saturates at 1
