"""TANGO with three gated-projection sets (docs/design.md §2.4): one block, shared W_q, W_k and norm, and
three (W_g, W_u, W_o) sets of width F for the first, the middle and the last applications."""

from __future__ import annotations

from torch import nn

from tango_lm.errors import UserError
from tango_lm.layers.tango_variants import ThreeSetTangoBlock
from tango_lm.models.archs.tango import Tango
from tango_lm.models.backbone import Backbone
from tango_lm.models.config import ModelConfig


class Tango3Set(Tango):
    name = "tango-3set"
    display_name = "TANGO (3 sets)"
    description = "TANGO with three gated-projection sets"
    min_depth = 3
    decode_state = "rotated keys and source gates of every position (d + F per position)"
    tiny = {"depth": 3}

    @staticmethod
    def validate(cfg: ModelConfig) -> None:
        Tango.validate(cfg)  # F a multiple of H; active_width within the per-head gate width
        if cfg.depth < 3:
            raise UserError(
                f"a 3-set model needs depth >= 3 (got depth={cfg.depth}): its first, middle and last "
                "applications use different sets; raise depth or use arch=tango"
            )

    @staticmethod
    def build(cfg: ModelConfig) -> nn.Module:
        block = ThreeSetTangoBlock(cfg.d_model, cfg.n_heads, cfg.width, cfg.depth, cfg.norm_eps, cfg.active_width)
        return Backbone([block], [0] * cfg.depth, cfg.head_dim, cfg.rope_theta)

    @staticmethod
    def non_embedding_params(cfg: ModelConfig) -> int:
        d, f = cfg.d_model, cfg.width
        return 2 * d * d + 9 * d * f + 2 * d

    # Each application multiplies through W_q, W_k and one set: TANGO's matmul and attention
    # counts (inherited) are unchanged.
