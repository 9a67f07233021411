"""Analytic FLOPs per token (`models/flops.py`) against `torch.utils.flop_counter.FlopCounterMode`.

The analytic count is *model FLOPs*: 2 x the weights a token multiplies through (`matmul_params_per_token`
of the arch and the head) plus the token mixing the model needs (`attention_flops_per_token`), averaged
over a causal sequence (position t sees t + 1 sources: the causal half, no padding, no recomputation,
no algorithm-specific extra work). Training is 3 x the forward.

What FlopCounterMode counts, and how the tests make it comparable:

- It counts matmul-like ops (mm, addmm, bmm, baddbmm, convolution, some SDPA kernels) by their full
  shapes; elementwise work (norms, softmax, SiLU, broadcast products, sums) counts nothing. In-place
  `addmm_` / `baddbmm_` count nothing either (the registry keys the out-of-place packets only): the
  fused loss's backward and windowed TANGO's chunks use them, so `count` registers them.
- SDPA on a CPU: with equal q/k and v widths it dispatches `_scaled_dot_product_flash_attention_for_cpu`,
  which FlopCounterMode does not know, so it counts **0** for attention; with different widths
  (TANGO's gate average) it falls back to the math path and counts the **full T x T square** of its
  bmms, ignoring `is_causal`. The tests force one of two explicit paths:
  * the *reference* path: every causal mixing op is replaced by a loop over destinations of
    causal-masked matmuls (destination t multiplies against its t + 1 visible sources only), so
    FlopCounterMode counts exactly the causal model FLOPs; each reference is checked to give the
    same loss as the real op.
  * the *square* path (math SDPA backend, TANGO's fused op, GAU's relu^2 attention): counted
    mixing = the full square, and model FLOPs = square x (T + 1) / (2T) (the causal fraction of a
    T x T matrix, sum_t (t + 1) / T^2).
- Custom autograd Functions do not hide their matmuls: FlopCounterMode is a dispatch mode and sees
  the torch ops inside `forward` and `backward`. TANGO's fused CPU op (`ops/tango_mix.py`) counts
  the same square as the composition; the chunked fused loss (`ops/twin_loss.py`) counts the same
  forward at any `loss_chunk`, and a backward of 3 x its forward (it recomputes the logits).
- Ops FlopCounterMode cannot see at all: `torch.linalg.solve_triangular` (GDN's chunked UT
  transform), and the elementwise forms of onóna's token gate (`w . rmsnorm(x)`) and AttnRes's
  depth mix. The reference path writes the gate and the depth mix as matmuls, and GDN's delta rule
  as its recurrence with the rank-1 write as a matmul (6 d_k d_v per head and token), which is what
  the analytic count assumes.

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

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterator

import arch_cases
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import tango_lm.heads.mos
import tango_lm.layers.flash
import tango_lm.layers.gated_deltanet
import tango_lm.layers.gau
import tango_lm.layers.tango
import tango_lm.layers.tango_windowed
import tango_lm.ops.twin_loss
from tango_lm import ModelConfig
from tango_lm.heads.onona import TokenGate
from tango_lm.heads.registry import HEADS
from tango_lm.layers.attnres import AttnRes
from tango_lm.layers.flash import FlashLayer
from tango_lm.layers.moe import moe_layers
from tango_lm.layers.norm import rms_norm
from tango_lm.models.archs.tango_compact import controller_width
from tango_lm.models.flops import flops_per_token, forward_flops_per_token
from tango_lm.models.registry import ARCHITECTURES
from tango_lm.ops.delta_rule import delta_rule_recurrent
from tango_lm.ops.gate_average import merge_heads, split_heads
from tango_lm.ops.tango_mix import tango_mix_reference
from tango_lm.ops.twin_loss import mixture_nll_reference
from tango_lm.ops.windowed import FEATURE_MAPS

aten = torch.ops.aten
B = 2
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
    "gdn-hybrid": ({"arch": "gdn-hybrid", "depth": 3, "attention_every": 3, "gdn_head_dim": 8,
                    "gdn_expand_v": 2.0, "gdn_chunk": 4, "n_kv_heads": 2}, 6),  # GDN, GDN, attention
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
    "gdn-hybrid": 4 * 32 * 7 / 2 + 2 * 6 * 4 * 8 * 16,  # T = 6; 1 attention layer; 2 GDN layers of 4 heads, d_k 8, d_v 16
    "moe": 2 * 4 * 32 * 9 / 2,
    "attnres": 2 * 4 * 32 * 9 / 2 + 4 * 32 * (1 + 2 + 3 + 4 + 5),
    "attnres-block": 4 * 4 * 32 * 9 / 2 + 4 * 32 * (1 + 2 + 2 + 3 + 3 + 4 + 4 + 5 + 5),
}


# -- counting ------------------------------------------------------------------------------------
def _inplace_mm(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _inplace_bmm(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]


# FlopCounterMode keys formulas by op packet, and `addmm_` / `baddbmm_` are separate packets it
# does not know (it would count them as 0).
INPLACE = {aten.addmm_: _inplace_mm, aten.baddbmm_: _inplace_bmm}
WEIGHT_OPS = {"mm", "addmm", "addmm_", "convolution"}  # projections, heads, short convs
MIXING_OPS = {"bmm", "baddbmm", "baddbmm_"}  # token mixing (the reference path writes it as batched matmuls)
# The backward check compares matmuls only: FlopCounterMode's `convolution_backward` formula ignores
# `groups`, so it counts GDN's depthwise short convs' weight gradient C (channels) times too high.
MATMUL_OPS = WEIGHT_OPS - {"convolution"} | MIXING_OPS


@contextlib.contextmanager
def count(extra: dict | None = None) -> Iterator[Counter]:
    """FLOPs by op name (`mm`, `bmm`, ...) of everything run inside the block."""
    out: Counter = Counter()
    mode = FlopCounterMode(display=False, custom_mapping={**INPLACE, **(extra or {})})
    with mode:
        yield out
    for op, flops in mode.get_flop_counts()["Global"].items():
        out[op.__name__.split(".")[-1]] += flops


def matmuls(counts: Counter) -> int:
    return sum(counts[o] for o in MATMUL_OPS)


def split(counts: Counter) -> tuple[int, int]:
    unknown = set(counts) - WEIGHT_OPS - MIXING_OPS
    assert not unknown, f"unexpected counted ops {unknown}"
    return sum(counts[o] for o in WEIGHT_OPS), sum(counts[o] for o in MIXING_OPS)


def build(cfg: ModelConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return cfg.build().eval()


def batch(cfg: ModelConfig, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randint(0, cfg.vocab_size, (B, t), generator=gen),
            torch.randint(0, cfg.vocab_size, (B, t), generator=gen))


# -- the reference path: causal mixing as explicit per-destination matmuls -------------------------
def causal_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Causal softmax attention, destination by destination against its t + 1 sources."""
    assert is_causal and attn_mask is None and not enable_gqa and q.shape[-2] == k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rows = []
    for t in range(q.shape[-2]):
        scores = (q[..., t : t + 1, :] @ k[..., : t + 1, :].transpose(-1, -2)) * scale
        rows.append(scores.softmax(-1) @ v[..., : t + 1, :])
    return torch.cat(rows, dim=-2)


