"""`tango-lm report` on hand-written run directories with known numbers: means, sample standard
deviations, best marks, per-seed margins (seed 000 Table 13), depth scaling (Table 5) and
head-vs-Standard deltas (seed 001 Table 1), in the JSON, CSV and Markdown outputs."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
from pathlib import Path

import pytest

from tango_lm.cli import main
from tango_lm.errors import UserError
from tango_lm.eval.report import write_report
from tests import helpers

SEEDS = [[17, 101], [23, 103], [41, 107]]
# (depth, arch) -> test NLL per seed
TEST_NLL = {
    (4, "tango"): [3.0, 3.2, 3.1],
    (4, "loop-transformer"): [3.3, 3.4, 3.5],
    (4, "gau"): [3.2, 3.1, 3.6],
    (8, "tango"): [2.9, 3.0, 2.95],
    (8, "loop-transformer"): [3.4, 3.5, 3.6],
    (8, "gau"): [3.0, 3.05, 3.1],
}
# dense backbone, head -> test NLL for the first two seeds (seed 001 Table 1 pairs)
HEADS = {"standard": [2.90, 2.80], "onona": [2.88, 2.79]}


def write_run(
    root: Path,
    labels: dict,
    test_nll: float,
    dev_nll: float,
    tokens_per_s: float = 1000.0,
    select: str = "best",
    sweep_json: bool = True,
    dev_curve: list[float] | None = None,
) -> Path:
    seed = labels["seed"]
    name = "/".join(f"{k}={'-'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in labels.items())
    run = root / name
    run.mkdir(parents=True)
    config = {
        "model": {"arch": labels["arch"], "head": labels.get("head", "standard"), "depth": labels["depth"]},
        "data": {"dir": f"/data/{labels['dataset']}"},
        "train": {"seed": seed[0], "data_seed": seed[1], "select": select},
    }
    (run / "config.json").write_text(json.dumps(config))
    dev_curve = dev_curve or [dev_nll + 0.5, dev_nll]
    records = []
    for i, d in enumerate(dev_curve, 1):
        records.append({"step": 10 * i, "loss": d + 0.1, "tokens": 1000 * i})
        records.append({"step": 10 * i, "dev_nll": d, "tokens": 1000 * i, "best": True})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    selected = 10 * len(dev_curve)
    summary = {
        "arch": labels["arch"],
        "head": labels.get("head", "standard"),
        "steps": selected,
        "selected_step": selected,
        "best_dev_nll": min(dev_curve),
        "test_nll": test_nll,
        "tokens_per_s": tokens_per_s,
        "params_total": 1000,
        "tokens": 1000 * len(dev_curve),
    }
    (run / "summary.json").write_text(json.dumps(summary))
    if sweep_json:
        (run / "sweep.json").write_text(json.dumps({"name": name, "labels": labels}))
    return run


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "sweep"
    for (depth, arch), values in TEST_NLL.items():
        for seed, v in zip(SEEDS, values, strict=True):
            labels = {"dataset": "dmmath", "tier": "70M", "depth": depth, "arch": arch, "seed": seed}
            write_run(root, labels, v, v + 0.05, tokens_per_s={"tango": 1e3, "gau": 3e3}.get(arch, 2e3))
    for head, values in HEADS.items():
        for seed, v in zip(SEEDS, values, strict=False):
            labels = {"dataset": "climbmix", "tier": "142M", "depth": 16, "arch": "dense", "head": head, "seed": seed}
            write_run(root, labels, v, v)
    return root


def _cell(report, dataset, depth, model):
    row = next(r for r in report["main"] if r["dataset"] == dataset and r["depth"] == depth)
    return row, row["cells"].get(model)


def test_means_stds_and_best_marks(runs):
    res = write_report(runs, plots=False)
    report = res["report"]
    assert res["warnings"] == []
    row, tango = _cell(report, "dmmath", 4, "tango")
    assert tango["mean"] == pytest.approx(3.1) and tango["std"] == pytest.approx(0.1) and tango["n"] == 3
    _, gau = _cell(report, "dmmath", 4, "gau")
    assert gau["mean"] == pytest.approx(3.3) and gau["std"] == pytest.approx(math.sqrt(0.07))  # ddof = 1
    assert row["best"] == ["tango"]
    row8, _ = _cell(report, "dmmath", 8, "tango")
    assert row8["best"] == ["tango"]
    # Rows in order: dmmath before climbmix (first seen in path order is climbmix; datasets keep
    # that order), depth ascending within a dataset.
    assert [(r["dataset"], r["depth"]) for r in report["main"]] == [("climbmix", 16), ("dmmath", 4), ("dmmath", 8)]
    assert report["models"][:3] == ["tango", "loop-transformer", "gau"]  # registry order, not alphabetical

    md = (runs / "report" / "report.md").read_text()
    assert "**3.100 ± 0.100**" in md and "3.300 ± 0.265" in md and "3.400 ± 0.100" in md
    assert "| TANGO | Loop Transformer++ | Full-attention GAU |" in md

    with open(runs / "report" / "main.csv") as f:
        rows = list(csv.DictReader(f))
    gau4 = next(r for r in rows if r["model"] == "gau" and r["depth"] == "4")
    assert float(gau4["mean"]) == pytest.approx(3.3) and float(gau4["std"]) == pytest.approx(math.sqrt(0.07))
    assert gau4["best"] == "0"
    assert next(r for r in rows if r["model"] == "tango" and r["depth"] == "4")["best"] == "1"


def test_per_seed_margins(runs):
    report = write_report(runs, plots=False)["report"]
    m4 = next(m for m in report["margins"] if m["dataset"] == "dmmath" and m["depth"] == 4)
    assert m4["model"] == "tango"
    margins = {s: v["margin"] for s, v in m4["seeds"].items()}
    # seed 17/101: 3.0 - min(3.3, 3.2); 23/103: 3.2 - min(3.4, 3.1) (GAU wins there); 41/107: 3.1 - 3.5
    assert margins == pytest.approx({"17/101": -0.2, "23/103": 0.1, "41/107": -0.4})
    assert m4["seeds"]["23/103"]["next"] == "gau" and m4["seeds"]["41/107"]["next"] == "loop-transformer"
    md = (runs / "report" / "report.md").read_text()
    assert "| dmmath | 70M | 4 | TANGO | -0.2000 | +0.1000 | -0.4000 |" in md
    with open(runs / "report" / "margins.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["dataset"] == "dmmath" and r["depth"] == "4"]
    assert [float(r["margin"]) for r in rows] == pytest.approx([-0.2, 0.1, -0.4])

    # A reference model: margins of the Loop Transformer++ over the best of the others.
    ref = write_report(runs, runs / "ref", plots=False, reference="loop-transformer")["report"]
    m4 = next(m for m in ref["margins"] if m["dataset"] == "dmmath" and m["depth"] == 4)
    assert {s: v["margin"] for s, v in m4["seeds"].items()} == pytest.approx(
        {"17/101": 0.3, "23/103": 0.3, "41/107": 0.4}
    )
    ref_md = (runs / "ref" / "report.md").read_text()  # its heading names it, not "the best model"
    assert "## Per-seed margin of Loop Transformer++ over the best other model" in ref_md
    assert "## Per-seed margin of the best model over the best other model" in md


def test_depth_scaling(runs):
    report = write_report(runs, plots=False)["report"]
    rows = {r["model"]: r for r in report["depth"] if r["dataset"] == "dmmath"}
    assert rows["tango"]["depths"][4]["mean"] == pytest.approx(3.1)
    assert rows["tango"]["depths"][8]["mean"] == pytest.approx(2.95)
    assert rows["tango"]["depths"][8]["std"] == pytest.approx(0.05)
    assert rows["tango"]["non_increasing"] is True and rows["loop-transformer"]["non_increasing"] is False
    md = (runs / "report" / "report.md").read_text()
    assert "| dmmath | 70M | TANGO | 3.100 ± 0.100 | 2.950 ± 0.050 | yes |" in md
    assert "| dmmath | 70M | Loop Transformer++ | 3.400 ± 0.100 | 3.500 ± 0.100 | no |" in md


def test_head_vs_standard_pairs(runs):
    report = write_report(runs, plots=False)["report"]
    (pair,) = report["heads"]
    assert (pair["arch"], pair["head"], pair["n"]) == ("dense", "onona", 2)
    assert pair["head_nll"] == pytest.approx(2.835) and pair["standard_nll"] == pytest.approx(2.85)
    assert pair["delta"] == pytest.approx(-0.015) and pair["delta_std"] == pytest.approx(math.sqrt(0.00005))
    md = (runs / "report" / "report.md").read_text()
    assert "| climbmix | 142M | 16 | Dense | onóna | 2.8350 | 2.8500 | -0.0150 ± 0.0071 | 2 |" in md
    with open(runs / "report" / "heads.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["delta"]) == pytest.approx(-0.015)
    # The main table puts the onóna arm beside its Standard backbone.
    _, onona = _cell(report, "climbmix", 16, "dense+onona")
    assert onona["mean"] == pytest.approx(2.835) and onona["std"] == pytest.approx(0.09 / math.sqrt(2))


def test_a_heads_row_averages_only_the_seeds_both_heads_have(tmp_path):
    # onóna has a seed the Standard head lacks: its NLL, the Standard one and their difference are
    # all over the paired seed, so head_nll - standard_nll is the delta the row prints.
    root = tmp_path / "runs"
    for head, by_seed in {"standard": {1: 3.0}, "onona": {1: 2.9, 2: 2.0}}.items():
        for seed, v in by_seed.items():
            labels = {"dataset": "d", "tier": "2M", "depth": 2, "arch": "dense", "head": head, "seed": [seed, 100]}
            write_run(root, labels, v, v)
    (pair,) = write_report(root, plots=False)["report"]["heads"]
    assert pair["n"] == 1
    assert (pair["head_nll"], pair["standard_nll"]) == pytest.approx((2.9, 3.0))
    assert pair["head_nll"] - pair["standard_nll"] == pytest.approx(pair["delta"])


def test_dev_split_uses_the_selected_checkpoint(tmp_path):
    root = tmp_path / "runs"
    # select: final -> dev NLL at the final step (3.2), not the best (3.0).
    write_run(
        root,
        {"dataset": "d", "tier": "2M", "depth": 2, "arch": "tango", "seed": [1, 2]},
        3.5,
        0,
        select="final",
        dev_curve=[3.0, 3.2],
    )
    report = write_report(root, plots=False, split="dev")["report"]
    assert report["main"][0]["cells"]["tango"]["mean"] == pytest.approx(3.2)
    assert report["runs"][0]["test_nll"] == 3.5


def test_a_diverged_dev_nll_of_the_selected_checkpoint_is_not_replaced_by_the_best(tmp_path):
    # select: final, the final dev NLL logged as null (not finite): that checkpoint has no dev NLL
    # to report; the best one (3.0, of another checkpoint) is not it.
    root = tmp_path / "runs"
    labels = {"dataset": "d", "tier": "2M", "depth": 2, "arch": "tango", "seed": [1, 2]}
    run = write_run(root, labels, 3.5, 0, select="final", dev_curve=[3.0, 3.2])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    records[-1]["dev_nll"] = None
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_run(root, {**labels, "arch": "gau"}, 3.6, 0, select="final", dev_curve=[3.1, 3.3])
    res = write_report(root, plots=False, split="dev")
    assert [r["model"] for r in res["report"]["runs"]] == ["gau"]
    assert any("dev NLL is None" in w for w in res["warnings"])


def test_dev_split_without_a_log_takes_the_summarys_selected_dev_nll(tmp_path):
    # With metrics.jsonl gone, a select: final run's dev value was its best dev NLL (3.0), not
    # the final checkpoint's (3.2) that summary.json records.
    labels = {"dataset": "d", "tier": "2M", "depth": 2, "arch": "tango", "seed": [1, 2]}
    run = write_run(tmp_path / "runs", labels, 3.5, 0, select="final", dev_curve=[3.0, 3.2])
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "selected_dev_nll": 3.2}))
    (run / "metrics.jsonl").unlink()
    report = write_report(tmp_path / "runs", plots=False, split="dev")["report"]
    assert report["main"][0]["cells"]["tango"]["mean"] == pytest.approx(3.2)


def test_runs_without_sweep_json_are_labelled_from_their_config(tmp_path):
    root = tmp_path / "runs"
    for seed, v in zip(SEEDS, [1.0, 1.2, 1.1], strict=True):
        write_run(
            root, {"dataset": "x", "tier": "-", "depth": 3, "arch": "tango", "seed": seed}, v, v, sweep_json=False
        )
    report = write_report(root, plots=False)["report"]
    (row,) = report["main"]
    assert (row["dataset"], row["depth"]) == ("x", 3)
    assert row["cells"]["tango"]["mean"] == pytest.approx(1.1)
    assert report["seeds"] == ["17/101", "23/103", "41/107"]


def test_plain_runs_of_other_configs_are_not_averaged(tmp_path):
    # Two run directories without sweep.json, one model and seed, other widths: "the same setting
    # and seed" was averaged with a ± over one seed.
    root, labels = tmp_path / "runs", {"dataset": "x", "tier": "-", "depth": 2, "arch": "tango", "seed": SEEDS[0]}
    small = write_run(root / "small", labels, 3.0, 3.0, sweep_json=False)
    wide = write_run(root / "wide", labels, 2.0, 2.0, sweep_json=False)
    config = json.loads((wide / "config.json").read_text())
    config["model"]["width"] = 64
    (wide / "config.json").write_text(json.dumps(config))
    res = write_report(root, plots=False)
    rows = res["report"]["main"]
    assert sorted(r["cells"]["tango"]["mean"] for r in rows) == [2.0, 3.0]
    # the field they differ in labels their rows
    # (the field the older config.json lacks is at its default, 1024)
    assert sorted((r["model.width"], r["cells"]["tango"]["mean"]) for r in rows) == [(64, 2.0), (1024, 3.0)]
    again = write_run(root / "again", labels, 2.5, 2.5, sweep_json=False)  # the small run's config, run again
    (again / "config.json").write_text((small / "config.json").read_text())
    res = write_report(root, plots=False)
    assert any("are the same setting and seed; their mean is that seed's value" in w for w in res["warnings"])


def test_runs_on_two_datasets_in_folders_of_one_name_are_not_averaged(tmp_path):
    # The row's dataset is the folder's name, and the data section was not compared: runs on two
    # corpora in folders both named "dset" were "the same setting and seed", one mean of both.
    root, labels = tmp_path / "runs", {"dataset": "dset", "tier": "-", "depth": 2, "arch": "tango", "seed": SEEDS[0]}
    for name, nll in (("a", 3.0), ("b", 2.0)):
        run = write_run(root / name, labels, nll, nll, sweep_json=False)
        config = json.loads((run / "config.json").read_text())
        config["data"]["dir"] = f"/corpora/{name}/dset"
        (run / "config.json").write_text(json.dumps(config))
    res = write_report(root, plots=False)
    rows = res["report"]["main"]
    assert sorted((r["data.dir"], r["cells"]["tango"]["mean"]) for r in rows) == [
        ("/corpora/a/dset", 3.0),
        ("/corpora/b/dset", 2.0),
    ]
    assert not any("same setting and seed" in w for w in res["warnings"])


def test_a_seed_run_twice_counts_once_with_its_mean_in_every_table(tmp_path):
    # The main table averaged both copies as two samples, the margins took the first copy and the
    # heads table the last: TANGO was bold as the best while every per-seed margin said it lost.
    root = tmp_path / "runs"
    labels = {"dataset": "x", "tier": "-", "depth": 2}
    for seed, tango, loop in ((SEEDS[0], 3.0, 2.9), (SEEDS[1], 3.0, 2.9)):
        write_run(root / "a", {**labels, "arch": "tango", "seed": seed}, tango, tango)
        write_run(root / "a", {**labels, "arch": "loop-transformer", "seed": seed}, loop, loop)
        write_run(root / "a", {**labels, "arch": "tango", "head": "onona", "seed": seed}, 3.1, 3.1)
    write_run(root / "rerun", {**labels, "arch": "tango", "seed": SEEDS[0]}, 2.0, 2.0)  # seed 17 again
    report = write_report(root, plots=False)["report"]
    (row,) = report["main"]
    tango = row["cells"]["tango"]
    assert tango["n"] == 2 and tango["seeds"]["17/101"] == pytest.approx(2.5) and tango["mean"] == pytest.approx(2.75)
    assert row["best"] == ["tango"]
    (margins,) = report["margins"]
    assert margins["model"] == "tango" and margins["seeds"]["17/101"]["margin"] == pytest.approx(2.5 - 2.9)
    (onona,) = report["heads"]
    assert onona["standard_nll"] == pytest.approx(2.75)
    (depth,) = [d for d in report["depth"] if d["model"] == "tango"]
    assert depth["depths"][2]["mean"] == pytest.approx(2.75) and depth["depths"][2]["n"] == 2


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    root = tmp_path / "runs"
    for (depth, arch), values in TEST_NLL.items():
        if arch != "gau":
            labels = {"dataset": "dmmath", "tier": "70M", "depth": depth, "arch": arch, "seed": SEEDS[0]}
            write_run(root, labels, values[0], values[0], tokens_per_s=1000.0 * depth)
    res = write_report(root)
    pngs = sorted(Path(f).relative_to(root / "report" / "plots").as_posix() for f in res["files"] if f.endswith(".png"))
    # learning curves per row and seed, NLL against depth, NLL against throughput
    assert pngs == [
        "curves/dmmath_tier-70M_depth-4_seed-17-101.png",
        "curves/dmmath_tier-70M_depth-8_seed-17-101.png",
        "depth_dmmath_tier-70M.png",
        "throughput_dmmath.png",
    ]
    for p in pngs:
        assert (root / "report" / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rewritten_report_removes_the_plots_it_no_longer_draws_and_nothing_else(tmp_path):
    pytest.importorskip("matplotlib")
    root = tmp_path / "runs"
    labels = {"dataset": "dmmath", "tier": "70M", "depth": 4, "arch": "tango"}
    for seed in SEEDS[:2]:
        write_run(root, {**labels, "seed": seed}, 3.0, 3.0)
    plots = root / "report" / "plots"
    write_report(root)
    assert (plots / "curves/dmmath_tier-70M_depth-4_seed-23-103.png").exists()
    (plots / "mine.png").write_bytes(b"the user's")
    shutil.rmtree(root / "dataset=dmmath/tier=70M/depth=4/arch=tango/seed=23-103")
    res = write_report(root)
    assert not (plots / "curves/dmmath_tier-70M_depth-4_seed-23-103.png").exists()  # a seed no longer there
    assert res["report"]["plots"] == [
        "plots/curves/dmmath_tier-70M_depth-4_seed-17-101.png",
        "plots/throughput_dmmath.png",
    ]
    write_report(root, plots=False)  # plots that no longer match the tables go too
    assert sorted(p.name for p in plots.rglob("*") if p.is_file()) == ["mine.png"]


def test_throughput_points_count_a_seed_run_twice_once():
    # Seed A twice (copies 2.0 and 4.0: its value 3.0) and seed B once (5.0): the point is 4.0,
    # as the tables' seed_values give; a plain mean over runs gave 11 / 3.
    from tango_lm.eval.plots import throughput_points
    from tango_lm.eval.report_runs import RunRecord

    def run(seed: str, value: float, tokens_per_s: float) -> RunRecord:
        return RunRecord(
            Path(seed), "d", "70M", 4, "tango", "standard", seed, (), value, value, None, tokens_per_s, 1, 1
        )

    points = throughput_points([run("A", 2.0, 100.0), run("A", 4.0, 300.0), run("B", 5.0, 400.0)])
    assert points == {"d": {"tango": [(300.0, 4.0, "70M/d4")]}}


def test_throughput_points_of_rows_apart_in_a_setting_say_it():
    # Two points of one model, tier and depth that the tables keep apart (train.lr) had one tag.
    from tango_lm.eval.plots import throughput_points
    from tango_lm.eval.report_runs import RunRecord

    def run(lr: float, value: float) -> RunRecord:
        extras = (("train.lr", lr),)
        return RunRecord(Path(str(lr)), "d", "-", 2, "tango", "standard", "A", extras, value, value, None, 9.0, 1, 1)

    points = throughput_points([run(0.001, 3.0), run(0.01, 4.0)])
    assert points == {"d": {"tango": [(9.0, 3.0, "d2 train.lr=0.001"), (9.0, 4.0, "d2 train.lr=0.01")]}}


def test_throughput_tags_name_only_the_settings_that_tell_a_models_points_apart():
    # Every label of every point went into its tag: unreadable, and the axes squeezed to a strip.
    from tango_lm.eval.plots import throughput_points
    from tango_lm.eval.report_runs import RunRecord

    def run(model: str, lr: float, select: str) -> RunRecord:
        extras = (("train.lr", lr), ("train.select", select))
        return RunRecord(Path(model + str(lr)), "d", "-", 2, model, "standard", "A", extras, lr, lr, None, 9.0, 1, 1)

    points = throughput_points([run("tango", 0.1, "best"), run("tango", 0.2, "best"), run("gau", 0.1, "final")])
    assert points == {
        "d": {"tango": [(9.0, 0.1, "d2 train.lr=0.1"), (9.0, 0.2, "d2 train.lr=0.2")], "gau": [(9.0, 0.1, "d2")]}
    }


def test_plots_of_runs_apart_in_many_fields_have_names_the_disk_takes(tmp_path):
    # Every field two runs differ in went into the curve's file name: with a dozen, the name passed
    # 255 bytes and `report` failed ("File name too long"), writing no report at all.
    pytest.importorskip("matplotlib")
    root, labels = tmp_path / "runs", {"dataset": "x", "tier": "-", "depth": 2, "arch": "tango", "seed": SEEDS[0]}
    fields = {f"a_rather_long_training_field_{i}": i for i in range(12)}
    for name, value in (("a", 1), ("b", 2)):
        run = write_run(root / name, labels, 3.0, 3.0, sweep_json=False)
        config = json.loads((run / "config.json").read_text())
        config["train"].update({k: v * value for k, v in fields.items()})
        (run / "config.json").write_text(json.dumps(config))
    res = write_report(root)
    curves = [Path(f) for f in res["files"] if "/curves/" in f]
    assert len(curves) == 2 and len({p.name for p in curves}) == 2
    assert all(len(p.name) < 200 and p.read_bytes()[:4] == b"\x89PNG" for p in curves)
    assert (root / "report" / "report.md").exists()


# -- damaged inputs ----------------------------------------------------------------------------
def _one_run(root: Path) -> Path:
    return write_run(root, {"dataset": "d", "tier": "2M", "depth": 2, "arch": "tango", "seed": [1, 2]}, 3.0, 3.0)


def test_partial_last_metrics_line_is_skipped_with_a_warning(tmp_path, capsys):
    run = _one_run(tmp_path / "runs")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 30, "loss": 2.')
    assert main(["report", str(tmp_path / "runs"), "--no-plots", "--json"]) == 0
    captured = capsys.readouterr()
    assert "warning:" in captured.err and "metrics.jsonl" in captured.err and "partial last line" in captured.err
    assert json.loads(captured.out)["main"][0]["cells"]["tango"]["mean"] == 3.0


def test_unfinished_run_is_left_out_with_a_warning(tmp_path):
    run = _one_run(tmp_path / "runs")
    other = tmp_path / "runs" / "unfinished"
    other.mkdir()
    (other / "config.json").write_text((run / "config.json").read_text())
    failed = tmp_path / "runs" / "failed"
    failed.mkdir()
    (failed / "failed.json").write_text('{"error": "bad"}')
    res = write_report(tmp_path / "runs", plots=False)
    assert len(res["report"]["runs"]) == 1
    assert any("unfinished" in w and "no summary.json" in w for w in res["warnings"])
    assert any(str(failed) in w and "failed before training" in w for w in res["warnings"])


def test_a_skipped_step_has_no_point_on_the_curve(tmp_path):
    # The trainer logs a step whose loss was not finite as "loss": null (train/nonfinite.py).
    run = _one_run(tmp_path / "runs")
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 25, "loss": None, "tokens": 2500, "skipped": True}) + "\n")
    res = write_report(tmp_path / "runs", plots=True)
    assert res["report"]["runs"][0]["test_nll"] == 3.0
    assert (tmp_path / "runs" / "report" / "plots").is_dir()


def test_a_summary_from_before_a_failed_attempt_is_left_out(tmp_path):
    # The grid was edited (more steps, say) and the run's resume failed: its summary is stale.
    run = _one_run(tmp_path / "runs")
    _one_run(tmp_path / "runs" / "other")
    (run / "failed.json").write_text('{"error": "cannot resume"}')
    res = write_report(tmp_path / "runs", plots=False)
    assert len(res["report"]["runs"]) == 1
    assert any(str(run) in w and "latest attempt failed" in w for w in res["warnings"])


def test_a_summary_written_after_the_failed_attempt_counts(tmp_path):
    # A run that failed in a sweep and was finished with `train RUN --resume` by a version that
    # left failed.json beside the new summary: report left it out for good.
    run = _one_run(tmp_path / "runs")
    (run / "failed.json").write_text('{"error": "disk full"}')
    os.utime(run / "failed.json", (1_000_000_000, 1_000_000_000))
    res = write_report(tmp_path / "runs", plots=False)
    assert len(res["report"]["runs"]) == 1 and not any("latest attempt failed" in w for w in res["warnings"])


def test_seed_columns_in_numeric_order(tmp_path):
    for seed in ([5, 1], [17, 2]):
        write_run(tmp_path / "runs", {"dataset": "d", "tier": "2M", "depth": 2, "arch": "tango", "seed": seed}, 3, 3)
        labels = {"dataset": "d", "tier": "2M", "depth": 2, "arch": "gau", "seed": seed}
        write_run(tmp_path / "runs", labels, 3.5, 3.5)
    report = write_report(tmp_path / "runs", plots=False)["report"]
    assert list(report["margins"][0]["seeds"]) == ["5/1", "17/2"]


def test_report_of_a_live_sweep_passes_over_checkpoints_that_vanish(tmp_path, monkeypatch):
    # A running sweep renames and removes old checkpoint directories while the report walks the
    # tree; a checkpoint's own config.json is no run either.
    import os

    root = tmp_path / "runs"
    run = _one_run(root)
    step = run / "checkpoints" / "step-00000010"
    step.mkdir(parents=True)
    (step / "config.json").write_text((run / "config.json").read_text())
    going = root / "live" / "checkpoints" / ".old-step-00000004"
    going.mkdir(parents=True)
    (going.parent.parent / "config.json").write_text((run / "config.json").read_text())  # no summary yet
    gone = root / "removed-mid-walk"
    gone.mkdir()
    real_scandir = os.scandir

    def scandir(path="."):
        if Path(path) == gone:  # listed by its parent, then removed before the walk reached it
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    res = write_report(root, plots=False)
    assert [r["path"] for r in res["report"]["runs"]] == [str(run)]
    assert any("live" in w and "no summary.json" in w for w in res["warnings"])


def test_a_plain_seed_is_labelled_with_the_data_seed_it_trained_with(tmp_path):
    """A grid's `seed: 1` trains with the base's data_seed (101): the run is seed 1/101, one seed with
    a `seed: [1, 101]` run of the same setting, not a second one."""
    root = tmp_path / "runs"
    labels = {"dataset": "x", "tier": "-", "depth": 2, "arch": "tango"}
    plain = write_run(root / "a", {**labels, "seed": [1, 101]}, 3.0, 3.0)
    sweep = json.loads((plain / "sweep.json").read_text())
    (plain / "sweep.json").write_text(json.dumps({**sweep, "labels": {**labels, "seed": [1, None]}}))
    write_run(root / "b", {**labels, "seed": [1, 101]}, 2.0, 2.0)
    res = write_report(root, plots=False)
    (row,) = res["report"]["main"]
    assert row["cells"]["tango"]["seeds"] == {"1/101": pytest.approx(2.5)}
    assert any("are the same setting and seed" in w for w in res["warnings"]), res["warnings"]


@pytest.mark.parametrize(
    "case",
    [
        "truncated_summary",
        "corrupt_middle_metrics",
        "corrupt_config",
        "no_runs",
        "labels_a_list",
        "depth_a_word",
        "model_a_number",
        "throughput_a_word",
    ],
)
def test_damaged_inputs_exit_2_naming_the_file(tmp_path, capsys, case):
    root = tmp_path / "runs"
    if case == "no_runs":
        root.mkdir()
        want = "no finished runs"
    elif case in ("labels_a_list", "depth_a_word", "model_a_number", "throughput_a_word"):
        run = _one_run(root)
        sweep, config = json.loads((run / "sweep.json").read_text()), json.loads((run / "config.json").read_text())
        if case == "labels_a_list":
            (run / "sweep.json").write_text(json.dumps({**sweep, "labels": []}))
            want = f"{run / 'sweep.json'} is corrupt (its labels are not a mapping)"
        elif case == "depth_a_word":
            (run / "sweep.json").write_text(json.dumps({**sweep, "labels": {**sweep["labels"], "depth": "two"}}))
            want = "records depth 'two', not a number"
        elif case == "model_a_number":
            (run / "config.json").write_text(json.dumps({**config, "model": 1}))
            want = f"{run / 'config.json'} is corrupt (a section is not a mapping)"
        else:  # not a number: no point on the throughput plot, the rest of the report as before
            summary = json.loads((run / "summary.json").read_text())
            (run / "summary.json").write_text(json.dumps({**summary, "tokens_per_s": "fast"}))
            assert main(["report", str(root)]) == 0
            assert json.loads((root / "report" / "report.json").read_text())["runs"][0]["tokens_per_s"] is None
            return
    else:
        run = _one_run(root)
        if case == "truncated_summary":
            text = (run / "summary.json").read_text()
            (run / "summary.json").write_text(text[: len(text) // 2])
            want = (
                f"{run / 'summary.json'} is truncated or corrupt (not valid JSON); `tango-lm train {run} --resume` "
                "writes it again (as rerunning its sweep does), or delete the run"
            )
        elif case == "corrupt_middle_metrics":
            lines = (run / "metrics.jsonl").read_text().splitlines()
            lines[1] = lines[1][:5]
            (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
            want = f"{run / 'metrics.jsonl'} line 2"
        else:
            (run / "config.json").write_text("{not json")
            want = str(run / "config.json")
    assert main(["report", str(root), "--no-plots"]) == 2
    line = helpers.assert_one_error_line(capsys.readouterr().err)
    assert want in line


def test_an_out_that_is_a_file_is_a_user_error(runs, tmp_path):
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(UserError, match="--out .*afile is a file; give a directory for the report"):
        write_report(runs, tmp_path / "afile", plots=False)
    assert (tmp_path / "afile").read_text() == "mine"


def test_an_out_that_holds_the_runs_is_a_user_error(runs, tmp_path):
    """Its runs were skipped as the report's own: 'no finished runs', though they are all there."""
    for out in (runs, runs.parent):
        with pytest.raises(UserError, match=f"^--out {out} holds the runs of {runs} it would report; "):
            write_report(runs, out, plots=False)
    assert not (runs / "report").exists()


