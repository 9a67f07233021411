"""Seed 000 Table 3's last column: the smallest and largest non-embedding parameter count over a
row's architectures (TANGO / windowed TANGO, Loop and Untied Transformer++, GAU at each context
length, FLASH), and the paper's values to set it against.

The paper prints the range in millions with three decimals; `paper_range` returns it as such and
`in_paper_units` rounds a count the same way, so a reading reproduces an endpoint when the two are
equal. Which reading of GAU/FLASH comes closest, and why none reproduces all eight endpoints, is in
docs/table3-ranges.md (tested in tests/models/test_table3_ranges.py).
"""

from __future__ import annotations

from typing import Any

# The architectures Table 3's rows match (the Loop and Untied columns are the Transformer++ baselines).
TABLE3_ARCHS = ("tango", "tango-windowed", "loop-transformer", "untied-transformer", "gau", "flash")

# (tier, depth) -> (smallest, largest) non-embedding count in millions, as printed in Table 3.
PAPER_RANGES = {
    ("70M", 4): (44.238, 44.307),
    ("70M", 8): (44.180, 44.279),
    ("160M", 4): (121.293, 121.429),
    ("160M", 8): (121.272, 121.543),
}


def in_paper_units(count: int) -> float:
    """A parameter count in millions with three decimals, as Table 3 prints it."""
    return round(count / 1e6, 3)


def paper_range(tier: str, depth: int) -> tuple[float, float] | None:
    """Table 3's range for a paper tier and depth, or None when the paper has no such row."""
    return PAPER_RANGES.get((tier.strip().upper(), depth))


def non_embedding_range(rows: list[dict[str, Any]], table3: bool = True) -> dict[str, Any] | None:
    """The smallest and largest non-embedding count among the rows of Table 3's architectures
    (`match_tier` rows), or among all rows with `table3=False` (a range printed under a table of
    other models had left them out), with the architectures that set them; None without a row."""
    mine = [r for r in rows if r["arch"] in TABLE3_ARCHS or not table3]
    if not mine:
        return None
    low = min(mine, key=lambda r: r["non_embedding"])
    high = max(mine, key=lambda r: r["non_embedding"])
    return {
        "min": low["non_embedding"],
        "max": high["non_embedding"],
        "min_arch": low["arch"],
        "max_arch": high["arch"],
    }
