"""Transformer++ baselines (docs/design.md §2.1): Untied (`depth` distinct blocks) and Loop (one block
applied `depth` times)."""

from __future__ import annotations

from torch import nn

from tango_lm.layers.active_width import check_active_width, trained_width
from tango_lm.layers.transformer import transformer_block
from tango_lm.models.archs.base import Architecture, causal_pairs_per_token
from tango_lm.models.backbone import Backbone
from tango_lm.models.config import ModelConfig
from tango_lm.models.fixed_geometry import FixedGeometry

# Seed 000 Table 6: the conventionally proportioned Untied baselines (d, heads, F), head width 32.
# The paper gives these geometries rather than a rule, so they are data.
CONVENTIONAL_UNTIED = FixedGeometry(
    label="conventional-untied",
    display_name="Conventional Untied",
    title="Conventional Untied Transformer++",
    source="seed 000 Table 6",
    shapes={
        ("70M", 4): (800, 25, 2064),
        ("70M", 8): (640, 20, 1616),
        ("70M", 16): (480, 15, 1344),
        ("160M", 4): (1376, 43, 3664),
        ("160M", 8): (1056, 33, 2816),
        ("160M", 16): (800, 25, 2080),
    },
)


def block_params(cfg: ModelConfig) -> int:
    d, f = cfg.d_model, cfg.width
    return 4 * d * d + 3 * d * f + 2 * d


class _TransformerPP(Architecture):
    family = "tango"
    matched = True
    rotating_width = True
    in_bench_suite = True
    width_name = "FFN"
    decode_state = "rotated keys and values of every position"
    unique_blocks = staticmethod(lambda cfg: cfg.depth)

    @staticmethod
    def validate(cfg: ModelConfig) -> None:
        # Rotating narrow-width training (docs/design.md §2.6): K columns of the FFN width.
        check_active_width(cfg.active_width, cfg.width, "the FFN width", "lower active_width or raise width")

    @classmethod
    def build(cls, cfg: ModelConfig) -> nn.Module:
        n = cls.unique_blocks(cfg)
        layers = [
            transformer_block(cfg.d_model, cfg.n_heads, cfg.width, cfg.norm_eps, cfg.active_width) for _ in range(n)
        ]
        schedule = [i % n for i in range(cfg.depth)]
        return Backbone(layers, schedule, cfg.head_dim, cfg.rope_theta)

    @classmethod
    def non_embedding_params(cls, cfg: ModelConfig) -> int:
        return cls.unique_blocks(cfg) * block_params(cfg) + cfg.d_model

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> float:
        # Rotating narrow width runs K of the F FFN columns (averaged over a rotation).
        d, f = cfg.d_model, trained_width(cfg.width, 1, cfg.active_width)
        return cfg.depth * (4 * d * d + 3 * d * f)

    @staticmethod
    def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        # q.k and probs.v, each 2*d FLOPs per visible source.
        return int(cfg.depth * 2 * 2 * cfg.d_model * causal_pairs_per_token(seq_len))


class UntiedTransformer(_TransformerPP):
    name = "untied-transformer"
    display_name = "Untied Transformer++"
    description = "Untied Transformer++"
    fixed_geometries = (CONVENTIONAL_UNTIED,)


class LoopTransformer(_TransformerPP):
    name = "loop-transformer"
    display_name = "Loop Transformer++"
    description = "Loop Transformer++"
    unique_blocks = staticmethod(lambda cfg: 1)
