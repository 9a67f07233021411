"""Dense, Qwen3-style (docs/design.md §4.1): `depth` distinct pre-norm layers of GQA + QK-norm attention with
RoPE and SwiGLU, no biases, final RMSNorm. The other onóna-paper backbones reuse its attention.

Parameters (H query heads, H_kv key/value heads of width d_h, FFN width F):
    per layer  2·d·H·d_h + 2·d·H_kv·d_h + 2·d_h (QK-norm) + 3·d·F + 2·d (pre-norms)
    total      depth · per layer + d (final norm)
142M preset: d = 768, 16 layers, 12 heads / 6 KV heads of 64, F = 2048 -> 103,836,416
non-embedding, 142,469,888 with the tied V = 50304 table (the onóna paper's count).

FLOPs per token (forward): 2 × the weights above (projections and FFN), plus attention
2·2·H·d_h per visible source (q·k and p·v), (T + 1) / 2 sources on average.
"""

from __future__ import annotations

from torch import nn

from tango_lm.errors import UserError
from tango_lm.layers.gqa import dense_block, dense_block_params
from tango_lm.layers.prenorm import PreNormBlock
from tango_lm.models.archs.base import Architecture, causal_pairs_per_token
from tango_lm.models.backbone import Backbone
from tango_lm.models.config import ModelConfig


def check_gqa(cfg: ModelConfig) -> None:
    """The key/value heads must divide the query heads."""
    if cfg.n_kv_heads < 1 or cfg.n_heads % cfg.n_kv_heads:
        # The head count often follows from an override (d_model=64 keeps a preset's 64-wide heads:
        # one head), so the message says where it came from and which field to set.
        divisors = [k for k in range(1, cfg.n_heads + 1) if cfg.n_heads % k == 0]
        raise UserError(
            f"model.n_heads={cfg.n_heads} (d_model={cfg.d_model} / head_dim={cfg.head_dim}) is not a multiple "
            f"of n_kv_heads={cfg.n_kv_heads}; set model.n_kv_heads to one of {divisors}, or change head_dim or n_heads"
        )


def attention_matmul_params(cfg: ModelConfig) -> int:
    """q, k, v, o projection weights of one GQA attention layer."""
    return 2 * cfg.d_model * cfg.head_dim * (cfg.n_heads + cfg.n_kv_heads)


def dense_layer_params(cfg: ModelConfig) -> int:
    return dense_block_params(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.width)


def attention_mixing_flops(cfg: ModelConfig, seq_len: int) -> float:
    """One attention layer's q·k and p·v FLOPs per token."""
    return 2 * 2 * cfg.n_heads * cfg.head_dim * causal_pairs_per_token(seq_len)


def dense_layer(cfg: ModelConfig) -> PreNormBlock:
    return dense_block(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.width, cfg.norm_eps)


class Dense(Architecture):
    name = "dense"
    reads = ("n_kv_heads",)
    display_name = "Dense"
    family = "onona"
    decode_state = "keys and values of the n_kv_heads heads, every position"
    tiny = {"n_kv_heads": 2}

    @staticmethod
    def validate(cfg: ModelConfig) -> None:
        check_gqa(cfg)

    @staticmethod
    def build(cfg: ModelConfig) -> nn.Module:
        layers = [dense_layer(cfg) for _ in range(cfg.depth)]
        return Backbone(layers, list(range(cfg.depth)), cfg.head_dim, cfg.rope_theta)

    @staticmethod
    def non_embedding_params(cfg: ModelConfig) -> int:
        return cfg.depth * dense_layer_params(cfg) + cfg.d_model

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> int:
        return cfg.depth * (attention_matmul_params(cfg) + 3 * cfg.d_model * cfg.width)

    @staticmethod
    def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        return int(cfg.depth * attention_mixing_flops(cfg, seq_len))
