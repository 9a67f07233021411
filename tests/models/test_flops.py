"""Analytic FLOPs per token (`models/flops.py`) against `torch.utils.flop_counter.FlopCounterMode`.

The analytic count is *model FLOPs*: 2 x the weights a token multiplies through (`matmul_params_per_token`
of the arch and the head) plus the token mixing the model needs (`attention_flops_per_token`), averaged
over a causal sequence (position t sees t + 1 sources: the causal half, no padding, no recomputation,
no algorithm-specific extra work). Training is 3 x the forward.

How FlopCounterMode's counts are made comparable (the reference path of causal mixing, in-place
matmuls, ops it cannot see) is in `flop_counting.py`.

Per-arch analytic mixing (the hand derivations are in `HAND_MIXING` below):

- tango / tango-3set: 2(d + F) per visible source (q.k over d_h in H heads, probs.gates over F);
  3-set applies one (W_g, W_u, W_o) set per application, so the same weights per token as TANGO.
- tango-compact: 2(d + r) per visible source (the average runs over the r controller channels);
  the r -> F expansion is a weight (r F) like the others.
- tango-windowed: 2(d + F) per exactly-scored source (min(W, t + 1) of them), plus the feature-map
  state: each source leaving the window is added to S = sum phi(k) [g, 1]^T (2 d_h (F/H + 1) per
  head) and each destination with older sources reads it with phi(q) (the same again).
- loop / untied transformer, dense, moe, attention layers of gdn-hybrid / attnres: 4 H d_h per
  visible source (q.k and probs.v). MoE: router d E plus k experts' 3 d F_e per token (nominal:
  capacity drops are not subtracted).
- gau: 2(s + e) per visible source. flash: 2(s + e) per visible source of the token's own group,
  plus 2se for each token that adds to the cross-group sum (every group but the last) and 2se for
  each that reads it (every group but the first).
- gdn-hybrid GDN layers: the recurrence, 6 d_k d_v per head (read k^T M, rank-1 write, read q^T M);
  the chunked form's intra-chunk work (4C d_k + 2C d_v per head and token, plus an uncounted
  triangular solve) is algorithm overhead and is not model FLOPs. Short convs count as weights.
- attnres: Dense plus 4d per source of each of the 2 depth + 1 depth mixes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import sdpa_flop_count

import tango_lm.heads.mos
import tango_lm.layers.flash
import tango_lm.layers.gated_deltanet
import tango_lm.layers.gau
import tango_lm.layers.tango
import tango_lm.layers.tango_windowed
import tango_lm.ops.twin_loss
from tango_lm import ModelConfig
from tango_lm.heads.registry import HEADS
from tango_lm.layers.moe import moe_layers
from tango_lm.models.archs.tango_compact import controller_width
from tango_lm.models.flops import flops_per_token, forward_flops_per_token
from tango_lm.models.registry import ARCHITECTURES
from tango_lm.ops.delta_rule import delta_rule_recurrent
from tango_lm.ops.tango_mix import tango_mix_reference
from tests import arch_cases
from tests.flop_counting import (
    B,
    batch,
    build,
    count,
    delta_rule_model,
    matmuls,
    reference_counts,
    split,
    use_head_reference,
)

aten = torch.ops.aten
BASE = {"d_model": 32, "head_dim": 8, "width": 64, "depth": 2, "vocab_size": 64, "context_length": 32}

# The hand derivations' configurations: case -> (config overrides, sequence length T). The generic
# tests below build every registered architecture from tests/arch_cases.py instead.
CASES: dict[str, tuple[dict, int]] = {
    "tango": ({}, 8),
    "tango-3set": ({"arch": "tango-3set", "depth": 3}, 8),
    "tango-compact": ({"arch": "tango-compact", "controller_width": 16}, 8),
    "tango-windowed": ({"arch": "tango-windowed", "window": 3}, 8),
    "loop-transformer": ({"arch": "loop-transformer", "depth": 3}, 8),
    "untied-transformer": ({"arch": "untied-transformer", "width": 48}, 8),
    "gau": ({"arch": "gau", "width": 48, "qk_dim": 8}, 8),
    "flash": ({"arch": "flash", "width": 48, "qk_dim": 8, "group_size": 4}, 10),  # groups 4, 4, 2
    "dense": ({"arch": "dense", "n_kv_heads": 2}, 8),
    "gdn-hybrid": (
        {
            "arch": "gdn-hybrid",
            "depth": 3,
            "attention_every": 3,
            "gdn_head_dim": 8,
            "gdn_expand_v": 2.0,
            "gdn_chunk": 4,
            "n_kv_heads": 2,
        },
        6,
    ),  # GDN, GDN, attention
    "moe": ({"arch": "moe", "n_experts": 4, "moe_top_k": 2, "capacity_factor_train": 2.0}, 8),  # E/k: no drops
    "attnres": ({"arch": "attnres", "n_kv_heads": 2}, 8),
    "attnres-block": ({"arch": "attnres", "depth": 4, "attnres_block": 1}, 8),
}


def config(case: str, **changes) -> tuple[ModelConfig, int]:
    overrides, t = CASES[case]
    return ModelConfig(**{**BASE, **overrides, **changes}), t


# -- hand derivations of the analytic mixing count, from the definitions, position by position ------
def _causal(t: int) -> float:
    """sum over destinations of visible sources, per token: (T + 1) / 2."""
    return sum(i + 1 for i in range(t)) / t


def _attention(cfg: ModelConfig, t: int) -> float:
    return 4 * cfg.n_heads * cfg.head_dim * _causal(t)


def _windowed(cfg: ModelConfig, t: int) -> float:
    d, f, w, dh = cfg.d_model, cfg.width, cfg.window, cfg.head_dim
    exact = sum(min(w, i + 1) for i in range(t)) * 2 * (d + f)
    state = 2 * dh * f + 2 * d  # per head 2 d_h (F/H + 1): phi(k) [g, 1]^T, or phi(q) against it
    reads = sum(1 for i in range(t) if i >= w)  # destinations with a source older than the window
    writes = sum(1 for s in range(t) if s + w <= t - 1)  # sources older than some destination's window
    return cfg.depth * (exact + (reads + writes) * state) / t


def _flash(cfg: ModelConfig, t: int) -> float:
    s, e, g = cfg.qk_dim, cfg.width, cfg.group_size
    last = (t - 1) // g
    quad = sum(i - (i // g) * g + 1 for i in range(t)) * 2 * (s + e)
    linear = sum(2 * s * e * ((i // g > 0) + (i // g < last)) for i in range(t))
    return cfg.depth * (quad + linear) / t


def _gdn(cfg: ModelConfig, t: int) -> float:
    heads, dk, dv = cfg.d_model // cfg.gdn_head_dim, cfg.gdn_head_dim, round(cfg.gdn_head_dim * cfg.gdn_expand_v)
    n_attn = cfg.depth // cfg.attention_every
    return n_attn * _attention(cfg, t) + (cfg.depth - n_attn) * 6 * heads * dk * dv


def _attnres(cfg: ModelConfig, t: int) -> float:
    # Simulate the sources: the embedding, then each sublayer output (full) or block sums of
    # 2 x attnres_block sublayer outputs plus the running partial sum (block).
    per_block = 2 * cfg.attnres_block if cfg.attnres_block else 1
    sources, completed, partial = [], 1, 0
    for _ in range(2 * cfg.depth + 1):
        sources.append(completed + (partial > 0))
        partial += 1
        if partial == per_block:
            completed, partial = completed + 1, 0
    return cfg.depth * _attention(cfg, t) + 4 * cfg.d_model * sum(sources)


HAND_MIXING: dict[str, Callable[[ModelConfig, int], float]] = {
    "tango": lambda c, t: c.depth * 2 * (c.d_model + c.width) * _causal(t),
    "tango-3set": lambda c, t: c.depth * 2 * (c.d_model + c.width) * _causal(t),
    "tango-compact": lambda c, t: c.depth * 2 * (c.d_model + controller_width(c)) * _causal(t),
    "tango-windowed": _windowed,
    "loop-transformer": lambda c, t: c.depth * _attention(c, t),
    "untied-transformer": lambda c, t: c.depth * _attention(c, t),
    "gau": lambda c, t: c.depth * 2 * (c.qk_dim + c.width) * _causal(t),
    "flash": _flash,
    "dense": lambda c, t: c.depth * _attention(c, t),
    "gdn-hybrid": _gdn,
    "moe": lambda c, t: c.depth * _attention(c, t),
    "attnres": _attnres,
    "attnres-block": _attnres,
}

# Literal hand counts for one case per arch (per token, forward mixing), arithmetic spelled out.
LITERAL_MIXING = {
    "tango": 2 * 2 * (32 + 64) * 9 / 2,  # depth 2, 2(d + F) per source, (T + 1)/2 = 4.5 sources (T = 8)
    "tango-3set": 3 * 2 * (32 + 64) * 9 / 2,
    "tango-compact": 2 * 2 * (32 + 16) * 9 / 2,  # r = 16
    # W = 3: exact (1 + 2 + 6 * 3)/8 sources; state: 5 reads (t >= 3) + 5 writes (s <= 4) of 2*8*64 + 2*32
    "tango-windowed": 2 * (2 * (32 + 64) * 21 / 8 + 10 * (2 * 8 * 64 + 2 * 32) / 8),
    "loop-transformer": 3 * 4 * 32 * 9 / 2,
    "untied-transformer": 2 * 4 * 32 * 9 / 2,
    "gau": 2 * 2 * (8 + 48) * 9 / 2,
    # T = 10 in groups 4, 4, 2: in-group sources (10 + 10 + 3)/10; 8 writes (groups 0, 1) + 6 reads (groups 1, 2)
    "flash": 2 * (2 * (8 + 48) * 23 / 10 + 2 * 8 * 48 * 14 / 10),
    "dense": 2 * 4 * 32 * 9 / 2,
    "gdn-hybrid": 4 * 32 * 7 / 2
    + 2 * 6 * 4 * 8 * 16,  # T = 6; 1 attention layer; 2 GDN layers of 4 heads, d_k 8, d_v 16
    "moe": 2 * 4 * 32 * 9 / 2,
    "attnres": 2 * 4 * 32 * 9 / 2 + 4 * 32 * (1 + 2 + 3 + 4 + 5),
    "attnres-block": 4 * 4 * 32 * 9 / 2 + 4 * 32 * (1 + 2 + 2 + 3 + 3 + 4 + 4 + 5 + 5),
}


# -- tests ---------------------------------------------------------------------------------------
@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """The models are tiny: intra-op threads only add overhead (ten times the run time on a busy
    two-core machine). The thread count is restored for the other test modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