def test_an_out_in_a_dataset_or_a_run_is_a_user_error(runs, data_dir, tmp_path):
    # The report's files went into a prepared dataset (re-preparing it would take them along) or
    # beside a run's own files.
    before = helpers.snapshot(data_dir)
    for out in (data_dir, data_dir / "report"):
        with pytest.raises(UserError, match=f"--out {out} is inside the prepared dataset {data_dir}; give the report"):
            write_report(runs, out, plots=False)
    assert helpers.snapshot(data_dir) == before
    run = next(p.parent for p in sorted(runs.rglob("summary.json")))
    with pytest.raises(UserError, match=f"--out {run} holds a run; give the report a directory of its own"):
        write_report(runs, run, plots=False)
    assert not (run / "report.md").exists()
    assert write_report(runs, run / "report", plots=False)["out"] == str(run / "report")  # a folder of its own


def test_unknown_reference_is_a_user_error(runs):
    with pytest.raises(UserError, match="--reference 'nope'"):
        write_report(runs, plots=False, reference="nope")


def test_plain_runs_trained_differently_are_not_paired_or_ranked_together(tmp_path):
    # Outside a sweep, an onóna run of 2 steps at lr 1e-5 was paired against a Standard run of 8 steps
    # ("heads against Standard") and ranked with it, with nothing said.
    root = tmp_path / "runs"
    labels = {"dataset": "x", "tier": "-", "depth": 2, "arch": "dense", "seed": SEEDS[0]}
    standard = write_run(root, {**labels, "head": "standard"}, 3.0, 3.0, sweep_json=False)
    onona = write_run(root, {**labels, "head": "onona"}, 4.0, 4.0, sweep_json=False)
    report = write_report(root, plots=False)["report"]
    assert [(h["head"], h["delta"]) for h in report["heads"]] == [("onona", 1.0)]  # the same training: paired
    config = json.loads((onona / "config.json").read_text())
    config["train"].update(steps=2, lr=1e-5, out_dir="elsewhere", save_every=1)  # the last two label nothing
    (onona / "config.json").write_text(json.dumps(config))
    report = write_report(root, plots=False)["report"]
    assert report["heads"] == []
    rows = {(r["train.lr"], r["train.tokens"]): sorted(r["cells"]) for r in report["main"]}
    # lr missing: its default; a budget as the tokens it trains (2 steps of 8 windows of 1,024)
    assert rows == {(0.001, None): ["dense"], (1e-5, 2 * 8 * 1024): ["dense+onona"]}
    assert standard.exists()


