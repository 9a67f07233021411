"""`tango-lm sweep`: grid parsing and run naming, parameter matching per architecture, failures
recorded without stopping the sweep, and restarts that skip finished runs and resume the rest,
also after SIGKILL."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tango_lm import config_checks
from tango_lm.cli import main, parse_args
from tango_lm.data.shards import write_prepared
from tango_lm.data.tokenizers import get_tokenizer
from tango_lm.errors import UserError
from tango_lm.models.matching import match_width
from tango_lm.models.registry import ARCHITECTURES
from tango_lm.sweep import load_grid, run_sweep, runner
from tango_lm.sweep.runner import plan_rows, run_state
from tango_lm.train.checkpoint import step_of
from tango_lm.train.trainer import Trainer
from tests import helpers

CONFIGS = helpers.ROOT / "configs" / "sweeps"
BASE = {"model": {k: v for k, v in helpers.TINY_MODEL.items() if k != "arch"}, "train": dict(helpers.TINY_TRAIN)}


pytestmark = pytest.mark.usefixtures("one_thread")


def write_grid(tmp_path: Path, axes: dict, data_dir: Path | None = None, **train) -> Path:
    base = json.loads(json.dumps(BASE))
    base["train"].update(train)
    if data_dir is not None:
        base["data"] = {"dir": str(data_dir)}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({"out_dir": str(tmp_path / "sweep"), "base": base, "axes": axes}, sort_keys=False))
    return path


def summaries(root: Path) -> dict[str, dict]:
    return {str(p.parent.relative_to(root)): json.loads(p.read_text()) for p in root.rglob("summary.json")}


# -- grids ------------------------------------------------------------------------------------
def test_run_names_matching_and_budgets(data_dir, tmp_path):
    axes = {
        "dataset": {"syn": str(data_dir)},
        "target_params": [20000],
        "depth": [1, 2],
        "arch": ["tango", "loop-transformer"],
        "head": ["standard", "onona"],
        "train.lr": [0.002],
        "seed": [[17, 101], [23, 103]],
    }
    grid = load_grid(write_grid(tmp_path, axes, steps=None, tokens_per_param=2))
    assert len(grid.runs) == 16
    assert (
        grid.runs[0].name
        == "dataset=syn/target_params=20000/depth=1/arch=tango/head=standard/train.lr=0.002/seed=17-101"
    )
    assert grid.runs[1].name.endswith("head=standard/train.lr=0.002/seed=23-103")
    assert len({r.name for r in grid.runs}) == 16
    for run in grid.runs:
        cfg = run.config
        assert cfg.train.out_dir == str(tmp_path / "sweep" / run.name)
        assert cfg.data.dir == str(data_dir) and cfg.train.lr == 0.002
        assert (cfg.train.seed, cfg.train.data_seed) == tuple(run.labels["seed"])
        # Width matched with the standard head; the onóna arm keeps that backbone.
        standard = cfg.model.replace(head="standard", width=cfg.model.d_model)
        assert cfg.model.width == match_width(standard, 20000).width
        # TPP against the target: every architecture and head trains on the same tokens.
        assert cfg.train.tokens == 40000 and cfg.train.tokens_per_param is None
        assert run.tokens_per_param == 2  # written to sweep.json: reports know the tokens came from it
    assert {r.config.model.head for r in grid.runs} == {"standard", "onona"}
    assert json.loads(json.dumps(grid.runs[0].labels)) == {
        "dataset": "syn",
        "target_params": 20000,
        "depth": 1,
        "arch": "tango",
        "head": "standard",
        "train.lr": 0.002,
        "seed": [17, 101],
    }
    # --only: a substring, or a glob against the name or its tail from any "/" (as the grids' examples write)
    assert len(grid.select(["arch=tango/"])) == len(grid.select(["depth=2/*"])) == 8
    assert len(grid.select(["*/arch=tango/head=onona/*"])) == len(grid.select(["head=onona/*seed=17-101"])) == 4
    assert grid.select(["arch=tango*"]) == grid.select(["arch=tango/"])  # a glob from the start of a part


def test_example_grids_load():
    cpu = load_grid(CONFIGS / "dmmath-cpu.yaml", check_data=False)
    assert len(cpu.runs) == 8
    table1 = load_grid(CONFIGS / "table1-fineweb.yaml", check_data=False)
    assert len(table1.select(["tier=70M/*"])) == len(table1.runs) // 2  # the --only its comment shows
    assert len(table1.runs) == 72 and set(table1.missing_data) <= {"fineweb-edu"}
    widths = {
        r.labels["arch"]: r.config.model.width
        for r in table1.runs
        if r.labels["tier"] == "70M" and r.labels["depth"] == 4
    }
    # seed 000 Table 3, 70M, depth 4 (GAU's range is 7,136-7,152 depending on context length)
    assert widths["tango"] == widths["tango-windowed"] == 28480
    assert (widths["loop-transformer"], widths["untied-transformer"]) == (28144, 6528)
    assert 7136 <= widths["gau"] <= 7152 and widths["flash"] == 7152
    tokens = {r.labels["tier"]: r.config.train.tokens for r in table1.runs}
    assert tokens == {"70M": 20 * 70_000_000, "160M": 20 * 160_000_000}


def test_shipped_grids_use_the_papers_seed_pairs():
    # Seed 000 Table 13: model seed / data-order seed 17/101, 23/103 and 41/107.
    paper = [(17, 101), (23, 103), (41, 107)]
    for path in sorted(CONFIGS.glob("*.yaml")):
        pairs = list(dict.fromkeys(tuple(r.labels["seed"]) for r in load_grid(path, check_data=False).runs))
        assert pairs == paper[: len(pairs)], path.name


MALFORMED = {
    "unknown_axis": ({"colour": ["red"]}, "unknown axis 'colour'"),
    "mistyped_axis": ({"dephts": [2]}, "grid.yaml (did you mean 'depth'?); axes are"),
    "mistyped_field": ({"train.warmup_step": [2]}, "is not a config field (did you mean 'warmup_steps'?)"),
    "bad_type": ({"depth": ["two"]}, "takes positive integers"),
    "empty_axis": ({"arch": []}, "axis 'arch'"),
    "unknown_arch": ({"arch": ["tango", "nope"]}, "unknown arch 'nope'"),
    "dataset_missing": ({"dataset": {"gone": "/nonexistent/data"}}, "dataset 'gone'"),
    "base_data_missing": ({"depth": [1]}, "the base's data.dir"),
    "data_dir_axis_missing": ({"data.dir": ["nodata"]}, "axis data.dir value 'nodata'"),  # listed as new, then failed
    "bad_seed": ({"seed": [[1, 2, 3]]}, "[model_seed, data_seed] pairs"),
    "unknown_field": ({"train.colour": [1]}, "not a config field"),
    "bad_combination": ({"model.d_model": [33]}, "run model.d_model=33"),
    "repeated_value": ({"depth": [2, 2]}, "repeats a value"),
    "repeated_value_spelled_twice": ({"train.lr": [1, 1.0]}, "repeats a value"),  # labels 1 and 1.0
    # values written two ways that resolve alike: one setting trained twice, its copies a "mean of seeds"
    "one_tier_written_twice": ({"tier": ["20K", 20000]}, "are one setting (the same config once"),
    "one_seed_written_twice": ({"seed": [17, [17, 101]]}, "are one setting (the same config once"),
    "tier_not_whole": ({"tier": [1.5]}, "axis 'tier' of sweep grid"),
    "target_named_as_its_axis": ({"target_params": ["1e4x"]}, "axis 'target_params' of sweep grid"),
    "negative_value": ({"train.lr": [-1]}, "train.lr must be positive (got -1.0)"),  # not "cannot name a directory"
    "not_a_list": ({"depth": 2}, "must be a list"),
    "axes_a_list": ([], "axes in sweep grid"),  # `axes: []` was one run, named "run", as no axes
    # a field axis beside the named axis that sets it: overwritten, or mislabelling the runs
    "field_and_named_axis": ({"arch": ["tango"], "model.arch": ["gau"]}, "axes model.arch and arch"),
    "seed_field_and_seed": ({"seed": [[1, 2]], "train.data_seed": [4]}, "axes train.data_seed and seed"),
    "data_dir_and_dataset": (
        {"dataset": {"a": "/x"}, "data.dir": ["y"]},
        "axes data.dir and dataset",
    ),  # named a, trained y
    "width_with_a_tier": ({"tier": ["70M"], "model.width": [128]}, "the matcher sets the width"),
    "seq_len_past_the_context": ({"train.seq_len": [64]}, "train.seq_len=64 is longer than model.context_length=32"),
    "two_budget_axes": ({"train.steps": [2], "train.tokens": [256]}, "both set the budget"),
    # listed as new by --dry-run, then "File name too long" when the sweep started
    "name_past_255_bytes": ({"train.wandb_project": ["x" * 300]}, "over the 255 a file system takes"),
    "no_conventional_geometry": (
        {"tier": ["50K"], "arch": ["conventional-untied"]},
        "no conventional-untied geometry for tier 50K at",
    ),
    # Table 6's shape has the tier's parameters only with GPT-2's embedding: 30M at the 70M tier over bytes
    "conventional_geometry_with_another_vocabulary": (
        {"tier": ["70M"], "model.depth": [4], "arch": ["conventional-untied"]},
        "with model.vocab_size=257 it has 30,267,200, not matched to the other runs",
    ),
}


@pytest.mark.parametrize(
    "case", [*MALFORMED, "not_yaml", "not_utf8", "unknown_key", "missing_file", "only_matches_nothing"]
)
def test_malformed_grids_exit_2_with_one_line(data_dir, tmp_path, capsys, monkeypatch, case):
    args = []
    if case in ("base_data_missing", "data_dir_axis_missing"):  # relative directories: make sure they are absent here
        monkeypatch.chdir(tmp_path)
    if case in MALFORMED:
        axes, want = MALFORMED[case]
        path = write_grid(tmp_path, axes, None if case == "base_data_missing" else data_dir)
    elif case == "not_yaml":
        path, want = tmp_path / "g.yaml", "not valid YAML"
        path.write_text("axes: {depth: [1, 2]\n")
    elif case == "not_utf8":  # it said "is not valid YAML; fix its syntax", of a file with none wrong
        path, want = tmp_path / "g.yaml", "sweep grid " + str(tmp_path / "g.yaml") + " is not text (not UTF-8); give"
        path.write_bytes(b"axes: {depth: [1, 2]}  # d\xe9pth\n")
    elif case == "unknown_key":
        path, want = tmp_path / "g.yaml", "unknown key 'axis'"
        path.write_text("axis: {depth: [1]}\n")
    elif case == "missing_file":
        path, want = tmp_path / "nope.yaml", "does not exist"
    else:
        path, want = write_grid(tmp_path, {"depth": [1, 2]}, data_dir), "matches none"
        args = ["--only", "depth=3"]
    assert main(["sweep", str(path), *args]) == 2
    line = helpers.assert_one_error_line(capsys.readouterr().err)
    assert want in line, line
    assert line.count("of sweep grid") <= 1, line  # where it is, said once
    assert not (tmp_path / "sweep").exists()
    if case in (
        "dataset_missing",
        "base_data_missing",
        "data_dir_axis_missing",
    ):  # a dry run lists the plan, saying what is missing
        assert main(["sweep", str(path), "--dry-run"]) == 0
        assert "data missing: " in capsys.readouterr().out


def test_a_count_yaml_reads_as_a_float_is_a_tier_and_a_target(data_dir, tmp_path):
    # `tier: [1e9]` was refused ("got 1000000000.0") although the tier error offers 1e9 as an example.
    for axis in ("tier", "target_params"):
        path = tmp_path / axis / "grid.yaml"
        path.parent.mkdir()
        path.write_text(write_grid(tmp_path / axis, {axis: [1]}, data_dir).read_text().replace("- 1\n", "- 2e4\n"))
        (run,) = load_grid(path).runs
        assert f"{axis}=20000" in run.name.split("/")


def test_dry_run_lists_runs_and_trains_nothing(data_dir, tmp_path, capsys):
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "depth": [1, 2], "arch": ["tango", "gau"]})
    assert main(["sweep", str(path), "--dry-run", "--only", "arch=tango", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["run"] for r in rows] == ["dataset=syn/depth=1/arch=tango", "dataset=syn/depth=2/arch=tango"]
    assert all(r["state"] == "new" and r["steps"] == 12 for r in rows)
    assert main(["sweep", str(path), "--dry-run", "--only", "*/arch=gau"]) == 0
    out = capsys.readouterr().out
    assert "depth=2/arch=gau" in out and "arch=tango" not in out and "2 runs" in out
    for extra in ([], ["--json"]):  # the command itself says success (main does not paper over a None)
        args = parse_args(["sweep", str(path), "--dry-run", *extra])
        assert args.func(args) == 0
    assert not (tmp_path / "sweep").exists()


def test_runs_their_data_refuses_stop_the_sweep_before_anything_trains(data_dir, tmp_path, capsys):
    """A vocabulary too small for the dataset fails every run when it starts: the sweep (and its
    dry run, in the note) says so up front, and trains nothing."""
    path = write_grid(
        tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango", "gau"], "model.vocab_size": [257, 100]}
    )
    assert main(["sweep", str(path), "--dry-run", "--json"]) == 0
    notes = {r["run"]: r["note"] for r in json.loads(capsys.readouterr().out)}
    assert notes["dataset=syn/arch=tango/model.vocab_size=257"] is None
    assert notes["dataset=syn/arch=gau/model.vocab_size=100"].startswith("refused: dataset ")
    assert "model.vocab_size is 100" in notes["dataset=syn/arch=tango/model.vocab_size=100"]
    rc, _, err, _ = helpers.run_main(capsys, ["sweep", str(path), "--no-progress"])
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("error: run dataset=syn/arch=tango/model.vocab_size=100 (and 1 more): dataset ")
    assert "set model.vocab_size=" in err and err.endswith("nothing was trained\n")
    assert not (tmp_path / "sweep").exists()
    # --only the runs it fits trains them
    assert main(["sweep", str(path), "--no-progress", "--only", "*=257"]) == 0


def test_a_logger_package_missing_stops_the_sweep_before_anything_trains(data_dir, tmp_path, capsys, monkeypatch):
    # Each run failed as it started (a failed.json per run; under SLURM, every job submitted).
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]}, loggers=["jsonl", "wandb"])
    assert main(["sweep", str(path), "--dry-run", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["note"].startswith("refused: train.loggers includes wandb but the wandb package is not installed")
    rc, _, err, _ = helpers.run_main(capsys, ["sweep", str(path), "--no-progress"])
    assert rc == 2 and err.count("\n") == 1 and "pip install 'tango-lm[wandb]'" in err
    assert err.endswith("nothing was trained\n")
    assert not (tmp_path / "sweep").exists()


def test_a_refused_run_is_said_alone_not_after_the_other_runs_warnings(data_dir, tmp_path, capsys):
    path = write_grid(
        tmp_path, {"dataset": {"syn": str(data_dir)}, "model.vocab_size": [257, 100], "train.warmup_steps": [10**6]}
    )
    rc, _, err, _ = helpers.run_main(capsys, ["sweep", str(path), "--no-progress"])
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: run ") and "nothing was trained" in err
    rc, _, err, _ = helpers.run_main(capsys, ["sweep", str(path), "--dry-run"])  # a plan: the warning said
    assert rc == 0 and "warning: train.warmup_steps=1000000 is not below" in err


@pytest.mark.parametrize(
    ("axis", "said"),
    [
        ({"model.context_length": [32, 100000]}, "the training split has"),  # trained, then failed.json
        ({"data.test_split": ["test", "nope"]}, "split 'nope' is not in"),
    ],
)
def test_runs_their_splits_cannot_serve_stop_the_sweep_before_anything_trains(data_dir, tmp_path, capsys, axis, said):
    # As a vocabulary too small: a split too short for a run's window, or one the data lacks, fails
    # the run as it starts; the sweep said nothing until then (and a cluster job was submitted).
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"], **axis})
    assert main(["sweep", str(path), "--dry-run", "--json"]) == 0
    notes = [r["note"] for r in json.loads(capsys.readouterr().out)]
    assert notes[0] is None and notes[1].startswith("refused: ") and said in notes[1]
    rc, _, err, _ = helpers.run_main(capsys, ["sweep", str(path), "--no-progress"])
    assert rc == 2 and err.count("\n") == 1 and said in err and err.endswith("nothing was trained\n")
    assert not (tmp_path / "sweep").exists()


def test_a_warning_shared_by_runs_is_said_once_before_they_train(data_dir, tmp_path, capsys):
    """The runs' start-of-run warnings are said by the sweep (and its dry run) once each, with the
    runs they concern, and not again by each run."""
    axes = {"dataset": {"syn": str(data_dir)}, "arch": ["tango", "tango-windowed"], "seed": [[1, 2], [3, 4]]}
    path = write_grid(tmp_path, axes, steps=2, warmup_steps=5)
    grid = yaml.safe_load(path.read_text())
    grid["base"]["model"]["window"] = helpers.TINY_MODEL["context_length"]
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    runs = load_grid(path).runs
    windowed = [r.config.model for r in runs if r.config.model.arch == "tango-windowed"]
    expected = [
        f"warning: {config_checks.warmup_past_the_run(runs[0].config)} (every run)",
        f"warning: {ARCHITECTURES['tango-windowed'].warnings(windowed[0])[0]} (2 of 4 runs, {runs[2].name} first)",
    ]
    assert main(["sweep", str(path), "--dry-run"]) == 0
    assert capsys.readouterr().err.splitlines() == expected
    assert main(["sweep", str(path), "--no-progress"]) == 0
    assert capsys.readouterr().err.splitlines() == expected  # said once, not again by each run
    assert main(["sweep", str(path), "--no-progress"]) == 0  # every run done: nothing to warn of
    assert capsys.readouterr().err == ""


def test_a_sweep_under_torchrun_is_refused_in_one_line(data_dir, tmp_path, capsys, monkeypatch):
    # Every process took the sweep's lock: the second said another sweep (its sibling) held it.
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]}, parallel="ddp")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert main(["sweep", str(path), "--no-progress"]) == 2
        line = helpers.assert_one_error_line(capsys.readouterr().err)
        assert "tango-lm sweep runs in one process, not under torchrun" in line
    assert not (tmp_path / "sweep").exists()


# -- running ----------------------------------------------------------------------------------
def test_failures_are_recorded_and_the_sweep_goes_on(data_dir, tmp_path, monkeypatch, capsys):
    import tango_lm.train.trainer as trainer_module

    axes = {
        "dataset": {"syn": str(data_dir)},
        "arch": ["tango", "loop-transformer", "untied-transformer"],
        "data.test_split": ["test", "dev"],
    }  # a run on test_split "dev" stands for one refused as it starts (a UserError no check before foresaw)
    path = write_grid(tmp_path, axes, steps=4, save_every=2, eval_every=2)
    original = trainer_module.train

    def refusing(run, resume=False, **kwargs):
        if run.data.test_split == "dev":
            raise UserError("the run refuses to start\nsecond line")
        return original(run, resume=resume, **kwargs)

    def flaky(run, resume=False, **kwargs):
        if run.model.arch == "loop-transformer":
            raise RuntimeError("boom\nsecond line")
        return refusing(run, resume=resume, **kwargs)

    monkeypatch.setattr(trainer_module, "train", flaky)
    assert main(["sweep", str(path), "--no-progress"]) == 1
    root = tmp_path / "sweep"
    out = capsys.readouterr().out
    assert "2 of 6 runs finished" in out
    status = {r["run"]: r for r in json.loads((root / "status.json").read_text())["runs"]}
    assert [r["status"] for r in status.values()] == ["trained", "failed", "failed", "failed", "trained", "failed"]
    boom = json.loads((root / "dataset=syn/arch=loop-transformer/data.test_split=test/failed.json").read_text())
    assert boom["error"] == "RuntimeError: boom" and boom["type"] == "RuntimeError"
    log = (root / "dataset=syn/arch=loop-transformer/data.test_split=test/failed.log").read_text()
    assert "Traceback" in log and "boom" in log
    user = json.loads((root / "dataset=syn/arch=tango/data.test_split=dev/failed.json").read_text())
    assert "the run refuses to start" in user["error"] and "\n" not in user["error"]

    # Rerun with the fault gone: finished runs are not touched, the failed ones are retried.
    monkeypatch.setattr(trainer_module, "train", refusing)
    done = [
        root / "dataset=syn/arch=tango/data.test_split=test",
        root / "dataset=syn/arch=untied-transformer/data.test_split=test",
    ]
    before = helpers.snapshot(*done)
    assert main(["sweep", str(path), "--no-progress"]) == 1
    assert helpers.snapshot(*done) == before
    status = [r["status"] for r in json.loads((root / "status.json").read_text())["runs"]]
    assert status == ["skipped", "failed", "trained", "failed", "skipped", "failed"]
    assert not (root / "dataset=syn/arch=loop-transformer/data.test_split=test/failed.json").exists()


def test_a_run_that_failed_before_its_first_checkpoint_is_retried_from_the_start(data_dir, tmp_path, monkeypatch):
    # Its attempt left config.json and metrics.jsonl: the retry clears them (a fresh train refuses a
    # directory that holds a run), and the log holds the retry's steps once.
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]}, steps=4, save_every=4)
    original = Trainer.train_step

    def fail_at_2(self):
        if self.step == 1:  # the update of step 2
            raise RuntimeError("boom")
        return original(self)

    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", fail_at_2)
        assert main(["sweep", str(path), "--no-progress"]) == 1
    (run,) = load_grid(path).runs
    assert (run.out_dir / "metrics.jsonl").exists() and not list((run.out_dir / "checkpoints").glob("step-*"))
    assert plan_rows(load_grid(path), load_grid(path).runs)[0]["state"] == "retry"
    rows = run_sweep(load_grid(path), progress=False, log=lambda _: None)
    assert [r["status"] for r in rows] == ["trained"]
    assert [r["step"] for r in helpers.loss_records(run.out_dir)] == [1, 2, 3, 4]


def test_a_failed_run_finished_with_resume_as_its_error_says_is_reported(data_dir, tmp_path, monkeypatch, capsys):
    # The sweep records the failure (failed.json); `train RUN --resume` finishes the run. Its record
    # of a failed latest attempt goes with the finish: `report` counts the run, and the sweep, which
    # finds it done, does not retrain it.
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]}, steps=4, save_every=2)
    original = Trainer.train_step

    def failing_at_3(self):
        if self.step == 3:
            raise RuntimeError("disk full")
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", failing_at_3)
    assert main(["sweep", str(path), "--no-progress"]) == 1
    run_dir = tmp_path / "sweep" / "dataset=syn/arch=tango"
    assert (run_dir / "failed.json").exists() and not (run_dir / "summary.json").exists()
    monkeypatch.setattr(Trainer, "train_step", original)
    assert main(["train", str(run_dir), "--resume", "--no-progress"]) == 0
    assert (run_dir / "summary.json").exists()
    assert not (run_dir / "failed.json").exists() and not (run_dir / "failed.log").exists()
    capsys.readouterr()
    assert main(["report", str(tmp_path / "sweep")]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "TANGO" in captured.out
    assert run_state(load_grid(path).runs[0])["state"] == "done"


def test_a_report_names_the_runs_of_the_grid_that_never_started(data_dir, tmp_path, capsys):
    # A sweep killed after its first run (or run with --only) left the others without a directory:
    # the report showed the finished ones as the whole grid, and said nothing of the rest.
    axes = {
        "dataset": {"syn": str(data_dir)},
        "arch": ["tango", "loop-transformer", "gau", "flash", "untied-transformer"],
    }
    path = write_grid(tmp_path, axes, steps=2)
    assert main(["sweep", str(path), "--no-progress", "--only", "arch=tango"]) == 0
    assert json.loads((tmp_path / "sweep" / "grid.json").read_text())["runs"] == [
        f"dataset=syn/arch={arch}" for arch in axes["arch"]
    ]
    capsys.readouterr()
    assert main(["report", str(tmp_path / "sweep"), "--no-plots"]) == 0
    assert (
        "warning: 4 of the grid's 5 runs never started (dataset=syn/arch=loop-transformer, dataset=syn/arch=gau, "
        "dataset=syn/arch=flash and 1 more); the tables hold the others"
    ) in capsys.readouterr().err
    assert main(["sweep", str(path), "--no-progress"]) == 0
    assert main(["report", str(tmp_path / "sweep"), "--no-plots"]) == 0
    assert "never started" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("stop", "code", "said"), [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "stopped by SIGTERM")]
)
def test_interrupted_run_resumes_exactly(data_dir, tmp_path, monkeypatch, capsys, stop, code, said):
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango", "loop-transformer"]})
    grid = load_grid(path)
    original = Trainer.train_step

    def stop_at_8(self):
        if self.step == 8 and self.run.model.arch == "tango":
            if stop == "SIGTERM":  # `timeout`, `kill`, a cluster's time limit: it killed the sweep outright
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(2)
            raise KeyboardInterrupt
        return original(self)

    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", stop_at_8)
        assert main(["sweep", str(path), "--no-progress"]) == code  # Ctrl-C or SIGTERM stops the sweep
    assert capsys.readouterr().err == f"{said}; run the same command again to continue the sweep\n"
    tango = grid.runs[0].out_dir
    assert not (tango / "summary.json").exists() and not (grid.runs[1].out_dir).exists()
    rows = run_sweep(load_grid(path), progress=False, log=lambda _: None)
    assert [r["status"] for r in rows] == ["resumed", "trained"]

    from tango_lm.train.trainer import train

    fresh = helpers.run_config(data_dir, tmp_path / "fresh")
    assert train(fresh).summary["test_nll"] == json.loads((tango / "summary.json").read_text())["test_nll"]
    assert helpers.loss_records(tango) == helpers.loss_records(tmp_path / "fresh")


def test_a_run_from_before_a_config_field_existed_or_logged_otherwise_is_still_done(data_dir, tmp_path):
    # Its config.json lacks the field: not "another config" (every finished run after an upgrade).
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]})
    run_sweep(load_grid(path), progress=False, log=lambda _: None)
    grid = load_grid(path)
    config_file = grid.runs[0].out_dir / "config.json"
    config = json.loads(config_file.read_text())
    del config["train"]["reshuffle_each_epoch"]
    config_file.write_text(json.dumps(config))
    assert plan_rows(grid, grid.runs)[0]["state"] == "done"
    # Nor does a grid edited in how runs log, checkpoint or compile make it "another config" (the
    # sweep reported every finished run failed and exited 1).
    logistics = {"log_every": 3, "keep_last": 5, "save_every": 2, "compile": True, "max_nonfinite_steps": 2}
    edited = load_grid(write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]}, **logistics))
    assert plan_rows(edited, edited.runs)[0]["state"] == "done"


def test_a_grid_edited_in_a_field_a_finished_run_does_not_read_leaves_it_done(data_dir, tmp_path):
    # The base's window is read by windowed TANGO alone: editing it made the finished tango run
    # "another config" (not reported, not retrained) though it would compute the same.
    def grid_with_window(window: int):
        path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango", "tango-windowed"]})
        grid = yaml.safe_load(path.read_text())
        grid["base"]["model"]["window"] = window
        path.write_text(yaml.safe_dump(grid, sort_keys=False))
        return load_grid(path)

    run_sweep(grid_with_window(8), progress=False, log=lambda _: None)
    edited = grid_with_window(4)
    rows = plan_rows(edited, edited.runs)
    states = {r.config.model.arch: row["state"] for r, row in zip(edited.runs, rows, strict=True)}
    assert states == {"tango": "done", "tango-windowed": "other-config"}


def test_a_grid_edited_in_how_a_model_computes_leaves_a_finished_run_done(data_dir, tmp_path):
    # The report merged runs differing only in loss_chunk, gdn_chunk or gdn_backend, but the sweep
    # called such a finished run "another config" (not reported, not retrained).
    def grid_with(**model: object):
        path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]})
        grid = yaml.safe_load(path.read_text())
        grid["base"]["model"].update(model)
        path.write_text(yaml.safe_dump(grid, sort_keys=False))
        return load_grid(path)

    run_sweep(grid_with(loss_chunk=16), progress=False, log=lambda _: None)
    edited = grid_with(loss_chunk=8)
    assert plan_rows(edited, edited.runs)[0]["state"] == "done"
    edited = grid_with(loss_chunk=16, init_std=0.03)  # and a field that changes what it computes does not
    assert plan_rows(edited, edited.runs)[0]["state"] == "other-config"


def test_a_head_field_axis_is_honoured_with_a_tier(data_dir, tmp_path):
    # The model.head axis was read before the field axes: runs named onona trained a Standard head.
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "target_params": [20000], "model.head": ["onona"]})
    (run,) = load_grid(path).runs
    assert run.config.model.head == "onona"


def test_a_step_a_kill_left_beside_its_place_is_resumed_not_deleted(data_dir, tmp_path):
    # Its only checkpoint a complete .tmp-* copy (killed before the rename), the run was "new": the
    # sweep removed its files, the copy with them, and trained it again from step 1.
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]}, steps=4, keep_last=1)
    grid = load_grid(path)
    run_sweep(grid, progress=False, log=lambda _: None)
    out = grid.runs[0].out_dir
    (out / "summary.json").unlink()
    last = sorted((out / "checkpoints").glob("step-*"))[-1]
    last.rename(last.with_name(f".tmp-{last.name}-999"))
    assert run_state(grid.runs[0]) == {"state": "resume", "from_step": step_of(last), "steps": 4}
    (row,) = run_sweep(load_grid(path), progress=False, log=lambda _: None)
    assert row["status"] == "resumed" and helpers.step_names(out) == [last.name]


@pytest.mark.parametrize("change", [{"lr": 0.03}, {"steps": 16}, {"steps": 8}])
def test_a_run_directory_of_another_config_is_neither_reused_nor_resumed(data_dir, tmp_path, change):
    # An edited grid: the finished run was shown as the grid's (another lr), resumed on another
    # schedule (more steps: its decay had ended at 12), or lost its summary before a refusal (fewer).
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]})
    assert [r["status"] for r in run_sweep(load_grid(path), progress=False, log=lambda _: None)] == ["trained"]
    run_dir = load_grid(path).runs[0].out_dir
    before = helpers.snapshot(run_dir)
    edited = load_grid(write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]}, **change))
    said = "train.lr" if "lr" in change else f"a budget of 12 steps there, {change['steps']} in the grid"
    assert plan_rows(edited, edited.runs)[0]["state"] == "other-config"
    (row,) = run_sweep(edited, progress=False, log=lambda _: None)
    assert row["status"] == "failed" and f"holds a run of another config ({said}" in row["error"]
    assert helpers.snapshot(run_dir) == before


def test_the_same_budget_written_as_tokens_is_the_same_run(data_dir, tmp_path):
    # `steps: 12` edited to the tokens of those 12 steps marked every finished run other-config.
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]})
    grid = load_grid(path)
    run_sweep(grid, progress=False, log=lambda _: None)
    cfg = grid.runs[0].config
    tokens = 12 * cfg.train.batch_size * cfg.train.grad_accum * cfg.seq_len()
    edited = load_grid(
        write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]}, steps=None, tokens=tokens)
    )
    assert edited.runs[0].config.total_steps() == 12 and edited.runs[0].config.train.steps is None
    assert plan_rows(edited, edited.runs)[0]["state"] == "done"


@pytest.mark.parametrize("last_step", ["in place", "a copy a kill left beside its place"])
def test_a_run_whose_dataset_was_prepared_again_since_is_neither_reused_nor_resumed(data_dir, tmp_path, last_step):
    """The same data.dir, other tokens: the finished run was shown as done, and a report averaged it
    with the runs on the new data. Its latest step a copy waiting to be put back, the check read no
    step and resumed it into a refusal (failed.json written into the other config's run)."""
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    path = write_grid(tmp_path, {"arch": ["tango"]}, data, keep_last=1)
    assert [r["status"] for r in run_sweep(load_grid(path), progress=False, log=lambda _: None)] == ["trained"]
    grid = load_grid(path)
    assert plan_rows(grid, grid.runs)[0]["state"] == "done"
    if last_step != "in place":
        (grid.runs[0].out_dir / "summary.json").unlink()
        last = sorted((grid.runs[0].out_dir / "checkpoints").glob("step-*"))[-1]
        last.rename(last.with_name(f".tmp-{last.name}-999"))
    before = helpers.snapshot(grid.runs[0].out_dir)
    docs = helpers.make_docs(helpers.TRAIN_DOCS, 7)  # other documents, prepared at the same path
    write_prepared(
        data,
        get_tokenizer("byte"),
        {"train": docs, "dev": docs[:8], "test": docs[8:16]},
        {},
        progress=False,
        overwrite=True,
    )
    (row,) = plan_rows(grid, grid.runs)
    assert (
        row["state"] == "other-config"
        and row["note"] == f"data.dir {data} holds other tokens than the run trained on (prepared again since)"
    )
    (row,) = run_sweep(grid, progress=False, log=lambda _: None)
    assert row["status"] == "failed" and "(prepared again since)); delete that directory" in row["error"]
    assert helpers.snapshot(grid.runs[0].out_dir) == before


def test_a_grid_edited_in_its_data_or_submitted_to_slurm_leaves_another_configs_run_alone(
    data_dir, tmp_path, monkeypatch
):
    # The data section was not compared: a finished run on another test split was shown as the
    # edited grid's result. And the SLURM launcher submitted a run of another config: its job
    # wrote failed.json into the finished run, which every later report then left out.
    path = write_grid(tmp_path, {"arch": ["tango"]}, data_dir)
    run_sweep(load_grid(path), progress=False, log=lambda _: None)
    run_dir = load_grid(path).runs[0].out_dir
    before = helpers.snapshot(run_dir)
    spec = yaml.safe_load(path.read_text())
    monkeypatch.chdir(data_dir.parent)
    spec["base"]["data"] = {"dir": os.path.relpath(data_dir)}  # the same directory, written otherwise
    path.write_text(yaml.safe_dump(spec))
    assert plan_rows(load_grid(path), load_grid(path).runs)[0]["state"] == "done"
    spec["base"]["data"]["test_split"] = "dev"
    path.write_text(yaml.safe_dump(spec))
    edited = load_grid(path)
    assert plan_rows(edited, edited.runs)[0]["state"] == "other-config"
    (row,) = run_sweep(edited, progress=False, log=lambda _: None)
    assert "holds a run of another config (data.test_split" in row["error"]
    if importlib.util.find_spec("submitit") is not None:
        from tango_lm.sweep.launchers import slurm_settings, submit_sweep

        settings = slurm_settings(edited, {"gpus_per_job": 0})
        (row,) = submit_sweep(edited, edited.runs, settings, cluster="local", log=lambda _: None)
        assert row["status"] == "failed" and "another config" in row["error"] and "job_id" not in row
    assert helpers.snapshot(run_dir) == before


def test_attempt_killed_before_its_first_checkpoint_starts_clean(data_dir, tmp_path):
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]})
    run_dir = load_grid(path).runs[0].out_dir
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9.9}\n{"step": 2, "lo')
    rows = run_sweep(load_grid(path), progress=False, log=lambda _: None)
    assert rows[0]["status"] == "trained"
    steps = [r["step"] for r in helpers.loss_records(run_dir)]
    assert steps == list(range(1, 13))


def test_one_sweep_at_a_time(data_dir, tmp_path):
    import fcntl

    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]})
    (tmp_path / "sweep").mkdir()
    with open(tmp_path / "sweep" / ".lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UserError, match="is in use by"):
            run_sweep(load_grid(path), progress=False, log=lambda _: None)


def test_a_locked_sweep_says_its_error_alone_not_after_its_runs_warnings(data_dir, tmp_path, capsys):
    # The runs' warnings were printed before the lock was asked for, then the error line.
    import fcntl

    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"]}, steps=2, warmup_steps=5)
    (tmp_path / "sweep").mkdir()
    with open(tmp_path / "sweep" / ".lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        rc, _, err, _ = helpers.run_main(capsys, ["sweep", str(path), "--no-progress"])
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and "is in use by" in err
    rc, _, err, _ = helpers.run_main(capsys, ["sweep", str(path), "--no-progress"])
    assert rc == 0 and "warning: train.warmup_steps=5 is not below" in err


def test_the_runs_left_are_warned_of_fields_only_the_grids_other_architectures_read(data_dir, tmp_path, capsys):
    # With --only (or once windowed TANGO's runs were done), tango's runs were warned that the
    # base's window, which the grid's windowed TANGO reads, is unused.
    axes = {"dataset": {"syn": str(data_dir)}, "arch": ["tango", "tango-windowed"]}
    path = write_grid(tmp_path, axes, steps=2)
    grid = yaml.safe_load(path.read_text())
    grid["base"]["model"]["window"] = 8
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    for only in ([], ["--only", "arch=tang[o]"]):  # the glob matches the name from a / on
        rc, _, err, _ = helpers.run_main(capsys, ["sweep", str(path), "--dry-run", *only])
        assert rc == 0 and "window" not in err, (only, err)


def test_runs_that_differ_only_in_a_field_their_architecture_does_not_read_are_trained_once(data_dir, tmp_path, capsys):
    # A window axis beside TANGO: its two TANGO runs build and train one model alike, and report
    # averaged them as two seeds (with a warning). The first trains; the other is said, not trained.
    axes = {"dataset": {"syn": str(data_dir)}, "arch": ["tango", "tango-windowed"], "model.window": [4, 8]}
    path = write_grid(tmp_path, axes, steps=2)
    grid = load_grid(path)
    tango = "dataset=syn/arch=tango/model.window"
    assert [r.name for r in grid.runs] == [
        f"{tango}=4",
        "dataset=syn/arch=tango-windowed/model.window=4",
        "dataset=syn/arch=tango-windowed/model.window=8",
    ]
    assert grid.repeats == {f"{tango}=8": (f"{tango}=4", ("window",))}
    said = (
        "warning: tango does not read model.window: a run of the grid that differs from another only there is "
        f"one setting with it, trained once ({tango}=8 is {tango}=4)"
    )
    rc, out, err, _ = helpers.run_main(capsys, ["sweep", str(path), "--dry-run"])
    assert rc == 0 and said in err.splitlines() and f"{tango}=8" not in out
    rc, _, err, _ = helpers.run_main(capsys, ["sweep", str(path), "--no-progress"])
    assert rc == 0 and said in err.splitlines()
    assert len(summaries(tmp_path / "sweep")) == 3
    rc, _, err, _ = helpers.run_main(capsys, ["sweep", str(path), "--no-progress"])  # all done: nothing said
    assert rc == 0 and err == ""
    # --only: the repeat is said only with the run it is trained as; selected alone, its error says why.
    shutil.rmtree(tmp_path / "sweep")
    rc, _, err, _ = helpers.run_main(capsys, ["sweep", str(path), "--dry-run", "--only", "tango-windowed"])
    assert rc == 0 and "does not read" not in err
    rc, _, err, _ = helpers.run_main(capsys, ["sweep", str(path), "--dry-run", "--only", f"{tango}=8"])
    assert rc == 2 and f"({tango}=8 is trained as {tango}=4: its architecture does not read model.window)" in err


def mid_run(root: Path) -> bool:
    """Two runs finished and another one holds a checkpoint but no summary yet."""
    try:
        finished = {p.parent for p in root.rglob("summary.json")}
        started = {p.parents[2] for p in root.rglob("checkpoints/step-*/COMPLETE")}
    except FileNotFoundError:  # the running sweep removed an old checkpoint while rglob walked it: ask again
        return False
    return len(finished) >= 2 and bool(started - finished)


def test_sigkill_loses_no_finished_run(data_dir, tmp_path):
    axes = {"dataset": {"syn": str(data_dir)}, "arch": ["tango", "loop-transformer"], "seed": [[17, 101], [23, 103]]}
    path = write_grid(tmp_path, axes, steps=16)
    root = tmp_path / "sweep"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tango_lm.cli", "sweep", str(path), "--no-progress"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            deadline = time.time() + 120
            while not mid_run(root) and proc.poll() is None and time.time() < deadline:
                time.sleep(0.02)
            assert proc.poll() is None, (tmp_path / "log.txt").read_text()  # still mid-sweep
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    finished = sorted(p.parent for p in root.rglob("summary.json"))
    assert 2 <= len(finished) < 4
    before = helpers.snapshot(*finished)

    rows = run_sweep(load_grid(path), progress=False, log=lambda _: None)
    assert helpers.snapshot(*finished) == before  # finished runs untouched: same bytes, same mtimes
    statuses = [r["status"] for r in rows]
    assert statuses.count("skipped") == len(finished) and "resumed" in statuses
    done = summaries(root)
    assert len(done) == 4 and all(s["steps"] == 16 for s in done.values())
    for run_dir in (p.parent for p in root.rglob("summary.json")):
        steps = [r["step"] for r in helpers.loss_records(run_dir)]
        assert steps == list(range(1, 17)), run_dir  # every step logged once, none lost or repeated


def test_a_file_where_a_run_directory_belongs_fails_that_run_only(data_dir, tmp_path):
    # The run's lock could not be created: the whole sweep stopped, the other runs untrained.
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "seed": [[1, 2], [3, 4]]})
    first, second = load_grid(path).runs
    first.out_dir.parent.mkdir(parents=True, exist_ok=True)
    first.out_dir.write_text("not a run")
    rows = run_sweep(load_grid(path), progress=False, log=lambda _: None)
    assert [r["status"] for r in rows] == ["failed", "trained"] and "Not a directory" in rows[0]["error"]
    assert first.out_dir.read_text() == "not a run"