def causal_relu2(q, k, v, rel_bias, scale, group: int | None = None):
    """GAU's relu^2 attention (FLASH's quadratic part with `group`), destination by destination."""
    half = (rel_bias.shape[0] + 1) // 2
    rows = []
    for t in range(q.shape[-2]):
        lo = 0 if group is None else (t // group) * group
        offset = t - torch.arange(lo, t + 1)
        scores = (q[..., t : t + 1, :] @ k[..., lo : t + 1, :].transpose(-1, -2)) * scale + rel_bias[offset + half - 1]
        rows.append(F.relu(scores).square() @ v[..., lo : t + 1, :])
    return torch.cat(rows, dim=-2)


def flash_quadratic(self, q, k, v):
    return causal_relu2(q, k, v, self.rel_bias, self.quad_scale, self.group_size)


def flash_linear(q, k, v, group_size, scale=1.0):
    """FLASH's cross-group part as the model needs it: groups with a later group add K^T V to the
    running sum, groups after the first read it."""
    t, g = q.shape[-2], group_size
    groups = -(-t // g)
    total, out = None, []
    for c in range(groups):
        sl = slice(c * g, min((c + 1) * g, t))
        out.append(torch.zeros_like(v[..., sl, :]) if total is None else (q[..., sl, :] @ total) * scale)
        if c < groups - 1:
            kv = k[..., sl, :].transpose(-1, -2) @ v[..., sl, :]
            total = kv if total is None else total + kv
    return torch.cat(out, dim=-2)


def windowed_model(q, k, q_raw, k_raw, a, u, window, feature_map="elu+1", chunk_size=None):
    """Windowed TANGO destination by destination: exact weights over min(W, t + 1) sources, and the
    feature-map state S = sum phi(k_s) [g_s, 1]^T (numerator and normaliser), written once per
    source leaving the window, read once per destination with older sources."""
    phi = FEATURE_MAPS[feature_map]
    pq, pk = phi(q_raw), phi(k_raw)
    g = split_heads(F.silu(a), q.shape[1])
    g1 = torch.cat([g, torch.ones_like(g[..., :1])], dim=-1)
    w = g.shape[-1]
    state, rows = None, []
    for t in range(q.shape[-2]):
        if t >= window:
            s = t - window
            add = pk[..., s : s + 1, :].transpose(-1, -2) @ g1[..., s : s + 1, :]
            state = add if state is None else state + add
        lo = max(0, t - window + 1)
        e = ((q[..., t : t + 1, :] @ k[..., lo : t + 1, :].transpose(-1, -2)) / math.sqrt(q.shape[-1])).exp()
        num, den = e @ g[..., lo : t + 1, :], e.sum(-1, keepdim=True)
        if state is not None:
            old = pq[..., t : t + 1, :] @ state
            num, den = num + old[..., :w], den + old[..., w:]
        rows.append(num / den)
    return merge_heads(torch.cat(rows, dim=-2)) * u


def delta_rule_model(q, k, v, beta, g, state=None, chunk=64, backend="torch"):
    """The gated delta rule as its recurrence, M = a M + k (b (v - a k^T M))^T, o = q^T M, with
    the three d_k x d_v products as matmuls (6 d_k d_v per head and token)."""
    b, h, t, dk = k.shape
    m = state if state is not None else q.new_zeros(b, h, dk, v.shape[-1])
    alpha, beta = g.exp().to(q.dtype), beta.to(q.dtype)
    outs = []
    for i in range(t):
        k_i, a = k[:, :, i : i + 1], alpha[:, :, i, None, None]
        r = beta[:, :, i, None, None] * (v[:, :, i : i + 1] - a * (k_i @ m))
        m = a * m + k_i.transpose(-1, -2) @ r
        outs.append(q[:, :, i : i + 1] @ m)
    return torch.cat(outs, dim=2).to(v.dtype), m


def token_gate_matmul(self, x):
    """onóna's gate `w . rmsnorm(x)` as a matmul (2d per position, the head's `+ d`)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (rms_norm(xf, self.eps) @ self.weight.to(xf.dtype)[:, None]).squeeze(-1)


def attnres_matmul(self, values, normed):
    """AttnRes's depth mix with its two d-wide products per source as batched matmuls (4d)."""
    u = (self.query * self.norm.weight).to(normed[0].dtype)
    keys = torch.stack(normed, dim=-2)  # [B, T, n, d]
    logits = (keys @ u[:, None].expand(*keys.shape[:-2], u.shape[0], 1)).squeeze(-1)
    alpha = logits.softmax(-1).to(values[0].dtype)
    return (alpha.unsqueeze(-2) @ torch.stack(values, dim=-2)).squeeze(-2)


def plain_mixture_nll(hs, tables, targets, log_prior=None, *, components=None, sigsoftmax=False, chunk=0,
                      ignore_index=-100):
    return mixture_nll_reference(hs, tables, targets, log_prior, sigsoftmax, ignore_index, components)


def use_head_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The heads' gate as a matmul, and their loss through the plain (materialized) path."""
    monkeypatch.setattr(TokenGate, "forward", token_gate_matmul)
    monkeypatch.setattr(tango_lm.ops.twin_loss, "mixture_nll", plain_mixture_nll)
    monkeypatch.setattr(tango_lm.heads.mos, "mixture_nll", plain_mixture_nll)


def use_reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # tango_mix is imported by name into layers.tango (the three-set block reuses TangoBlock.mix), so
    # patching ops.tango_mix alone would not reach the blocks.
    monkeypatch.setattr(tango_lm.layers.tango, "tango_mix", tango_mix_reference)
    monkeypatch.setattr(F, "scaled_dot_product_attention", causal_sdpa)
    monkeypatch.setattr(tango_lm.layers.gau, "relu2_attention", causal_relu2)
    monkeypatch.setattr(FlashLayer, "quadratic", flash_quadratic)
    monkeypatch.setattr(tango_lm.layers.flash, "group_linear_attention", flash_linear)
    monkeypatch.setattr(tango_lm.layers.tango_windowed, "windowed_mix", windowed_model)
    monkeypatch.setattr(tango_lm.layers.gated_deltanet, "gated_delta_rule", delta_rule_model)
    monkeypatch.setattr(AttnRes, "forward", attnres_matmul)
    use_head_reference(monkeypatch)


def reference_counts(model, x, y, monkeypatch, patches=use_reference_path):
    """(forward counts, backward counts, reference loss, real loss) of model.nll(x, y)."""
    real = model.nll(x, y).detach()
    with monkeypatch.context() as patch:
        patches(patch)
        with count() as fwd:
            loss = model.nll(x, y)
        with count() as bwd:
            loss.backward()
    return fwd, bwd, loss.detach(), real


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
    assert weights == pytest.approx(segments * 2 * n * (arch.matmul_params_per_token(cfg)
                                                        + head.matmul_params_per_token(cfg)), rel=1e-12, abs=0)
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
    rotating = ModelConfig(arch="tango", d_model=512, n_heads=16, width=28480, depth=8, active_width=368,
                           vocab_size=50257, context_length=1024)
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


def test_cpu_flash_sdpa_is_invisible_to_flop_counter():
    """With q, k, v of one width, CPU SDPA runs a kernel FlopCounterMode has no formula for: its
    attention counts 0. Registering the square formula for it gives the math path's count."""
    cfg, t = config("dense")
    model = build(cfg)
    x, y = batch(cfg, t)
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]), count() as math_path:
        model.nll(x, y)
    with torch.no_grad(), count() as default:
        model.nll(x, y)
    weights, square = split(math_path)
    assert square == cfg.depth * B * t * t * 4 * cfg.n_heads * cfg.head_dim
    assert split(default) in ((weights, 0), (weights, square))  # 0 where the CPU flash kernel ran
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
    torch.testing.assert_close(delta_rule_model(q, k, v, beta.double(), g.double())[0],
                               delta_rule_recurrent(q, k, v, beta.double(), g.double())[0])


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
    nominal = 2 * B * t * (ARCHITECTURES["moe"].matmul_params_per_token(cfg) + HEADS[cfg.head].matmul_params_per_token(cfg))
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
