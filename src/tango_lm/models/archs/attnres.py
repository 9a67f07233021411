"""Attention Residuals backbone (docs/design.md §4.4, AttnRes; Kimi Team 2026): the Dense model's layers, with
the residual stream replaced by softmax attention over depth (layers/attnres.py). Sublayers are
the attention and SwiGLU sublayers; `attnres_block` (layers per block) selects Block AttnRes.

Parameters: Dense plus 2·d per depth mix (pseudo-query w_l and key-norm weight): two per layer
and one for the output, i.e. Dense + (2·depth + 1)·2·d. At the 142M shape: 103,887,104
non-embedding, the paper's "103.9M for AttnRes" (Appendix C).
FLOPs per token (forward): Dense's, plus per mix 4·d per source (the logit dot product and the
weighted sum), with l sources at mix l in full AttnRes (fewer with blocks).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tango_lm.errors import UserError
from tango_lm.layers.attnres import AttnRes, AttnResLayer, DepthSources
from tango_lm.layers.rope import rope_tables
from tango_lm.models.archs.base import Architecture
from tango_lm.models.archs.dense import Dense, check_gqa, dense_layer_params
from tango_lm.models.backbone import Backbone
from tango_lm.models.config import ModelConfig
from tango_lm.serve.cache import DecodeCache


def block_sublayers(cfg: ModelConfig) -> int:
    """Sublayer outputs summed per source: 2 per layer of a block, 1 for full AttnRes."""
    return 2 * cfg.attnres_block if cfg.attnres_block else 1


def sources_per_mix(cfg: ModelConfig) -> list[int]:
    """How many sources each of the 2·depth + 1 mixes attends over."""
    block, counts = block_sublayers(cfg), []
    for done in range(2 * cfg.depth + 1):  # `done` sublayer outputs recorded before this mix
        counts.append(1 + done // block + (1 if done % block else 0))
    return counts


class AttnResBackbone(Backbone):
    """Embedding -> layers reading and writing depth sources -> the output mix."""

    def __init__(self, cfg: ModelConfig) -> None:
        layers = [
            AttnResLayer(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.width, cfg.norm_eps)
            for _ in range(cfg.depth)
        ]
        super().__init__(layers, list(range(cfg.depth)), cfg.head_dim, cfg.rope_theta)
        self.out_res = AttnRes(cfg.d_model, cfg.norm_eps)
        self.block = block_sublayers(cfg)
        self.eps = cfg.norm_eps

    def forward(self, x: torch.Tensor, cache: DecodeCache | None = None) -> torch.Tensor:
        start = cache.position if cache is not None else 0
        rope = rope_tables(x.shape[1], self.head_dim, self.rope_theta, x.device, start=start, dtype=x.dtype)
        sources = DepthSources.start(x, self.block, self.eps)
        recompute = self.recomputes(cache)
        for application, index in enumerate(self.schedule):
            if recompute:  # a layer edits its sources in place: checkpoint it on a copy
                sources = checkpoint(_apply_layer, self.layers[index], sources, rope, use_reentrant=False)
            else:
                state = cache.states[application] if cache is not None else None
                self.layers[index](sources, rope, state)
        return self.out_res(*sources.current())


def _apply_layer(layer: AttnResLayer, sources: DepthSources, rope: tuple[torch.Tensor, torch.Tensor]) -> DepthSources:
    """The sources after `layer`, leaving `sources` as it was, so the backward's recomputation
    starts from the same sources as the forward did."""
    after = sources.copy()
    layer(after, rope)
    return after


class AttnResArch(Architecture):
    name = "attnres"
    reads = ("n_kv_heads", "attnres_block")
    display_name = "AttnRes"
    family = "onona"
    budget_reference = "dense"  # the paper's 40 TPP of the Dense Standard count at this shape
    decode_state = "keys and values of the n_kv_heads heads, every position"
    tiny = {"n_kv_heads": 2}
    layers_return_tensors = False  # a layer adds its outputs to the DepthSources it is given

    @staticmethod
    def validate(cfg: ModelConfig) -> None:
        check_gqa(cfg)
        if cfg.attnres_block is not None and cfg.attnres_block < 0:
            raise UserError(
                f"model.attnres_block must be >= 0 (got {cfg.attnres_block}); use 0 or leave it unset for full AttnRes"
            )

    @staticmethod
    def build(cfg: ModelConfig) -> nn.Module:
        return AttnResBackbone(cfg)

    @staticmethod
    def non_embedding_params(cfg: ModelConfig) -> int:
        return cfg.depth * dense_layer_params(cfg) + cfg.d_model + (2 * cfg.depth + 1) * 2 * cfg.d_model

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> int:
        return Dense.matmul_params_per_token(cfg)

    @staticmethod
    def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        return Dense.attention_flops_per_token(cfg, seq_len) + 4 * cfg.d_model * sum(sources_per_mix(cfg))
