"""`LanguageModel`: head embedding -> backbone -> final RMSNorm -> head (docs/design.md §1, §7)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tango_lm.errors import UserError
from tango_lm.layers import active_width
from tango_lm.layers.gated_deltanet import ShortConvolution
from tango_lm.layers.norm import RMSNorm
from tango_lm.models.config import ModelConfig, active_width_unsupported
from tango_lm.ops.twin_loss import IGNORE_INDEX
from tango_lm.serve.cache import DecodeCache


def _draw_short_convolutions(model: nn.Module, std: float) -> None:
    """GDN's short convolutions, N(0, std²) as fla's models draw every Conv1d (they kept PyTorch's
    U(±0.5) at kernel 4: 14 times fla's std, whatever model.init_std said). From a generator of
    their own, seeded by the model seed: every other weight draws exactly as before (a seed still
    makes the same model, tests/train/test_old_checkpoints.py)."""
    convs = [m for m in model.modules() if isinstance(m, ShortConvolution)]
    if not convs:
        return
    generator = torch.Generator().manual_seed(torch.initial_seed() ^ 0x5C0)  # torch.manual_seed(s) sets initial_seed
    with torch.no_grad():
        for conv in convs:
            drawn = torch.randn(conv.weight.shape, generator=generator) * std
            conv.weight.copy_(drawn)


class LanguageModel(nn.Module):
    """Calling the model on input_ids [B, T] returns next-token log-probs [B, T, V] in fp32."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        from tango_lm.heads.registry import HEADS
        from tango_lm.models.registry import ARCHITECTURES

        self.config = config
        self.backbone = ARCHITECTURES[config.arch].build(config)
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        if config.active_width is not None and not active_width.active_columns(self.backbone):
            raise active_width_unsupported(config.arch)  # a registration whose rotating_width is wrong
        # The body is initialized before the head draws its tables, so with one seed every head
        # gets the same initial body (the onóna protocol compares heads on identical bodies).
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.init_std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        _draw_short_convolutions(self, config.init_std)
        self.head = HEADS[config.head](config)
        self.head.loss_chunk = config.loss_chunk

    def _outside_vocab(self, ids: torch.Tensor, ignore: int | None = None) -> tuple[int, int] | None:
        """(min, max) of `ids` (`ignore` not counted) when one is outside [0, vocab_size), else None.
        It reads values, so it looks only at CPU tensors, and not under torch.compile."""
        if ids.device.type != "cpu" or torch.compiler.is_compiling() or ids.numel() == 0:
            return None
        if ignore is not None:
            ids = torch.where(ids == ignore, 0, ids)  # min and max of the rest: no data-dependent shape
        lo, hi = int(ids.min()), int(ids.max())
        return (lo, hi) if lo < 0 or hi >= self.config.vocab_size else None

    def check_ids(self, input_ids: torch.Tensor) -> None:
        """Raise UserError for ids outside [0, vocab_size) (`_outside_vocab`)."""
        if (bad := self._outside_vocab(input_ids)) is not None:
            lo, hi = bad
            raise UserError(
                f"token id {hi if hi >= self.config.vocab_size else lo} is outside the model's vocabulary "
                f"[0, {self.config.vocab_size}); use data prepared with the model's tokenizer or raise model.vocab_size"
            )

    def check_targets(self, input_ids: torch.Tensor, targets: torch.Tensor) -> None:
        """Raise UserError unless targets match input_ids' shape and are ids of the vocabulary or
        IGNORE_INDEX (read as `check_ids` reads ids)."""
        _check_id_tensor(targets, "targets")
        if targets.shape != input_ids.shape:
            raise UserError(
                f"targets of shape {tuple(targets.shape)} for input_ids of shape {tuple(input_ids.shape)}; "
                "give one target per input position"
            )
        if (bad := self._outside_vocab(targets, ignore=IGNORE_INDEX)) is not None:
            lo, hi = bad
            raise UserError(
                f"target id {lo if lo < 0 else hi} is outside the model's vocabulary [0, {self.config.vocab_size}); "
                f"targets are token ids, or {IGNORE_INDEX} for a position not scored"
            )

    def hidden(self, input_ids: torch.Tensor, cache: DecodeCache | None = None) -> torch.Tensor:
        """Final-normed hidden states [B, T, d]; with a cache, of the positions after it (and the
        cache advances past them)."""
        _check_id_tensor(input_ids, "input_ids")
        if input_ids.dim() != 2:
            raise UserError(f"input_ids of shape {tuple(input_ids.shape)}; give a [batch, positions] tensor")
        start = cache.position if cache is not None else 0
        if start + input_ids.shape[-1] > self.config.context_length:
            raise UserError(
                f"sequence of {start + input_ids.shape[-1]} tokens is longer than model.context_length="
                f"{self.config.context_length}; shorten it or raise context_length"
            )
        self.check_ids(input_ids)
        if input_ids.shape[-1] == 0:  # no position: some mixers' convolutions and chunks need one
            return self.norm(self.head.embed(input_ids))
        h = self.norm(self.backbone(self.head.embed(input_ids), cache))
        if cache is not None:
            cache.position += input_ids.shape[-1]
        return h

    def forward(self, input_ids: torch.Tensor, cache: DecodeCache | None = None) -> torch.Tensor:
        """Next-token log-probs [B, T, V] (fp32) of the given positions."""
        return self.head.log_probs(self.hidden(input_ids, cache), input_ids)

    # -- rotating narrow-width training (docs/design.md §2.6, layers/active_width.py) -----------------------
    @property
    def num_segments(self) -> int | None:
        """Segments of the gated width under `active_width` (None when it is not set)."""
        return active_width.model_num_segments(self.backbone)

    def set_active_segment(self, index: int | None) -> None:
        """Run only segment `index` of every block's gated width; None runs all columns (eval default)."""
        active_width.set_active_segment(self.backbone, index)

    # -- activation checkpointing (train.activation_checkpointing, models/backbone.py) -------------
    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block application in the backward of training forwards (less activation
        memory for one more forward of the body); decoding and evaluation are unaffected."""
        self.backbone.activation_checkpointing = bool(enabled)

    def new_cache(self, capacity: int | None = None) -> DecodeCache:
        """An empty decode cache for up to `capacity` positions (default: the context length)."""
        if capacity is None:
            capacity = self.config.context_length
        elif isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            # 0 had meant the default and -1 a negative-size buffer at the first forward
            raise UserError(f"a decode cache's capacity is a number of positions >= 1 (got {capacity!r})")
        return DecodeCache(len(self.backbone.schedule), capacity)

    def nll(self, input_ids: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """NLL in nats of targets [B, T] through the head's fused loss path ('mean' over the scored
        targets, or 'sum'); targets equal to IGNORE_INDEX (-100) are not scored, as in
        F.cross_entropy. In training mode MoE adds its load-balancing loss (below)."""
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.check_targets(input_ids, targets)
        total = self.head.nll(self.hidden(input_ids), input_ids, targets)
        scored = (targets != IGNORE_INDEX).sum()
        loss = total / scored if reduction == "mean" else total
        # MoE load-balancing loss (docs/design.md §4.3): part of the training objective only (per scored
        # target, so that 'sum' / scored == 'mean'); evaluation NLL stays pure.
        aux = self.backbone.aux_loss() if self.training and hasattr(self.backbone, "aux_loss") else None
        if aux is not None:
            loss = loss + (aux if reduction == "mean" else aux * scored)
        return loss


def _check_id_tensor(ids: Any, name: str) -> None:
    """Token ids are an integer tensor: a list had raised AttributeError, floats or bools a deep
    embedding or gather error."""
    if not isinstance(ids, torch.Tensor):
        raise UserError(
            f"{name} must be a torch tensor of token ids (got a {type(ids).__name__}); use torch.tensor(...)"
        )
    if ids.dtype not in (torch.int64, torch.int32):  # what nn.Embedding takes (uint8 or int16 raised deep in it)
        raise UserError(f"{name} must hold int64 or int32 token ids (got {ids.dtype}); convert with .long()")


def build_model(config: ModelConfig) -> LanguageModel:
    """Build the model a config describes (docs/design.md §7), holding a copy of it checked again:
    fields set after it was checked (`cfg.d_model = 64`) kept the derived head count (1 head of
    64 for 2 of 32), and a later change to the caller's object changed the model's config too."""
    if not isinstance(config, ModelConfig):
        raise UserError(f"build_model takes a ModelConfig (got {type(config).__name__}); see ModelConfig.from_dict")
    return LanguageModel(ModelConfig.from_dict(config.to_dict()))
