"""The runs a report reads (eval/report_runs.py): the learning curve of an MoE run is its NLL,
without the load-balancing term its logged loss holds.

Destination: tests/eval/test_report_runs.py (reuses write_run from tests/eval/test_report.py)."""

from __future__ import annotations

import json

import pytest

from tango_lm.eval.report_runs import collect_runs
from tests.eval.test_report import SEEDS, write_run


def test_an_moe_train_curve_leaves_out_the_load_balancing_term(tmp_path):
    root = tmp_path / "runs"
    run = write_run(root, {"dataset": "d", "tier": "70M", "depth": 2, "arch": "moe", "seed": SEEDS[0]}, 3.0, 3.0)
    records = [
        {"step": 10, "loss": 3.30, "aux_loss": 0.05, "tokens": 1000},
        {"step": 20, "loss": 3.10, "aux_loss": 0.02, "tokens": 2000},
        {"step": 20, "dev_nll": 3.0, "tokens": 2000},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (record,), _ = collect_runs(root)
    assert [t for t, _ in record.train_curve] == [1000, 2000]
    assert [v for _, v in record.train_curve] == pytest.approx([3.25, 3.08])
    assert record.dev_curve == [(2000, 3.0)]


def test_a_target_params_axis_is_the_tier(tmp_path):
    # A sweep whose size axis is `target_params` (no `tier` label): its value is the Tier column.
    root = tmp_path / "runs"
    for seed in SEEDS[:2]:
        write_run(root, {"dataset": "d", "target_params": "70M", "depth": 2, "arch": "tango", "seed": seed}, 3.0, 3.0)
    records, _ = collect_runs(root)
    assert {r.tier for r in records} == {"70M"}
    assert all("target_params" not in dict(r.extras) for r in records)


def test_a_runs_checkpoints_are_not_runs(tmp_path):
    # A checkpoint holds the run's config.json but no summary.json: read as a run of its own, every
    # checkpoint was an "unfinished" warning.
    import shutil

    root = tmp_path / "runs"
    run = write_run(root, {"dataset": "d", "tier": "70M", "depth": 2, "arch": "tango", "seed": SEEDS[0]}, 3.0, 3.0)
    for step in ("step-00000010", "step-00000020"):
        (run / "checkpoints" / step).mkdir(parents=True)
        shutil.copy(run / "config.json", run / "checkpoints" / step / "config.json")
    records, warnings = collect_runs(root)
    assert [r.path for r in records] == [run] and warnings == []


def test_a_run_linked_twice_is_read_once_without_a_warning(tmp_path):
    tango = write_run(
        tmp_path / "runs", {"dataset": "x", "tier": "-", "depth": 2, "arch": "tango", "seed": SEEDS[0]}, 3.0, 3.0
    )
    picked = tmp_path / "picked"
    picked.mkdir()
    (picked / "a").symlink_to(tango, target_is_directory=True)
    (picked / "again").symlink_to(tango, target_is_directory=True)
    records, warnings = collect_runs(picked)
    assert len(records) == 1 and warnings == []
