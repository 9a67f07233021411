"""The wide-gate average (docs/design.md §2.2, ops/gate_average.py) against a naive reference written here.

`gbar^h_t = sum_{s<=t} a^h[t, s] g^h_s` with `a^h[t, s] = softmax_{s<=t}(q^h_t . k^h_s / sqrt(d_h))`.
The reference forms every weight a[t, s] explicitly (exp / sum, no library softmax or SDPA) and
sums the gates position by position; fast paths must match it in value and in the gradients
with respect to q, k and g, at odd sizes and a value width unlike the head width.
"""

from __future__ import annotations

import math

import pytest
import torch

from tango_lm.ops.gate_average import gate_average, gate_average_reference, gate_average_sdpa

SIZES = (1, 7, 63, 130)


def naive_gate_average(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """q, k [B, H, T, d_h], g [B, H, T, w] -> [B, H, T, w], one destination t at a time."""
    t_len, d_h = q.shape[-2], q.shape[-1]
    rows = []
    for t in range(t_len):
        # scores[..., s] = q_t . k_s / sqrt(d_h) for the visible sources s = 0 .. t
        scores = (q[..., t : t + 1, :] * k[..., : t + 1, :]).sum(-1) / math.sqrt(d_h)
        e = torch.exp(scores - scores.max(-1, keepdim=True).values)
        a = e / e.sum(-1, keepdim=True)  # a[..., s] = a[t, s]
        rows.append((a.unsqueeze(-1) * g[..., : t + 1, :]).sum(-2))
    return torch.stack(rows, dim=-2)


def make_inputs(t: int, dtype: torch.dtype, width: int = 12, seed: int = 0):
    """Non-contiguous [B, H, T, .] views (as the block produces them), d_h = 8, value width != d_h."""
    gen = torch.Generator().manual_seed(seed)
    b, h, d_h = 2, 3, 8

    def rand(w: int, scale: float) -> torch.Tensor:
        x = (torch.randn(b, t, h, w, generator=gen, dtype=torch.float64) * scale).to(dtype)
        return x.transpose(1, 2).requires_grad_(True)

    # Scale 1.5 gives peaked, non-uniform attention rows, so errors in the weights show.
    q, k, g = rand(d_h, 1.5), rand(d_h, 1.5), rand(width, 1.0)
    dy = torch.randn(b, h, t, width, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, g, dy


def value_and_grads(fn, q, k, g, dy):
    out = fn(q, k, g)
    grads = torch.autograd.grad(out, (q, k, g), dy)
    return (out, *grads)


@pytest.fixture
def nan_empty(monkeypatch):
    """`torch.empty` / `torch.empty_like` return NaN-filled buffers, so any element an op forgets
    to write shows up as NaN in its output or gradients (fla's rule)."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x.fill_(float("nan"))
        return x

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(real_empty_like(*a, **kw)))


_REFERENCE_CACHE: dict = {}


def reference(t: int, width: int = 12):
    """float64 reference value and gradients (cached: the naive loop is the slow part)."""
    key = (t, width)
    if key not in _REFERENCE_CACHE:
        q, k, g, dy = make_inputs(t, torch.float64, width)
        _REFERENCE_CACHE[key] = tuple(x.detach() for x in value_and_grads(naive_gate_average, q, k, g, dy))
    return _REFERENCE_CACHE[key]


def assert_close_rel(actual, expected, rel: float, what: str) -> None:
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale, f"{what}: max abs error {err:.3e} > {rel:g} x {scale:.3e}"


NAMES = ("out", "dq", "dk", "dg")
FAST_PATHS = {
    "sdpa": gate_average_sdpa,
    "default": gate_average,
    "library_reference": gate_average_reference,
}


def test_naive_reference_is_what_the_spec_defines():
    # Hand-checkable case: one head, T = 2, d_h = 2. Row 0 sees only itself; row 1 weighs
    # sources 0 and 1 by softmax(q_1 . k_s / sqrt 2).
    q = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[0.0, 1.0], [1.0, 1.0]]]], dtype=torch.float64)
    g = torch.tensor([[[[3.0], [-1.0]]]], dtype=torch.float64)
    s0, s1 = 2.0 / math.sqrt(2), 2.0 / math.sqrt(2)  # q_1.k_0 = 2, q_1.k_1 = 2: equal weights
    w0 = math.exp(s0) / (math.exp(s0) + math.exp(s1))
    expected = torch.tensor([[[[3.0], [w0 * 3.0 + (1 - w0) * -1.0]]]], dtype=torch.float64)
    torch.testing.assert_close(naive_gate_average(q, k, g), expected, rtol=0, atol=1e-15)
    # Asymmetric case: q_1 . k_0 = 0, q_1 . k_1 = 2.
    q2 = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64)
    k2 = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]]], dtype=torch.float64)
    a1 = math.exp(2 / math.sqrt(2)) / (1 + math.exp(2 / math.sqrt(2)))
    out = naive_gate_average(q2, k2, g)
    assert out[0, 0, 1, 0].item() == pytest.approx(3.0 * (1 - a1) - a1, abs=1e-14)


@pytest.mark.parametrize("t", SIZES)
@pytest.mark.parametrize("path", ["sdpa", "default", "library_reference"])
def test_sdpa_paths_match_reference_float64(path, t, nan_empty):
    q, k, g, dy = make_inputs(t, torch.float64)
    got = value_and_grads(FAST_PATHS[path], q, k, g, dy)
    for name, a, e in zip(NAMES, got, reference(t), strict=True):
        assert a.dtype == torch.float64 and a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=f"{path} T={t} {name}")


@pytest.mark.parametrize("t", SIZES)
@pytest.mark.parametrize("path", list(FAST_PATHS))
def test_fast_paths_match_reference_float32(path, t, nan_empty):
    q, k, g, dy = make_inputs(t, torch.float32)
    got = value_and_grads(FAST_PATHS[path], q, k, g, dy)
    for name, a, e in zip(NAMES, got, reference(t), strict=True):
        assert a.dtype == torch.float32 and a.shape == e.shape
        assert_close_rel(a, e, 2e-5, f"{path} T={t} {name}")


def test_gate_average_is_causal():
    t = 33
    q, k, g, _ = make_inputs(t, torch.float64, seed=3)
    base = {name: fn(q, k, g).detach() for name, fn in FAST_PATHS.items()}
    cut = 20
    q2, k2, g2 = (x.detach().clone() for x in (q, k, g))
    for x in (q2, k2, g2):
        x[..., cut:, :] = torch.randn_like(x[..., cut:, :]) * 3
    for name, fn in FAST_PATHS.items():
        out = fn(q2, k2, g2)
        torch.testing.assert_close(out[..., :cut, :], base[name][..., :cut, :], rtol=0, atol=1e-6, msg=name)
        assert (out[..., cut:, :] - base[name][..., cut:, :]).abs().max() > 1e-3, name