def test_the_depth_table_never_joins_depths_trained_differently(tmp_path):
    """A grid edited to lr 3e-3 and depth 4 beside its depth-2 runs at 1e-3: each depth's row held
    one lr, so nothing labelled them, and the depth table read the lr's effect as depth's."""
    root = tmp_path / "runs"
    for depth, lr, nll in ((2, 1e-3, 4.7), (4, 3e-3, 3.6)):
        run = write_run(
            root, {"dataset": "x", "tier": "-", "depth": depth, "arch": "tango", "seed": SEEDS[0]}, nll, nll
        )
        config = json.loads((run / "config.json").read_text())
        config["train"]["lr"] = lr
        (run / "config.json").write_text(json.dumps(config))
    report = write_report(root, plots=False)["report"]
    assert sorted((r["train.lr"], sorted(r["depths"])) for r in report["depth"]) == [(1e-3, [2]), (3e-3, [4])]
    for run in root.rglob("config.json"):  # one lr: one line of the depth table, as before
        config = json.loads(run.read_text())
        config["train"]["lr"] = 1e-3
        run.write_text(json.dumps(config))
    ((row,),) = [write_report(root, plots=False)["report"]["depth"]]
    assert sorted(row["depths"]) == [2, 4] and "train.lr" not in row


def test_training_labels_cover_sweep_runs_and_ignore_what_computes_nothing(tmp_path):
    root = tmp_path / "runs"
    labels = {"dataset": "x", "tier": "-", "depth": 2, "seed": SEEDS[0]}
    swept = write_run(root / "sweep", {**labels, "arch": "tango"}, 3.0, 3.0)  # with sweep.json
    plain = write_run(root / "plain", {**labels, "arch": "loop-transformer"}, 4.0, 4.0, sweep_json=False)

    def edit(run, **train):
        config = json.loads((run / "config.json").read_text())
        config["train"].update(train)
        (run / "config.json").write_text(json.dumps(config))

    def main_rows():
        return sorted(
            (sorted(k for k in r if k.startswith("train.")), sorted(r["cells"]))
            for r in write_report(root, plots=False)["report"]["main"]
        )

    # Neither seq_len None and its resolved value, nor eval_batch_size off MoE, nor the logging, splits a row;
    # a field one config.json lacks is at its default (reshuffle_each_epoch: true).
    edit(swept, seq_len=None, reshuffle_each_epoch=True, eval_batch_size=2, compile=True, keep_last=1)
    model = json.loads((plain / "config.json").read_text())["model"]
    edit(plain, seq_len=model.get("context_length", 1024), lr=0.001)
    assert main_rows() == [([], ["loop-transformer", "tango"])]
    # A plain run of another lr beside a sweep's run was ranked against it.
    edit(plain, lr=1e-5)
    assert main_rows() == [(["train.lr"], ["loop-transformer"]), (["train.lr"], ["tango"])]


