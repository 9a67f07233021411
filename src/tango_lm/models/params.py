"""Parameter counts from the formulas (docs/design.md §2-§4); tests hold every formula to the module's `numel`."""

from __future__ import annotations

from tango_lm.models.config import ModelConfig


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """{'total', 'non_embedding', 'embedding'} from the formulas; tests hold them to `numel`."""
    from tango_lm.heads.registry import HEADS
    from tango_lm.models.registry import ARCHITECTURES

    head = HEADS[cfg.head]
    embedding = head.embedding_params(cfg)
    non_embedding = ARCHITECTURES[cfg.arch].non_embedding_params(cfg) + head.extra_params(cfg)
    return {"total": embedding + non_embedding, "non_embedding": non_embedding, "embedding": embedding}


def active_non_embedding_params(cfg: ModelConfig) -> int:
    """The non-embedding parameters one token uses: MoE's router and k of its E experts per layer
    (the count its presets match Dense's at, docs/design.md §4.3); every parameter elsewhere."""
    from tango_lm.heads.registry import HEADS
    from tango_lm.models.registry import ARCHITECTURES

    return ARCHITECTURES[cfg.arch].active_non_embedding_params(cfg) + HEADS[cfg.head].extra_params(cfg)
