"""FlopCounterMode counts made comparable with the analytic model FLOPs (for tests/models/test_flops.py and
the generic FLOPs check there).

What FlopCounterMode counts, and how the tests make it comparable:

- It counts matmul-like ops (mm, addmm, bmm, baddbmm, convolution, some SDPA kernels) by their full
  shapes; elementwise work (norms, softmax, SiLU, broadcast products, sums) counts nothing. In-place
  `addmm_` / `baddbmm_` count nothing either (the registry keys the out-of-place packets only): the
  fused loss's backward and windowed TANGO's chunks use them, so `count` registers them.
- SDPA on a CPU: with equal q/k and v widths it dispatches `_scaled_dot_product_flash_attention_for_cpu`,
  which FlopCounterMode before torch 2.15 does not know, so it counts **0** for attention (2.15
  counts the full square, as the math path's bmms); with different widths
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
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import tango_lm.heads.mos
import tango_lm.layers.flash
import tango_lm.layers.gated_deltanet
import tango_lm.layers.gau
import tango_lm.layers.tango
import tango_lm.layers.tango_windowed
import tango_lm.ops.twin_loss
from tango_lm import ModelConfig
from tango_lm.heads.onona import TokenGate
from tango_lm.layers.attnres import AttnRes
from tango_lm.layers.flash import FlashLayer
from tango_lm.layers.norm import rms_norm
from tango_lm.ops.gate_average import merge_heads, split_heads
from tango_lm.ops.tango_mix import tango_mix_reference
from tango_lm.ops.twin_loss import mixture_nll_reference
from tango_lm.ops.windowed import FEATURE_MAPS

aten = torch.ops.aten
B = 2


# -- counting ------------------------------------------------------------------------------------
def _inplace_mm(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _inplace_bmm(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]


# FlopCounterMode keys formulas by op packet, and `addmm_` / `baddbmm_` are separate packets it
# does not know (it would count them as 0).
INPLACE = {aten.addmm_: _inplace_mm, aten.baddbmm_: _inplace_bmm}
WEIGHT_OPS = {"mm", "addmm", "addmm_", "convolution"}  # projections, heads, short convs
MIXING_MATMULS = {"bmm", "baddbmm", "baddbmm_"}  # token mixing (the reference path writes it as batched matmuls)
# CPU flash SDPA (q, k, v of one width), which torch 2.15's FlopCounterMode counts (the full square;
# earlier versions count 0 for it): token mixing too.
CPU_FLASH_SDPA = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}
MIXING_OPS = MIXING_MATMULS | CPU_FLASH_SDPA
# The backward check compares matmuls only: FlopCounterMode's `convolution_backward` formula ignores
# `groups`, so it counts GDN's depthwise short convs' weight gradient C (channels) times too high,
# and its flash attention backward counts the recomputed scores (2.5x the forward, not 2x).
MATMUL_OPS = WEIGHT_OPS - {"convolution"} | MIXING_MATMULS


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
    return (
        torch.randint(0, cfg.vocab_size, (B, t), generator=gen),
        torch.randint(0, cfg.vocab_size, (B, t), generator=gen),
    )


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


def plain_mixture_nll(
    hs, tables, targets, log_prior=None, *, components=None, sigsoftmax=False, chunk=0, ignore_index=-100
):
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