@pytest.mark.parametrize("batch_dependent", [False, True])
def test_eval_batch_size_splits_rows_of_an_architecture_whose_scores_depend_on_it(
    tmp_path, monkeypatch, batch_dependent
):
    """Read from the architecture (`scores_depend_on_batch`: MoE's), not its name: a new one that
    declares it has runs scored at other eval batch sizes kept apart too."""
    from tango_lm.models.registry import ARCHITECTURES

    monkeypatch.setattr(ARCHITECTURES["dense"], "scores_depend_on_batch", batch_dependent)
    labels = {"dataset": "x", "tier": "-", "depth": 2, "arch": "dense"}
    runs = [write_run(tmp_path / "runs", {**labels, "seed": seed}, 3.0, 3.0) for seed in SEEDS[:2]]
    config = json.loads((runs[0] / "config.json").read_text())
    config["train"]["eval_batch_size"] = 2
    (runs[0] / "config.json").write_text(json.dumps(config))
    rows = write_report(tmp_path / "runs", plots=False)["report"]["main"]
    assert len(rows) == (2 if batch_dependent else 1)


def test_linked_run_directories_are_read_once_each(tmp_path):
    """A folder of links to runs is how one gathers a comparison: it read as "no finished runs"."""
    labels = {"dataset": "x", "tier": "-", "depth": 2, "seed": SEEDS[0]}
    tango = write_run(tmp_path / "runs", {**labels, "arch": "tango"}, 3.0, 3.0)
    loop = write_run(tmp_path / "runs", {**labels, "arch": "loop-transformer"}, 4.0, 4.0)
    picked = tmp_path / "picked"
    picked.mkdir()
    (picked / "a").symlink_to(tango, target_is_directory=True)
    (picked / "b").symlink_to(loop, target_is_directory=True)
    (picked / "again").symlink_to(tango, target_is_directory=True)  # the same run twice: one run
    (picked / "up").symlink_to(picked, target_is_directory=True)  # a loop: walked once
    (row,) = write_report(picked, plots=False)["report"]["main"]
    assert {arch: cell["n"] for arch, cell in row["cells"].items()} == {"tango": 1, "loop-transformer": 1}