def test_head_shape_axes_change_what_they_name(data_dir, tmp_path):
    # A model.head_dim axis over a base that writes n_heads was ignored (head_dim follows n_heads);
    # a d_model axis kept the base's head width only when the base wrote head_dim.
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "model.head_dim": [8, 16]})
    with path.open() as f:
        grid = yaml.safe_load(f)
    del grid["base"]["model"]["head_dim"]
    grid["base"]["model"].update(d_model=32, n_heads=4)  # heads of 8
    path.write_text(yaml.safe_dump(grid))
    assert [(r.config.model.n_heads, r.config.model.head_dim) for r in load_grid(path).runs] == [(4, 8), (2, 16)]
    grid["axes"] = {"dataset": {"syn": str(data_dir)}, "d_model": [64]}
    path.write_text(yaml.safe_dump(grid))
    (run,) = load_grid(path).runs
    assert (run.config.model.n_heads, run.config.model.head_dim) == (8, 8)


def test_d_model_and_head_axes_keep_the_bases_gqa_group_as_overrides_do(data_dir, tmp_path):
    # The d_model axis and a model.* axis were applied one after the other: the second no longer saw the
    # base's n_heads, so 4 heads over 2 key/value heads became groups of 4 (or a valid grid was refused).
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "d_model": [64], "model.head_dim": [8]})
    grid = yaml.safe_load(path.read_text())
    grid["base"]["model"].update(arch="dense", d_model=32, n_heads=4, n_kv_heads=2)
    del grid["base"]["model"]["head_dim"]
    path.write_text(yaml.safe_dump(grid))
    (run,) = load_grid(path).runs
    assert (run.config.model.n_heads, run.config.model.n_kv_heads, run.config.model.head_dim) == (8, 4, 8)
    grid["axes"] = {"dataset": {"syn": str(data_dir)}, "d_model": [64], "model.n_heads": [2]}
    path.write_text(yaml.safe_dump(grid))
    (run,) = load_grid(path).runs
    assert (run.config.model.n_heads, run.config.model.n_kv_heads) == (2, 1)


