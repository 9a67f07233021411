"""GAU and FLASH (docs/design.md §2.7): the chunked linear part against a quadratic reference, both layers
against naive per-position references, causality, cached decoding, parameter formulas and the
Table 3 widths (docs/design.md §2.8)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tango_lm import ModelConfig, UserError, build_model
from tango_lm.layers.flash import FlashLayer
from tango_lm.layers.gau import GAULayer
from tango_lm.layers.rope import rope_tables
from tango_lm.models.matching import TIERS, match_tier, match_width
from tango_lm.models.params import count_params
from tango_lm.models.registry import ARCHITECTURES
from tango_lm.ops.flash_linear import group_linear_attention, group_linear_attention_reference

V_GPT2 = 50257


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.5) -> torch.nn.Module:
    """Every parameter N(1, std^2) for norm weights and gammas, N(0, std^2) otherwise, so the
    attention terms are far from the near-zero values of the paper's init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std
            p.copy_(noise + (1.0 if name.endswith(("norm.weight", "gamma")) else 0.0))
    return module


def tiny(arch: str, seed: int = 0, **fields) -> torch.nn.Module:
    base = dict(
        arch=arch, d_model=16, head_dim=8, width=24, qk_dim=8, group_size=5, depth=2, vocab_size=31, context_length=40
    )
    base.update(fields)
    torch.manual_seed(seed)
    return randomize(build_model(ModelConfig(**base)).double().eval(), seed)


# -- the chunked linear part -----------------------------------------------------------------


@pytest.mark.parametrize(("t", "g"), [(1, 4), (5, 8), (8, 8), (9, 8), (37, 8), (63, 16), (64, 16), (63, 1), (50, 7)])
def test_group_linear_attention_matches_quadratic_reference(t, g):
    gen = torch.Generator().manual_seed(t * 100 + g)
    q, k, v = (torch.randn(2, 3, t, w, generator=gen, dtype=torch.float64, requires_grad=True) for w in (6, 6, 5))
    out = group_linear_attention(q, k, v, g, scale=0.3)
    ref = group_linear_attention_reference(q, k, v, g, scale=0.3)
    assert out.shape == ref.shape == (2, 3, t, 5)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[..., : min(t, g), :], torch.zeros_like(ref[..., : min(t, g), :]))
    if t <= g:
        return  # one group: the output is identically zero
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_group_linear_attention_float32_relative_error():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 500, w, generator=gen) for w in (16, 16, 24))
    out = group_linear_attention(q, k, v, 64, scale=1 / 500)
    ref = group_linear_attention_reference(q.double(), k.double(), v.double(), 64, scale=1 / 500)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


# -- naive per-position references -----------------------------------------------------------


def rotate(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """RoPE (rotate-half) of x [..., s] at one position, written out."""
    s = x.shape[-1]
    angle = pos * theta ** (-torch.arange(0, s, 2, dtype=torch.float64) / s)
    cos, sin = torch.cos(angle).repeat(2), torch.sin(angle).repeat(2)
    x1, x2 = x[..., : s // 2], x[..., s // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def naive_layer(layer: GAULayer | FlashLayer, x: torch.Tensor, context: int, theta: float = 10000.0) -> torch.Tensor:
    """One GAU / FLASH layer, one destination and one source at a time (docs/design.md §2.7)."""
    e = layer.width
    if hasattr(layer.norm, "bias"):  # gau_norm: layernorm, (x - mean) / std * weight + bias
        c = x - x.mean(-1, keepdim=True)
        h = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + layer.norm.eps) * layer.norm.weight + layer.norm.bias
    else:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layer.norm.eps) * layer.norm.weight
    uv = F.silu(h @ layer.uv_proj.weight.T + layer.uv_proj.bias)
    u, v = uv[..., :e], uv[..., e:]
    z = F.silu(h @ layer.z_proj.weight.T + layer.z_proj.bias)
    t_len = x.shape[1]
    bases = [
        [rotate(z[:, t] * gamma + beta, t, theta) for t in range(t_len)]
        for gamma, beta in zip(layer.gamma, layer.beta, strict=True)
    ]
    rows = []
    for t in range(t_len):
        acc = torch.zeros_like(v[:, 0])
        for j in range(t + 1):
            if isinstance(layer, FlashLayer):
                g = layer.group_size
                if j // g == t // g:  # quadratic, inside the group
                    score = (bases[0][t] * bases[1][j]).sum(-1) / g + layer.rel_bias[t - j + g - 1]
                    acc = acc + F.relu(score).square()[:, None] * v[:, j]
                else:  # linear, from an earlier group
                    acc = acc + ((bases[2][t] * bases[3][j]).sum(-1) / context)[:, None] * v[:, j]
            else:
                score = (bases[0][t] * bases[1][j]).sum(-1) / context + layer.rel_bias[t - j + context - 1]
                acc = acc + F.relu(score).square()[:, None] * v[:, j]
        rows.append(x[:, t] + (u[:, t] * acc) @ layer.o_proj.weight.T + layer.o_proj.bias)
    return torch.stack(rows, 1)


