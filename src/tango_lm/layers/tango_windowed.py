"""The windowed TANGO block (docs/design.md §2.3): TANGO's parameters, a window of exact scores, a feature
map beyond it.

Only the token mixing differs from `TangoBlock`: the weights of sources in the last `window`
positions are TANGO's unnormalised `exp(q.k / sqrt(d_h))` (q, k with RoPE), older sources weigh
`phi(q_raw) . phi(k_raw)` with phi applied to the un-rotated q and k, and the gates are averaged
with those weights (`ops/windowed.py`). `forward` therefore hands `mix` both the rotated and the
un-rotated q and k.

Rotating narrow-width training (docs/design.md §2.6, `layers/active_width.py`) works as in `TangoBlock`: the
block computes with W_g, W_u, W_o narrowed to the active segment, K of each head's F/H columns, so
the gates and `u` hand the mixing op H heads of K columns; the scores (q, k) do not depend on the
gates, so each active column is averaged exactly as in the full model.

Decode state per application (`LayerState.extra`, constant size once W - 1 positions are seen):
the last W - 1 rotated keys, their phi(k_raw) and their gates, and the prefix sums
S = sum phi(k_s) g_s^T [B, H, d_h, F/H] and z = sum phi(k_s) [B, H, d_h] of every older source.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tango_lm.layers.rope import apply_rope
from tango_lm.layers.tango import TangoBlock, prefill_through_door
from tango_lm.ops.gate_average import merge_heads, split_heads
from tango_lm.ops.windowed import (
    MIN_CHUNK,
    _normalized_weights,
    apply_feature_map,
    compute_dtype,
    windowed_gate_average_cached,
)
from tango_lm.ops.windowed_mix import windowed_mix
from tango_lm.serve.cache import LayerState


class WindowedTangoBlock(TangoBlock):
    """Windowed TANGO; the same parameters as `TangoBlock` (2d^2 + 3dF + d)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        width: int,
        eps: float,
        window: int = 64,
        feature_map: str = "elu+1",
        active_width: int | None = None,
    ) -> None:
        super().__init__(d_model, n_heads, width, eps, active_width)
        self.window = window
        self.feature_map = feature_map
        self.chunk_size: int | None = None  # None: max(W, MIN_CHUNK); tests shrink it to exercise the prefix path

    def mix(  # type: ignore[override]
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        a: torch.Tensor,
        u: torch.Tensor,
        q_raw: torch.Tensor,
        k_raw: torch.Tensor,
    ) -> torch.Tensor:
        """`gbar * u` from rotated q, k and un-rotated q_raw, k_raw [B, H, T, d_h], a and u [B, T, F]."""
        return windowed_mix(q, k, q_raw, k_raw, a, u, self.window, self.feature_map, self.chunk_size)

    def mix_cached(  # type: ignore[override]
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        a: torch.Tensor,
        u: torch.Tensor,
        state: LayerState,
        q_raw: torch.Tensor,
        k_raw: torch.Tensor,
    ) -> torch.Tensor:
        """Decoding: the new positions, in pieces of at most one chunk, against the state; a plain
        prefill runs `mix` (`prefill_through_door`) and then sums up its older sources."""
        if state.position is not None:
            return self.mix_static(q, k, a, u, state, q_raw, k_raw)
        g = split_heads(F.silu(a), self.n_heads)
        k_phi = apply_feature_map(k_raw, self.feature_map)
        if prefill_through_door(q, state):
            self._store_prefill(state, q, k, k_phi, g)
            return self.mix(q, k, a, u, q_raw, k_raw)
        ex = state.extra
        if "s" not in ex:
            _start_state(ex, q, k, k_phi, g)
        piece = self.chunk_size or max(self.window, MIN_CHUNK)
        outs = []
        for start in range(0, q.shape[-2], piece):
            sl = slice(start, start + piece)
            k_loc = torch.cat([ex["k"], k[..., sl, :]], dim=-2)
            phi_loc = torch.cat([ex["k_phi"], k_phi[..., sl, :]], dim=-2)
            g_loc = torch.cat([ex["g"], g[..., sl, :]], dim=-2)
            outs.append(
                windowed_gate_average_cached(
                    q[..., sl, :],
                    q_raw[..., sl, :],
                    k_loc,
                    phi_loc,
                    g_loc,
                    ex["s"],
                    ex["z"],
                    self.window,
                    self.feature_map,
                )
            )
            _fold_older(ex, k_loc, phi_loc, g_loc, self.window - 1)
        return merge_heads(torch.cat(outs, dim=-2)) * u

    def _store_prefill(
        self, state: LayerState, q: torch.Tensor, k: torch.Tensor, k_phi: torch.Tensor, g: torch.Tensor
    ) -> None:
        """The state after a prefill of these T positions: what the piecewise path leaves."""
        _start_state(state.extra, q, k[..., :0, :], k_phi[..., :0, :], g[..., :0, :])
        _fold_older(state.extra, k, k_phi, g, self.window - 1)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        application: int = 0,
        state: LayerState | None = None,
    ) -> torch.Tensor:
        cos, sin = rope
        h = self.norm(x)
        q_raw, k_raw = self.raw_queries_keys(h)  # the feature map reads them before RoPE
        q, k = apply_rope(q_raw, cos, sin), apply_rope(k_raw, cos, sin)
        a, u, w_o = self.gate_inputs(h, application)
        if state is None:
            mixed = self.mix(q, k, a, u, q_raw, k_raw)
        else:
            mixed = self.mix_cached(q, k, a, u, state, q_raw, k_raw)
        return x + F.linear(mixed, w_o)

    # -- static decode steps (serve/static_decode.py) ---------------------------------------------
    def enter_static(self, state: LayerState, position: int) -> None:
        """The eager state after `position` prefilled positions as fixed-size tensors: a ring of R
        slots (slot = position mod R) for the window's rotated keys, phi(k) and gates (the eager
        state holds the last min(position, W - 1) of them), and the prefix sums s, z."""
        ex, static, w = state.extra, state.static, self._ring_slots(state)
        k, k_phi, g, s, z = (ex.pop(name) for name in ("k", "k_phi", "g", "s", "z"))
        slots = torch.arange(position - k.shape[-2], position, device=k.device) % w
        for name, x in (("ring_k", k), ("ring_phi", k_phi), ("ring_g", g)):
            kept = static.get(name)
            shape = (*x.shape[:-2], w, x.shape[-1])
            if kept is None or tuple(kept.shape) != shape or kept.dtype != x.dtype or kept.device != x.device:
                static[name] = kept = x.new_zeros(shape)
            kept.zero_().index_copy_(kept.dim() - 2, slots, x)
        for name, x in (("s", s), ("z", z)):
            kept = static.get(name)
            if kept is None or kept.shape != x.shape or kept.dtype != x.dtype or kept.device != x.device:
                static[name] = x.clone()
            else:
                kept.copy_(x)

    def _ring_slots(self, state: LayerState) -> int:
        """R = min(W, the cache's capacity): a window past the context (a large W meaning "no
        window") sized the ring by W, 4.4 GB and 4.6 s for 5 tokens of a 13k-parameter model at
        W = 4,000,000; no position past the capacity exists to fill more slots."""
        return min(self.window, state.capacity)

    def mix_static(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        a: torch.Tensor,
        u: torch.Tensor,
        state: LayerState,
        q_raw: torch.Tensor,
        k_raw: torch.Tensor,
    ) -> torch.Tensor:
        """One destination at `state.position` against the ring and the prefix sums, in place."""
        static, w = state.static, self._ring_slots(state)
        p = state.position
        g = split_heads(F.silu(a), self.n_heads)
        slot = p % w
        for name, x in (("ring_k", k), ("ring_phi", apply_feature_map(k_raw, self.feature_map)), ("ring_g", g)):
            static[name].index_copy_(static[name].dim() - 2, slot, x)
        dist = (p - torch.arange(w, device=p.device)) % w  # how far back each slot's position lies
        in_window = (dist <= p)[None, :]  # [1, W]: slots before position 0 hold nothing yet
        dtype = compute_dtype(q, k, g, static["s"])
        with torch.autocast(g.device.type, enabled=False):
            qr, kr, gf = (x.to(dtype) for x in (q, static["ring_k"], static["ring_g"]))
            pq = apply_feature_map(q_raw.to(dtype), self.feature_map)
            scores = (qr @ kr.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            no_old = torch.zeros_like(scores, dtype=torch.bool)
            prefix_den = (pq * static["z"].to(dtype).unsqueeze(-2)).sum(-1)
            weights, prefix_scale = _normalized_weights(scores, in_window, scores, no_old, prefix_den)
            out = weights @ gf + (pq * prefix_scale.unsqueeze(-1)) @ static["s"].to(dtype)
            # The oldest source (position p - W + 1) leaves the window of every later destination
            # (never, with a ring of the cache's capacity: its positions all lie in the window).
            leaving = (p + 1) % w
            valid = (p - self.window + 1 >= 0).to(dtype)
            phi_out = static["ring_phi"].index_select(-2, leaving).to(dtype) * valid
            g_out = static["ring_g"].index_select(-2, leaving).to(dtype)
            static["s"].add_((phi_out.transpose(-1, -2) @ g_out).to(static["s"].dtype))
            static["z"].add_(phi_out.sum(-2).to(static["z"].dtype))
        return merge_heads(out.to(g.dtype)) * u


def _start_state(ex: dict, q: torch.Tensor, k: torch.Tensor, k_phi: torch.Tensor, g: torch.Tensor) -> None:
    """An empty decode state: no window sources yet, zero prefix sums in the compute dtype."""
    b, h, _, d_h = k.shape
    acc = compute_dtype(q, k, g)
    ex["k"], ex["k_phi"], ex["g"] = k[..., :0, :], k_phi[..., :0, :], g[..., :0, :]
    ex["s"] = torch.zeros(b, h, d_h, g.shape[-1], dtype=acc, device=g.device)
    ex["z"] = torch.zeros(b, h, d_h, dtype=acc, device=g.device)


def _fold_older(ex: dict, k: torch.Tensor, k_phi: torch.Tensor, g: torch.Tensor, keep: int) -> None:
    """Keep the last `keep` (W - 1) sources of k, phi(k) and g in the state; the older ones have left
    the window of every later destination, so they are added to the prefix sums s and z."""
    drop = max(k.shape[-2] - keep, 0)
    if drop:
        phi_out = k_phi[..., :drop, :].to(ex["s"].dtype)
        ex["s"] = ex["s"] + phi_out.transpose(-1, -2) @ g[..., :drop, :].to(ex["s"].dtype)
        ex["z"] = ex["z"] + phi_out.sum(-2)
    # Copies, so the state does not pin the whole concatenation in memory.
    ex["k"], ex["k_phi"], ex["g"] = (x[..., drop:, :].contiguous() for x in (k, k_phi, g))
