"""Parameter matching (docs/design.md §2.8): pick each architecture's free width so its total parameter
count is nearest a target. Reproduces seed 000 Table 3 at the 70M and 160M tiers."""

from __future__ import annotations

import decimal
import re
from typing import Any

from tango_lm.errors import UserError
from tango_lm.models.config import ModelConfig
from tango_lm.models.params import count_params

# Tier name -> (total parameters, d_model) as the TANGO paper defines them.
TIERS = {"70M": (70_000_000, 512), "160M": (160_000_000, 768)}
PAPER_VOCAB = 50257  # GPT-2's vocabulary, the papers' (their Tables 3, 6 and 9 count its embedding)


def matched_archs() -> list[str]:
    """The architectures of the TANGO paper's matched comparison, in registry order."""
    from tango_lm.models.registry import ARCHITECTURES

    return [name for name, arch in ARCHITECTURES.items() if arch.matched]


def parse_tier(tier: str, d_model: int | None) -> tuple[int, int]:
    """'70M' / '160M' / '25M' / '1.5B' / '1e9' / '1500000' -> (target total, d_model)."""
    key = tier.strip().upper()
    if key in TIERS:
        target, default_d = TIERS[key]
        return target, d_model if d_model is not None else default_d
    m = re.fullmatch(r"(\d+(?:\.\d+)?(?:E\d+)?)([KMB]?)", key)  # 1e9 as YAML and train.tokens take it
    if not m:
        raise UserError(f"unknown tier {tier!r}; use 70M, 160M or a parameter count such as 25M, 1.5B, 1e9 or 1500000")
    # Exact decimal arithmetic: a float multiplied 1e30 into 1,000,000,000,000,000,019,884,624,838,656.
    number = decimal.Decimal(m.group(1))
    if number.adjusted() > 30:  # 1e5000 would be 5,000 digits to multiply and print
        raise UserError(f"tier {tier!r} is past any model's parameter count; give one below 2**63, such as 1.5B")
    with decimal.localcontext() as ctx:  # exact: the default 28 digits rounded 1.0000000000000000000000000001K
        ctx.prec = len(m.group(1)) + 40
        exact = number.scaleb({"": 0, "K": 3, "M": 6, "B": 9}[m.group(2)])
        shown = exact.normalize()  # 1000.5, not 1000.5000
    if exact != exact.to_integral_value():  # 1.5 was matched as 1 parameter, 1.0005K as 1,000
        raise UserError(f"tier {tier!r} is {shown:f} parameters, not a whole number; give a count such as 1500 or 1.5K")
    target = int(exact)
    if not 1 <= target < 2**63:
        raise UserError(
            f"tier {tier!r} is no parameter count a model can have; give one from 1 to 2**63 - 1, such as 25M"
        )
    if d_model is None:
        raise UserError(f"tier {tier!r} is not a paper tier; give --d-model for it")
    return target, d_model


def match_width(cfg: ModelConfig, target_total: int) -> ModelConfig:
    """The config with `width` set to the multiple of the architecture's step whose total
    parameter count is nearest `target_total` (ties go to the smaller width)."""
    from tango_lm.models.registry import ARCHITECTURES

    step = ARCHITECTURES[cfg.arch].width_multiple(cfg)
    base = count_params(cfg.replace(width=step))["total"]
    per_step = count_params(cfg.replace(width=2 * step))["total"] - base
    if per_step <= 0:
        raise UserError(f"architecture {cfg.arch!r} has no free width to match; set its width directly")
    # Counts are affine in width, so the nearest multiple is found in closed form, then checked.
    k = max(1, (2 * (target_total - base) + per_step) // (2 * per_step) + 1)  # integers: exact at any size
    candidates = [c for c in (k - 1, k, k + 1) if c >= 1]
    best = min(candidates, key=lambda c: (abs(count_params(cfg.replace(width=c * step))["total"] - target_total), c))
    if count_params(cfg.replace(width=step))["total"] > target_total and best == 1:
        smallest = count_params(cfg.replace(width=step))["total"]
        raise UserError(
            f"{cfg.arch} at d_model={cfg.d_model}, depth={cfg.depth} already has {smallest:,} parameters at its "
            f"smallest width ({step}), more than {target_total:,}; raise the target, or lower what the width does "
            "not set: d_model, depth, the vocabulary, or a field such as GAU's context length (its relative bias)"
        )
    return cfg.replace(width=best * step)


def match_tier(
    target: int,
    d_model: int,
    depth: int,
    archs: list[str] | None = None,
    unmatched: dict[str, str] | None = None,
    **fields: Any,
) -> list[dict[str, Any]]:
    """One row per architecture: its matched width and parameter counts. With `unmatched`, an
    architecture no width matches (its other parameters alone pass the target) is left out, its
    error recorded there, instead of stopping the others."""
    if depth < 1:
        raise UserError(f"depth must be at least 1 (got {depth})")
    from tango_lm.models.registry import ARCHITECTURES

    rows = []
    for arch in archs or matched_archs():
        if archs is None and depth < ARCHITECTURES[arch].min_depth and unmatched is None:
            continue  # e.g. three sets need three applications
        try:
            base = ModelConfig(arch=arch, d_model=d_model, depth=depth, width=d_model, **fields)
            rows.append(_row(match_width(base, target), target))
        except UserError as exc:
            if unmatched is None:
                raise
            unmatched[arch] = str(exc)  # said under the table: a depth three sets cannot take, say
    return rows


# Seed 000 Table 9: the active-ratio comparison at 70M, depth 4: target F/d -> (d, heads, F).
ACTIVE_RATIO = {
    "tango": {0.5: (1280, 40, 640), 1: (1248, 39, 1170), 2: (1184, 37, 2257), 4: (1088, 34, 4046), 8: (928, 29, 7656)},
    "tango-3set": {
        0.5: (1216, 38, 570),
        1: (1120, 35, 1120),
        2: (992, 31, 2015),
        4: (864, 27, 3267),
        8: (704, 22, 5346),
    },
}


def _row(cfg: ModelConfig, target: int | None, **extra: Any) -> dict[str, Any]:
    counts = count_params(cfg)
    gap = counts["total"] - target if target is not None else None
    return {
        "arch": cfg.arch,
        "d_model": cfg.d_model,
        "n_heads": cfg.n_heads,
        "width": cfg.width,
        "depth": cfg.depth,
        **counts,
        "gap": gap,
        **extra,
    }


def active_ratio_rows(vocab_size: int = PAPER_VOCAB) -> list[dict[str, Any]]:
    """Table 9's geometries with their counts (70M target, depth 4)."""
    from tango_lm.models.registry import ARCHITECTURES

    rows = []
    for arch, table in ACTIVE_RATIO.items():
        if arch not in ARCHITECTURES:
            continue
        for ratio, (d, heads, width) in table.items():
            cfg = ModelConfig(arch=arch, d_model=d, n_heads=heads, width=width, depth=4, vocab_size=vocab_size)
            rows.append(_row(cfg, 70_000_000, target_ratio=ratio, realized_ratio=round(width / d, 3)))
    return rows
