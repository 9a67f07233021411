"""What the report's plots draw (eval/plots.py), not only that they are written: the depth plot's
error bars are the standard deviation over seeds, and the learning curves' dev panel the dev NLL.

Destination: tests/eval/test_report_plots.py (reuses write_run from tests/eval/test_report.py)."""

from __future__ import annotations

import statistics

import pytest

from tango_lm.eval.report import write_report
from tests.eval.test_report import SEEDS, write_run


def test_depth_plot_error_bars_are_the_std_over_seeds(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    root = tmp_path / "runs"
    values = {2: [3.0, 3.4], 4: [2.8, 2.9]}  # depth -> test NLL per seed
    for depth, nlls in values.items():
        for seed, v in zip(SEEDS, nlls, strict=False):
            write_run(root, {"dataset": "d", "tier": "70M", "depth": depth, "arch": "tango", "seed": seed}, v, v)
    drawn, real = [], Axes.errorbar
    monkeypatch.setattr(
        Axes,
        "errorbar",
        lambda self, x, y, *a, **k: drawn.append((list(x), list(y), list(k["yerr"]))) or real(self, x, y, *a, **k),
    )
    write_report(root)
    ((xs, ys, yerr),) = drawn
    assert xs == [2, 4]
    assert ys == pytest.approx([statistics.fmean(values[d]) for d in xs])
    assert yerr == pytest.approx([statistics.stdev(values[d]) for d in xs])  # ddof = 1, as the tables


def test_learning_curves_draw_train_nll_and_dev_nll_on_their_panels(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    root = tmp_path / "runs"
    dev = [3.5, 3.2, 3.1]
    write_run(
        root, {"dataset": "d", "tier": "70M", "depth": 4, "arch": "tango", "seed": SEEDS[0]}, 3.0, 3.1, dev_curve=dev
    )
    drawn, real = [], Axes.plot
    monkeypatch.setattr(
        Axes, "plot", lambda self, *a, **k: drawn.append((list(a[0]), list(a[1]))) or real(self, *a, **k)
    )
    write_report(root)
    tokens = [1000, 2000, 3000]  # write_run logs a train loss of d + 0.1 and a dev NLL of d per eval
    assert len(drawn) == 2
    (train_x, train_y), (dev_x, dev_y) = drawn  # the train panel's line, then the dev panel's
    assert (train_x, dev_x) == (tokens, tokens)
    assert train_y == pytest.approx([d + 0.1 for d in dev]) and dev_y == pytest.approx(dev)


def test_throughput_points_plot_the_reported_split():
    # `report --split dev`: a record's value is its dev NLL, and the throughput plot is of the same
    # numbers as the tables (its axis says "dev NLL"), not the test NLL.
    from pathlib import Path

    from tango_lm.eval.plots import throughput_points
    from tango_lm.eval.report_runs import RunRecord

    dev, test = 3.25, 3.5
    record = RunRecord(Path("r"), "d", "70M", 4, "tango", "standard", "A", (), dev, test, dev, 500.0, 1, 1)
    assert throughput_points([record]) == {"d": {"tango": [(500.0, dev, "70M/d4")]}}


def test_the_depth_plot_names_the_reported_split(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    root = tmp_path / "runs"
    for depth in (2, 4):
        write_run(root, {"dataset": "d", "tier": "70M", "depth": depth, "arch": "tango", "seed": SEEDS[0]}, 3.0, 3.1)
    labels, real = [], Axes.set_ylabel
    monkeypatch.setattr(
        Axes, "set_ylabel", lambda self, label, *a, **k: labels.append(label) or real(self, label, *a, **k)
    )
    write_report(root, split="dev")
    assert labels and all(label.startswith(("dev NLL", "train NLL")) for label in labels), labels
    assert "dev NLL (nats/token)" in labels  # the depth and throughput plots


def test_plots_of_plain_runs_name_no_tier(tmp_path, monkeypatch):
    # Runs trained without a sweep have no tier: their figures said "d, tier -" in files named "d_tier--_...".
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from tango_lm.eval.plots import throughput_points
    from tango_lm.eval.report_runs import collect_runs

    root = tmp_path / "runs"
    for depth in (2, 4):
        write_run(root, {"dataset": "d", "depth": depth, "arch": "tango", "seed": SEEDS[0]}, 3.0, 3.1, sweep_json=False)
    titles, real = [], Figure.suptitle
    monkeypatch.setattr(Figure, "suptitle", lambda self, t, *a, **k: titles.append(t) or real(self, t, *a, **k))
    write_report(root)
    names = sorted(p.name for p in (root / "report" / "plots").rglob("*.png"))
    assert names == ["d_depth-2_seed-17-101.png", "d_depth-4_seed-17-101.png", "depth_d.png", "throughput_d.png"]
    assert titles == ["d, depth 2, seed 17/101", "d, depth 4, seed 17/101"]
    records, _ = collect_runs(root)
    assert sorted(tag for _, _, tag in throughput_points(records)["d"]["tango"]) == ["d2", "d4"]