def test_a_budget_axis_replaces_the_bases_budget_of_another_kind(data_dir, tmp_path):
    # A train.tokens_per_param axis over a base with train.steps (a preset's tokens, say) was ignored:
    # steps win over tokens_per_param, so runs labelled by 1 and 20 tokens per parameter trained alike.
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "train.tokens_per_param": [0.5, 1]}, steps=6)
    runs = load_grid(path).runs
    assert [r.config.train.steps for r in runs] == [None, None]
    assert [r.config.train.tokens for r in runs] == [
        int(tpp * r.config.model.replace(head="standard").num_params()["total"])
        for tpp, r in zip((0.5, 1), runs, strict=True)
    ]
    # Each run's sweep.json records the TPP behind its tokens (the report compares the runs' tokens by it).
    runner._prepare_dir(runs[0], {"state": "new"})
    assert json.loads((runs[0].out_dir / "sweep.json").read_text())["tokens_per_param"] == 0.5


def test_a_sweep_whose_reader_leaves_trains_every_run(data_dir, tmp_path, monkeypatch):
    # `tango-lm sweep grid.yaml | head -1`: the BrokenPipeError of the second line stopped the sweep
    # after its first run, exit code 0; a command that trains goes on with its output in /dev/null.
    import os
    import sys

    # steps 2 < warmup_steps: every run warns on stderr when it starts (`2>&1 | head` closed it too)
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"], "seed": [1, 2, 3]}, steps=2)
    read, write = os.pipe()
    os.close(read)  # the reader has left
    closed = open(write, "w", buffering=1)  # line-buffered: every line meets the closed pipe
    monkeypatch.setattr(sys, "stdout", closed)
    monkeypatch.setattr(sys, "stderr", closed)
    try:
        assert main(["sweep", str(path)]) == 0
    finally:
        monkeypatch.undo()
        closed.close()
    assert len(summaries(tmp_path / "sweep")) == 3
    # `>&-`: no stdout at all, where print writes nothing (the guard's own write had raised)
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"], "seed": [4]}, steps=2)
    monkeypatch.setattr(sys, "stdout", None)
    try:
        assert main(["sweep", str(path)]) == 0
    finally:
        monkeypatch.undo()
    assert len(summaries(tmp_path / "sweep")) == 4


