"""Attention Residuals (docs/design.md §4.4, AttnRes; Kimi Team 2026, arXiv 2603.15031).

The residual stream is replaced by softmax attention over depth. Sublayer l (attention or SwiGLU,
each still pre-normed) reads

    h_l = Σ_{i<l} α_{i→l} v_i,     α_{i→l} = softmax_i(w_lᵀ RMSNorm_l(v_i)),

with v_0 the token embedding and v_i the earlier sublayer outputs; `w_l` (the pseudo-query,
`*.query`) starts at zero, so every sublayer starts from the uniform average of its sources. The
output of the stack is one more such mix (`out_res`). Each mix owns `w_l` and its RMSNorm weight,
2d parameters, as in the Kimi reference code.

Block AttnRes (`attnres_block = S` layers): sublayer outputs are summed within blocks of 2S
sublayers; a sublayer attends over the embedding, the completed block sums, and the partial sum of
its own block so far (when it is not the block's first). Full AttnRes is every sublayer output as
its own source.

Since RMSNorm_l(v) · w_l = (v / rms(v)) · (g_l ⊙ w_l), each source is normalized once, when it is
added, and each mix is a dot product with g_l ⊙ w_l: the L² norms of the definition reduce to L,
and no stacked copy of the sources is made (autograd keeps only the sources themselves).
"""

from __future__ import annotations

import torch
from torch import nn

from tango_lm.layers.gqa import GroupedQueryAttention
from tango_lm.layers.norm import RMSNorm
from tango_lm.layers.transformer import SwiGLU
from tango_lm.serve.cache import LayerState


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in fp32 or wider."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class DepthSources:
    """The sources a mix attends over: the embedding, completed (block) sums and the running
    partial sum, each with its unit-RMS copy. `block` counts sublayers (1 = full AttnRes)."""

    def __init__(
        self,
        values: list[torch.Tensor],
        normed: list[torch.Tensor],
        block: int,
        eps: float,
        partial: torch.Tensor | None = None,
        partial_normed: torch.Tensor | None = None,
        count: int = 0,
    ) -> None:
        self.values, self.normed, self.block, self.eps = values, normed, block, eps
        self.partial, self.partial_normed, self.count = partial, partial_normed, count

    @classmethod
    def start(cls, embedding: torch.Tensor, block: int, eps: float) -> DepthSources:
        """The sources before the first sublayer: the embedding alone."""
        return cls([embedding], [unit_rms(embedding, eps)], block, eps)

    def copy(self) -> DepthSources:
        """A copy that `add` can extend without changing this one (the tensors are shared). Built
        by the constructor: under torch 2.11 Dynamo broke the compiled graph at every checkpointed
        layer on `copy.copy`, and failed to trace `DepthSources.__new__` there."""
        return DepthSources(
            list(self.values), list(self.normed), self.block, self.eps, self.partial, self.partial_normed, self.count
        )

    def current(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self.partial is None:
            return self.values, self.normed
        return self.values + [self.partial], self.normed + [self.partial_normed]

    def add(self, out: torch.Tensor) -> None:
        """Record a sublayer's output."""
        self.partial = out if self.partial is None else self.partial + out
        self.count += 1
        if self.count == self.block:
            self.values.append(self.partial)
            self.normed.append(unit_rms(self.partial, self.eps))
            self.partial, self.partial_normed, self.count = None, None, 0
        else:
            self.partial_normed = unit_rms(self.partial, self.eps)


class AttnRes(nn.Module):
    """One depth mix: pseudo-query `query` (w_l, zero init) and the key norm `norm` (its weight g_l)."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d_model))
        self.norm = RMSNorm(d_model, eps)

    def forward(self, values: list[torch.Tensor], normed: list[torch.Tensor]) -> torch.Tensor:
        """Σ_i softmax_i(w · RMSNorm(v_i)) v_i over the sources (normed: their unit-RMS copies)."""
        u = self.query * self.norm.weight
        # Elementwise product and sum rather than a matmul: autocast leaves it in fp32.
        logits = torch.stack([(n * u.to(n.dtype)).sum(-1) for n in normed])  # [n, B, T]
        alpha = logits.softmax(0)
        out = alpha[0, ..., None] * values[0]
        for i in range(1, len(values)):
            out = out + alpha[i, ..., None] * values[i]
        return out.to(values[0].dtype)  # the stream's dtype: bf16 weights take bf16 inputs (alpha is fp32)


def attn_res_reference(values: list[torch.Tensor], query: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """The definition, written directly (stack, RMSNorm with weight, softmax over sources)."""
    v = torch.stack(values).double()
    logits = (norm(v) * query.double()).sum(-1)
    return (logits.softmax(0)[..., None] * v).sum(0)


class AttnResLayer(nn.Module):
    """A Dense layer (GQA + QK-norm attention, SwiGLU) whose two sublayers read depth mixes
    (`attn_res`, `mlp_res`) instead of the residual stream and write their outputs as sources."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, width: int, eps: float) -> None:
        super().__init__()
        self.attn_res = AttnRes(d_model, eps)
        self.attn_norm = RMSNorm(d_model, eps)
        self.attn = GroupedQueryAttention(d_model, n_heads, n_kv_heads, head_dim, eps)
        self.mlp_res = AttnRes(d_model, eps)
        self.mlp_norm = RMSNorm(d_model, eps)
        self.mlp = SwiGLU(d_model, width)

    def forward(
        self, sources: DepthSources, rope: tuple[torch.Tensor, torch.Tensor], state: LayerState | None = None
    ) -> None:
        h = self.attn_res(*sources.current())
        sources.add(self.attn(self.attn_norm(h), rope, state))
        h = self.mlp_res(*sources.current())
        sources.add(self.mlp(self.mlp_norm(h)))
