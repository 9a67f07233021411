"""The TANGO block (docs/design.md §2.2, layers/tango.py) against a naive reference of the whole block.

The reference is written from docs/design.md §2.2's equations with nothing from the library but the block's
weights: RMSNorm, rotate-half RoPE per head on q and k (positions 0..T-1, theta 10,000), the SiLU
source gate, a per-head softmax average with an explicit loop over destinations and sources, the
destination projection, the down projection and the residual.
"""

from __future__ import annotations

import math

import pytest
import torch

from tango_lm.layers.rope import rope_tables
from tango_lm.layers.tango import TangoBlock

THETA = 10000.0
EPS = 1e-6

# (d_model, n_heads, width F, T): head widths 16 and 12, gate widths per head 20 and 10.
CASES = [(32, 2, 40, 7), (48, 4, 40, 33)]


def make_block(d: int, n_heads: int, width: int, seed: int = 0) -> TangoBlock:
    torch.manual_seed(seed)
    block = TangoBlock(d, n_heads, width, EPS).double()
    with torch.no_grad():
        # A non-trivial norm weight, so a norm that ignores it cannot pass.
        block.norm.weight.copy_(1 + 0.3 * torch.randn(d, dtype=torch.float64))
        # Larger q, k so the attention rows are far from uniform.
        block.q_proj.weight.mul_(3.0)
        block.k_proj.weight.mul_(3.0)
    return block


def rope_naive(v: torch.Tensor, pos: int, theta: float = THETA) -> torch.Tensor:
    """Rotate-half RoPE of v [..., d_h] at position pos: pairs (i, i + d_h/2) rotated by pos * theta^(-2i/d_h)."""
    half = v.shape[-1] // 2
    i = torch.arange(half, dtype=torch.float64)
    angle = pos * theta ** (-2 * i / v.shape[-1])
    c, s = torch.cos(angle), torch.sin(angle)
    v1, v2 = v[..., :half], v[..., half:]
    return torch.cat([v1 * c - v2 * s, v2 * c + v1 * s], dim=-1)


def rms_norm_naive(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * weight


def naive_block(block: TangoBlock, x: torch.Tensor, n_heads: int) -> torch.Tensor:
    b, t_len, d = x.shape
    d_h = d // n_heads
    h = rms_norm_naive(x, block.norm.weight)
    q = h @ block.q_proj.weight.T
    k = h @ block.k_proj.weight.T
    pre = h @ block.gate_proj.weight.T
    g = pre * torch.sigmoid(pre)  # silu
    u = h @ block.up_proj.weight.T
    f_h = g.shape[-1] // n_heads
    outs = []
    for t in range(t_len):
        heads = []
        for hd in range(n_heads):
            qs, fs = slice(hd * d_h, (hd + 1) * d_h), slice(hd * f_h, (hd + 1) * f_h)
            q_t = rope_naive(q[:, t, qs], t)
            scores = [(q_t * rope_naive(k[:, s, qs], s)).sum(-1) / math.sqrt(d_h) for s in range(t + 1)]
            scores = torch.stack(scores, dim=-1)  # [B, t+1]
            e = torch.exp(scores - scores.max(-1, keepdim=True).values)
            a = e / e.sum(-1, keepdim=True)
            gbar = sum(a[:, s : s + 1] * g[:, s, fs] for s in range(t + 1))
            heads.append(gbar)
        outs.append(torch.cat(heads, dim=-1) * u[:, t])
    y = torch.stack(outs, dim=1)  # [B, T, F]
    return x + y @ block.down_proj.weight.T


def swiglu_naive(block: TangoBlock, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
    """`x + W_o(silu(W_g h) * W_u h)` (docs/design.md §2.2's self-only property); swap exchanges W_g and W_u."""
    h = rms_norm_naive(x, block.norm.weight)
    wg, wu = block.gate_proj.weight, block.up_proj.weight
    if swap:
        wg, wu = wu, wg
    pre = h @ wg.T
    return x + (pre * torch.sigmoid(pre) * (h @ wu.T)) @ block.down_proj.weight.T


def run_block(block: TangoBlock, x: torch.Tensor) -> torch.Tensor:
    d_h = x.shape[-1] // block.n_heads
    return block(x, rope_tables(x.shape[1], d_h, THETA, x.device))


def inputs(b: int, t: int, d: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, d, generator=gen, dtype=torch.float64).requires_grad_(True)
    dy = torch.randn(b, t, d, generator=gen, dtype=torch.float64)
    return x, dy


def rel_err(a: torch.Tensor, e: torch.Tensor) -> float:
    return ((a - e).abs().max() / e.abs().max()).item()


# The block takes its norm statistics and RoPE in fp32 (docs/design.md §1), so float64 agreement is to
# fp32 rounding; any structural mistake (head split, rotation, scale, roles) is O(1).
TOL = 2e-6


@pytest.mark.parametrize(("d", "n_heads", "width", "t"), CASES)
def test_block_matches_naive_reference(d, n_heads, width, t):
    block = make_block(d, n_heads, width)
    x, dy = inputs(2, t, d)
    params = dict(block.named_parameters())
    assert set(params) == {f"{n}.weight" for n in ("norm", "q_proj", "k_proj", "gate_proj", "up_proj", "down_proj")}
    wrt = [x, *params.values()]

    out = run_block(block, x)
    got = torch.autograd.grad(out, wrt, dy)
    ref = naive_block(block, x, n_heads)
    want = torch.autograd.grad(ref, wrt, dy)

    assert out.shape == x.shape and out.dtype == torch.float64
    # The residual is not the whole story: the block's update is what is compared.
    assert rel_err(out - x, ref - x) < TOL, "forward"
    for name, a, e in zip(["x", *params], got, want, strict=True):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, e) < TOL, f"grad {name}: {rel_err(a, e):.2e}"


def test_block_float64_is_float64_exact():
    d, n_heads, width, t = CASES[0]
    block = make_block(d, n_heads, width)
    x, _ = inputs(2, t, d)
    # Exact float64 tables, so only the block's own arithmetic is in question.
    pos = torch.arange(t, dtype=torch.float64)
    d_h = d // n_heads
    inv = THETA ** (-torch.arange(0, d_h, 2, dtype=torch.float64) / d_h)
    ang = torch.cat([torch.outer(pos, inv)] * 2, dim=-1)
    out = block(x, (ang.cos(), ang.sin()))
    ref = naive_block(block, x, n_heads)
    assert rel_err(out - x, ref - x) < 1e-12


def diagonal_attention_setup(d: int, n_heads: int, width: int, t: int, scale: float = 10.0):
    """A block and input whose attention is self-only to float64 precision, through the real path.

    With W_q = W_k = scale * I, a unit norm weight and every head slice of every x_t of the same
    length, the score of source s at destination t is scale^2 * h_t . R_{s-t} h_s / sqrt(d_h): by
    Cauchy-Schwarz the diagonal wins, and a large scale pushes the other weights below 1e-17.
    """
    block = make_block(d, n_heads, width)
    d_h = d // n_heads
    with torch.no_grad():
        block.norm.weight.fill_(1.0)
        block.q_proj.weight.copy_(scale * torch.eye(d, dtype=torch.float64))
        block.k_proj.weight.copy_(scale * torch.eye(d, dtype=torch.float64))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, t, n_heads, d_h, generator=gen, dtype=torch.float64)
    x = (x / x.norm(dim=-1, keepdim=True)).reshape(2, t, d) * 1.7
    # Check the construction: every off-diagonal score is at least 40 nats below the diagonal.
    h = rms_norm_naive(x, block.norm.weight) * scale
    for hd in range(n_heads):
        hs = h[..., hd * d_h : (hd + 1) * d_h]
        rot = [rope_naive(hs[:, s], s) for s in range(t)]
        for t_ in range(t):
            diag = (rot[t_] * rot[t_]).sum(-1)
            for s in range(t_):
                assert ((diag - (rot[t_] * rot[s]).sum(-1)) / math.sqrt(d_h)).min() > 40
    return block, x


