"""Geometries a paper gives as data rather than by the matching rule (docs/design.md §2.8).

Each is registered on its architecture (`Architecture.fixed_geometries`) under a label of its own,
and everything reads it from there (`models.registry.fixed_geometries`): a sweep's `arch` axis
takes the label (with a tier axis, whose geometry it builds), `tango-lm match` lists it after the
matched rows, the generated presets include it, and reports show its runs after the architecture's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tango_lm.models.config import ModelConfig


@dataclass(frozen=True)
class FixedGeometry:
    label: str  # the `arch` a sweep takes and a run directory carries: "conventional-untied"
    display_name: str  # in reports: "Conventional Untied"
    title: str  # in generated presets: "Conventional Untied Transformer++"
    source: str  # where the paper gives it: "seed 000 Table 6"
    shapes: Mapping[tuple[str, int], tuple[int, int, int]]  # (tier, depth) -> (d_model, n_heads, width)

    def config(self, arch: str, tier: str, depth: int, vocab_size: int) -> ModelConfig | None:
        """The geometry of `arch` for a paper tier and depth, or None where the paper gives none."""
        shape = self.shapes.get((tier.strip().upper(), depth))
        if shape is None:
            return None
        d_model, n_heads, width = shape
        return ModelConfig(arch=arch, d_model=d_model, n_heads=n_heads, width=width, depth=depth, vocab_size=vocab_size)

    def where(self) -> str:
        """The tiers and depths it has, for an error: "tier 70M or 160M with depth 4, 8 or 16"."""
        tiers = list(dict.fromkeys(tier for tier, _ in self.shapes))
        depths = sorted({depth for _, depth in self.shapes})
        return f"tier {_either(tiers)} with depth {_either([str(d) for d in depths])}"


def _either(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"
