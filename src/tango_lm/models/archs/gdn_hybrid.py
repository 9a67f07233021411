"""Gated DeltaNet hybrid (docs/design.md §4.2): `depth` layers, every `attention_every`-th one (default 4: three
GDN layers to one) the Dense model's GQA + QK-norm attention, the rest Gated DeltaNet; each layer
is followed by SwiGLU of width F, all pre-normed, final RMSNorm.

GDN sizes. fla's `GatedDeltaNet` defaults (6 heads of 256 at d = 2048, i.e. key width 0.75·d,
values expanded 2x) would add about 6·d² per layer. We keep fla's layer structure, init and
names, but default to key width = value width = d in heads of 128 (`gdn_head_dim = 128`,
`gdn_n_heads = d // 128`, `gdn_expand_v = 1`): at the paper's 142M shape (d = 768, F = 2048, 16
layers, 12 of them GDN) this gives 118,213,520 non-embedding parameters, the paper's "118.2M for GDN
hybrid" (Appendix C; the fla-default ratios would give 125.3M). As in the paper, the hybrid shares
the Dense model's depth and width, so it is larger than Dense; `width` can be lowered to match
the Dense total instead (see the presets).

Parameters of a GDN layer (h heads, key width d_k, value width d_v per head, kernel K_c):
    2·d·h·d_k (q, k) + 3·d·h·d_v (v, g, o) + 2·d·h (a, b) + 2·h (A_log, dt_bias)
    + K_c·h·(2·d_k + d_v) (short convs) + d_v (o_norm) + 3·d·F + 2·d
FLOPs per token (forward): 2 × the projection, conv and FFN weights, plus, per GDN head, 6·d_k·d_v
for the recurrence (read Mᵀk, the rank-1 write, read Mᵀq), plus the attention layers' mixing.
"""

from __future__ import annotations

from torch import nn

from tango_lm.errors import UserError
from tango_lm.layers.gated_deltanet import gated_deltanet_block, gdn_params
from tango_lm.models.archs.base import Architecture
from tango_lm.models.archs.dense import (
    attention_matmul_params,
    attention_mixing_flops,
    check_gqa,
    dense_layer,
    dense_layer_params,
)
from tango_lm.models.backbone import Backbone
from tango_lm.models.config import ModelConfig

GDN_BACKENDS = ("auto", "torch", "fla")


def is_attention_layer(cfg: ModelConfig, index: int) -> bool:
    return cfg.attention_every > 0 and (index + 1) % cfg.attention_every == 0


def n_attention_layers(cfg: ModelConfig) -> int:
    return cfg.depth // cfg.attention_every if cfg.attention_every > 0 else 0


def n_gdn_layers(cfg: ModelConfig) -> int:
    """The Gated DeltaNet layers: none with attention_every=1, when no GDN field is read."""
    return cfg.depth - n_attention_layers(cfg)


def gdn_shape(cfg: ModelConfig) -> tuple[int, int, int]:
    """(heads, key width, value width) per GDN head."""
    heads = cfg.gdn_n_heads if cfg.gdn_n_heads is not None else cfg.d_model // cfg.gdn_head_dim
    return heads, cfg.gdn_head_dim, round(cfg.gdn_head_dim * cfg.gdn_expand_v)


def gdn_layer_params(cfg: ModelConfig) -> int:
    heads, dk, dv = gdn_shape(cfg)
    d = cfg.d_model
    return gdn_params(d, heads, dk, dv, cfg.conv_size) + 3 * d * cfg.width + 2 * d


