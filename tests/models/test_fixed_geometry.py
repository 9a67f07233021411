"""A paper's fixed geometry is registered on its architecture (models/fixed_geometry.py), and
every reader takes it from there: a new one on another architecture reaches `tango-lm match`, the
sweep's `arch` axis, the generated presets and the report's labels without another edit."""

from __future__ import annotations

import json

import pytest
import yaml

from tango_lm.cli import main
from tango_lm.errors import UserError
from tango_lm.eval.report import arch_labels
from tango_lm.models.archs.transformer import LoopTransformer
from tango_lm.models.fixed_geometry import FixedGeometry
from tango_lm.models.matching import PAPER_VOCAB
from tango_lm.models.preset_catalog import tango_presets
from tango_lm.models.registry import fixed_geometries
from tango_lm.sweep import load_grid
from tests import helpers

WIDE_LOOP = FixedGeometry(
    label="wide-loop",
    display_name="Wide Loop",
    title="Wide Loop Transformer++",
    source="a test's table",
    shapes={("70M", 4): (1024, 32, 2048)},
)


@pytest.fixture
def wide_loop(monkeypatch):
    monkeypatch.setattr(LoopTransformer, "fixed_geometries", (WIDE_LOOP,))


def test_config_builds_the_architecture_at_the_tables_shape():
    cfg = WIDE_LOOP.config("loop-transformer", " 70m ", 4, PAPER_VOCAB)
    assert (cfg.arch, cfg.d_model, cfg.n_heads, cfg.width, cfg.depth) == ("loop-transformer", 1024, 32, 2048, 4)
    assert WIDE_LOOP.config("loop-transformer", "70M", 8, PAPER_VOCAB) is None
    assert WIDE_LOOP.where() == "tier 70M with depth 4"


def test_the_registry_lists_every_architectures_geometries(wide_loop):
    assert list(fixed_geometries()) == ["wide-loop", "conventional-untied"]  # registry order
    assert fixed_geometries()["wide-loop"] == ("loop-transformer", WIDE_LOOP)


def test_match_lists_a_new_geometry(wide_loop, capsys):
    assert main(["match", "--tier", "70M", "--depth", "4", "--json"]) == 0
    rows = {r["arch"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    want = WIDE_LOOP.config("loop-transformer", "70M", 4, PAPER_VOCAB).num_params()["total"]
    assert rows["wide-loop"]["total"] == want and rows["wide-loop"]["width"] == 2048
    assert "conventional-untied" in rows


def test_presets_and_report_labels_include_a_new_geometry(wide_loop):
    preset = yaml.safe_load(tango_presets()["wide-loop-70m-d4"])
    assert preset["model"]["arch"] == "loop-transformer" and preset["model"]["d_model"] == 1024
    labels = list(arch_labels())
    assert labels.index("wide-loop") == labels.index("loop-transformer") + 1
    assert arch_labels()["wide-loop"] == "Wide Loop"


def test_a_sweep_builds_a_new_geometry_from_its_tier(wide_loop, tmp_path):
    base = {"model": {k: v for k, v in helpers.TINY_MODEL.items() if k != "arch"}, "train": dict(helpers.TINY_TRAIN)}
    base["model"].update(vocab_size=PAPER_VOCAB, context_length=64)
    grid = {
        "out_dir": str(tmp_path / "sweep"),
        "base": base,
        "axes": {"tier": ["70M"], "depth": [4], "arch": ["wide-loop"]},
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    (run,) = load_grid(path, check_data=False).runs
    model = run.config.model
    assert (model.arch, model.d_model, model.n_heads, model.width) == ("loop-transformer", 1024, 32, 2048)
    assert run.labels["arch"] == "wide-loop"

    grid["axes"] = {"depth": [4], "arch": ["wide-loop"]}
    path.write_text(yaml.safe_dump(grid))
    with pytest.raises(UserError, match=r"arch 'wide-loop' .* needs a tier axis \(70M\) .*\(a test's table\)"):
        load_grid(path, check_data=False)
    grid["axes"] = {"tier": ["70M"], "depth": [8], "arch": ["wide-loop"]}
    path.write_text(yaml.safe_dump(grid))
    with pytest.raises(
        UserError, match="a test's table has no wide-loop geometry for tier 70M at depth 8; use tier 70M"
    ):
        load_grid(path, check_data=False)