def test_what_a_sweep_or_an_older_version_decided_splits_no_row(tmp_path):
    def edit(run, section, **fields):
        config = json.loads((run / "config.json").read_text())
        config[section].update(fields)
        (run / "config.json").write_text(json.dumps(config))

    def cells(root):
        return sorted(sorted(r["cells"]) for r in write_report(root, plots=False)["report"]["main"])

    labels = {"dataset": "x", "tier": "-", "depth": 2, "seed": SEEDS[0]}
    # a grid's tokens_per_param without a tier gives each architecture its own token budget: by design
    sweep = tmp_path / "sweep"
    tango = write_run(sweep, {**labels, "arch": "tango"}, 3.0, 3.0)
    loop = write_run(sweep, {**labels, "arch": "loop-transformer"}, 4.0, 4.0)
    edit(tango, "train", tokens=351)
    edit(loop, "train", tokens=371)
    for run in (tango, loop):  # as the sweep writes it (sweep/grid.py _fix_budget)
        (run / "sweep.json").write_text(
            json.dumps({**json.loads((run / "sweep.json").read_text()), "tokens_per_param": 2})
        )
    assert cells(sweep) == [["loop-transformer", "tango"]]
    # a config.json from before n_kv_heads and capacity_factor_eval were written, beside a new one
    plain = tmp_path / "plain"
    old = write_run(plain, {**labels, "arch": "dense", "head": "standard"}, 3.0, 3.0, sweep_json=False)
    new = write_run(plain, {**labels, "arch": "dense", "head": "onona"}, 3.5, 3.5, sweep_json=False)
    edit(old, "model", d_model=64, head_dim=16)
    edit(new, "model", d_model=64, head_dim=16, n_heads=4, n_kv_heads=4, capacity_factor_eval=4.0)
    report = write_report(plain, plots=False)["report"]
    assert [(h["head"], h["delta"]) for h in report["heads"]] == [("onona", 0.5)]
    # eval_every changed on a resume picks nothing under select: final (it picks the checkpoint under best)
    for select, rows in (("final", 1), ("best", 2)):
        for run in (old, new):
            edit(run, "train", select=select, eval_every=2 if run == old else 3)
        assert len(write_report(plain, plots=False)["report"]["main"]) == rows, select


