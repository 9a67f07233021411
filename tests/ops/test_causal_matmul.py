"""The blocked CPU op for `tril(p) @ v` (ops/causal_matmul.py) against the composition and a
naive loop, forward and gradients, at odd sizes and block sizes."""

from __future__ import annotations

import pytest
import torch

from tango_lm.ops import cpu_kernels
from tango_lm.ops.causal_matmul import causal_blocks, causal_matmul, causal_matmul_fused, causal_matmul_reference

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: the PyTorch path runs")


def naive(p, v):
    """out_t = sum_{s <= t} p[t, s] v_s, one destination at a time."""
    return torch.stack(
        [torch.einsum("...s,...se->...e", p[..., t, : t + 1], v[..., : t + 1, :]) for t in range(p.shape[-1])], dim=-2
    )


def inputs(lead, t, e, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(*lead, t, t, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    v = torch.randn(*lead, t, e, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    return p, v


def grads(fn, p, v, dy):
    out = fn(p, v)
    return (out, *torch.autograd.grad(out, (p, v), dy))


@pytest.mark.parametrize(
    ("block", "lead", "t", "e"),
    [(4, (2,), 13, 5), (5, (2, 3), 10, 3), (8, (1,), 8, 7), (3, (3,), 1, 2), (16, (), 40, 9), (4, (2, 1), 17, 1)],
)
def test_blocked_matches_naive_and_reference_float64(monkeypatch, block, lead, t, e):
    # Several blocks, a partial last one, T = block, T = 1, no leading dimension, e = 1.
    monkeypatch.setattr("tango_lm.ops.causal_matmul.CAUSAL_BLOCK", block)
    p, v = inputs(lead, t, e, seed=t)
    dy = torch.randn(*lead, t, e, dtype=torch.float64)
    want = grads(naive, p, v, dy)
    for fn in (causal_matmul_fused, causal_matmul_reference):
        for got, exp, name in zip(grads(fn, p, v, dy), want, ("out", "dp", "dv"), strict=True):
            torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12, msg=f"{fn.__name__} {name}")


def test_gradient_for_p_is_zero_above_the_diagonal(monkeypatch):
    monkeypatch.setattr("tango_lm.ops.causal_matmul.CAUSAL_BLOCK", 4)
    p, v = inputs((2,), 11, 3, seed=1)
    (dp,) = torch.autograd.grad(causal_matmul_fused(p, v).sum(), p)
    below = torch.ones(11, 11, dtype=torch.bool).tril()
    assert torch.equal(dp[..., ~below], torch.zeros(2, 55, dtype=dp.dtype)) and dp[..., below].abs().min() > 0


def test_gradcheck(monkeypatch):
    monkeypatch.setattr("tango_lm.ops.causal_matmul.CAUSAL_BLOCK", 3)
    assert torch.autograd.gradcheck(causal_matmul_fused, inputs((2,), 7, 2, seed=2))


def test_uninitialised_memory_never_reaches_the_output(monkeypatch):
    # NaN-filled buffers show any element the op forgets to write.
    monkeypatch.setattr("tango_lm.ops.causal_matmul.CAUSAL_BLOCK", 4)
    real_empty, real_empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: real_empty_like(*a, **k).fill_(float("nan")))
    p, v = inputs((2,), 13, 5, seed=3)
    dy = torch.randn(2, 13, 5, dtype=torch.float64)
    for got, exp in zip(grads(causal_matmul_fused, p, v, dy), grads(naive, p, v, dy), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)


def test_float32_close_to_float64():
    p64, v64 = inputs((2,), 300, 16, seed=4)  # the default block of 128: three blocks, a partial last
    p32, v32 = (x.detach().float().requires_grad_(True) for x in (p64, v64))
    dy = torch.randn(2, 300, 16, dtype=torch.float64)
    blocked = lambda p, v: causal_matmul_fused(p, v, kernels=False)  # noqa: E731
    for got, exp in zip(
        grads(blocked, p32, v32, dy.float()), grads(causal_matmul_reference, p64, v64, dy), strict=True
    ):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exp, rtol=1e-4, atol=1e-4)


def test_dispatch(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "tango_lm.ops.causal_matmul.causal_matmul_fused", lambda p, v, kernels: calls.append(kernels) or p @ v
    )
    monkeypatch.setattr("tango_lm.ops.causal_matmul.CAUSAL_BLOCK", 4)
    monkeypatch.setattr(cpu_kernels, "usable", lambda v: False)
    causal_matmul(*inputs((1,), 9, 2, dtype=torch.float32))
    assert calls == [False]  # longer than a block, CPU, one dtype: the blocked op
    causal_matmul(*inputs((1,), 4, 2, dtype=torch.float32))
    p, v = inputs((1,), 9, 2, dtype=torch.float32)
    torch.testing.assert_close(causal_matmul(p, v[0]), causal_matmul_reference(p, v))
    assert calls == [False]  # one block, or values broadcast over p's leading dimensions: the composition
    monkeypatch.setattr(cpu_kernels, "usable", lambda v: True)
    monkeypatch.setattr(cpu_kernels, "preferred", lambda: True)
    causal_matmul(*inputs((1,), 4, 2, dtype=torch.float32))
    assert calls == [False, True]  # the C kernels at any length, where preferred
    monkeypatch.setattr(cpu_kernels, "preferred", lambda: False)
    causal_matmul(*inputs((1,), 9, 2, dtype=torch.float32))
    assert calls == [False, True, False]  # not preferred (an Intel CPU with MKL): the blocked op


@needs_kernels
@pytest.mark.parametrize(
    ("lead", "t", "e"), [((2,), 13, 5), ((2, 3), 10, 3), ((1,), 1, 2), ((), 40, 9), ((2,), 70, 37), ((1, 1), 7, 64)]
)
def test_kernels_match_naive(lead, t, e):
    # The C kernels in float32 against the naive loop in float64: forward and both gradients.
    p64, v64 = inputs(lead, t, e, seed=t + e)
    p32, v32 = (x.detach().float().requires_grad_(True) for x in (p64, v64))
    dy = torch.randn(*lead, t, e, dtype=torch.float64)
    got = grads(lambda p, v: causal_matmul_fused(p, v, kernels=True), p32, v32, dy.float())
    for g, w, name in zip(got, grads(naive, p64, v64, dy), ("out", "dp", "dv"), strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5, msg=name)
    below = torch.ones(t, t, dtype=torch.bool).tril()
    assert (got[1][..., ~below] == 0).all()


def test_blocks_cover_the_sequence():
    assert causal_blocks(10, 4) == [(0, 4), (4, 8), (8, 10)] and causal_blocks(4, 4) == [(0, 4)]
    assert causal_blocks(0, 4) == []


@pytest.mark.parametrize("kernels", ["c", "blocked", "reference"])
@pytest.mark.parametrize(("t", "e"), [(0, 4), (5, 0), (0, 0)])
def test_empty_inputs_give_an_empty_product(kernels, t, e):
    # No position or no value column: the blocked op and the C kernels have nothing to tile, the
    # result is empty (as the composition's) rather than a reshape error.
    if kernels == "c" and not cpu_kernels.available():
        pytest.skip("no C compiler")
    p, v = inputs((2, 3), t, e, dtype=torch.float32)
    out = causal_matmul(p, v, kernels=kernels)
    assert out.shape == (2, 3, t, e)
    dp, dv = torch.autograd.grad(out.sum(), (p, v), allow_unused=True)
    assert dp is None or dp.shape == p.shape
