"""What `train` checks of its run directory (train/run_dir.py), at edges the CLI tests do not
reach: a run known by its checkpoints alone, a step name below the latest checkpoint, and a
`checkpoints` that is a user's file on a fresh start."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tango_lm.errors import UserError
from tango_lm.train.run_dir import claim_run_dir, is_run_dir, remove_run_files


def _run(out: Path) -> SimpleNamespace:
    return SimpleNamespace(train=SimpleNamespace(out_dir=str(out)))


def _complete_step(run: Path, step: int) -> Path:
    step_dir = run / "checkpoints" / f"step-{step:08d}"
    step_dir.mkdir(parents=True)
    (step_dir / "COMPLETE").write_text(f'{{"step": {step}}}')
    return step_dir


def test_a_run_known_by_its_checkpoints_alone_takes_no_run_inside_it(tmp_path):
    # Its config.json deleted (or never copied), the run is still a run: a train inside it would
    # lie among its files, read by `report` and `eval` as one.
    run = tmp_path / "run"
    _complete_step(run, 4)
    assert is_run_dir(run)
    with pytest.raises(UserError, match=f"is inside the run directory {run}; set train.out_dir"):
        with claim_run_dir(_run(run / "nested"), resume=False):
            pass
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]


def test_a_file_at_a_step_below_the_latest_checkpoint_does_not_stop_a_resume(tmp_path):
    # Only a step name the resumed run will save under is in its way; an earlier one never is.
    run = tmp_path / "run"
    _complete_step(run, 8)
    (run / "checkpoints" / "step-00000004").write_text("a user's note")
    with claim_run_dir(_run(run), resume=True):
        pass
    (run / "checkpoints" / "step-00000012").write_text("in the way")
    with pytest.raises(UserError, match="step-00000012 is a file, not a checkpoint directory"):
        with claim_run_dir(_run(run), resume=True):
            pass


def test_a_fresh_start_keeps_a_checkpoints_that_is_a_file(tmp_path):
    # quickstart --fresh and a sweep's retry remove the run's files; a file named checkpoints is
    # no run's (training refuses it with its own error), so it stays.
    (tmp_path / "checkpoints").write_text("mine")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    remove_run_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]
    assert (tmp_path / "checkpoints").read_text() == "mine"


def test_a_fresh_start_removes_a_linked_checkpoints_folder_not_what_it_links_to(tmp_path):
    # checkpoints linked to a scratch disk: rmtree of the link was an OSError traceback.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "keep.txt").write_text("another run's")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(scratch, target_is_directory=True)
    remove_run_files(run)
    assert list(run.iterdir()) == [] and (scratch / "keep.txt").read_text() == "another run's"


def test_a_dangling_link_among_the_run_files_is_a_run_file(tmp_path):
    # A config.json linked to a disk not mounted now: the directory holds a run all the same.
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").symlink_to(tmp_path / "unmounted" / "config.json")
    with pytest.raises(UserError, match=r"already holds a run \(config.json\); pass --resume"):
        with claim_run_dir(_run(run), resume=False):
            pass
    assert [p.name for p in run.iterdir()] == ["config.json"]
