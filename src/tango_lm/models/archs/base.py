"""What every architecture provides: validation, construction, and its analytic counts."""

from __future__ import annotations

from torch import nn

from tango_lm.models.config import ModelConfig


class Architecture:
    """Stateless description of one architecture. Counts exclude the vocabulary tables, which
    belong to the head; they include the final norm (`d`)."""

    name: str = ""
    uses_heads: bool = True  # False: no multi-head split (GAU, FLASH), so d_model need not divide by heads

    @staticmethod
    def validate(cfg: ModelConfig) -> None:
        """Raise UserError for configs this architecture cannot build."""

    @staticmethod
    def build(cfg: ModelConfig) -> nn.Module:
        raise NotImplementedError

    @staticmethod
    def non_embedding_params(cfg: ModelConfig) -> int:
        raise NotImplementedError

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> float:
        """Weights each token multiplies through in one forward (loops counted per application).
        Under rotating narrow-width training only the active columns, averaged over a rotation
        (so possibly fractional)."""
        raise NotImplementedError

    @staticmethod
    def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        """Forward FLOPs of token mixing per token, averaged over a causal sequence of seq_len."""
        raise NotImplementedError

    @staticmethod
    def width_multiple(cfg: ModelConfig) -> int:
        """The free width (`width`) is matched in steps of this (docs/design.md §2.8)."""
        return int(cfg.n_heads or 1)


def causal_pairs_per_token(seq_len: int) -> float:
    """Average number of visible sources per destination in a causal sequence: (T + 1) / 2."""
    return (seq_len + 1) / 2
