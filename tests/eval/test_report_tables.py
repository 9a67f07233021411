"""The report's CSV tables (eval/report_tables.py `csv_tables`): every column of margins.csv,
depth.csv and main.csv carries the number the report computed for that row.

Destination: tests/eval/test_report_tables.py (reuses write_run from tests/eval/test_report.py)."""

from __future__ import annotations

import csv
import math

import pytest

from tango_lm.eval.report import write_report
from tests.eval.test_report import SEEDS, TEST_NLL, write_run


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sweep"
    for (depth, arch), values in TEST_NLL.items():
        for seed, v in zip(SEEDS, values, strict=True):
            write_run(root, {"dataset": "dmmath", "tier": "70M", "depth": depth, "arch": arch, "seed": seed}, v, v)
    # one seed only: no standard deviation
    write_run(root, {"dataset": "solo", "tier": "70M", "depth": 4, "arch": "tango", "seed": SEEDS[0]}, 3.0, 3.0)
    return root


def _csv(root, name):
    with open(root / "report" / f"{name}.csv") as f:
        return list(csv.DictReader(f))


def test_margins_csv_names_the_best_other_model_of_each_seed(sweep):
    write_report(sweep, plots=False)
    rows = [r for r in _csv(sweep, "margins") if r["dataset"] == "dmmath" and r["depth"] == "4"]
    # TANGO against min(Loop, GAU) per seed: 3.3 vs 3.2 (GAU), 3.4 vs 3.1 (GAU), 3.5 vs 3.6 (Loop)
    assert [(r["model"], r["seed"], r["next"]) for r in rows] == [
        ("tango", "17/101", "gau"),
        ("tango", "23/103", "gau"),
        ("tango", "41/107", "loop-transformer"),
    ]
    assert [float(r["margin"]) for r in rows] == pytest.approx([-0.2, 0.1, -0.4])


def test_depth_csv_has_each_depths_mean_std_and_seed_count(sweep):
    write_report(sweep, plots=False)
    rows = {(r["model"], r["depth"]): r for r in _csv(sweep, "depth") if r["dataset"] == "dmmath"}
    tango8 = rows[("tango", "8")]
    assert float(tango8["mean"]) == pytest.approx(2.95) and float(tango8["std"]) == pytest.approx(0.05)
    assert tango8["n"] == "3"
    gau4 = rows[("gau", "4")]
    assert float(gau4["mean"]) == pytest.approx(3.3) and float(gau4["std"]) == pytest.approx(math.sqrt(0.07))


def test_main_csv_leaves_the_std_of_a_single_seed_empty(sweep):
    write_report(sweep, plots=False)
    (solo,) = [r for r in _csv(sweep, "main") if r["dataset"] == "solo"]
    assert (solo["model"], solo["n"], solo["std"], solo["best"]) == ("tango", "1", "", "1")
    assert float(solo["mean"]) == pytest.approx(3.0)
    md = (sweep / "report" / "report.md").read_text()
    assert "| solo | 70M | 4 | **3.000** |" in md  # no "± 0.000" for one seed
