"""Windowed TANGO (docs/design.md §2.3): TANGO with exact scores in a window of `window` recent sources and
the feature map `feature_map` for older ones. Same parameters as TANGO; linear cost in T."""

from __future__ import annotations

from torch import nn

from tango_lm.errors import UserError
from tango_lm.layers.tango_windowed import WindowedTangoBlock
from tango_lm.models.archs.base import longest_sequence
from tango_lm.models.archs.tango import Tango
from tango_lm.models.backbone import Backbone
from tango_lm.models.config import ModelConfig
from tango_lm.ops.windowed import FEATURE_MAPS


def window_pairs_per_token(seq_len: int, window: int) -> float:
    """Average number of exactly-scored sources per destination: mean over t < T of min(W, t + 1)."""
    if seq_len <= window:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


class TangoWindowed(Tango):
    name = "tango-windowed"
    triton_ops = ("windowed_mix",)
    reads = ("window", "feature_map")
    display_name = "Windowed TANGO"
    description = "windowed TANGO (window 64, elu+1 features)"
    decode_state = (
        "the last window - 1 keys, feature-mapped keys and gates, and the prefix sums of "
        "phi(k) g^T and phi(k) (bounded)"
    )
    tiny = {"window": 4}

    @staticmethod
    def validate(cfg: ModelConfig) -> None:
        Tango.validate(cfg)
        if cfg.feature_map not in FEATURE_MAPS:
            raise UserError(
                f"unknown model.feature_map {cfg.feature_map!r} for tango-windowed; "
                f"choose one of: {', '.join(FEATURE_MAPS)}"
            )

    @staticmethod
    def build(cfg: ModelConfig) -> nn.Module:
        block = WindowedTangoBlock(
            cfg.d_model, cfg.n_heads, cfg.width, cfg.norm_eps, cfg.window, cfg.feature_map, cfg.active_width
        )
        return Backbone([block], [0] * cfg.depth, cfg.head_dim, cfg.rope_theta)

    @staticmethod
    def warnings(cfg: ModelConfig, seq_len: int | None = None) -> list[str]:
        if cfg.window < min(seq_len or cfg.context_length, cfg.context_length):
            return []
        return [
            f"model.window={cfg.window} is at least {longest_sequence(cfg, seq_len)}: no source is ever "
            "older than the window, so tango-windowed computes exactly full-prefix TANGO, at its quadratic cost; "
            "lower model.window for the linear-time model"
        ]

    @staticmethod
    def decode_state_grows(cfg: ModelConfig) -> bool:
        return False

    @classmethod
    def preset_geometry(cls, cfg: ModelConfig) -> list[str]:
        return [*Tango.preset_geometry(cfg), f"  window: {cfg.window}"]

    @classmethod
    def attention_flops_per_token(cls, cfg: ModelConfig, seq_len: int) -> int:
        """Per application: TANGO's 2(d + F) per exactly-scored source, over min(W, t + 1) sources;
        plus, for destinations with sources older than the window (t >= W, a fraction (T - W) / T),
        the feature-map part: adding phi(k) g^T and phi(k) to the prefix state (2 d_h (F/H + 1) per
        head) and reading it out with phi(q) (the same again), 4 (d_h F + d) in all.
        With W >= T it is TANGO's count. Under rotating narrow-width training F is the gate columns
        a step runs (`Tango.trained_width`), as for TANGO."""
        d, f = cfg.d_model, cls.trained_width(cfg)
        exact = 2 * (d + f) * window_pairs_per_token(seq_len, cfg.window)
        old_fraction = max(seq_len - cfg.window, 0) / seq_len
        feature = 4 * (cfg.head_dim * f + d) * old_fraction
        return int(cfg.depth * (exact + feature))
