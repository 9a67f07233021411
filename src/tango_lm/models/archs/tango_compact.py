"""Compact-controller TANGO (docs/design.md §2.5, the project's reading; see layers/tango_variants.py): the
sources emit r controller channels, attention averages them, the destination expands them to F."""

from __future__ import annotations

from torch import nn

from tango_lm.errors import UserError
from tango_lm.layers.active_width import check_active_width, trained_width
from tango_lm.layers.tango_variants import CompactTangoBlock
from tango_lm.models.archs.base import Architecture, causal_pairs_per_token
from tango_lm.models.backbone import Backbone
from tango_lm.models.config import ModelConfig


def controller_width(cfg: ModelConfig) -> int:
    """r: `controller_width`, or d_model when it is not set."""
    return cfg.controller_width if cfg.controller_width is not None else cfg.d_model


class TangoCompact(Architecture):
    name = "tango-compact"
    triton_ops = ("tango_mix",)  # its wide and its narrow average
    reads = ("controller_width",)
    display_name = "Compact-controller TANGO"
    description = "compact-controller TANGO (r = d; the project's reading of the paper)"
    family = "tango"
    matched = True
    rotating_width = True
    in_bench_suite = True
    decode_state = "rotated keys and controller channels of every position (d + r per position)"
    tiny = {"controller_width": 16}

    @staticmethod
    def validate(cfg: ModelConfig) -> None:
        r = controller_width(cfg)
        if r < 1 or r % cfg.n_heads:
            raise UserError(
                f"model.controller_width={r} must be a positive multiple of n_heads={cfg.n_heads}: the controller "
                f"is split across heads; use a multiple of {cfg.n_heads} such as {max(r - r % cfg.n_heads, cfg.n_heads)}"
            )
        # Rotating narrow-width training narrows the F expansion columns as one part (like an FFN).
        check_active_width(cfg.active_width, cfg.width, "the gate width width", "lower active_width or raise width")

    @staticmethod
    def build(cfg: ModelConfig) -> nn.Module:
        block = CompactTangoBlock(
            cfg.d_model, cfg.n_heads, cfg.width, controller_width(cfg), cfg.norm_eps, cfg.active_width
        )
        return Backbone([block], [0] * cfg.depth, cfg.head_dim, cfg.rope_theta)

    @staticmethod
    def non_embedding_params(cfg: ModelConfig) -> int:
        d, f, r = cfg.d_model, cfg.width, controller_width(cfg)
        return 2 * d * d + d * r + r * f + 2 * d * f + 2 * d

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> float:
        # Rotating narrow width runs K of the F columns (W_e, W_u, W_o; averaged over a rotation);
        # the controller and its average always run in full.
        d, r = cfg.d_model, controller_width(cfg)
        f = trained_width(cfg.width, 1, cfg.active_width)
        return cfg.depth * (2 * d * d + d * r + r * f + 2 * d * f)

    @staticmethod
    def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        # q.k over d_h per head (2d in all) and the controller average over r (2r), per visible source.
        return int(cfg.depth * 2 * (cfg.d_model + controller_width(cfg)) * causal_pairs_per_token(seq_len))
