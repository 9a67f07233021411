"""Seed 000 Table 3's last column (models/table3_range.py, docs/table3-ranges.md): the non-embedding
range over a row's architectures, against the paper's eight endpoints, under design.md §2.7's GAU/FLASH
(RMSNorm) and the LayerNorm reading (`model.gau_norm: layernorm`, + d per layer); the `match`
command's range line and JSON; the LayerNorm module itself."""

from __future__ import annotations

import json

import pytest
import torch

from tango_lm import ModelConfig
from tango_lm.cli import main
from tango_lm.layers.norm import LayerNorm
from tango_lm.models.matching import TIERS, match_tier
from tango_lm.models.params import count_params
from tango_lm.models.table3_range import PAPER_RANGES, TABLE3_ARCHS, in_paper_units, non_embedding_range

# Table 3's GAU and FLASH widths (GAU's range is over context lengths).
GAU_WIDTHS = {
    ("70M", 4): (7136, 7152),
    ("70M", 8): (3536, 3552),
    ("160M", 4): (13104, 13120),
    ("160M", 8): (6528, 6544),
}
FLASH_WIDTHS = {("70M", 4): 7152, ("70M", 8): 3552, ("160M", 4): 13120, ("160M", 8): 6544}
CONTEXTS = (512, 8192)  # one set of context lengths for every row


def row_range(tier: str, depth: int, norm: str, contexts=CONTEXTS) -> tuple[dict, dict]:
    """(the non-embedding range, arch -> matched widths) of Table 3's architectures, GAU at each context."""
    target, d = TIERS[tier]
    archs = [a for a in TABLE3_ARCHS if a != "gau"]
    rows = match_tier(target, d, depth, archs, gau_norm=norm)
    rows += [match_tier(target, d, depth, ["gau"], context_length=n, gau_norm=norm)[0] for n in contexts]
    widths: dict[str, set[int]] = {}
    for r in rows:
        widths.setdefault(r["arch"], set()).add(r["width"])
    return non_embedding_range(rows), widths


def gau_count(tier: str, depth: int, width: int, context: int, norm: str) -> int:
    d = TIERS[tier][1]
    cfg = ModelConfig(arch="gau", d_model=d, width=width, depth=depth, context_length=context, gau_norm=norm)
    return count_params(cfg)["non_embedding"]


@pytest.mark.parametrize(("tier", "depth"), list(PAPER_RANGES))
def test_one_context_set_gives_table3_widths_under_both_readings(tier, depth):
    for norm in ("rmsnorm", "layernorm"):
        for short in (64, 512):  # any context up to 512 for the wider GAU
            span, widths = row_range(tier, depth, norm, (short, 8192))
            assert widths["gau"] == set(GAU_WIDTHS[tier, depth]) and widths["flash"] == {FLASH_WIDTHS[tier, depth]}
            if short == 64:
                assert span == row_range(tier, depth, norm)[0]  # the same range as with 512


def test_rmsnorm_reaches_no_gau_or_flash_endpoint_at_any_context():
    # Under design.md §2.7's count, the five endpoints TANGO, Loop and Untied do not give (44.238M, 121.293M,
    # 121.429M, 121.272M, 121.543M) are no model's at a Table 3 width and a power-of-two context.
    reached = set()
    for (tier, depth), paper in PAPER_RANGES.items():
        target, d = TIERS[tier]
        counts = [r["non_embedding"] for r in match_tier(target, d, depth, list(TABLE3_ARCHS))]
        counts += [gau_count(tier, depth, w, 2**k, "rmsnorm") for w in GAU_WIDTHS[tier, depth] for k in range(6, 15)]
        reached |= {p for p in paper if p in {in_paper_units(c) for c in counts}}
    assert reached == {44.307, 44.180, 44.279}


def test_layernorm_reproduces_six_endpoints_with_one_context_set_rmsnorm_two():
    hits = {}
    for norm in ("rmsnorm", "layernorm"):
        hits[norm] = []
        for (tier, depth), (lo, hi) in PAPER_RANGES.items():
            span, _ = row_range(tier, depth, norm)
            hits[norm] += [in_paper_units(span["min"]) == lo, in_paper_units(span["max"]) == hi]
    assert sum(hits["rmsnorm"]) == 2 and sum(hits["layernorm"]) == 6
    # The two the LayerNorm reading misses there are the 160M minima (121.293M, 121.272M).
    assert hits["layernorm"] == [True, True, True, True, False, True, False, True]


# Each endpoint as the LayerNorm reading gives it: the model at a Table 3 width that sets it.
LAYERNORM_ENDPOINTS = {
    ("70M", 4): (("gau", 7136, 8192), ("untied-transformer", None, None)),
    ("70M", 8): (("untied-transformer", None, None), ("loop-transformer", None, None)),
    ("160M", 4): (("gau", 13104, 2048), ("flash", None, None)),
    ("160M", 8): (("gau", 6528, 2048), ("flash", None, None)),
}


