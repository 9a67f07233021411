"""FLASH baseline (docs/design.md §2.7): `depth` independent FLASH layers (mixed-chunk attention)."""

from __future__ import annotations

from torch import nn

from tango_lm.errors import UserError
from tango_lm.layers.flash import FlashLayer
from tango_lm.models.archs.base import Architecture, longest_sequence
from tango_lm.models.archs.gau import check_qk_dim, gated_unit_matmul_params, gated_unit_params
from tango_lm.models.backbone import Backbone
from tango_lm.models.config import ModelConfig


def group_pairs_per_token(seq_len: int, group_size: int) -> float:
    """Average number of visible sources inside a position's own group (groups aligned to 0)."""
    full, rest = divmod(seq_len, group_size)
    return (full * group_size * (group_size + 1) / 2 + rest * (rest + 1) / 2) / seq_len


class Flash(Architecture):
    name = "flash"
    triton_ops = ("relu2_attention",)
    reads = ("qk_dim", "group_size", "gau_norm")
    display_name = "FLASH"
    description = "FLASH (s = 128, g = 256)"
    family = "tango"
    matched = True
    in_bench_suite = True
    decode_state = "the current group's keys and values, and the sum of K^T V over completed groups (bounded)"
    tiny = {"qk_dim": 8, "group_size": 4}
    uses_heads = False

    @staticmethod
    def validate(cfg: ModelConfig) -> None:
        check_qk_dim(cfg)
        if cfg.group_size < 1:
            raise UserError(f"model.group_size={cfg.group_size} must be at least 1; use 256 (the paper's g)")

    @staticmethod
    def warnings(cfg: ModelConfig, seq_len: int | None = None) -> list[str]:
        if cfg.group_size < min(seq_len or cfg.context_length, cfg.context_length):
            return []
        return [
            f"model.group_size={cfg.group_size} is at least {longest_sequence(cfg, seq_len)}: one group "
            "holds the whole context, so FLASH's linear (across-group) part never runs and computes GAU-like "
            "quadratic attention, and relative-bias entries past the context never train; lower model.group_size"
        ]

    @staticmethod
    def build(cfg: ModelConfig) -> nn.Module:
        layers = [
            FlashLayer(
                cfg.d_model,
                cfg.width,
                cfg.qk_dim,
                cfg.group_size,
                cfg.context_length,
                cfg.norm_eps,
                cfg.init_std,
                cfg.gau_norm,
            )
            for _ in range(cfg.depth)
        ]
        return Backbone(layers, list(range(cfg.depth)), cfg.qk_dim, cfg.rope_theta)

    @staticmethod
    def non_embedding_params(cfg: ModelConfig) -> int:
        # 3de + 2e + ds + s + 8s + d + d + (2g - 1) per layer, plus the final norm.
        return cfg.depth * gated_unit_params(cfg, 4, 2 * cfg.group_size - 1) + cfg.d_model

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> int:
        return gated_unit_matmul_params(cfg)

    @staticmethod
    def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        # Model FLOPs, causal: the quadratic part is 2(s + e) per visible source of the token's own
        # group (causal half, no padding). The linear part is 2se per token that adds its
        # lin_k^T V to the running sum, i.e. a token of any group but the last (only later groups
        # read a group's sum), plus 2se per token that reads the sum with lin_q, i.e. a token of any
        # group but the first. (This used to be a flat 4se per token, which counted the first
        # group's reads and the last group's writes that no token needs; with T <= g there is no
        # linear part at all.) The chunked op's padding of a last partial group is not counted.
        s, e, g = cfg.qk_dim, cfg.width, cfg.group_size
        quad = 2 * (s + e) * group_pairs_per_token(seq_len, g)
        writes = (-(-seq_len // g) - 1) * g  # tokens outside the last group
        reads = seq_len - min(g, seq_len)  # tokens outside the first group
        return int(cfg.depth * (quad + 2 * s * e * (writes + reads) / seq_len))

    @staticmethod
    def width_multiple(cfg: ModelConfig) -> int:
        return 16

    @staticmethod
    def decode_state_grows(cfg: ModelConfig) -> bool:
        return False

    @staticmethod
    def preset_geometry(cfg: ModelConfig) -> list[str]:
        return [
            f"  qk_dim: {cfg.qk_dim}          # s",
            f"  group_size: {cfg.group_size}     # g",
            f"  width: {cfg.width}          # e: the expansion width",
            f"  depth: {cfg.depth}             # block applications",
        ]