GENERIC_T = 8  # tiny models: T spans two FLASH groups, two GDN chunks and windowed TANGO's window
GENERIC_VARIANTS = {"attnres-block": ("attnres", {"depth": 4, "attnres_block": 1})}
GENERIC_CASES = {**{arch: (arch, {}) for arch in arch_cases.names()}, **GENERIC_VARIANTS}


def generic_config(case: str) -> ModelConfig:
    arch, changes = GENERIC_CASES[case]
    return arch_cases.tiny_config(arch, **changes)


@pytest.mark.parametrize("case", sorted(GENERIC_CASES))
def test_training_flops_are_three_forwards(case):
    cfg = generic_config(case)
    t = GENERIC_T
    assert flops_per_token(cfg, t) == 3 * forward_flops_per_token(cfg, t) == cfg.flops_per_token(t)


@pytest.mark.parametrize("case", sorted(CASES))
def test_analytic_mixing_matches_hand_derivation(case):
    cfg, t = config(case)
    analytic = ARCHITECTURES[cfg.arch].attention_flops_per_token(cfg, t)
    hand = HAND_MIXING[case](cfg, t)
    assert hand == pytest.approx(LITERAL_MIXING[case])
    assert analytic == int(hand)  # the arch truncates per token; < 1 FLOP


