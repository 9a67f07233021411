"""Windowed TANGO (docs/design.md §2.3): ops/windowed.py, layers/tango_windowed.py, models/archs/tango_windowed.py.

docs/design.md §2.3's weights, for destination t and source s <= t (per head):
`w[t, s] = exp(q_t . k_s / sqrt(d_h))` (q, k rotated) when `t - W < s <= t`, else
`w[t, s] = phi(q_t) . phi(k_s)` (phi of the un-rotated q, k), and `gbar_t = sum_s w g_s / sum_s w`.
The naive checks below form every w[t, s] with explicit loops; the chunked linear-time path must
match the quadratic reference in value and gradients at odd sizes, and with W >= T the model is TANGO.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tango_lm import ModelConfig, UserError, build_model
from tango_lm.bench.windowed import windowed_time_per_token
from tango_lm.layers.rope import apply_rope, rope_tables
from tango_lm.layers.tango_windowed import WindowedTangoBlock
from tango_lm.models.archs.tango import Tango
from tango_lm.models.archs.tango_windowed import TangoWindowed
from tango_lm.ops.gate_average import merge_heads, split_heads
from tango_lm.ops.windowed import (
    FEATURE_MAPS,
    windowed_gate_average,
    windowed_gate_average_reference,
)
from tango_lm.ops.windowed_mix import windowed_mix, windowed_mix_fused, windowed_mix_reference

SIZES = (1, 7, 63, 130)
WINDOWS = (1, 5, 64, 200)  # 200 > every T: all exact


def make_inputs(t: int, dtype: torch.dtype = torch.float64, width: int = 12, seed: int = 0, scale: float = 1.5):
    """q_rot, k_rot, q_raw, k_raw [B, H, T, d_h] and g [B, H, T, w] as non-contiguous views (as the
    block produces them), plus an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    b, h, d_h = 2, 3, 8

    def rand(w: int, s: float) -> torch.Tensor:
        x = (torch.randn(b, t, h, w, generator=gen, dtype=torch.float64) * s).to(dtype)
        return x.transpose(1, 2).requires_grad_(True)

    xs = [rand(d_h, scale) for _ in range(4)] + [rand(width, 1.0)]
    dy = torch.randn(b, h, t, width, generator=gen, dtype=torch.float64).to(dtype)
    return xs, dy


def rel_err(a: torch.Tensor, e: torch.Tensor) -> float:
    """Largest difference relative to the largest expected value (at least 1e-3, so that exactly
    zero gradients, such as q's and k's at T = 1, compare to rounding noise absolutely)."""
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-3)).item()


# -- the op: chunked path against the quadratic reference ---------------------------------------


