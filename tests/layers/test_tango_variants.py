"""TANGO with three gated-projection sets (docs/design.md §2.4) and compact-controller TANGO (docs/design.md §2.5,
layers/tango_variants.py): which set each application uses, the compact block against a naive
reference and against TANGO with the gate silu(h W_c) W_e, parameter formulas against `numel`.
(Cached decoding of both is tested through TINY in test_generate.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from tango_lm import ModelConfig, UserError, build_model
from tango_lm.layers.rope import rope_tables
from tango_lm.layers.tango import TangoBlock
from tango_lm.layers.tango_variants import CompactTangoBlock, ThreeSetTangoBlock, set_for_application
from tango_lm.models.params import count_params

EPS = 1e-6
THETA = 10000.0


pytestmark = pytest.mark.usefixtures("one_thread")


def numel(model: torch.nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    non_emb = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("head."))
    return total, non_emb


def rope(t: int, d_h: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_tables(t, d_h, THETA, torch.device("cpu"), dtype=torch.float64)


def randomize_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """float64, random weights (q, k large enough for peaked attention, a non-unit norm weight)."""
    gen = torch.Generator().manual_seed(seed)
    module.double()
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = (
                1.0 if name.endswith("norm.weight") else (0.6 if name.split(".")[-2] in ("q_proj", "k_proj") else 0.3)
            )
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + scale * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return module


# -- three gated-projection sets ---------------------------------------------------------------
def test_set_schedule():
    assert [set_for_application(a, 3) for a in range(3)] == [0, 1, 2]
    assert [set_for_application(a, 6) for a in range(6)] == [0, 1, 1, 1, 1, 2]


def test_three_set_state_dict_names():
    model = build_model(ModelConfig(arch="tango-3set", d_model=32, head_dim=8, width=16, depth=3, vocab_size=20))
    names = {n.removeprefix("backbone.layers.0.") for n in model.state_dict() if n.startswith("backbone.")}
    sets = {f"sets.{i}.{p}.weight" for i in range(3) for p in ("gate_proj", "up_proj", "down_proj")}
    assert names == {"norm.weight", "q_proj.weight", "k_proj.weight"} | sets


def three_set_block(depth: int = 5) -> ThreeSetTangoBlock:
    torch.manual_seed(0)
    return randomize_(ThreeSetTangoBlock(32, 4, 24, depth, EPS), seed=1)


def test_each_application_is_tango_with_its_set():
    # Application a of the 3-set block is exactly TangoBlock with the shared q, k, norm and set
    # set_for_application(a) (first -> 0, middle -> 1, last -> 2).
    depth = 5
    block = three_set_block(depth)
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    tables = rope(9, 8)
    for i in range(3):
        tango = TangoBlock(32, 4, 24, EPS).double()
        shared = {k: v for k, v in block.state_dict().items() if not k.startswith("sets.")}
        mine = {k.removeprefix(f"sets.{i}."): v for k, v in block.state_dict().items() if k.startswith(f"sets.{i}.")}
        tango.load_state_dict({**shared, **mine})
        want = tango(x, tables)
        for app in range(depth):
            got = block(x, tables, app)
            if set_for_application(app, depth) == i:
                assert torch.equal(got, want), (app, i)
            else:
                assert (got - want).abs().max() > 1e-3, (app, i)


def test_zeroing_a_sets_down_proj_silences_exactly_its_applications():
    depth = 5
    tables = rope(7, 8)
    x = torch.randn(2, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for i, apps in enumerate([{0}, {1, 2, 3}, {4}]):
        block = three_set_block(depth)
        with torch.no_grad():
            block.sets[i].down_proj.weight.zero_()
        silent = {app for app in range(depth) if torch.equal(block(x, tables, app), x)}
        assert silent == apps, i


def test_three_set_model_uses_the_sets_by_position():
    # Whole model: changing set 2 (the last) changes the output, but the hidden state entering
    # the last application is the same.
    cfg = ModelConfig(arch="tango-3set", d_model=32, head_dim=8, width=16, depth=4, vocab_size=30, context_length=16)
    torch.manual_seed(0)
    model = build_model(cfg).double()
    seen = []
    block = model.backbone.layers[0]
    handle = block.register_forward_hook(lambda m, args, out: seen.append(args[0].detach().clone()))
    ids = torch.randint(0, 30, (2, 10), generator=torch.Generator().manual_seed(4))
    before = model(ids)
    inputs_before = list(seen)
    seen.clear()
    with torch.no_grad():
        block.sets[2].up_proj.weight.mul_(-1.5)
    after = model(ids)
    handle.remove()
    assert [torch.equal(a, b) for a, b in zip(inputs_before, seen, strict=True)] == [True] * 4
    assert (after - before).abs().max() > 1e-6


def test_three_set_needs_depth_three():
    for depth in (1, 2):
        with pytest.raises(UserError, match=r"depth >= 3.*raise depth or use arch=tango"):
            ModelConfig(arch="tango-3set", d_model=32, head_dim=8, width=16, depth=depth)
    with pytest.raises(UserError, match="multiple of n_heads"):
        ModelConfig(arch="tango-3set", d_model=32, head_dim=8, width=18, depth=3)


@pytest.mark.parametrize(("d", "head_dim", "f", "depth", "vocab"), [(32, 8, 16, 3, 50), (48, 16, 33, 4, 97)])
def test_three_set_formula_equals_numel(d, head_dim, f, depth, vocab):
    cfg = ModelConfig(arch="tango-3set", d_model=d, head_dim=head_dim, width=f, depth=depth, vocab_size=vocab)
    total, non_emb = numel(build_model(cfg))
    assert count_params(cfg) == {"total": total, "non_embedding": non_emb, "embedding": vocab * d}
    assert non_emb == 2 * d * d + 9 * d * f + 2 * d


def test_three_set_spec_check():
    # docs/design.md §2.4: V = 50257, d = 1216, 38 heads, F = 570 -> 70,310,336.
    cfg = ModelConfig(arch="tango-3set", d_model=1216, n_heads=38, width=570, depth=4, vocab_size=50257)
    with torch.device("meta"):
        model = build_model(cfg)
    assert numel(model)[0] == count_params(cfg)["total"] == 70_310_336


# -- compact controller ------------------------------------------------------------------------
def rms_norm_naive(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * weight


def rope_naive(v: torch.Tensor, pos: int) -> torch.Tensor:
    half = v.shape[-1] // 2
    angle = pos * THETA ** (-2 * torch.arange(half, dtype=torch.float64) / v.shape[-1])
    v1, v2 = v[..., :half], v[..., half:]
    return torch.cat([v1 * angle.cos() - v2 * angle.sin(), v2 * angle.cos() + v1 * angle.sin()], dim=-1)


def attention_weights(q: torch.Tensor, k: torch.Tensor, n_heads: int) -> torch.Tensor:
    """a[b, head, t, s]: causal softmax of RoPE'd q.k / sqrt(d_h), by explicit loops."""
    b, t_len, d = q.shape
    d_h = d // n_heads
    a = torch.zeros(b, n_heads, t_len, t_len, dtype=q.dtype)
    for hd in range(n_heads):
        sl = slice(hd * d_h, (hd + 1) * d_h)
        for t in range(t_len):
            q_t = rope_naive(q[:, t, sl], t)
            scores = torch.stack([(q_t * rope_naive(k[:, s, sl], s)).sum(-1) for s in range(t + 1)], -1)
            a[:, hd, t, : t + 1] = torch.softmax(scores / math.sqrt(d_h), dim=-1)
    return a