def test_a_tokens_per_param_budget_is_the_steps_the_run_finished_with(tmp_path):
    # The count a TPP budget multiplies changed between versions (a MoE run's own count, then the
    # Dense model's): today's count labelled an older run with tokens it never trained.
    from tango_lm.eval.report_runs import _resolved_setting

    labels = {"dataset": "x", "tier": "-", "depth": 2, "seed": SEEDS[0], "arch": "tango"}
    run = write_run(tmp_path / "runs", labels, 3.0, 3.0, sweep_json=False)
    config = json.loads((run / "config.json").read_text())
    config["train"].update(tokens_per_param=0.05, batch_size=4, grad_accum=2, seq_len=16)
    (run / "config.json").write_text(json.dumps(config))
    summary = json.loads((run / "summary.json").read_text())
    for steps, tokens in ((17, 17 * 4 * 2 * 16), (None, None)):
        (run / "summary.json").write_text(json.dumps({**summary, "steps": steps}))
        resolved = _resolved_setting(run)["train"]
        assert resolved["tokens_per_param"] is None
        if tokens is not None:
            assert resolved["tokens"] == tokens
        else:  # no finished steps: today's count, as before
            assert resolved["tokens"] > 0


def test_runs_of_one_sweep_trained_differently_are_not_ranked_together(tmp_path):
    # A grid edited after some of its runs trained (warmup 1 -> 3, one architecture's directory
    # deleted and retrained) left the other's run beside it: the report ranked them in one row.
    def edit(run, **fields):
        config = json.loads((run / "config.json").read_text())
        config["train"].update(fields)
        (run / "config.json").write_text(json.dumps(config))

    labels = {"dataset": "x", "tier": "-", "depth": 2, "seed": SEEDS[0]}
    sweep = tmp_path / "sweep"
    tango = write_run(sweep, {**labels, "arch": "tango"}, 3.0, 3.0)
    loop = write_run(sweep, {**labels, "arch": "loop-transformer"}, 4.0, 4.0)
    edit(tango, warmup_steps=3)
    edit(loop, warmup_steps=1)
    rows = write_report(sweep, plots=False)["report"]["main"]
    assert sorted((r["train.warmup_steps"], sorted(r["cells"])) for r in rows) == [
        (1, ["loop-transformer"]),
        (3, ["tango"]),
    ]
    # Token budgets of another kind of difference (not one tokens_per_param turned per architecture)
    # split too (steps of 8 windows of 1,024 tokens: 3 steps against 5).
    edit(tango, warmup_steps=1, tokens=3 * 8192)
    edit(loop, tokens=5 * 8192)
    assert len(write_report(sweep, plots=False)["report"]["main"]) == 2
    # One budget written in two kinds is one setting: `steps: 3` and the tokens of 3 steps (or any
    # count that rounds up to them) were labelled apart.
    edit(loop, tokens=None, steps=3)
    edit(tango, tokens=3 * 8192 - 100)
    (row,) = write_report(sweep, plots=False)["report"]["main"]
    assert sorted(row["cells"]) == ["loop-transformer", "tango"]


