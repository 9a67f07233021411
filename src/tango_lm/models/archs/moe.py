"""Mixture of experts (docs/design.md §4.3): the Dense model with each SwiGLU replaced by E routed SwiGLU
experts of width F_e, top-k per token (layers/moe.py: routing, capacity, load-balancing loss).

Active parameters are matched to Dense by `F_e = F / k` (`moe_expert_width` unset): the k experts
a token uses hold 3·d·k·F_e = 3·d·F weights, Dense's FFN, and the router adds d·E per layer. At the
142M shape with E = 8, k = 2, F_e = 1024 this gives 330,427,136 non-embedding parameters in all and
103,934,720 active, the paper's "330.4M total and 103.9M active" (Appendix C).

Parameters: depth · (attention + 2·d + d·E + E·3·d·F_e) + d; active: E·3·d·F_e -> k·3·d·F_e.
FLOPs per token (forward): 2 × (attention projections + router + k experts' weights) per layer
(nominal: dropped assignments are not subtracted), plus the attention mixing.

The load-balancing loss reaches training through `MoEBackbone.aux_loss()` (mean over layers),
which `LanguageModel.nll` adds in training mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tango_lm.errors import UserError
from tango_lm.layers.gqa import gqa_params
from tango_lm.layers.moe import moe_block, moe_ffn_params, moe_layers
from tango_lm.models.archs.base import Architecture
from tango_lm.models.archs.dense import attention_matmul_params, attention_mixing_flops, check_gqa
from tango_lm.models.backbone import Backbone
from tango_lm.models.config import ModelConfig


def expert_width(cfg: ModelConfig) -> int:
    return cfg.moe_expert_width if cfg.moe_expert_width is not None else cfg.width // cfg.moe_top_k


class MoEBackbone(Backbone):
    """The layer stack plus the load-balancing loss of its last training forward."""

    def recomputed(self, layer: nn.Module, x: torch.Tensor, rope: tuple, application: int) -> torch.Tensor:
        # The checkpointed region returns the experts' statistics; they are stored outside it.
        x, layer.mlp.aux_loss, layer.mlp.dropped = checkpoint(
            layer.forward_with_stats, x, rope, application, use_reentrant=False
        )
        return x

    def aux_loss(self) -> torch.Tensor | None:
        """Mean over MoE layers of α·E·Σ f_i P_i from the last forward in training mode, else None."""
        losses = [m.aux_loss for m in moe_layers(self) if m.aux_loss is not None]
        return torch.stack(losses).mean() if losses else None


class MoE(Architecture):
    name = "moe"
    reads = (
        "n_kv_heads",
        "n_experts",
        "moe_top_k",
        "moe_expert_width",
        "moe_renormalize",
        "capacity_factor_train",
        "capacity_factor_eval",
        "aux_loss_weight",
    )
    display_name = "MoE"
    family = "onona"
    budget_reference = "dense"  # the paper's 40 TPP of the Dense Standard count at this shape
    decode_state = "keys and values of the n_kv_heads heads, every position"
    skips_parameters = True
    scores_depend_on_batch = True
    # Capacity E / k drops no token, so a decoded position equals the full forward's.
    tiny = {"n_kv_heads": 2, "n_experts": 4, "moe_top_k": 2, "moe_expert_width": None, "capacity_factor_train": 2.0}

    @staticmethod
    def validate(cfg: ModelConfig) -> None:
        check_gqa(cfg)
        if cfg.n_experts < 1:
            raise UserError(f"model.n_experts must be at least 1 (got {cfg.n_experts})")
        if cfg.moe_top_k < 1:
            raise UserError(f"model.moe_top_k must be at least 1 (got {cfg.moe_top_k})")
        if cfg.moe_top_k > cfg.n_experts:
            raise UserError(f"moe_top_k={cfg.moe_top_k} exceeds n_experts={cfg.n_experts}; lower moe_top_k")
        if cfg.moe_expert_width is not None and cfg.moe_expert_width < 1:
            raise UserError(f"model.moe_expert_width={cfg.moe_expert_width} is below 1; give at least 1")
        if expert_width(cfg) < 1:
            raise UserError(
                f"expert width {expert_width(cfg)} (width // moe_top_k) is below 1; raise width or set moe_expert_width"
            )
        for name in ("capacity_factor_train", "capacity_factor_eval"):
            if getattr(cfg, name) <= 0:
                raise UserError(
                    f"model.{name} must be positive (got {getattr(cfg, name)}); "
                    "n_experts / moe_top_k never drops a token"
                )
        if cfg.aux_loss_weight < 0:
            raise UserError(f"model.aux_loss_weight must be >= 0 (got {cfg.aux_loss_weight})")

    @staticmethod
    def warnings(cfg: ModelConfig, seq_len: int | None = None) -> list[str]:
        if cfg.moe_top_k != 1 or not cfg.moe_renormalize:
            return []
        return [
            "model.moe_top_k=1 with model.moe_renormalize=true: every token's one weight is 1, so the router "
            "learns only from the load-balancing loss, not from the language-model loss; set "
            "model.moe_renormalize=false (Switch Transformer's top-1 routing)"
        ]

    @staticmethod
    def build(cfg: ModelConfig) -> nn.Module:
        layers = [
            moe_block(
                cfg.d_model,
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.head_dim,
                cfg.norm_eps,
                cfg.n_experts,
                cfg.moe_top_k,
                expert_width(cfg),
                cfg.moe_renormalize,
                cfg.capacity_factor_train,
                cfg.capacity_factor_eval,
                cfg.aux_loss_weight,
            )
            for _ in range(cfg.depth)
        ]
        return MoEBackbone(layers, list(range(cfg.depth)), cfg.head_dim, cfg.rope_theta)

    @staticmethod
    def width_multiple(cfg: ModelConfig) -> int:
        # F_e = F / k: a multiple of k keeps every expert whole (width 1 at one head built none)
        heads = int(cfg.n_heads or 1)
        return math.lcm(heads, cfg.moe_top_k) if cfg.moe_expert_width is None else heads

    @staticmethod
    def layer_params(cfg: ModelConfig, experts: int) -> int:
        d = cfg.d_model
        attention = gqa_params(d, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        return (
            attention
            + 2 * d
            + moe_ffn_params(d, cfg.n_experts, expert_width(cfg))
            - (cfg.n_experts - experts) * 3 * d * expert_width(cfg)
        )

    @staticmethod
    def non_embedding_params(cfg: ModelConfig) -> int:
        return cfg.depth * MoE.layer_params(cfg, cfg.n_experts) + cfg.d_model

    @staticmethod
    def active_non_embedding_params(cfg: ModelConfig) -> int:
        """Parameters one token uses: the router and k of the E experts per layer."""
        return cfg.depth * MoE.layer_params(cfg, cfg.moe_top_k) + cfg.d_model

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> int:
        d = cfg.d_model
        active_ffn = d * cfg.n_experts + cfg.moe_top_k * 3 * d * expert_width(cfg)
        return cfg.depth * (attention_matmul_params(cfg) + active_ffn)

    @staticmethod
    def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        return int(cfg.depth * attention_mixing_flops(cfg, seq_len))