def make_layer(kind: str, context: int, group: int = 4, norm: str = "rmsnorm") -> GAULayer | FlashLayer:
    torch.manual_seed(1)
    if kind == "gau":
        layer = GAULayer(12, 10, 6, context, norm=norm)
    else:
        layer = FlashLayer(12, 10, 6, group, context, norm=norm)
    return randomize(layer.double(), seed=2)


@pytest.mark.parametrize(
    ("kind", "t", "group", "block", "norm"),
    [
        ("gau", 13, 0, None, "rmsnorm"),
        ("gau", 1, 0, None, "rmsnorm"),
        ("flash", 13, 4, None, "rmsnorm"),
        ("flash", 3, 4, None, "rmsnorm"),
        ("flash", 12, 4, None, "rmsnorm"),
        ("flash", 11, 1, None, "rmsnorm"),
        ("gau", 13, 0, 4, "rmsnorm"),
        ("flash", 15, 8, 3, "rmsnorm"),
        ("gau", 13, 0, None, "layernorm"),
        ("flash", 13, 4, None, "layernorm"),
    ],  # docs/table3-ranges.md
)
def test_layer_matches_naive_reference(monkeypatch, kind, t, group, block, norm):
    # block: blocks of the causal product short enough that the blocked CPU op runs (ops/causal_matmul.py)
    if block is not None:
        monkeypatch.setattr("tango_lm.ops.causal_matmul.CAUSAL_BLOCK", block)
    context = 16
    layer = make_layer(kind, context, group, norm)
    x = torch.randn(2, t, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(t), requires_grad=True)
    out = layer(x, rope_tables(t, 6, 10000.0, x.device, dtype=x.dtype))
    ref = naive_layer(layer, x, context)
    assert (out - x).abs().max() > 1e-2  # the parameters make the mixing non-trivial
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    params = [x, *layer.parameters()]
    got = torch.autograd.grad(out, params, grad, allow_unused=True)
    want = torch.autograd.grad(ref, params, grad, allow_unused=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_flash_with_one_group_equals_gau():
    """With g = n and T <= g, FLASH's linear part vanishes and its quad part is GAU's attention."""
    gau, flash = make_layer("gau", 16), make_layer("flash", 16, group=16)
    with torch.no_grad():
        for name, p in gau.named_parameters():
            src = dict(flash.named_parameters())[name]
            p.copy_(src[:2] if name in ("gamma", "beta") else src)
    x = torch.randn(2, 16, 12, dtype=torch.float64)
    rope = rope_tables(16, 6, 10000.0, x.device, dtype=x.dtype)
    torch.testing.assert_close(flash(x, rope), gau(x, rope), rtol=1e-12, atol=1e-12)


# -- models: causality and cached decoding ----------------------------------------------------


@pytest.mark.parametrize("arch", ["gau", "flash"])
def test_future_tokens_do_not_change_past_outputs(arch):
    model = tiny(arch)
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(0, 31, (2, 23), generator=gen)
    full = model(x)
    for cut in (1, 5, 7, 10, 22):  # group boundaries (5, 10) and positions inside groups
        y = x.clone()
        y[:, cut:] = torch.randint(0, 31, y[:, cut:].shape, generator=gen)
        torch.testing.assert_close(model(y)[:, :cut], full[:, :cut], rtol=1e-12, atol=1e-12)
        assert not torch.allclose(model(y)[:, cut:], full[:, cut:])
        torch.testing.assert_close(model(x[:, :cut]), full[:, :cut], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("arch", ["gau", "flash"])
@pytest.mark.parametrize("cuts", [(5, 6, 7, 23, 24, 31), (1, 2, 3, 4, 9, 33), (13, 14, 37)])
def test_cached_decoding_reproduces_full_forward(arch, cuts):
    """Group size 5: prefills ending on and off group boundaries, single steps that complete a
    group, and chunks spanning several groups."""
    model = tiny(arch)
    x = torch.randint(0, 31, (2, 37), generator=torch.Generator().manual_seed(5))
    full = model(x)
    cache = model.new_cache()
    bounds = [0, *cuts, 37] if cuts[-1] != 37 else [0, *cuts]
    pieces = [model(x[:, a:b], cache) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-10)
    if arch == "flash":  # the state is one partial group and one running sum per layer
        for state in cache.states:
            assert state.extra["quad_k"].shape[-2] == 37 % 5 and state.extra["kv"].shape == (2, 8, 24)
            assert not state.buffers


def test_bf16_autocast_forward_runs():
    for arch in ("gau", "flash"):
        model = build_model(
            ModelConfig(
                arch=arch,
                d_model=16,
                head_dim=8,
                width=24,
                qk_dim=8,
                group_size=4,
                depth=1,
                vocab_size=31,
                context_length=16,
            )
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randint(0, 31, (2, 14)))
        assert out.shape == (2, 14, 31) and torch.isfinite(out).all()


# -- configs, parameters, FLOPs and matching --------------------------------------------------


def spec_params(arch: str, d: int, e: int, s: int, depth: int, n: int, g: int, norm: str = "rmsnorm") -> int:
    """docs/design.md §2.7 per-layer formulas, written out, times depth, plus the final norm (a
    LayerNorm has a bias too: + d per layer)."""
    if arch == "gau":
        layer = 3 * d * e + 2 * e + d * s + s + 4 * s + d + d + (2 * n - 1)
    else:
        layer = 3 * d * e + 2 * e + d * s + s + 8 * s + d + d + (2 * g - 1)
    return depth * (layer + (d if norm == "layernorm" else 0)) + d


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("arch", ["gau", "flash"])
@pytest.mark.parametrize(("d", "e", "s", "depth", "n", "g"), [(16, 24, 8, 1, 10, 3), (32, 48, 4, 3, 7, 16)])
def test_formula_equals_numel(arch, d, e, s, depth, n, g, norm):
    cfg = ModelConfig(
        arch=arch,
        d_model=d,
        head_dim=8,
        width=e,
        qk_dim=s,
        group_size=g,
        depth=depth,
        vocab_size=29,
        context_length=n,
        gau_norm=norm,
    )
    model = build_model(cfg)
    non_emb = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("head."))
    counts = count_params(cfg)
    assert counts["non_embedding"] == non_emb == spec_params(arch, d, e, s, depth, n, g, norm)
    assert counts["total"] == sum(p.numel() for p in model.parameters()) == non_emb + 29 * d
    names = {
        name.split(".")[-1] if name.endswith(("gamma", "beta", "rel_bias")) else name.split(".")[-2]
        for name, _ in model.backbone.layers[0].named_parameters()
    }
    assert names == {"norm", "uv_proj", "z_proj", "o_proj", "gamma", "beta", "rel_bias"}


def test_spec_check_number_flash():
    cfg = ModelConfig(arch="flash", d_model=512, width=7152, depth=4, vocab_size=V_GPT2)
    with torch.device("meta"):
        model = build_model(cfg)
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters()) == 70_004_092


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"arch": "gau", "qk_dim": 7}, "qk_dim"),
        ({"arch": "flash", "qk_dim": 0}, "qk_dim"),
        ({"arch": "flash", "group_size": 0}, "group_size"),
        ({"arch": "gau", "gau_norm": "scalenorm"}, "unknown model.gau_norm 'scalenorm' for GAU/FLASH; choose one of"),
    ],
)
def test_bad_configs_are_user_errors(fields, match):
    with pytest.raises(UserError, match=match):
        ModelConfig(d_model=64, **fields)