@pytest.mark.parametrize(("tier", "depth"), list(PAPER_RANGES))
def test_every_endpoint_is_a_table3_model_under_the_layernorm_reading(tier, depth):
    target, d = TIERS[tier]
    fixed = {r["arch"]: r["non_embedding"] for r in match_tier(target, d, depth, gau_norm="layernorm")}
    for (arch, width, context), paper in zip(LAYERNORM_ENDPOINTS[tier, depth], PAPER_RANGES[tier, depth], strict=True):
        count = fixed[arch] if width is None else gau_count(tier, depth, width, context, "layernorm")
        assert in_paper_units(count) == paper, (arch, width, context)
        if width is not None:  # the same model under design.md §2.7's RMSNorm misses it
            assert in_paper_units(gau_count(tier, depth, width, context, "rmsnorm")) != paper


def test_no_nearest_matched_gau_reaches_the_160m_depth4_minimum():
    # A GAU of width 13,104 is the nearest multiple of 16 only when its total is at least half a
    # width step (16 (3d + 2) per layer) below the target, whatever its context length or norm:
    # at least 121.329M non-embedding, so the paper's 121.293M is not a matched GAU there.
    target, d = TIERS["160M"]
    half_step = 4 * 16 * (3 * d + 2) // 2
    floor = target - 50257 * d - half_step
    assert in_paper_units(floor) == 121.329
    for norm in ("rmsnorm", "layernorm"):
        for context in (256, 2048, 8192, 16384):
            row = match_tier(target, d, 4, ["gau"], context_length=context, gau_norm=norm)[0]
            if row["width"] == 13104:
                assert row["non_embedding"] >= floor > 121_293_500


def test_match_prints_the_range_next_to_the_papers(capsys):
    assert main(["match", "--tier", "70M", "--depth", "4"]) == 0
    out = capsys.readouterr().out
    assert (
        "non-embedding range (seed 000 Table 3's last column): 44.271M (tango) to 44.307M (untied-transformer)" in out
    )
    assert "the paper: 44.238M to 44.307M" in out
    # one architecture, or fields of its own, is no Table 3 column (it said so of a FLASH at qk_dim 64)
    for extra in (["--arch", "flash", "qk_dim=64"], ["--arch", "flash"], ["qk_dim=64"]):
        assert main(["match", "--tier", "70M", "--depth", "4", *extra]) == 0
        out = capsys.readouterr().out
        assert "non-embedding range: " in out and "Table 3" not in out
    # and it spans every row shown: it had left out the architectures outside Table 3 (here the smallest)
    assert (
        main(
            [
                "match",
                "--tier",
                "70M",
                "--depth",
                "4",
                "--arch",
                "tango",
                "--arch",
                "dense",
                "--arch",
                "tango-3set",
                "--json",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    counts = {r["arch"]: r["non_embedding"] for r in res["models"]}
    span = res["non_embedding_range"]
    assert (span["min"], span["max"]) == (min(counts.values()), max(counts.values())) and len(set(counts.values())) > 1
    argv = ["match", "--tier", "70M", "--depth", "4", "--context-length", "512", "8192", "--gau-norm", "layernorm"]
    assert main([*argv, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    gau = [(r["width"], r["context_length"]) for r in res["models"] if r["arch"] == "gau"]
    assert gau == [(7152, 512), (7136, 8192)]
    span = res["non_embedding_range"]
    assert [in_paper_units(span["min"]), in_paper_units(span["max"])] == span["paper_millions"] == [44.238, 44.307]
    assert (span["min_arch"], span["max_arch"]) == ("gau", "untied-transformer")
    assert main(argv) == 0
    assert "   n  " in capsys.readouterr().out  # the context column, with several GAU rows
    # Not a paper row (another d_model, or only some architectures): no paper range to compare with.
    assert main(["match", "--tier", "70M", "--depth", "4", "--d-model", "256", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["non_embedding_range"]["paper_millions"] is None
    assert main(["match", "--tier", "70M", "--depth", "4", "--arch", "tango", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["non_embedding_range"]["paper_millions"] is None


def test_layernorm_module_against_its_formula_forward_and_gradients():
    torch.manual_seed(0)
    norm = LayerNorm(13, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(3, 7, 13, dtype=torch.float64, requires_grad=True)
    c = x - x.mean(-1, keepdim=True)
    want = c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight + norm.bias
    got = norm(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(got)
    params = [x, norm.weight, norm.bias]
    for a, b in zip(torch.autograd.grad(got, params, dy), torch.autograd.grad(want, params, dy), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # bf16 input: the statistics in fp32, the output in bf16
    xb = (x.detach() * 100 + 1000).to(torch.bfloat16)
    out = LayerNorm(13)(xb)
    ref = torch.nn.functional.layer_norm(xb.float(), (13,), eps=1e-6)
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), ref, atol=2e-2)
