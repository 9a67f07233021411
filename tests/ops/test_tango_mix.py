"""The fused CPU op for TANGO's mixing (ops/tango_mix.py) against the plain composition and a
naive loop, forward and gradients, at odd sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tango_lm.ops.tango_mix import tango_mix, tango_mix_fused, tango_mix_reference


def naive_mix(q, k, a, u):
    """gbar_t = sum_{s<=t} softmax(q_t.k_s / sqrt(d_h)) silu(a_s), per head; times u_t."""
    b, h, t, d_h = q.shape
    g = F.silu(a).view(b, t, h, -1)
    out = torch.zeros_like(g)
    for i in range(t):
        w = torch.softmax(torch.einsum("bhd,bshd->bhs", q[:, :, i], k.transpose(1, 2)[:, : i + 1]) / d_h**0.5, -1)
        out[:, i] = torch.einsum("bhs,bshf->bhf", w, g[:, : i + 1])
    return out.reshape(b, t, -1) * u


def inputs(b, h, t, d_h, fh, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_(True)

    return r(b, h, t, d_h, scale=1.5), r(b, h, t, d_h, scale=1.5), r(b, t, h * fh), r(b, t, h * fh)


def grads(fn, xs, dy):
    out = fn(*xs)
    return (out, *torch.autograd.grad(out, xs, dy))


@pytest.mark.parametrize(
    ("b", "h", "t", "d_h", "fh"), [(2, 3, 7, 4, 9), (1, 2, 33, 8, 5), (3, 1, 1, 2, 6), (1, 4, 63, 6, 11)]
)
def test_fused_matches_naive_and_reference_float64(b, h, t, d_h, fh):
    xs = inputs(b, h, t, d_h, fh, torch.float64)
    dy = torch.randn(b, t, h * fh, dtype=torch.float64)
    want = grads(naive_mix, xs, dy)
    for fn in (tango_mix_fused, tango_mix_reference):
        for got, exp, name in zip(grads(fn, xs, dy), want, ("y", "dq", "dk", "da", "du"), strict=True):
            torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12, msg=f"{fn.__name__} {name}")


def test_fused_gradcheck():
    xs = inputs(2, 2, 5, 4, 3, torch.float64, seed=1)
    assert torch.autograd.gradcheck(tango_mix_fused, xs)


def test_fused_float32_close_to_float64():
    xs64 = inputs(2, 4, 130, 8, 16, torch.float64, seed=2)
    xs32 = tuple(x.detach().float().requires_grad_(True) for x in xs64)
    dy = torch.randn(2, 130, 64, dtype=torch.float64)
    for got, exp in zip(grads(tango_mix_fused, xs32, dy.float()), grads(tango_mix_reference, xs64, dy), strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exp, rtol=1e-4, atol=1e-5)


def test_dispatch_uses_fused_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "tango_lm.ops.tango_mix.tango_mix_fused", lambda *xs, **kw: calls.append(1) or tango_mix_reference(*xs)
    )
    xs = inputs(1, 2, 4, 4, 3, torch.float32)
    tango_mix(*xs)
    assert calls == [1]


@pytest.mark.parametrize(("block", "t"), [(4, 13), (5, 10), (8, 8), (3, 1), (16, 40), (3, 40)])
def test_causal_blocks_match_naive(monkeypatch, block, t):
    # Blocks that skip later sources: several, a partial last one, T = block, doubled blocks (T > 8 blocks).
    monkeypatch.setattr("tango_lm.ops.tango_mix.CAUSAL_BLOCK", block)
    xs = inputs(2, 3, t, 4, 5, torch.float64, seed=t)
    dy = torch.randn(2, t, 15, dtype=torch.float64)
    for got, exp, name in zip(
        grads(tango_mix_fused, xs, dy), grads(naive_mix, xs, dy), ("y", "dq", "dk", "da", "du"), strict=True
    ):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12, msg=name)
    assert torch.autograd.gradcheck(tango_mix_fused, inputs(1, 2, t, 3, 2, torch.float64, seed=1))


def test_uninitialised_memory_never_reaches_the_output(monkeypatch):
    # fla's rule: NaN-filled buffers show any element the op forgets to write (blocks of 4, T = 13).
    monkeypatch.setattr("tango_lm.ops.tango_mix.CAUSAL_BLOCK", 4)
    real_empty, real_empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: real_empty_like(*a, **k).fill_(float("nan")))
    xs = inputs(2, 3, 13, 4, 5, torch.float64, seed=3)
    dy = torch.randn(2, 13, 15, dtype=torch.float64)
    for got, exp in zip(grads(tango_mix_fused, xs, dy), grads(naive_mix, xs, dy), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("recompute", [False, True])
def test_probabilities_kept_or_recomputed_give_the_same_gradients(monkeypatch, recompute):
    monkeypatch.setattr("tango_lm.ops.tango_mix.recompute_probs", lambda t, w: recompute)
    xs = inputs(2, 3, 13, 4, 5, torch.float64, seed=5)
    dy = torch.randn(2, 13, 15, dtype=torch.float64)
    for got, exp in zip(grads(tango_mix_fused, xs, dy), grads(naive_mix, xs, dy), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)


def test_long_sequences_do_not_keep_the_probabilities():
    # T = 40 > F/H = 5: the [B, H, T, T] probabilities (2 * 3 * 40 * 40 floats) are not kept.
    saved = []
    xs = inputs(2, 3, 40, 4, 5, torch.float32, seed=6)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        tango_mix_fused(*xs)
    assert torch.Size([2, 3, 40, 40]) not in saved and saved
    saved.clear()
    short = inputs(2, 3, 4, 4, 5, torch.float32, seed=6)  # T = 4 <= 5: kept
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        tango_mix_fused(*short)
    assert torch.Size([2, 3, 4, 4]) in saved