def test_flops_formulas():
    gau = ModelConfig(arch="gau", d_model=64, width=96, qk_dim=16, depth=2, context_length=64)
    flash = gau.replace(arch="flash", group_size=8)
    s, e = 16, 96
    assert ARCHITECTURES["gau"].attention_flops_per_token(gau, 63) == 2 * 2 * (s + e) * 32
    # 64 tokens in groups of 8: 4.5 visible in-group sources on average, plus the linear part: 2se for
    # each of the 56 tokens outside the last group (writing the running sum) and the 56 outside the
    # first (reading it).
    linear = 2 * s * e * (56 + 56) / 64
    assert ARCHITECTURES["flash"].attention_flops_per_token(flash, 64) == int(2 * (2 * (s + e) * 4.5 + linear))
    for cfg in (gau, flash):
        assert ARCHITECTURES[cfg.arch].matmul_params_per_token(cfg) == 2 * (3 * 64 * e + 64 * s)
    # FLASH's mixing cost per token is bounded in the sequence length; GAU's grows.
    arch = ARCHITECTURES["flash"]
    bound = int(2 * (2 * (s + e) * 4.5 + 4 * s * e))
    assert arch.attention_flops_per_token(flash, 64) <= arch.attention_flops_per_token(flash, 4096) <= bound