def test_a_field_only_other_architectures_read_splits_no_row(tmp_path):
    # A sweep's base sets window for its tango runs too; beside another sweep's tango run with the
    # default window, each tango seed was a row of its own, and windowed TANGO, torn from the tango
    # run it trained beside, was ranked "best" alone.
    def edit(run, **fields):
        config = json.loads((run / "config.json").read_text())
        config["model"].update(fields)
        (run / "config.json").write_text(json.dumps(config))

    labels = {"dataset": "x", "tier": "-", "depth": 2}
    first, second = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    edit(write_run(first, {**labels, "arch": "tango", "seed": SEEDS[0]}, 3.0, 3.0), window=16)
    edit(write_run(first, {**labels, "arch": "tango-windowed", "seed": SEEDS[0]}, 3.2, 3.2), window=16)
    write_run(second, {**labels, "arch": "tango", "seed": SEEDS[1]}, 3.1, 3.1)
    (row,) = write_report(tmp_path / "runs", plots=False)["report"]["main"]
    assert sorted(row["cells"]) == ["tango", "tango-windowed"] and "model.window" not in row
    assert row["cells"]["tango"]["n"] == 2
    # a field the architecture reads still splits it
    edit(write_run(second, {**labels, "arch": "tango-windowed", "seed": SEEDS[1]}, 3.3, 3.3), window=8)
    rows = write_report(tmp_path / "runs", plots=False)["report"]["main"]
    assert sorted((sorted(r["cells"]), r.get("model.window")) for r in rows) == [
        (["tango"], None),
        (["tango-windowed"], 8),
        (["tango-windowed"], 16),
    ]