class GdnHybrid(Architecture):
    name = "gdn-hybrid"
    reads = (
        "n_kv_heads",
        "attention_every",
        "gdn_head_dim",
        "gdn_n_heads",
        "gdn_expand_v",
        "conv_size",
        "gdn_chunk",
        "gdn_backend",
    )
    display_name = "GDN hybrid"
    family = "onona"
    budget_reference = "dense"  # the paper's 40 TPP of the Dense Standard count at this shape
    decode_state = (
        "GDN layers: the d_k x d_v state per head and the last conv_size - 1 inputs of q, k, v "
        "(bounded); attention layers: keys and values of every position"
    )
    tiny = {
        "n_kv_heads": 2,
        "depth": 3,
        "attention_every": 3,
        "gdn_head_dim": 8,
        "gdn_expand_v": 2.0,
        "gdn_chunk": 4,
    }  # GDN, GDN, attention

    @staticmethod
    def validate(cfg: ModelConfig) -> None:
        check_gqa(cfg)
        for name in ("gdn_head_dim", "conv_size", "gdn_chunk"):
            if getattr(cfg, name) < 1:
                raise UserError(f"model.{name} must be at least 1 (got {getattr(cfg, name)})")
        if cfg.attention_every < 0:
            raise UserError(f"model.attention_every must be >= 0 (got {cfg.attention_every}); use 0 for GDN only")
        if cfg.gdn_n_heads is not None and cfg.gdn_n_heads < 1:
            raise UserError(f"model.gdn_n_heads must be at least 1 (got {cfg.gdn_n_heads}); or leave it unset")
        if n_gdn_layers(cfg) and cfg.gdn_n_heads is None and cfg.d_model < cfg.gdn_head_dim:
            raise UserError(
                f"model.gdn_head_dim={cfg.gdn_head_dim} exceeds d_model={cfg.d_model}; lower gdn_head_dim or set gdn_n_heads"
            )
        dv = cfg.gdn_head_dim * cfg.gdn_expand_v
        if dv < 1 or abs(dv - round(dv)) > 1e-9:
            raise UserError(
                f"model.gdn_head_dim * gdn_expand_v = {dv:g} must be a positive whole number; change gdn_expand_v"
            )
        if cfg.gdn_backend not in GDN_BACKENDS:
            raise UserError(f"model.gdn_backend must be one of {', '.join(GDN_BACKENDS)} (got {cfg.gdn_backend!r})")

    @staticmethod
    def warnings(cfg: ModelConfig, seq_len: int | None = None) -> list[str]:
        said = []
        if cfg.depth < cfg.attention_every:
            said.append(
                f"model.attention_every={cfg.attention_every} is more than model.depth={cfg.depth}: no layer is "
                "attention, so the hybrid is Gated DeltaNet alone; lower model.attention_every (0 says GDN only)"
            )
        if n_gdn_layers(cfg) and cfg.gdn_n_heads is None and cfg.d_model % cfg.gdn_head_dim:
            heads = gdn_shape(cfg)[0]
            said.append(
                f"model.d_model={cfg.d_model} is not a multiple of model.gdn_head_dim={cfg.gdn_head_dim}: the GDN "
                f"layers read {heads * cfg.gdn_head_dim} key channels ({heads} heads); set model.gdn_n_heads to choose"
            )
        return said

    @staticmethod
    def build(cfg: ModelConfig) -> nn.Module:
        heads, dk, dv = gdn_shape(cfg)
        layers = [
            dense_layer(cfg)
            if is_attention_layer(cfg, i)
            else gated_deltanet_block(
                cfg.d_model, heads, dk, dv, cfg.conv_size, cfg.width, cfg.norm_eps, cfg.gdn_chunk, cfg.gdn_backend
            )
            for i in range(cfg.depth)
        ]
        return Backbone(layers, list(range(cfg.depth)), cfg.head_dim, cfg.rope_theta)

    @staticmethod
    def non_embedding_params(cfg: ModelConfig) -> int:
        n_attn = n_attention_layers(cfg)
        return n_attn * dense_layer_params(cfg) + (cfg.depth - n_attn) * gdn_layer_params(cfg) + cfg.d_model

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> int:
        heads, dk, dv = gdn_shape(cfg)
        d, n_attn = cfg.d_model, n_attention_layers(cfg)
        gdn = 2 * d * heads * dk + 3 * d * heads * dv + 2 * d * heads + cfg.conv_size * heads * (2 * dk + dv)
        ffn = 3 * d * cfg.width
        return n_attn * (attention_matmul_params(cfg) + ffn) + (cfg.depth - n_attn) * (gdn + ffn)

    @staticmethod
    def check_packages(cfg: ModelConfig, on_cuda: bool) -> None:
        from tango_lm.ops import delta_rule_fla
        from tango_lm.ops.delta_rule import wants_fla

        if cfg.gdn_backend == "fla" and wants_fla("fla", on_cuda) and n_gdn_layers(cfg):
            delta_rule_fla.require_fla()

    @staticmethod
    def decode_state_grows(cfg: ModelConfig) -> bool:
        return n_attention_layers(cfg) > 0

    @staticmethod
    def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        heads, dk, dv = gdn_shape(cfg)
        n_attn = n_attention_layers(cfg)
        recurrence = 6 * heads * dk * dv
        return int(n_attn * attention_mixing_flops(cfg, seq_len) + (cfg.depth - n_attn) * recurrence)
