"""Top-k routed SwiGLU experts with a capacity factor and a load-balancing loss (docs/design.md §4.3, MoE;
Fedus et al. 2022), and the Dense block with its FFN replaced by them.

Routing: `p = softmax(router(x))` over E experts (fp32), each token takes its top-k experts with
weights p_i, renormalized to sum to 1 over the k when `moe_renormalize` (Mixtral / Qwen3-MoE; with
k = 1 turn it off, as in Switch, or the router gets no gradient from the loss).

Capacity: each expert takes at most `C = ceil(capacity_factor * N * k / E)` of the N tokens in the
call. Assignments are served in (token, rank) order with tokens in flattened [B, T] order, so a
position is only ever dropped because of positions before it in its own row (or of earlier rows):
the model stays causal. A dropped assignment contributes 0; a token with all its assignments
dropped passes through on the residual. `capacity_factor = E / k` never drops (the evaluation
default, models/config.py); below it, what a row gets depends on the rows batched with it and a
1-token decode step (which never drops) can differ from the full forward.

Load balancing: `aux = alpha * E * sum_i f_i P_i` with f_i the share of the N*k assignments
routed to expert i (before capacity) and P_i the mean router probability of expert i; it equals
alpha for a uniform router. Computed in training only and kept on the module (`aux_loss`); the
architecture averages it over layers (`MoEBackbone.aux_loss`).

Dispatch has no per-token Python loop (`ops/moe_dispatch.py`): in eager CPU runs assignments are
sorted by expert once and each expert runs on its contiguous slice; under torch.compile and on GPUs
each expert runs on a fixed buffer of C slots (static shapes, no host sync).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from tango_lm.layers.gqa import GroupedQueryAttention
from tango_lm.layers.prenorm import PreNormBlock
from tango_lm.layers.transformer import SwiGLU
from tango_lm.ops.moe_dispatch import dispatch_capacity, dispatch_sorted, use_capacity_dispatch
from tango_lm.serve.cache import LayerState


def moe_ffn_params(d_model: int, n_experts: int, expert_width: int) -> int:
    """Router d x E plus E SwiGLU experts of width F_e."""
    return d_model * n_experts + n_experts * 3 * d_model * expert_width


class MoEFeedForward(nn.Module):
    """Routed SwiGLU experts (`router`, `experts.{i}.gate_proj/up_proj/down_proj`)."""

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        top_k: int,
        expert_width: int,
        renormalize: bool = True,
        capacity_factor: float = 1.25,
        aux_loss_weight: float = 0.01,
        capacity_factor_eval: float = 4.0,
    ) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.renormalize = n_experts, top_k, renormalize
        self.capacity_factor = capacity_factor  # changed by `capacity_factor(model, ...)`
        self.capacity_factor_eval = capacity_factor_eval  # cached decoding serves at this capacity
        self.aux_loss_weight = aux_loss_weight
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d_model, expert_width) for _ in range(n_experts))
        self.aux_loss: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None  # share of assignments over capacity in the last call

    @property
    def last_dropped(self) -> float:
        """Share of the last call's assignments that were over capacity (a host read)."""
        return 0.0 if self.dropped is None else float(self.dropped)

    def capacity(self, n_tokens: int, capacity_factor: float) -> int:
        return max(1, math.ceil(capacity_factor * n_tokens * self.top_k / self.n_experts))

    def forward(self, h: torch.Tensor, state: LayerState | None = None) -> torch.Tensor:
        """h [B, T, d] -> [B, T, d]; with a decode state (cached decoding) at `capacity_factor_eval`.
        Keeps the call's load-balancing loss and drop rate on the module (`aux_loss`, `dropped`)."""
        out, self.aux_loss, self.dropped = self.route(h, state)
        return out

    def route(
        self, h: torch.Tensor, state: LayerState | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """`forward` without writing to the module: (output, load-balancing loss in training else
        None, share of assignments over capacity)."""
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        n, k, e = x.shape[0], self.top_k, self.n_experts
        # The router's matmul in fp32 too, not only its softmax: under bf16 autocast 0.3% of tokens
        # chose other experts than in fp32 (a discrete choice; Switch's selective precision).
        routing_dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(routing_dtype), self.router.weight.to(routing_dtype))
        probs = logits.softmax(-1)  # [N, E]
        weights, chosen = probs.topk(k, dim=-1)  # [N, k]
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)  # (token, rank) order
        onehot = F.one_hot(flat, e)  # [N*k, E]
        aux = None
        if self.training:
            f = onehot.sum(0).to(probs.dtype) / (n * k)
            aux = self.aux_loss_weight * e * (f * probs.mean(0)).sum()
        # Position of each assignment in its expert's queue; over-capacity ones are dropped.
        position = (onehot.cumsum(0) * onehot).sum(-1) - 1
        factor = self.capacity_factor_eval if state is not None else self.capacity_factor
        capacity = self.capacity(n, factor)
        dropped = (position >= capacity).float().mean()  # read on the host only via `last_dropped`
        dispatch = dispatch_capacity if use_capacity_dispatch(x) else dispatch_sorted
        out = dispatch(x, self.experts, flat, weights.reshape(-1), position, capacity, k)
        return out.view(shape), aux, dropped


class MoEBlock(PreNormBlock):
    """The pre-norm block with routed experts, plus `forward_with_stats` for activation checkpointing."""

    def forward_with_stats(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], application: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The training forward returning the experts' (aux loss, drop rate) instead of storing them."""
        x = x + self.mixer(self.attn_norm(x), rope, None)
        out, aux, dropped = self.mlp.route(self.mlp_norm(x))
        return x + out, aux, dropped


def moe_block(
    d_model: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    eps: float,
    n_experts: int,
    top_k: int,
    expert_width: int,
    renormalize: bool,
    capacity_factor_train: float,
    capacity_factor_eval: float,
    aux_loss_weight: float,
) -> MoEBlock:
    """`x += Attn(RMSNorm(x)); x += MoE(RMSNorm(x))` with the Dense block's GQA + QK-norm attention.
    Cached decoding serves with `capacity_factor_eval` (the paper's inference capacity)."""
    attn = GroupedQueryAttention(d_model, n_heads, n_kv_heads, head_dim, eps)
    experts = MoEFeedForward(
        d_model,
        n_experts,
        top_k,
        expert_width,
        renormalize,
        capacity_factor_train,
        aux_loss_weight,
        capacity_factor_eval,
    )
    return MoEBlock(d_model, eps, attn, experts)


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


@contextmanager
def capacity_factor(model: nn.Module, factor: float | str) -> Iterator[None]:
    """Run a model's MoE layers at another capacity inside the block: a number, or 'eval' /
    'train' for the config's `capacity_factor_eval` / `capacity_factor_train`. External
    evaluation (perplexity, lm-eval) uses `with capacity_factor(model, "eval"): ...`."""
    layers = moe_layers(model)
    if isinstance(factor, str):
        config = getattr(model, "config", None)
        if factor not in ("eval", "train") or config is None:
            raise ValueError(f"capacity factor must be a number, 'eval' or 'train' (got {factor!r})")
        factor = config.capacity_factor_eval if factor == "eval" else config.capacity_factor_train
    saved = [m.capacity_factor for m in layers]
    for m in layers:
        m.capacity_factor = float(factor)
    try:
        yield
    finally:
        for m, old in zip(layers, saved, strict=True):
            m.capacity_factor = old