def test_a_base_preset_with_a_model_section_reads_it_as_overrides(data_dir, tmp_path):
    # base: {preset: tango-70m-d4, model: {d_model: 64, ...}} kept the preset's 16 heads, 4 channels
    # each, where `train tango-70m-d4 d_model=64` keeps heads of 32 (2 heads): the same parameter
    # count, another model, unsaid.
    from tango_lm.train.config import load_run_config

    model = {"d_model": 64, "width": 256, "vocab_size": 257, "context_length": 32}
    grid = {
        "out_dir": str(tmp_path / "sweep"),
        "base": {"preset": "tango-70m-d4", "model": model, "data": {"dir": str(data_dir)}, "train": {"steps": 1}},
        "axes": {"depth": [2]},
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    swept = load_grid(path).runs[0].config.model
    given = load_run_config("tango-70m-d4", [f"{k}={v}" for k, v in model.items()] + ["depth=2", "train.steps=1"]).model
    assert (swept.n_heads, swept.head_dim) == (given.n_heads, given.head_dim) == (2, 32)
    assert swept == given


def test_a_sweep_without_a_terminal_writes_each_runs_progress_as_lines(data_dir, tmp_path, capsys):
    # `nohup tango-lm sweep grid.yaml > log 2>&1`: each run's header, then nothing until it ended.
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"], "seed": [1]}, progress=True)
    rc, _, err, _ = helpers.run_main(capsys, ["sweep", str(path)])
    assert rc == 0 and "train tango: step 12/12 (100%)" in err
    path = write_grid(tmp_path, {"dataset": {"syn": str(data_dir)}, "arch": ["tango"], "seed": [2]}, progress=True)
    rc, out, err, _ = helpers.run_main(capsys, ["sweep", str(path), "--no-progress"])
    assert rc == 0 and "trained" in out and "train tango: step" not in err