@pytest.mark.parametrize("xs", [[3000, 6200], [2400, 9700]])
def test_a_throughput_axis_within_one_decade_still_has_numbers(xs):
    # 3,000 to 6,200 tokens/s: no power of 10 between them, so the log axis showed only its
    # unlabelled minor ticks, and the plot no values at all. (Up to 9,700: "8,000" then "1e+04".)
    from matplotlib.figure import Figure

    from tango_lm.eval.plots import _label_within_a_decade

    ax = Figure().subplots()
    ax.scatter(xs, [1.0, 1.1])
    ax.set_xscale("log")
    _label_within_a_decade(ax, xs)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels and all(labels) and all(xs[0] * 0.8 <= t <= xs[1] * 1.25 for t in ax.get_xticks())
    assert all(label.replace(",", "").isdigit() for label in labels), labels


def test_a_learning_curve_of_one_record_is_drawn_and_no_legend_warning(tmp_path, monkeypatch):
    # steps <= log_every: one train record and no dev one. The line had no marker (a lone point
    # draws nothing), and the legend went on the empty dev panel, warning on stderr.
    pytest.importorskip("matplotlib")
    import warnings

    from matplotlib.axes import Axes

    root = tmp_path / "runs"
    run = write_run(root, {"dataset": "d", "tier": "70M", "depth": 4, "arch": "tango", "seed": SEEDS[0]}, 3.0, 3.0)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 3.1, "tokens": 1000}) + "\n")
    drawn, real_plot = [], Axes.plot
    monkeypatch.setattr(
        Axes, "plot", lambda self, *a, **k: drawn.append((len(a[0]), k.get("marker"))) or real_plot(self, *a, **k)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_report(root)
    assert drawn == [(1, "o")]


def test_a_row_whose_models_have_different_seeds_marks_no_best(runs, capsys):
    # A part-trained grid (--only) or a failed run: TANGO's one seed was marked best against Loop's
    # three-seed mean, unsaid; with every seed the ranking reversed.
    for seed in SEEDS[1:]:
        shutil.rmtree(runs / f"dataset=dmmath/tier=70M/depth=4/arch=tango/seed={seed[0]}-{seed[1]}")
    res = write_report(runs, plots=False)
    row, cell = _cell(res["report"], "dmmath", 4, "tango")
    assert cell["n"] == 1 and row["best"] == []
    said = "dmmath, tier 70M, depth 4: the models have different seeds (TANGO 1, Loop Transformer++ 3, Full-attention GAU 3)"
    assert any(w.startswith(said) for w in res["warnings"]), res["warnings"]
    depth4 = next(r for r in res["report"]["depth"] if r["model"] == "tango" and r["dataset"] == "dmmath")
    assert depth4["non_increasing"] is None  # its depths' means are of other seeds
    row8, _ = _cell(res["report"], "dmmath", 8, "tango")
    assert row8["best"] == ["tango"]  # a row with every seed still ranks