# Seed 000 Table 3 (GAU's range is over context lengths; the default 1024 must land in it).
TABLE3 = {
    ("70M", 4): {"gau": (7136, 7152), "flash": (7152, 7152)},
    ("70M", 8): {"gau": (3536, 3552), "flash": (3552, 3552)},
    ("160M", 4): {"gau": (13104, 13120), "flash": (13120, 13120)},
    ("160M", 8): {"gau": (6528, 6544), "flash": (6544, 6544)},
}


@pytest.mark.parametrize(("tier", "depth"), list(TABLE3))
def test_match_tier_reproduces_table3(tier, depth):
    target, d = TIERS[tier]
    rows = {row["arch"]: row for row in match_tier(target, d, depth)}
    for arch, (lo, hi) in TABLE3[tier, depth].items():
        row = rows[arch]
        e = row["width"]
        assert lo <= e <= hi and e % 16 == 0
        total = spec_params(arch, d, e, 128, depth, 1024, 256) + V_GPT2 * d
        assert row["total"] == total and row["gap"] == total - target
        for other in (e - 16, e + 16):  # nearest multiple of 16
            assert abs(spec_params(arch, d, other, 128, depth, 1024, 256) + V_GPT2 * d - target) >= abs(total - target)


def test_matched_count_equals_meta_numel():
    cfg = match_width(ModelConfig(arch="gau", d_model=768, depth=8, width=768, vocab_size=V_GPT2), 160_000_000)
    with torch.device("meta"):
        model = build_model(cfg)
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())
    assert math.isclose(count_params(cfg)["total"], 160_000_000, rel_tol=2e-3)