def check_reference_count(cfg: ModelConfig, t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted on the causal reference path: weights exactly, mixing up to the per-token int()."""
    model = build(cfg)
    x, y = batch(cfg, t)
    fwd, bwd, loss, real = reference_counts(model, x, y, monkeypatch)
    torch.testing.assert_close(loss, real, rtol=1e-4, atol=1e-5)  # the reference computes the same model
    weights, mixing = split(fwd)
    arch, head = ARCHITECTURES[cfg.arch], HEADS[cfg.head]
    n = B * t
    assert weights == 2 * n * (arch.matmul_params_per_token(cfg) + head.matmul_params_per_token(cfg))
    assert 0 <= mixing - n * arch.attention_flops_per_token(cfg, t) < n
    assert 0 <= weights + mixing - n * forward_flops_per_token(cfg, t) < n
    # Backward of every matmul is two matmuls (dX and dW); only products with a constant (GDN's zero
    # initial state) have one. Loose check.
    assert 1.9 * matmuls(fwd) <= matmuls(bwd) <= 2.0 * matmuls(fwd)


@pytest.mark.parametrize("case", sorted(GENERIC_CASES))
def test_reference_count_equals_analytic(case, monkeypatch):
    check_reference_count(generic_config(case), GENERIC_T, monkeypatch)


# Rotating narrow-width training (docs/design.md §2.6): case -> K. With BASE's 4 heads of F/H = 16 (TANGO family)
# or the FFN / compact width as one part, the segments are: tango 5, 5, 5, 1 per head (mean 4);
# tango-3set 6, 6, 4; tango-compact and loop 24, 24, 16 of 64; untied 20, 20, 8 of 48 (mean 16).
ACTIVE_WIDTH = {"tango": 5, "tango-3set": 6, "tango-compact": 24, "loop-transformer": 24, "untied-transformer": 20}


@pytest.mark.parametrize("case", sorted(ACTIVE_WIDTH))
def test_active_width_count_equals_analytic(case, monkeypatch):
    """Each segment's step counted on the reference path (forward and backward); over one rotation
    they average to the analytic training count (weights exactly, mixing up to the per-token int()).
    All segments active (evaluation) count the full width, which `full_width=True` gives."""
    cfg, t = config(case, active_width=ACTIVE_WIDTH[case])
    model = build(cfg)
    x, y = batch(cfg, t)
    arch, head = ARCHITECTURES[cfg.arch], HEADS[cfg.head]
    n, segments = B * t, model.num_segments
    assert segments == 4 if case == "tango" else segments == 3
    weights = mixing = 0
    for segment in range(segments):
        model.set_active_segment(segment)
        fwd, bwd, loss, real = reference_counts(model, x, y, monkeypatch)
        torch.testing.assert_close(loss, real, rtol=1e-4, atol=1e-5)
        assert 1.9 * matmuls(fwd) <= matmuls(bwd) <= 2.0 * matmuls(fwd)  # the backward runs the same width
        weights, mixing = weights + split(fwd)[0], mixing + split(fwd)[1]
    assert weights == pytest.approx(
        segments * 2 * n * (arch.matmul_params_per_token(cfg) + head.matmul_params_per_token(cfg)), rel=1e-12, abs=0
    )
    assert 0 <= mixing - segments * n * arch.attention_flops_per_token(cfg, t) < segments * n
    assert 0 <= weights + mixing - segments * n * forward_flops_per_token(cfg, t) < 2 * segments * n
    assert flops_per_token(cfg, t) == 3 * forward_flops_per_token(cfg, t) == cfg.flops_per_token(t)

    plain = cfg.replace(active_width=None)
    model.set_active_segment(None)
    fwd, _, _, _ = reference_counts(model, x, y, monkeypatch)
    assert split(fwd)[0] == 2 * n * (arch.matmul_params_per_token(plain) + head.matmul_params_per_token(plain))
    assert 0 <= sum(split(fwd)) - n * forward_flops_per_token(cfg, t, full_width=True) < n
    assert cfg.flops_per_token(t, full_width=True) == plain.flops_per_token(t) > cfg.flops_per_token(t)


def test_active_width_counts_like_the_narrow_model():
    """With K dividing each part, a step runs exactly a model of width (parts x K): TANGO with K = 4
    of 16 columns per head counts as TANGO of width 16, Untied with K = 16 of 48 as Untied of width 16.
    The 70M depth-8 rotating presets train at about 1/5 of their full-width FLOPs in the gated width."""
    for case, k in (("tango", 4), ("untied-transformer", 16)):
        cfg, t = config(case, active_width=k)
        narrow, _ = config(case, width=16)
        assert cfg.flops_per_token(t) == narrow.flops_per_token(t) < cfg.flops_per_token(t, full_width=True)
    cfg, t = config("tango", active_width=5)  # segments 5, 5, 5, 1: mean 4 per head, as K = 4
    assert cfg.flops_per_token(t) == config("tango", width=16)[0].flops_per_token(t)
    # tango-70m-d8-rotating: F/H = 1780 in ceil(1780 / 368) = 5 segments, so 1780 / 5 = 356 per head.
    rotating = ModelConfig(
        arch="tango",
        d_model=512,
        n_heads=16,
        width=28480,
        depth=8,
        active_width=368,
        vocab_size=50257,
        context_length=1024,
    )
    d, f, pairs = 512, 16 * 356, (1024 + 1) / 2
    forward = 2 * (8 * (2 * d * d + 3 * d * f) + 50257 * d) + int(8 * 2 * (d + f) * pairs)
    assert rotating.flops_per_token(1024) == 3 * forward
    assert 3.5 < rotating.flops_per_token(1024, full_width=True) / rotating.flops_per_token(1024) < 4.5


# Square path: FlopCounterMode counts the full T x T of causal attention, i.e. counted mixing =
# applications x B x T^2 x (FLOPs per source and destination below).
SQUARE_WIDTH = {
    "tango": lambda c: 2 * (c.d_model + c.width),  # the fused CPU op: q k^T and probs @ gates
    "tango-3set": lambda c: 2 * (c.d_model + c.width),
    "tango-compact": lambda c: 2 * (c.d_model + controller_width(c)),  # math SDPA (v width r/H != d_h)
    "loop-transformer": lambda c: 4 * c.d_model,  # math SDPA
    "untied-transformer": lambda c: 4 * c.d_model,
    "gau": lambda c: 2 * (c.qk_dim + c.width),  # relu^2 attention on the full square
    "dense": lambda c: 4 * c.n_heads * c.head_dim,  # GQA: keys/values repeated to H heads
    "moe": lambda c: 4 * c.n_heads * c.head_dim,
}


@pytest.mark.parametrize("case", sorted(SQUARE_WIDTH))
def test_square_count_converts_to_causal(case):
    cfg, t = config(case)
    model = build(cfg)
    x, y = batch(cfg, t)
    with sdpa_kernel([SDPBackend.MATH]), torch.no_grad(), count() as fwd:
        model.nll(x, y)
    weights, square = split(fwd)
    assert square == cfg.depth * B * t * t * SQUARE_WIDTH[case](cfg)
    # causal model FLOPs = square x (T + 1) / (2T)
    causal = square * (t + 1) / (2 * t)
    assert causal == pytest.approx(B * t * ARCHITECTURES[cfg.arch].attention_flops_per_token(cfg, t), abs=B * t)
    if case.startswith("tango") and case != "tango-compact":  # the fused op counts what the composition counts
        with pytest.MonkeyPatch.context() as patch, torch.no_grad(), count() as ref:
            patch.setattr(tango_lm.layers.tango, "tango_mix", tango_mix_reference)
            model.nll(x, y)
        assert split(ref) == (weights, square)


def test_cpu_flash_sdpa_counts_nothing_or_the_square():
    """With q, k, v of one width, CPU SDPA runs a kernel FlopCounterMode had no formula for before
    torch 2.15: its attention counts 0 there, and 2.15 counts the math path's full square.
    Registering the square formula for it gives the math path's count under either."""
    cfg, t = config("dense")
    model = build(cfg)
    x, y = batch(cfg, t)
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]), count() as math_path:
        model.nll(x, y)
    with torch.no_grad(), count() as default:
        model.nll(x, y)
    weights, square = split(math_path)
    assert square == cfg.depth * B * t * t * 4 * cfg.n_heads * cfg.head_dim
    assert split(default) in ((weights, 0), (weights, square))  # 0 where the CPU flash kernel ran uncounted
    kernel = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if kernel is not None:
        formula = {kernel: lambda q, k, v, *args, out_shape=None, **kw: sdpa_flop_count(q, k, v)}
        with torch.no_grad(), count(formula) as registered:
            model.nll(x, y)
        assert registered["bmm"] + registered[kernel.__name__.split(".")[-1]] == square