@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
@pytest.mark.parametrize("t", SIZES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("chunk", ["default", "window"])
def test_chunked_matches_reference(feature_map, t, window, chunk):
    # chunk_size = W puts the window's whole band in the previous chunk and exercises the
    # prefix sums at small T; the default (max(W, 64)) is what the block uses.
    xs, dy = make_inputs(t)
    chunk_size = window if chunk == "window" else None
    out = windowed_gate_average(*xs, window, feature_map, chunk_size=chunk_size)
    ref = windowed_gate_average_reference(*xs, window, feature_map)
    assert out.shape == ref.shape == dy.shape and out.dtype == torch.float64
    assert rel_err(out, ref) < 1e-12
    got = torch.autograd.grad(out, xs, dy)
    want = torch.autograd.grad(ref, xs, dy)
    for name, a, e in zip(("q_rot", "k_rot", "q_raw", "k_raw", "g"), got, want, strict=True):
        assert rel_err(a, e) < 1e-10, name


def test_uninitialised_memory_never_reaches_the_output(monkeypatch):
    # fla's rule: NaN-filled `new_empty` buffers show any element the op forgets to write.
    real = torch.Tensor.new_empty

    def nan_new_empty(self, *args, **kwargs):
        return real(self, *args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch.Tensor, "new_empty", nan_new_empty)
    xs, dy = make_inputs(130)
    for chunk_size in (None, 5, 7):  # 130 = 2 * 64 + 2, 26 * 5, 18 * 7 + 4
        out = windowed_gate_average(*xs, 5, chunk_size=chunk_size)
        assert rel_err(out, windowed_gate_average_reference(*xs, 5)) < 1e-12
        assert all(torch.isfinite(gr).all() for gr in torch.autograd.grad(out, xs, dy))


def phi_scalar(x: float, name: str) -> float:
    if name == "elu+1":
        return x + 1 if x > 0 else math.exp(x)
    return max(x, 0.0)


@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
def test_spec_formula_by_hand(feature_map):
    # One head, T = 9, W = 3: every weight from docs/design.md §2.3's two cases, one (t, s) at a time.
    (q_rot, k_rot, q_raw, k_raw, g), _ = make_inputs(9, width=5)
    q_rot, k_rot, q_raw, k_raw, g = (x[:1, :1].detach() for x in (q_rot, k_rot, q_raw, k_raw, g))
    window, d_h = 3, q_rot.shape[-1]
    rows = []
    for t in range(9):
        num, den = torch.zeros(5, dtype=torch.float64), 0.0
        for s in range(t + 1):
            if t - window < s:
                w = math.exp(float(q_rot[0, 0, t] @ k_rot[0, 0, s]) / math.sqrt(d_h))
            else:
                w = sum(
                    phi_scalar(float(q_raw[0, 0, t, i]), feature_map)
                    * phi_scalar(float(k_raw[0, 0, s, i]), feature_map)
                    for i in range(d_h)
                )
            num += w * g[0, 0, s]
            den += w
        rows.append(num / den)
    want = torch.stack(rows)[None, None]
    args = (q_rot, k_rot, q_raw, k_raw, g, window, feature_map)
    assert rel_err(windowed_gate_average_reference(*args), want) < 1e-12
    for chunk_size in (None, 3, 4):
        assert rel_err(windowed_gate_average(*args, chunk_size=chunk_size), want) < 1e-12


def test_windowed_mix_is_merge_times_u():
    (q_rot, k_rot, q_raw, k_raw, _), _ = make_inputs(63, width=4)
    b, h, t, d_h = q_rot.shape
    a, u = torch.randn(2, b, t, h * 4, dtype=torch.float64)
    g = torch.nn.functional.silu(a).view(b, t, h, 4).transpose(1, 2)
    for chunk_size in (None, 5):
        avg = windowed_gate_average_reference(q_rot, k_rot, q_raw, k_raw, g, 5)
        want = avg.transpose(1, 2).reshape(b, t, h * 4) * u
        for mix in (windowed_mix_reference, windowed_mix_fused, windowed_mix):
            got = mix(q_rot, k_rot, q_raw, k_raw, a, u, 5, chunk_size=chunk_size)
            assert got.shape == u.shape and rel_err(got, want) < 1e-12, mix.__name__


@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
@pytest.mark.parametrize(
    ("t", "window", "chunk_size"),
    [
        (1, 3, None),
        (7, 3, 3),
        (13, 3, 3),
        (30, 4, 5),
        (31, 4, 5),
        (64, 5, 7),
        (130, 64, None),
        (67, 200, None),
    ],
)
def test_fused_mix_matches_composition(feature_map, t, window, chunk_size):
    # Odd T, partial last chunks, 1 to 19 chunks (the prefix sums start at the third), W >= T.
    (q_rot, k_rot, q_raw, k_raw, _), _ = make_inputs(t, width=6, seed=t)
    b, h, _, _ = q_rot.shape
    gen = torch.Generator().manual_seed(t + 1)
    a, u, dy = (torch.randn(b, t, h * 6, generator=gen, dtype=torch.float64) for _ in range(3))
    a, u = a.requires_grad_(True), u.requires_grad_(True)
    xs = (q_rot, k_rot, q_raw, k_raw, a, u)
    ref = windowed_mix_reference(*xs, window, feature_map, chunk_size)
    got = windowed_mix_fused(*xs, window, feature_map, chunk_size)
    assert rel_err(got, ref) < 1e-12
    want = torch.autograd.grad(ref, xs, dy)
    have = torch.autograd.grad(got, xs, dy)
    for name, x, e in zip(("q_rot", "k_rot", "q_raw", "k_raw", "a", "u"), have, want, strict=True):
        assert rel_err(x, e) < 1e-10, name


def test_fused_mix_never_reads_uninitialised_memory(monkeypatch):
    # Every buffer the op allocates starts as NaN: a partial last chunk (31 = 6 * 5 + 1), the
    # chunk buffers' unused rows, the first chunk's missing previous chunk.
    (q_rot, k_rot, q_raw, k_raw, _), _ = make_inputs(31, width=6, seed=4)
    b, h, t, _ = q_rot.shape
    gen = torch.Generator().manual_seed(5)
    a, u, dy = (torch.randn(b, t, h * 6, generator=gen, dtype=torch.float64) for _ in range(3))
    xs = (q_rot, k_rot, q_raw, k_raw, a.requires_grad_(True), u.requires_grad_(True))
    ref = windowed_mix_reference(*xs, 4, "elu+1", 5)
    want = torch.autograd.grad(ref, xs, dy)
    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: real_empty_like(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda *a, **k: real_new_empty(*a, **k).fill_(float("nan")))
    got = windowed_mix_fused(*xs, 4, "elu+1", 5)
    assert rel_err(got, ref) < 1e-12
    for name, x, e in zip(
        ("q_rot", "k_rot", "q_raw", "k_raw", "a", "u"), torch.autograd.grad(got, xs, dy), want, strict=True
    ):
        assert rel_err(x, e) < 1e-10, name


def test_fused_mix_gradcheck():
    (q_rot, k_rot, q_raw, k_raw, _), _ = make_inputs(11, width=3, scale=0.7)
    b, h, t, _ = q_rot.shape
    a = torch.randn(b, t, h * 3, dtype=torch.float64, requires_grad=True)
    u = torch.randn(b, t, h * 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *x: windowed_mix_fused(*x, 2, "elu+1", 3), (q_rot, k_rot, q_raw, k_raw, a, u)
    )


def test_block_uses_the_fused_mix_on_cpu_fp32(monkeypatch):
    import tango_lm.ops.windowed_mix as ops

    calls = []
    monkeypatch.setattr(ops, "windowed_mix_fused", lambda *x: calls.append(1) or windowed_mix_reference(*x))
    block = WindowedTangoBlock(16, 2, 24, 1e-6, window=3)
    cos, sin = rope_tables(9, 8, 10000.0, torch.device("cpu"))
    block(torch.randn(2, 9, 16), (cos, sin))
    assert calls
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        block(torch.randn(2, 9, 16), (cos, sin))
    assert not calls  # low precision: the composition, in fp32 inside


# -- stability -----------------------------------------------------------------------------------


def test_large_scores_in_fp32_stay_finite_and_accurate():
    # Scores of standard deviation ~80 (|score| up to ~300): exp overflows fp32 without the
    # window's row maximum, and the feature-map weights are large too (|q_raw|, |k_raw| ~ 10).
    (q_rot, k_rot, q_raw, k_raw, g), dy = make_inputs(130, scale=9.0, seed=3)
    scores = q_rot @ k_rot.transpose(-1, -2) / math.sqrt(8)
    assert scores.std() > 60 and torch.isinf(scores.float().exp()).any()
    ref = windowed_gate_average_reference(q_rot, k_rot, q_raw, k_raw, g, 5)
    for chunk_size in (None, 5):
        xs32 = [x.detach().float().requires_grad_(True) for x in (q_rot, k_rot, q_raw, k_raw, g)]
        out = windowed_gate_average(*xs32, 5, chunk_size=chunk_size)
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        assert (out.double() - ref).abs().max() < 1e-4 * g.abs().max()
        assert all(torch.isfinite(gr).all() for gr in torch.autograd.grad(out, xs32, dy.float()))


def test_very_negative_window_scores_in_fp32():
    # Every exact score is -100: the feature-map sources dominate, and scaling them by
    # exp(-window max) = e^100 would overflow fp32; the stabiliser includes log of their total.
    (_, _, q_raw, k_raw, g), dy = make_inputs(63, seed=4)
    v = torch.full((8,), math.sqrt(100 * math.sqrt(8) / 8), dtype=torch.float64)
    q_rot = v.expand(2, 3, 63, 8).clone().requires_grad_(True)
    k_rot = (-v).expand(2, 3, 63, 8).clone().requires_grad_(True)
    ref = windowed_gate_average_reference(q_rot, k_rot, q_raw, k_raw, g, 5)
    xs32 = [x.detach().float().requires_grad_(True) for x in (q_rot, k_rot, q_raw, k_raw, g)]
    for chunk_size in (None, 5):
        out = windowed_gate_average(*xs32, 5, chunk_size=chunk_size)
        assert torch.isfinite(out).all() and (out.double() - ref).abs().max() < 1e-5 * g.abs().max()
        assert all(torch.isfinite(gr).all() for gr in torch.autograd.grad(out, xs32, dy.float()))


# -- the block -------------------------------------------------------------------------------------


def rope_naive(v: torch.Tensor, pos: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE of v [..., d_h] at position pos."""
    half = v.shape[-1] // 2
    angle = pos * theta ** (-2 * torch.arange(half, dtype=torch.float64) / v.shape[-1])
    v1, v2 = v[..., :half], v[..., half:]
    return torch.cat([v1 * angle.cos() - v2 * angle.sin(), v2 * angle.cos() + v1 * angle.sin()], dim=-1)


def naive_block(block: WindowedTangoBlock, x: torch.Tensor, n_heads: int, window: int) -> torch.Tensor:
    """docs/design.md §2.3 in the TANGO block of docs/design.md §2.2, from the block's weights only, one (t, s) at a time."""
    b, t_len, d = x.shape
    d_h = d // n_heads
    h = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * block.norm.weight
    q, k = h @ block.q_proj.weight.T, h @ block.k_proj.weight.T
    pre = h @ block.gate_proj.weight.T
    g, u = pre * torch.sigmoid(pre), h @ block.up_proj.weight.T
    f_h = g.shape[-1] // n_heads

    def phi(v):  # elu + 1
        return torch.where(v > 0, v + 1, torch.exp(v))

    outs = []
    for t in range(t_len):
        heads = []
        for hd in range(n_heads):
            qs, fs = slice(hd * d_h, (hd + 1) * d_h), slice(hd * f_h, (hd + 1) * f_h)
            num, den = 0, 0
            for s in range(t + 1):
                if t - window < s:  # exact, with RoPE at positions t and s
                    w = torch.exp((rope_naive(q[:, t, qs], t) * rope_naive(k[:, s, qs], s)).sum(-1) / math.sqrt(d_h))
                else:  # feature map of the un-rotated q and k
                    w = (phi(q[:, t, qs]) * phi(k[:, s, qs])).sum(-1)
                num, den = num + w[:, None] * g[:, s, fs], den + w[:, None]
            heads.append(num / den)
        outs.append(torch.cat(heads, -1) * u[:, t])
    return x + torch.stack(outs, 1) @ block.down_proj.weight.T


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_block_matches_naive_spec(chunk_size):
    d, n_heads, width, t, window = 16, 2, 12, 11, 3
    torch.manual_seed(0)
    block = WindowedTangoBlock(d, n_heads, width, 1e-6, window).double()
    block.chunk_size = chunk_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj"):
            getattr(block, name).weight.mul_(3.0)  # peaked exact weights
    x = torch.randn(2, t, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = block(x, rope_tables(t, d // n_heads, 10000.0, x.device, dtype=x.dtype))
    want = naive_block(block, x, n_heads, window)
    assert rel_err(out - x, want - x) < 2e-6  # the norm statistics run in fp32 (docs/design.md §1)


# -- the architecture ------------------------------------------------------------------------------


def tiny_config(arch: str, **kw) -> ModelConfig:
    return ModelConfig(arch=arch, d_model=32, head_dim=8, width=48, depth=3, vocab_size=61, context_length=48, **kw)


def tiny_pair(window: int):
    torch.manual_seed(0)
    tango = build_model(tiny_config("tango")).double().eval()
    windowed = build_model(tiny_config("tango-windowed", window=window)).double().eval()
    windowed.load_state_dict(tango.state_dict())
    return tango, windowed


@pytest.mark.parametrize("window", [37, 48])
def test_window_covering_the_sequence_is_tango(window):
    tango, windowed = tiny_pair(window)
    x = torch.randint(0, 61, (2, 37), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(windowed(x), tango(x), rtol=1e-10, atol=1e-10)


def test_short_window_is_not_tango():
    tango, windowed = tiny_pair(5)
    x = torch.randint(0, 61, (2, 37), generator=torch.Generator().manual_seed(1))
    full, win = tango(x), windowed(x)
    torch.testing.assert_close(win[:, :5], full[:, :5], rtol=1e-10, atol=1e-10)  # t < W: all exact
    assert (win[:, 5:] - full[:, 5:]).abs().max() > 1e-6


def test_parameters_are_tangos():
    cfg = tiny_config("tango-windowed", window=5)
    model = build_model(cfg)
    tango = build_model(tiny_config("tango"))
    assert cfg.num_params() == tiny_config("tango").num_params()
    assert cfg.num_params()["total"] == sum(p.numel() for p in model.parameters())
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in tango.state_dict().items()}


def test_feature_map_config():
    assert tiny_config("tango-windowed", feature_map="relu").feature_map == "relu"
    with pytest.raises(UserError, match="feature_map"):
        tiny_config("tango-windowed", feature_map="exp")
    with pytest.raises(UserError, match="window"):
        tiny_config("tango-windowed", window=0)


@pytest.mark.parametrize(("feature_map", "window"), [("elu+1", 5), ("relu", 5), ("elu+1", 1)])
def test_decoding_with_prefix_sums_reproduces_full_forward(feature_map, window):
    # chunk_size = max(W, 5) makes the full forward use the prefix sums at T = 37 (test_generate.py
    # covers the default chunking); the decode state must give the same log-probs.
    torch.manual_seed(0)
    model = build_model(tiny_config("tango-windowed", window=window, feature_map=feature_map)).double().eval()
    model.backbone.layers[0].chunk_size = max(window, 5)
    x = torch.randint(0, 61, (2, 37), generator=torch.Generator().manual_seed(1))
    full = model(x)
    cache = model.new_cache()
    pieces = [model(x[:, :12], cache)]  # a prefill longer than one chunk
    pieces += [model(x[:, i : i + 1], cache) for i in range(12, 30)]
    pieces.append(model(x[:, 30:], cache))
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-10)


def test_decode_state_does_not_grow_past_the_window():
    torch.manual_seed(0)
    model = build_model(tiny_config("tango-windowed", window=5)).eval()
    x = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(2))
    sizes = {}
    cache = model.new_cache()
    for t in range(40):
        model(x[:, t : t + 1], cache)
        sizes[t + 1] = cache.nbytes()
    assert sizes[20] == sizes[40] == sizes[5] > sizes[3]
    bulk = model.new_cache()
    model(x[:, :20], bulk)
    assert bulk.nbytes() == sizes[20]


def test_attention_flops():
    cfg = ModelConfig(arch="tango-windowed", d_model=32, head_dim=8, width=48, depth=1, window=2, vocab_size=61)
    # T = 4: exact sources 1, 2, 2, 2 (mean 7/4) at 2 (d + F) each; two of four destinations also
    # read and write the prefix state, 4 (d_h F + d) each.
    assert TangoWindowed.attention_flops_per_token(cfg, 4) == int(2 * 80 * 7 / 4 + 4 * (8 * 48 + 32) * 2 / 4)
    # W >= T: TANGO's count; W < T: bounded as T grows.
    for t in (1, 2, 37):
        wide = cfg.replace(window=64)
        assert TangoWindowed.attention_flops_per_token(wide, t) == Tango.attention_flops_per_token(wide, t)
    long = cfg.replace(window=64)
    assert TangoWindowed.attention_flops_per_token(long, 8192) < 1.01 * TangoWindowed.attention_flops_per_token(
        long, 4096
    )


def test_time_per_token_helper_runs():
    rows = windowed_time_per_token(
        seq_lens=(8, 16),
        window=4,
        d_model=32,
        width=64,
        head_dim=8,
        tokens=64,
        repeats=1,
        warmup=0,
        device="cpu",
    )
    assert [r["seq_len"] for r in rows] == [8, 16] and [r["batch"] for r in rows] == [8, 4]
    assert all(r["windowed_us_per_token"] > 0 and r["tango_us_per_token"] > 0 for r in rows)
    assert rows[0]["windowed_vs_first"] == 1.0


# -- rotating narrow-width training (docs/design.md §2.6) ----------------------------------------------------


def narrow_reference(block: WindowedTangoBlock, x: torch.Tensor, rope, cols: torch.Tensor) -> torch.Tensor:
    """Windowed TANGO with only the gate columns `cols` (of the full width), from the quadratic
    reference: W_g, W_u rows and W_o columns indexed directly, nothing from `ActiveColumns`."""
    h = block.norm(x)
    q_raw = split_heads(h @ block.q_proj.weight.T, block.n_heads)
    k_raw = split_heads(h @ block.k_proj.weight.T, block.n_heads)
    q, k = apply_rope(q_raw, *rope), apply_rope(k_raw, *rope)
    a = h @ block.gate_proj.weight[cols].T
    u = h @ block.up_proj.weight[cols].T
    g = split_heads(F.silu(a), block.n_heads)
    avg = windowed_gate_average_reference(q, k, q_raw, k_raw, g, block.window, block.feature_map)
    return x + (merge_heads(avg) * u) @ block.down_proj.weight[:, cols].T


@pytest.mark.usefixtures("one_thread")  # tiny tensors: threads only contend
@pytest.mark.parametrize("mix", ["fused", "composition"])
def test_rotating_segment_matches_reference_on_active_columns(monkeypatch, mix):
    # 3 heads of F/H = 13 columns, K = 5: segments [0,5) [5,10) [10,13) of each head; T = 37 with
    # W = 4 and chunks of 5 runs the band, the feature-map weights and the prefix sums.
    import tango_lm.layers.tango_windowed as layer

    monkeypatch.setattr(layer, "windowed_mix", windowed_mix_fused if mix == "fused" else windowed_mix_reference)
    d, heads, width, t, k = 24, 3, 39, 37, 5
    torch.manual_seed(0)
    block = WindowedTangoBlock(d, heads, width, 1e-6, window=4, active_width=k).double()
    block.chunk_size = 5
    x0 = torch.randn(2, t, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(2, t, d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    rope = rope_tables(t, d // heads, 10000.0, x0.device, dtype=x0.dtype)
    params = dict(block.named_parameters())
    for segment, (lo, hi) in enumerate([(0, 5), (5, 10), (10, 13)]):
        cols = torch.tensor([hd * 13 + c for hd in range(heads) for c in range(lo, hi)])
        outs, grads = [], []
        for run in ("block", "reference"):
            x = x0.clone().requires_grad_(True)
            block.active.select(segment)
            out = block(x, rope) if run == "block" else narrow_reference(block, x, rope, cols)
            outs.append(out)
            grads.append(torch.autograd.grad(out, [x, *params.values()], dy))
        assert rel_err(outs[0], outs[1]) < 1e-12, segment
        for name, got, want in zip(["x", *params], grads[0], grads[1], strict=True):
            assert rel_err(got, want) < 1e-10, (segment, name)
        inactive = torch.ones(width, dtype=torch.bool)
        inactive[cols] = False
        got = dict(zip(params, grads[0][1:], strict=True))
        assert not got["gate_proj.weight"][inactive].any() and not got["down_proj.weight"][:, inactive].any()
        assert got["up_proj.weight"][~inactive].abs().max() > 0
    block.active.select(None)


def test_rotating_flops_count_the_active_columns():
    cfg = ModelConfig(
        arch="tango-windowed", d_model=32, head_dim=8, width=48, depth=2, window=2, vocab_size=61, active_width=5
    )  # 4 heads of 12 columns: 3 segments, 48 / 3 = 16 columns a step
    narrow = cfg.replace(active_width=None, width=16)
    for t in (3, 37):
        assert TangoWindowed.attention_flops_per_token(cfg, t) == TangoWindowed.attention_flops_per_token(narrow, t)
    assert cfg.flops_per_token(37) < cfg.flops_per_token(37, full_width=True)
    assert cfg.flops_per_token(37, full_width=True) == cfg.replace(active_width=None).flops_per_token(37)
