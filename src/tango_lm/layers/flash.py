"""FLASH (Hua et al. 2022, "Transformer Quality in Linear Time"; docs/design.md §2.7): GAU with mixed-chunk
attention, linear in the sequence length.

The projections are GAU's, with four offset-scales of the base Z (quad_q, quad_k, lin_q, lin_k),
all rotated by RoPE. Positions are cut into groups of g aligned to position 0, and

    quad_t = sum_{j in t's group, j <= t} relu(quad_q_t . quad_k_j / g + b[t - j])^2 V_j
    lin_t  = sum_{j in earlier groups} (lin_q_t . lin_k_j) V_j / n
    x     += (U * (quad + lin)) W_o + b_o

with `b` a relative bias over 2g - 1 offsets and `n` the context length. The paper's pseudocode
divides the per-group `lin_k^T V` by n (its sequence length) before the exclusive cumulative sum;
the project uses the model's context length for n, as GAU does, so a position's output does not
depend on the batch's length and cached decoding reproduces the full forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tango_lm.layers.gau import GatedUnit
from tango_lm.ops.flash_linear import group_linear_attention
from tango_lm.ops.relu2_attention import relu2_attention
from tango_lm.serve.cache import LayerState


class FlashLayer(GatedUnit):
    """One FLASH layer. Parameters: 3de + 2e + ds + s + 8s + d + d + (2g - 1) (+ d with a LayerNorm).

    Decoding keeps, per layer, the current (incomplete) group's quad keys, values and lin keys and
    the running `sum lin_k^T V` over completed groups: memory O(g (s + e) + s e), not O(T)."""

    def __init__(
        self,
        d_model: int,
        width: int,
        qk_dim: int,
        group_size: int,
        context_length: int,
        eps: float = 1e-6,
        init_std: float = 0.02,
        norm: str = "rmsnorm",
    ) -> None:
        super().__init__(d_model, width, qk_dim, 4, group_size, eps, init_std, norm)
        self.group_size = group_size
        self.quad_scale = 1.0 / group_size
        self.lin_scale = 1.0 / context_length

    def quadratic(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal relu^2 attention inside each group: q, k [B, T, s], v [B, T, e] -> [B, T, e]."""
        t, g = q.shape[-2], self.group_size
        if t <= g:  # a single group
            return relu2_attention(q, k, v, self.rel_bias, self.quad_scale)
        pad = -t % g  # zero-pad a last partial group; its padding sits after every real position
        if pad:
            q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        q, k, v = (x.unflatten(-2, (-1, g)) for x in (q, k, v))  # [B, G, g, w]
        return relu2_attention(q, k, v, self.rel_bias, self.quad_scale).flatten(-3, -2)[..., :t, :]

    def mix(self, base: torch.Tensor, v: torch.Tensor, state: LayerState | None) -> torch.Tensor:
        quad_q, quad_k, lin_q, lin_k = base.unbind(1)
        if state is not None:
            return self.mix_cached(quad_q, quad_k, lin_q, lin_k, v, state)
        quad = self.quadratic(quad_q, quad_k, v)
        if quad_q.shape[-2] <= self.group_size:  # one group: no earlier group for the linear part
            return quad
        return quad + group_linear_attention(lin_q, lin_k, v, self.group_size, self.lin_scale)

    def mix_cached(
        self,
        quad_q: torch.Tensor,
        quad_k: torch.Tensor,
        lin_q: torch.Tensor,
        lin_k: torch.Tensor,
        v: torch.Tensor,
        state: LayerState,
    ) -> torch.Tensor:
        """Decoding: the new positions, one group segment at a time. Within a segment, the quad part
        attends over the group's cached and new keys; the lin part reads the completed groups' sum."""
        if state.position is not None:
            return self.mix_static(quad_q, quad_k, lin_q, lin_k, v, state)
        extra, g = state.extra, self.group_size
        pieces, start, t = [], 0, quad_q.shape[-2]
        while start < t:
            cached = extra["quad_k"].shape[-2] if "quad_k" in extra else 0
            stop = min(t, start + g - cached)
            group = {"quad_k": quad_k[:, start:stop], "v": v[:, start:stop], "lin_k": lin_k[:, start:stop]}
            if cached:
                group = {name: torch.cat([extra.pop(name), x], dim=-2) for name, x in group.items()}
            out = relu2_attention(quad_q[:, start:stop], group["quad_k"], group["v"], self.rel_bias, self.quad_scale)
            if "kv" in extra:  # its dtype is the prefill's: a bf16 prefill may precede fp32 steps
                out = out + (lin_q[:, start:stop] @ extra["kv"].to(lin_q.dtype)) * self.lin_scale
            pieces.append(out)
            if group["quad_k"].shape[-2] == g:  # the group is complete: fold it into the running sum
                kv = group["lin_k"].transpose(-1, -2) @ group["v"]
                extra["kv"] = extra["kv"] + kv if "kv" in extra else kv
            else:
                extra.update(group)
            start = stop
        return torch.cat(pieces, dim=-2)

    # -- static decode steps (serve/static_decode.py) ---------------------------------------------
    def enter_static(self, state: LayerState, position: int) -> None:
        """The eager state as fixed-size tensors: the current group's quad keys, values and lin keys
        in g slots (slot = position mod g), the completed groups' `sum lin_k^T V` (kv) and the
        current group's partial sum (pending), which joins kv when the group completes."""
        extra, static, g = state.extra, state.static, self.group_size
        quad_k = extra.pop("quad_k", None)
        v, lin_k, kv = extra.pop("v", None), extra.pop("lin_k", None), extra.pop("kv", None)
        if quad_k is None:  # a prompt that ended exactly at a group boundary
            return self._static_zeros(state, kv)
        b, c = quad_k.shape[0], quad_k.shape[1]
        shapes = {"quad_k": quad_k.shape[-1], "v": v.shape[-1], "lin_k": lin_k.shape[-1]}
        for name, width in shapes.items():
            _static_buffer(static, name, (b, g, width), quad_k)
        for name, x in (("quad_k", quad_k), ("v", v), ("lin_k", lin_k)):
            static[name].zero_()[:, :c] = x
        _static_buffer(static, "kv", (b, shapes["quad_k"], shapes["v"]), v)
        if kv is not None:
            static["kv"].copy_(kv)
        else:
            static["kv"].zero_()
        _static_buffer(static, "pending", static["kv"].shape, v)
        static["pending"].copy_(lin_k.transpose(-1, -2) @ v)

    def _static_zeros(self, state: LayerState, kv: torch.Tensor | None) -> None:
        if kv is None:
            raise ValueError("a FLASH decode state needs a prefill of at least one position")
        b, s, e = kv.shape
        static = state.static
        for name, width in (("quad_k", s), ("v", e), ("lin_k", s)):
            _static_buffer(static, name, (b, self.group_size, width), kv)
            static[name].zero_()
        for name in ("kv", "pending"):
            _static_buffer(static, name, kv.shape, kv)
        static["kv"].copy_(kv)
        static["pending"].zero_()

    def mix_static(
        self,
        quad_q: torch.Tensor,
        quad_k: torch.Tensor,
        lin_q: torch.Tensor,
        lin_k: torch.Tensor,
        v: torch.Tensor,
        state: LayerState,
    ) -> torch.Tensor:
        """One position at `state.position`, in place on the fixed-size state (no shape depends on it)."""
        static, g = state.static, self.group_size
        slot = state.position % g
        for name, x in (("quad_k", quad_k), ("v", v), ("lin_k", lin_k)):
            static[name].index_copy_(1, slot, x)
        out = relu2_attention(quad_q, static["quad_k"], static["v"], self.rel_bias, self.quad_scale, slot)
        out = out + (lin_q @ static["kv"]) * self.lin_scale  # zero while the first group is open
        pending = static["pending"] + lin_k.transpose(-1, -2) @ v
        complete = (slot == g - 1).to(pending.dtype)  # the group is full: fold it into kv
        static["kv"].add_(complete * pending)
        static["pending"].copy_((1 - complete) * pending)
        return out


def _static_buffer(static: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], like: torch.Tensor) -> None:
    """Keep `static[name]` when it already has this shape and dtype (its address stays), else allocate."""
    kept = static.get(name)
    if kept is None or tuple(kept.shape) != tuple(shape) or kept.dtype != like.dtype or kept.device != like.device:
        static[name] = like.new_zeros(shape)
