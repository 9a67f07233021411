"""GAU baseline (docs/design.md §2.7): `depth` independent GAU layers, no separate FFN."""

from __future__ import annotations

from torch import nn

from tango_lm.errors import UserError
from tango_lm.layers.gau import GAULayer
from tango_lm.models.archs.base import Architecture, causal_pairs_per_token
from tango_lm.models.backbone import Backbone
from tango_lm.models.config import ModelConfig

GAU_NORMS = ("rmsnorm", "layernorm")


def check_qk_dim(cfg: ModelConfig) -> None:
    """GAU and FLASH rotate the single query/key head of width s = qk_dim with RoPE (and take one
    of `GAU_NORMS`)."""
    if cfg.qk_dim < 2 or cfg.qk_dim % 2:
        raise UserError(f"model.qk_dim={cfg.qk_dim} must be a positive even number for RoPE; use 128 (the paper's s)")
    if cfg.gau_norm not in GAU_NORMS:
        raise UserError(f"unknown model.gau_norm {cfg.gau_norm!r} for GAU/FLASH; choose one of: {', '.join(GAU_NORMS)}")


def gated_unit_params(cfg: ModelConfig, n_offsets: int, bias_values: int) -> int:
    """One layer: [U|V] and Z projections with biases (2de + 2e + ds + s), 2 x n_offsets x s
    offset-scales, W_o with bias (de + d), the norm (d, or 2d for a LayerNorm) and the relative bias."""
    d, e, s = cfg.d_model, cfg.width, cfg.qk_dim
    norm = 2 * d if cfg.gau_norm == "layernorm" else d
    return 3 * d * e + 2 * e + d * s + s + 2 * n_offsets * s + d + norm + bias_values


def gated_unit_matmul_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies through: W_uv (2de), W_z (ds), W_o (de), per layer."""
    d, e, s = cfg.d_model, cfg.width, cfg.qk_dim
    return cfg.depth * (3 * d * e + d * s)


class Gau(Architecture):
    name = "gau"
    triton_ops = ("relu2_attention",)
    reads = ("qk_dim", "gau_norm")
    display_name = "Full-attention GAU"
    description = "full-attention GAU (s = 128)"
    family = "tango"
    matched = True
    in_bench_suite = True
    decode_state = "rotated keys (s) and values (e) of every position"
    tiny = {"qk_dim": 8}
    uses_heads = False

    @staticmethod
    def validate(cfg: ModelConfig) -> None:
        check_qk_dim(cfg)

    @staticmethod
    def build(cfg: ModelConfig) -> nn.Module:
        layers = [
            GAULayer(cfg.d_model, cfg.width, cfg.qk_dim, cfg.context_length, cfg.norm_eps, cfg.init_std, cfg.gau_norm)
            for _ in range(cfg.depth)
        ]
        return Backbone(layers, list(range(cfg.depth)), cfg.qk_dim, cfg.rope_theta)

    @staticmethod
    def non_embedding_params(cfg: ModelConfig) -> int:
        # 3de + 2e + ds + s + 4s + d + d + (2n - 1) per layer, plus the final norm.
        return cfg.depth * gated_unit_params(cfg, 2, 2 * cfg.context_length - 1) + cfg.d_model

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> int:
        return gated_unit_matmul_params(cfg)

    @staticmethod
    def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        # Q.K over s and A.V over e, 2(s + e) FLOPs per visible source.
        return int(cfg.depth * 2 * (cfg.qk_dim + cfg.width) * causal_pairs_per_token(seq_len))

    @staticmethod
    def width_multiple(cfg: ModelConfig) -> int:
        return 16

    @staticmethod
    def preset_geometry(cfg: ModelConfig) -> list[str]:
        return [
            f"  qk_dim: {cfg.qk_dim}          # s",
            f"  width: {cfg.width}          # e: the expansion width",
            f"  depth: {cfg.depth}             # block applications",
        ]