def test_flash_chunked_count():
    """The chunked FLASH op counts padded groups, the first group's reads of a zero sum and the
    last group's unread write: more than the model FLOPs."""
    cfg, t = config("flash")
    model = build(cfg)
    x, y = batch(cfg, t)
    with torch.no_grad(), count() as fwd:
        model.nll(x, y)
    s, e, g = cfg.qk_dim, cfg.width, cfg.group_size
    groups = -(-t // g)
    per_layer = B * groups * g * (g * 2 * (s + e) + 4 * s * e)
    assert split(fwd)[1] == cfg.depth * per_layer
    assert ARCHITECTURES["flash"].attention_flops_per_token(cfg, t) == int(_flash(cfg, t))
    # T <= g: one group, no cross-group part at all.
    assert ARCHITECTURES["flash"].attention_flops_per_token(cfg, g) == cfg.depth * 2 * (s + e) * (g + 1) / 2


def test_gdn_chunked_count():
    """The chunked delta rule counts 4C d_k + 2C d_v + 6 d_k d_v per head and padded token (its
    triangular solve, about C (d_k + d_v) more, is invisible); the model needs the recurrence's 6 d_k d_v."""
    cfg, t = config("gdn-hybrid")
    model = build(cfg)
    x, y = batch(cfg, t)
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]), count() as fwd:
        model.nll(x, y)
    heads, dk, c = cfg.d_model // cfg.gdn_head_dim, cfg.gdn_head_dim, cfg.gdn_chunk
    dv = round(cfg.gdn_head_dim * cfg.gdn_expand_v)
    padded = -(-t // c) * c
    n_gdn = cfg.depth - cfg.depth // cfg.attention_every
    chunked = n_gdn * B * heads * padded * (4 * c * dk + 2 * c * dv + 6 * dk * dv)
    attention = (cfg.depth // cfg.attention_every) * B * t * t * 4 * cfg.n_heads * cfg.head_dim
    assert split(fwd)[1] == chunked + attention
    # The recurrence reference is the same function as the chunked form.
    q, k = (F.normalize(torch.randn(1, 2, 7, 4, dtype=torch.float64), dim=-1) for _ in range(2))
    v, beta, g = torch.randn(1, 2, 7, 6, dtype=torch.float64), torch.rand(1, 2, 7), -torch.rand(1, 2, 7)
    torch.testing.assert_close(
        delta_rule_model(q, k, v, beta.double(), g.double())[0],
        delta_rule_recurrent(q, k, v, beta.double(), g.double())[0],
    )


def test_windowed_chunked_count():
    """Windowed TANGO's chunks score a [C, 2C] band exactly and by feature map (both over every
    band pair); the fused mix multiplies each chunk's rows by the gates of its own chunk and the
    previous one, and from the third chunk on adds its predecessor-but-one to the prefix state and
    reads it. With C = W = 3, T = 8 that is more than the model FLOPs, which count each source once
    in a window and the state once per source and destination. (The analytic count is not changed
    here: it matches the model FLOPs.)"""
    cfg, t = config("tango-windowed")
    model = build(cfg)
    for layer in model.backbone.layers:
        layer.chunk_size = cfg.window
    x, y = batch(cfg, t)
    with torch.no_grad(), count() as fwd:
        model.nll(x, y)
    d, f, dh, c = cfg.d_model, cfg.width, cfg.head_dim, cfg.window
    n = -(-t // c)
    scores = n * B * 2 * 2 * c * 2 * c * d  # exact and feature-map scores over the band
    gates = 0
    for i in range(n):
        rows = min(c, t - i * c)
        gates += 2 * rows * rows * f + (2 * rows * c * f if i >= 1 else 0)  # own chunk, previous chunk
        gates += (2 * c * dh * f + 2 * rows * dh * f) if i >= 2 else 0  # prefix state: add, read
    assert split(fwd)[1] == cfg.depth * (scores + B * gates)
    assert split(fwd)[1] > B * t * ARCHITECTURES["tango-windowed"].attention_flops_per_token(cfg, t)


def test_moe_counts_only_routed_experts():
    """Each token runs k experts: with capacity E/k nothing is dropped and the count is exact
    (test_reference_count_equals_analytic); with a small capacity the dropped assignments' expert
    FLOPs are missing from the count, while the analytic count stays nominal."""
    cfg, t = config("moe", capacity_factor_train=0.5)
    model = build(cfg)
    x, y = batch(cfg, t)
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]), count() as fwd:
        model.nll(x, y)
    weights = split(fwd)[0]
    nominal = (
        2 * B * t * (ARCHITECTURES["moe"].matmul_params_per_token(cfg) + HEADS[cfg.head].matmul_params_per_token(cfg))
    )
    dropped = sum(round(m.last_dropped * B * t * cfg.moe_top_k) for m in moe_layers(model))
    assert dropped > 0
    assert weights == nominal - dropped * 2 * 3 * cfg.d_model * (cfg.width // cfg.moe_top_k)


# Every head on TANGO, and the twin and the mixture heads on Dense too.
HEAD_CASES = [(head, "tango") for head in sorted(HEADS)] + [("onona", "dense"), ("mos", "dense")]


@pytest.mark.parametrize(("head", "arch_case"), HEAD_CASES)
def test_head_counts(head, arch_case, monkeypatch):
    """Every head's matmul weights (one body application; the body keeps its own mixing op): on the
    head reference path (gate as a matmul, plain loss) exactly, through the log-probs path, and
    through the chunked fused loss (the same forward; a backward of 3x its vocabulary matmuls)."""
    cfg, t = config(arch_case, head=head, depth=1)
    model = build(cfg)
    x, y = batch(cfg, t)
    n = B * t
    fwd, bwd, loss, real = reference_counts(model, x, y, monkeypatch, use_head_reference)
    torch.testing.assert_close(loss, real, rtol=1e-4, atol=1e-5)
    weights, _ = split(fwd)
    head_flops = 2 * n * HEADS[head].matmul_params_per_token(cfg)
    body_flops = 2 * n * ARCHITECTURES[cfg.arch].matmul_params_per_token(cfg)
    assert weights == body_flops + head_flops
    assert 1.9 * matmuls(fwd) <= matmuls(bwd) <= 2.0 * matmuls(fwd)
    # The real paths hide only the gate's 2d per position (elementwise there) from FlopCounterMode.
    gate = 2 * n * cfg.d_model if HEADS[head].extra_params(cfg) == cfg.d_model else 0
    with torch.no_grad(), count() as log_probs:
        model(x)
    assert split(log_probs)[0] == weights - gate
    model.head.loss_chunk = 5  # several chunks and a partial last one: the same forward count
    with count() as f_fwd:
        loss = model.nll(x, y)
    with count() as f_bwd:
        loss.backward()
    assert split(f_fwd)[0] == weights - gate
    # The fused loss recomputes its logits: 3 vocabulary matmuls in the backward per forward one
    # (its weight gradient is an in-place addmm_, which `count` registers).
    vocab = 2 * n * cfg.vocab_size * cfg.d_model * HEADS[head].vocab_projections
    assert split(f_bwd)[0] == 2 * (split(f_fwd)[0] - vocab) + 3 * vocab