def naive_compact(block: CompactTangoBlock, x: torch.Tensor) -> torch.Tensor:
    """docs/design.md §2.5 as written: c = silu(h W_c) split in heads, averaged per head, expanded by W_e."""
    n_heads = block.n_heads
    h = rms_norm_naive(x, block.norm.weight)
    a = attention_weights(h @ block.q_proj.weight.T, h @ block.k_proj.weight.T, n_heads)
    pre = h @ block.controller_proj.weight.T
    c = pre * torch.sigmoid(pre)
    r_h = c.shape[-1] // n_heads
    cbar = torch.cat([a[:, hd] @ c[..., hd * r_h : (hd + 1) * r_h] for hd in range(n_heads)], dim=-1)
    gbar = cbar @ block.expand_proj.weight.T
    return x + (gbar * (h @ block.up_proj.weight.T)) @ block.down_proj.weight.T


def naive_tango_with_gate(block: CompactTangoBlock, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """TANGO (docs/design.md §2.2) with a given source gate g [B, T, F] split in heads of F/H."""
    n_heads = block.n_heads
    h = rms_norm_naive(x, block.norm.weight)
    a = attention_weights(h @ block.q_proj.weight.T, h @ block.k_proj.weight.T, n_heads)
    f_h = g.shape[-1] // n_heads
    gbar = torch.cat([a[:, hd] @ g[..., hd * f_h : (hd + 1) * f_h] for hd in range(n_heads)], dim=-1)
    return x + (gbar * (h @ block.up_proj.weight.T)) @ block.down_proj.weight.T


def compact_block(d: int, n_heads: int, width: int, r: int, seed: int = 0) -> CompactTangoBlock:
    torch.manual_seed(seed)
    return randomize_(CompactTangoBlock(d, n_heads, width, r, EPS), seed + 1)


def rel_err(a: torch.Tensor, e: torch.Tensor) -> float:
    return ((a - e).abs().max() / e.abs().max()).item()


TOL = 2e-6  # the block's norm and RoPE run in fp32 (docs/design.md §1)


@pytest.mark.parametrize(("d", "n_heads", "width", "r", "t"), [(32, 2, 40, 12, 7), (48, 4, 30, 20, 13)])
def test_compact_matches_naive_reference(d, n_heads, width, r, t):
    block = compact_block(d, n_heads, width, r)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, t, d, dtype=torch.float64, generator=gen).requires_grad_(True)
    dy = torch.randn(2, t, d, dtype=torch.float64, generator=gen)
    params = dict(block.named_parameters())
    assert set(params) == {
        f"{n}.weight" for n in ("norm", "q_proj", "k_proj", "controller_proj", "expand_proj", "up_proj", "down_proj")
    }
    out = block(x, rope(t, d // n_heads))
    ref = naive_compact(block, x)
    assert rel_err(out - x, ref - x) < TOL
    got = torch.autograd.grad(out, [x, *params.values()], dy)
    want = torch.autograd.grad(ref, [x, *params.values()], dy)
    for name, a, e in zip(["x", *params], got, want, strict=True):
        assert rel_err(a, e) < TOL, name


def block_diagonal_(w: torch.Tensor, n_heads: int) -> None:
    """Zero W_e [F, r] outside the head blocks: head h's r/H channels feed only its F/H columns."""
    f, r = w.shape
    rows = torch.arange(f) // (f // n_heads)
    cols = torch.arange(r) // (r // n_heads)
    w.mul_((rows[:, None] == cols[None, :]).to(w.dtype))


@pytest.mark.parametrize(("n_heads", "block_diag"), [(1, False), (4, True)])
def test_compact_is_tango_with_gate_silu_h_wc_we(n_heads, block_diag):
    # By linearity, averaging c and then expanding equals averaging the expanded gate c W_e, when
    # each gate column reads the controller of its own head: always with one head, and with
    # several heads when W_e is head-block-diagonal (docs/design.md §2.5; see the module docstring).
    d, width, r, t = 32, 24, 8, 11
    block = compact_block(d, n_heads, width, r, seed=7)
    if block_diag:
        with torch.no_grad():
            block_diagonal_(block.expand_proj.weight, n_heads)
    x = torch.randn(2, t, d, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    h = rms_norm_naive(x, block.norm.weight)
    pre = h @ block.controller_proj.weight.T
    g = (pre * torch.sigmoid(pre)) @ block.expand_proj.weight.T  # the gate silu(h W_c) W_e
    want = naive_tango_with_gate(block, x, g)
    out = block(x, rope(t, d // n_heads)).detach()
    assert rel_err(out - x, want - x) < TOL


def test_compact_with_full_expansion_mixes_heads():
    # With several heads and a full W_e the variant is not per-head TANGO on silu(h W_c) W_e:
    # the reading matters, and the block follows the naive compact reference, not that one.
    d, n_heads, width, r, t = 32, 4, 24, 8, 11
    block = compact_block(d, n_heads, width, r, seed=7)
    x = torch.randn(2, t, d, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    h = rms_norm_naive(x, block.norm.weight)
    pre = h @ block.controller_proj.weight.T
    g = (pre * torch.sigmoid(pre)) @ block.expand_proj.weight.T
    out = block(x, rope(t, d // n_heads)).detach()
    assert rel_err(out - x, naive_tango_with_gate(block, x, g) - x) > 1e-2
    assert rel_err(out - x, naive_compact(block, x) - x) < TOL


def test_compact_cache_holds_r_channels():
    cfg = ModelConfig(
        arch="tango-compact",
        d_model=32,
        head_dim=8,
        width=48,
        controller_width=12,
        depth=2,
        vocab_size=30,
        context_length=16,
    )
    model = build_model(cfg)
    cache = model.new_cache()
    model(torch.randint(0, 30, (1, 5)), cache)
    state = cache.states[0]
    assert set(state.buffers) == {"k", "c"}
    assert state.buffers["c"].shape[1:] == (4, 16, 3)  # H heads of r/H = 3 channels, not F/H = 12


def test_compact_defaults_and_validation():
    cfg = ModelConfig(arch="tango-compact", d_model=32, head_dim=8, width=20)  # F need not divide by H
    assert cfg.controller_width is None
    block = build_model(cfg).backbone.layers[0]
    assert block.controller_proj.weight.shape == (32, 32) and block.expand_proj.weight.shape == (20, 32)
    with pytest.raises(UserError, match=r"controller_width=10 must be a positive multiple of n_heads=4.* such as 8"):
        ModelConfig(arch="tango-compact", d_model=32, head_dim=8, width=20, controller_width=10)
    with pytest.raises(UserError, match="controller_width=0"):
        ModelConfig(arch="tango-compact", d_model=32, head_dim=8, width=20, controller_width=0)


@pytest.mark.parametrize(
    ("d", "head_dim", "f", "r", "vocab"), [(32, 8, 20, None, 50), (48, 16, 33, 6, 97), (64, 32, 100, 128, 11)]
)
def test_compact_formula_equals_numel(d, head_dim, f, r, vocab):
    cfg = ModelConfig(
        arch="tango-compact", d_model=d, head_dim=head_dim, width=f, controller_width=r, depth=3, vocab_size=vocab
    )
    total, non_emb = numel(build_model(cfg))
    rr = r or d
    assert count_params(cfg) == {"total": total, "non_embedding": non_emb, "embedding": vocab * d}
    assert non_emb == 2 * d * d + d * rr + rr * f + 2 * d * f + 2 * d


def test_compact_flops_count_the_controller_average():
    base = dict(arch="tango-compact", d_model=64, head_dim=16, width=256, depth=2)
    small = ModelConfig(**base, controller_width=16).flops_per_token(128)
    large = ModelConfig(**base, controller_width=64).flops_per_token(128)
    # 48 more controller channels: 3 * depth * (2 (d + F) matmul + 2 * (T + 1) / 2 averaging) each.
    assert large - small == 3 * 2 * 48 * (2 * (64 + 256) + 129)
