"""Parameter formulas (docs/design.md §2.1, §2.2) against the modules, matching (docs/design.md §2.8) against seed 000
Table 3, and the shipped presets against both."""

from __future__ import annotations

import re

import pytest
import torch

from tango_lm import ModelConfig, build_model
from tango_lm.models.matching import TIERS, match_tier, match_width
from tango_lm.models.params import count_params
from tango_lm.train.config import PRESET_DIR, load_run_config
from tests import arch_cases

V_GPT2 = 50257


def spec_non_embedding(arch: str, d: int, f: int, depth: int) -> int:
    """docs/design.md §2.1 / §2.2, written out here (final norm included)."""
    block_pp = 4 * d * d + 3 * d * f + 2 * d
    if arch == "tango":
        return 2 * d * d + 3 * d * f + 2 * d
    if arch == "loop-transformer":
        return block_pp + d
    if arch == "untied-transformer":
        return depth * block_pp + d
    raise AssertionError(arch)


def numel(model: torch.nn.Module) -> tuple[int, int]:
    """(total, non-embedding) from the module; shared parameters are counted once by parameters()."""
    total = sum(p.numel() for p in model.parameters())
    non_emb = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("head."))
    return total, non_emb


def meta_model(cfg: ModelConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return build_model(cfg)


ARCHS = ("tango", "loop-transformer", "untied-transformer")


def check_param_count(arch: str) -> None:
    """The counts from the architecture's formula (plus the Standard head's table) equal the
    module's `numel`, at the tiny config and one application deeper."""
    for cfg in (
        arch_cases.tiny_config(arch),
        arch_cases.tiny_config(arch, depth=arch_cases.tiny_config(arch).depth + 1),
    ):
        total, non_emb = numel(meta_model(cfg))
        assert count_params(cfg) == {"total": total, "non_embedding": non_emb, "embedding": total - non_emb}, cfg


@pytest.mark.parametrize("arch", arch_cases.names())
def test_every_architecture_counts_its_parameters(arch):
    check_param_count(arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    ("d", "head_dim", "f", "depth", "vocab"),
    [(32, 16, 48, 1, 50), (32, 8, 64, 2, 97), (64, 16, 96, 3, 300), (64, 32, 130, 5, 211)],
)
def test_formula_equals_numel_small(arch, d, head_dim, f, depth, vocab):
    if arch == "tango":
        f -= f % (d // head_dim)
    cfg = ModelConfig(
        arch=arch, d_model=d, head_dim=head_dim, width=f, depth=depth, vocab_size=vocab, context_length=16
    )
    model = build_model(cfg)
    total, non_emb = numel(model)
    counts = count_params(cfg)
    assert counts["non_embedding"] == non_emb == spec_non_embedding(arch, d, f, depth)
    assert counts["total"] == total == non_emb + vocab * d
    assert counts["embedding"] == vocab * d
    assert cfg.num_params() == counts


def test_depth_changes_untied_count_only():
    base = dict(d_model=32, head_dim=16, width=48, vocab_size=50, context_length=8)
    for arch in ARCHS:
        n1 = numel(build_model(ModelConfig(arch=arch, depth=1, **base)))[0]
        n4 = numel(build_model(ModelConfig(arch=arch, depth=4, **base)))[0]
        if arch == "untied-transformer":
            assert n4 - n1 == 3 * (4 * 32 * 32 + 3 * 32 * 48 + 2 * 32)
        else:
            assert n4 == n1  # one shared block, counted once


@pytest.mark.parametrize(
    ("cfg", "non_embedding", "total"),
    [
        (dict(arch="tango", d_model=512, width=28480), 44_270_592, 70_002_176),
        (dict(arch="tango", d_model=1248, n_heads=39, width=1170), None, 70_218_720),
        (dict(arch="untied-transformer", d_model=800, n_heads=25, width=2064, depth=4), 30_061_600, 70_267_200),
    ],
    ids=["tango-d512", "tango-d1248", "conventional-untied"],
)
def test_spec_check_numbers(cfg, non_embedding, total):
    config = ModelConfig(vocab_size=V_GPT2, **cfg)
    counts = count_params(config)
    model_total, model_non_emb = numel(meta_model(config))
    assert counts["total"] == model_total == total
    assert counts["non_embedding"] == model_non_emb
    if non_embedding is not None:
        assert counts["non_embedding"] == non_embedding


TABLE3 = {
    ("70M", 4): {"tango": 28480, "loop-transformer": 28144, "untied-transformer": 6528},
    ("70M", 8): {"tango": 28480, "loop-transformer": 28144, "untied-transformer": 2912},
    ("160M", 4): {"tango": 52176, "loop-transformer": 51672, "untied-transformer": 12144},
    ("160M", 8): {"tango": 52176, "loop-transformer": 51672, "untied-transformer": 5568},
}


@pytest.mark.parametrize(("tier", "depth"), list(TABLE3))
def test_match_tier_reproduces_table3(tier, depth):
    target, d = {"70M": (70_000_000, 512), "160M": (160_000_000, 768)}[tier]
    assert TIERS[tier] == (target, d)
    rows = {row["arch"]: row for row in match_tier(target, d, depth, list(TABLE3[tier, depth]))}
    assert {a: rows[a]["width"] for a in TABLE3[tier, depth]} == TABLE3[tier, depth]
    for arch, row in rows.items():
        f, h = row["width"], d // 32
        assert row["n_heads"] == h and f % h == 0 and row["depth"] == depth
        total = spec_non_embedding(arch, d, f, depth) + V_GPT2 * d
        assert row["total"] == total and row["gap"] == total - target
        # Nearest multiple of H: neither neighbour is closer to the target (docs/design.md §2.8).
        for other in (f - h, f + h):
            assert abs(spec_non_embedding(arch, d, other, depth) + V_GPT2 * d - target) >= abs(total - target)


@pytest.mark.parametrize("arch", ARCHS)
def test_match_width_small_target(arch):
    cfg = ModelConfig(arch=arch, d_model=64, head_dim=16, width=64, depth=3, vocab_size=300)
    target = 250_000
    matched = match_width(cfg, target)
    f = matched.width
    assert f % 4 == 0 and matched.d_model == 64 and matched.depth == 3
    best = min(range(4, 4000, 4), key=lambda w: abs(spec_non_embedding(arch, 64, w, 3) + 300 * 64 - target))
    assert f == best
    assert count_params(matched)["total"] == numel(build_model(matched))[0]


ALL_PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
# The parameter-matched presets of seed 000 Table 3 (other families are tested below and in their own files).
PRESETS = [n for n in ALL_PRESETS if re.fullmatch(r"(tango|loop-transformer|untied-transformer)-(70m|160m)-d\d+", n)]


def test_presets_exist():
    names = set(PRESETS)
    for arch in ARCHS:
        for tier in ("70m", "160m"):
            for depth in (4, 8):
                assert f"{arch}-{tier}-d{depth}" in names


@pytest.mark.parametrize("name", PRESETS)
def test_preset_counts_and_matched_width(name):
    m = re.fullmatch(r"(?P<arch>.+)-(?P<tier>\d+m)-d(?P<depth>\d+)", name)
    assert m, f"preset name {name} does not follow <arch>-<tier>-d<depth>"
    cfg = load_run_config(name, []).model
    arch, tier, depth = m["arch"], m["tier"].upper(), int(m["depth"])
    target, d = TIERS[tier]
    assert (cfg.arch, cfg.d_model, cfg.depth, cfg.vocab_size, cfg.n_heads) == (arch, d, depth, V_GPT2, d // 32)
    counts = count_params(cfg)
    model_total, model_non_emb = numel(meta_model(cfg))
    assert counts["total"] == model_total == spec_non_embedding(arch, d, cfg.width, depth) + V_GPT2 * d
    assert counts["non_embedding"] == model_non_emb
    assert cfg.width == match_width(cfg.replace(width=d), target).width
    # The preset's own comment states its total; it must be the real one.
    text = (PRESET_DIR / f"{name}.yaml").read_text()
    stated = re.search(r"Total ([\d,]+) parameters", text)
    if stated:
        assert int(stated[1].replace(",", "")) == model_total


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_every_preset_counts_match_its_module(name):
    cfg = load_run_config(name, []).model
    counts = count_params(cfg)
    model_total, model_non_emb = numel(meta_model(cfg))
    assert (counts["total"], counts["non_embedding"]) == (model_total, model_non_emb)
    stated = re.search(r"Total ([\d,]+) parameters", (PRESET_DIR / f"{name}.yaml").read_text())
    if stated:
        assert int(stated[1].replace(",", "")) == model_total


def test_generated_presets_are_up_to_date():
    """The TANGO-paper presets on disk equal what the catalog generates (tools/make_presets.py)."""
    from tango_lm.models.preset_catalog import tango_presets

    for name, text in tango_presets().items():
        path = PRESET_DIR / f"{name}.yaml"  # a new matched architecture has none until generated
        assert path.is_file() and path.read_text() == text, f"{name}: run python tools/make_presets.py"


def test_matched_presets_of_a_tier_train_on_the_same_tokens():
    # 20 tokens per parameter of each model's own count gave each architecture its own budget
    # (21,363 steps for TANGO, 21,375 for the Untied Transformer++ at 70M, depth 4).
    from tango_lm.train.config import load_run_config

    for tier in ("70m", "160m"):
        runs = [load_run_config(n, []) for n in ALL_PRESETS if re.fullmatch(rf"[a-z0-9-]+-{tier}-d(4|8|16)", n)]
        assert len({r.total_steps() for r in runs}) == 1, tier
        assert {r.train.tokens for r in runs} == {20 * {"70m": 70_000_000, "160m": 160_000_000}[tier]}
