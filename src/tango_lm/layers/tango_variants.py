"""Two TANGO variants that change which weights make the gates (docs/design.md §2.4, §2.5).

**Three gated-projection sets** (`ThreeSetTangoBlock`, docs/design.md §2.4). One looped block whose norm and
`W_q`, `W_k` are shared by every application, with three sets `(W_g, W_u, W_o)` of width F: set 1
in the first application, set 3 in the last, set 2 in every middle one (so depth >= 3). Each
application is the TANGO block of docs/design.md §2.2 with its set's projections. Parameters
`2d^2 + 9dF + d` (plus the model's final norm). State-dict names: `sets.{0,1,2}.gate_proj` etc.

**Compact-controller TANGO** (`CompactTangoBlock`, docs/design.md §2.5). The paper's text for this variant is
not available; this is *the project's reading*, as docs/design.md §2.5 lays it down:

```
c_s      = silu(h_s W_c)                      # controller_proj: d -> r (default r = d), H heads of r/H
cbar^h_t = sum_{s<=t} a^h[t,s] c^h_s          # TANGO's attention (q, k with RoPE) averages c per head
gbar_t   = cbar_t W_e                         # expand_proj: r -> F, linear, reads every head
x_t     += W_o (gbar_t * u_t),  u = h W_u     # up_proj, down_proj as in TANGO
```

The average runs over r channels instead of F, so it costs O(T^2 r) rather than O(T^2 F), and
decoding caches r gate channels per position instead of F. By linearity
`gbar_t = sum_h sum_{s<=t} a^h[t,s] (c^h_s W_e^h)` (W_e^h: the rows of W_e that read head h). With
one head, or a W_e that maps each head's r/H controller channels only into that head's F/H gate
columns, this is exactly TANGO with the gate `silu(h W_c) W_e` in place of `silu(h W_g)`; with
several heads and a full W_e each gate column is a sum of the heads' averages. The expansion is
a full `r x F` matrix because docs/design.md §2.5 counts `rF` parameters for it. Parameters
`2d^2 + dr + rF + 2dF + d` (plus the final norm). `r` must be a multiple of H; F need not be.

Rotating narrow-width training (docs/design.md §2.6, `layers/active_width.py`): the three-set block narrows
every set the same way TANGO does (K columns of each head's F/H); the compact block narrows its
F columns as one part (like a Transformer++ FFN: its F columns belong to no head), i.e. the rows
of `expand_proj` and `up_proj` and the columns of `down_proj`; the controller and its O(T^2 r)
average always run in full.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tango_lm.layers.active_width import ActiveColumns
from tango_lm.layers.gated_projections import add_gated_projections, gated_weights
from tango_lm.layers.tango import TangoBlockBase, cache_and_attend, prefill_through_door
from tango_lm.ops.gate_average import merge_heads, split_heads
from tango_lm.ops.tango_mix import tango_mix
from tango_lm.serve.cache import LayerState


# -- three gated-projection sets (docs/design.md §2.4) -------------------------------------------------------
class GatedProjections(nn.Module):
    """One set (W_g, W_u, W_o) of width F: `gate_proj`, `up_proj`, `down_proj`."""

    def __init__(self, d_model: int, n_heads: int, width: int, active_width: int | None = None) -> None:
        super().__init__()
        add_gated_projections(self, d_model, n_heads, width, active_width)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W_g, W_u, W_o (narrowed to the active segment under rotating narrow-width training)."""
        return gated_weights(self)


def set_for_application(application: int, depth: int) -> int:
    """0-based set of an application: the first uses set 0, the last set 2, the middle ones set 1."""
    if application == 0:
        return 0
    return 2 if application == depth - 1 else 1


class ThreeSetTangoBlock(TangoBlockBase):
    """TANGO with three gated-projection sets. Parameters: 2d^2 + 9dF + d."""

    def __init__(
        self, d_model: int, n_heads: int, width: int, depth: int, eps: float, active_width: int | None = None
    ) -> None:
        super().__init__(d_model, n_heads, eps)
        if depth < 3:
            raise ValueError(f"a three-set TANGO block needs depth >= 3, got {depth}")
        self.depth = depth
        self.sets = nn.ModuleList(GatedProjections(d_model, n_heads, width, active_width) for _ in range(3))

    # Each application mixes exactly as TANGO does: only its set's projections differ.
    def gate_inputs(self, h: torch.Tensor, application: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w_g, w_u, w_o = self.sets[set_for_application(application, self.depth)].weights()
        return F.linear(h, w_g), F.linear(h, w_u), w_o


# -- compact controller (docs/design.md §2.5) ----------------------------------------------------------------
class CompactTangoBlock(TangoBlockBase):
    """Compact-controller TANGO (the project's reading, see the module docstring).
    Parameters: 2d^2 + dr + rF + 2dF + d."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        width: int,
        controller_width: int,
        eps: float,
        active_width: int | None = None,
    ) -> None:
        super().__init__(d_model, n_heads, eps)
        if controller_width % n_heads:
            raise ValueError(f"controller width {controller_width} is not a multiple of {n_heads} heads")
        self.controller_proj = nn.Linear(d_model, controller_width, bias=False)  # W_c: d -> r
        self.expand_proj = nn.Linear(controller_width, width, bias=False)  # W_e: r -> F
        self.up_proj = nn.Linear(d_model, width, bias=False)  # W_u
        self.down_proj = nn.Linear(width, d_model, bias=False)  # W_o
        self.active = (
            None
            if active_width is None
            else ActiveColumns(width, 1, active_width, rows=(self.expand_proj, self.up_proj), cols=(self.down_proj,))
        )

    def gated_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W_e, W_u, W_o (narrowed to the active segment's F columns under rotating narrow width)."""
        if self.active is None:
            return self.expand_proj.weight, self.up_proj.weight, self.down_proj.weight
        w_e, w_u, w_o = self.active.weights()
        return w_e, w_u, w_o

    def mix(self, q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """`gbar * u` with a the controller pre-activation [B, T, r] and u [B, T, F]:
        average c = silu(a) per head (O(T^2 r)), then expand r -> F."""
        cbar = tango_mix(q, k, a, None)  # the average alone, through the same door as TANGO's
        return F.linear(cbar, self.gated_weights()[0]) * u

    def mix_cached(
        self, q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, u: torch.Tensor, state: LayerState
    ) -> torch.Tensor:
        """Decoding: the cache holds keys and the r controller channels, not F gate columns; a plain
        prefill runs `mix` (`prefill_through_door`)."""
        c = split_heads(F.silu(a), self.n_heads)
        if prefill_through_door(q, state):
            cache_and_attend(q, k, c, state, "c", attend=False)
            return self.mix(q, k, a, u)
        cbar = merge_heads(cache_and_attend(q, k, c, state, "c"))
        return F.linear(cbar, self.gated_weights()[0]) * u

    def gate_inputs(self, h: torch.Tensor, application: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """a is the controller pre-activation [B, T, r]; `mix` expands its average to F."""
        _, w_u, w_o = self.gated_weights()
        return self.controller_proj(h), F.linear(h, w_u), w_o