@pytest.mark.parametrize(("d", "n_heads", "width", "t"), CASES)
def test_self_only_attention_is_swiglu(d, n_heads, width, t):
    # docs/design.md §2.2: when each destination attends only to itself, the block is the SwiGLU FFN
    # x + W_o(silu(W_g h) * W_u h), with W_g = gate_proj and W_u = up_proj.
    block, x = diagonal_attention_setup(d, n_heads, width, t)
    out = run_block(block, x).detach()
    want, swapped = swiglu_naive(block, x), swiglu_naive(block, x, swap=True)
    assert rel_err(out - x, want - x) < TOL
    # The property distinguishes the roles: W_g (gate_proj) is the SiLU half, W_u (up_proj) is linear.
    assert rel_err(swapped - x, want - x) > 0.1
    # And the construction matters: with ordinary q, k the same block is not a SwiGLU FFN.
    normal = make_block(d, n_heads, width)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(normal, name).weight.copy_(getattr(block, name).weight)
        normal.norm.weight.fill_(1.0)
    assert rel_err(run_block(normal, x).detach() - x, want - x) > 1e-2


@pytest.mark.parametrize(("d", "n_heads", "width", "t"), CASES)
def test_first_position_is_swiglu_without_patching(d, n_heads, width, t):
    # Position 0 sees only itself, so the real attention path gives SwiGLU there (and for T = 1).
    block = make_block(d, n_heads, width)
    x, _ = inputs(2, t, d, seed=3)
    x = x.detach()
    out = run_block(block, x)
    want = swiglu_naive(block, x)
    assert rel_err(out[:, 0] - x[:, 0], want[:, 0] - x[:, 0]) < TOL
    assert rel_err(out[:, -1] - x[:, -1], want[:, -1] - x[:, -1]) > 1e-2  # later positions mix sources
    out1 = run_block(block, x[:, :1])
    assert rel_err(out1 - x[:, :1], want[:, :1] - x[:, :1]) < TOL


def test_block_is_causal_and_batch_independent():
    d, n_heads, width, t = CASES[1]
    block = make_block(d, n_heads, width)
    x, _ = inputs(3, t, d, seed=4)
    x = x.detach()
    out = run_block(block, x)
    x2 = x.clone()
    x2[:, 20:] = torch.randn_like(x2[:, 20:])
    x2[1] = torch.randn_like(x2[1])
    out2 = run_block(block, x2)
    torch.testing.assert_close(out2[[0, 2], :20], out[[0, 2], :20], rtol=0, atol=1e-12)
    assert (out2[:, 20:] - out[:, 20:]).abs().max() > 1e-3
