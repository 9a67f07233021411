"""Full-prefix TANGO (docs/design.md §2.2): one TANGO block applied `depth` times."""

from __future__ import annotations

from torch import nn

from tango_lm.errors import UserError
from tango_lm.layers.active_width import check_active_width, trained_width
from tango_lm.layers.tango import TangoBlock
from tango_lm.models.archs.base import Architecture, causal_pairs_per_token
from tango_lm.models.backbone import Backbone
from tango_lm.models.config import ModelConfig


class Tango(Architecture):
    name = "tango"
    triton_ops = ("tango_mix",)
    display_name = "TANGO"
    description = "TANGO (full prefix)"
    family = "tango"
    matched = True
    rotating_width = True
    in_bench_suite = True
    decode_state = "rotated keys and source gates of every position (d + F per position)"
    tiny = {}

    @staticmethod
    def validate(cfg: ModelConfig) -> None:
        if cfg.width % cfg.n_heads:
            raise UserError(
                f"model.width={cfg.width} is not a multiple of n_heads={cfg.n_heads}: TANGO splits the gate "
                f"width across heads; use a multiple of {cfg.n_heads} such as {cfg.width - cfg.width % cfg.n_heads or cfg.n_heads}"
            )
        # Rotating narrow-width training (docs/design.md §2.6): K columns of each head's gate width.
        check_active_width(
            cfg.active_width,
            cfg.width // cfg.n_heads,
            "the per-head gate width width/n_heads",
            "lower active_width or raise width",
        )

    @staticmethod
    def build(cfg: ModelConfig) -> nn.Module:
        block = TangoBlock(cfg.d_model, cfg.n_heads, cfg.width, cfg.norm_eps, cfg.active_width)
        return Backbone([block], [0] * cfg.depth, cfg.head_dim, cfg.rope_theta)

    @staticmethod
    def non_embedding_params(cfg: ModelConfig) -> int:
        d, f = cfg.d_model, cfg.width
        return 2 * d * d + 3 * d * f + 2 * d

    @staticmethod
    def trained_width(cfg: ModelConfig) -> float:
        """F, or under rotating narrow-width training the gate columns a step runs (K of each
        head's F/H, averaged over a rotation): W_g, W_u, W_o and the gate average use only those."""
        return trained_width(cfg.width, cfg.n_heads, cfg.active_width)

    @classmethod
    def matmul_params_per_token(cls, cfg: ModelConfig) -> float:
        d, f = cfg.d_model, cls.trained_width(cfg)
        return cfg.depth * (2 * d * d + 3 * d * f)

    @classmethod
    def attention_flops_per_token(cls, cfg: ModelConfig, seq_len: int) -> int:
        # q.k over d_h per head (2d in all) and the gate average over F (2F), per visible source.
        return int(cfg.depth * 2 * (cfg.d_model + cls.trained_width(cfg)) * causal_pairs_per_token(seq_len))
