"""`tango-lm sweep --launcher slurm` (sweep/launchers.py) through submitit's local executor: a job
is an ordinary run directory; preempted (SLURM's USR2), it is requeued and resumes from its last
checkpoint (that a resumed run equals an uninterrupted one is test_trainer.py's)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

from tango_lm.cli import main
from tango_lm.errors import UserError
from tango_lm.sweep import launchers, load_grid
from tango_lm.sweep.launchers import executor_parameters, slurm_settings, submit_sweep, time_minutes
from tests import helpers

pytestmark = pytest.mark.usefixtures("one_thread")
SRC = str(helpers.ROOT / "src")


def write_grid(tmp_path: Path, data_dir: Path, slurm: dict | None = None, **train: object) -> Path:
    spec = {
        "out_dir": str(tmp_path / "sweep"),
        "base": {"model": helpers.TINY_MODEL, "data": {"dir": str(data_dir)}, "train": {**helpers.TINY_TRAIN, **train}},
        "axes": {"seed": [[17, 101]]},
    }
    if slurm is not None:
        spec["slurm"] = slurm
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_preempted_job_is_requeued_and_resumes(data_dir, tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny models are faster on one thread
    train_settings = {"steps": 24, "save_every": 4, "eval_every": 12}
    grid = load_grid(write_grid(tmp_path, data_dir, **train_settings))
    (run,) = grid.runs
    settings = slurm_settings(grid, {"gpus_per_job": 0, "time": "10"})
    result: dict = {}
    submitter = threading.Thread(
        target=lambda: result.update(
            rows=submit_sweep(grid, grid.runs, settings, wait=True, log=lambda _: None, cluster="local")
        )
    )
    submitter.start()
    first = helpers.step_dir(run.out_dir, 4)
    deadline = time.monotonic() + 120
    while not first.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first.exists(), "the job did not start training"
    pid = json.loads((run.out_dir / ".lock").read_text())["pid"]  # the process that trains the run
    os.kill(pid, signal.SIGUSR2)  # what SLURM sends before preempting a job or ending its time
    submitter.join(timeout=180)
    (row,) = result["rows"]
    assert row["status"] == "resumed", row  # the requeued job found the checkpoints
    log = next((grid.out_dir / ".submitit").glob("*_log.out")).read_text()
    assert "Requeued job" in log and "resuming from step" in log
    assert [r["step"] for r in helpers.loss_records(run.out_dir)] == list(range(1, 25))  # each step once
    assert row["steps"] == 24 and json.loads((run.out_dir / "summary.json").read_text())["steps"] == 24
    assert json.loads((grid.out_dir / "jobs.json").read_text())["jobs"][0]["job_id"] == row["job_id"]
    # submitted again: the finished run is skipped, nothing is queued
    assert submit_sweep(grid, grid.runs, settings, cluster="local", log=lambda _: None)[0]["status"] == "skipped"


def test_a_job_records_the_grids_token_budget_as_the_local_launcher_does(data_dir, tmp_path, monkeypatch):
    # A job's sweep.json lacked tokens_per_param, so a report of a SLURM sweep without a tier gave
    # each architecture (its own token count by design) a row of its own and ranked nothing.
    pytest.importorskip("submitit")
    monkeypatch.setattr(launchers, "_export_torch_distributed_env", lambda: None)
    grid = load_grid(write_grid(tmp_path, data_dir, steps=None, tokens_per_param=0.01))
    (run,) = grid.runs
    assert run.tokens_per_param == 0.01
    job = launchers.SweepJob.of(run)
    assert job.checkpoint().function.tokens_per_param == 0.01  # what a requeued job carries too
    assert job()["status"] == "trained"
    assert json.loads((run.out_dir / "sweep.json").read_text())["tokens_per_param"] == 0.01


def test_a_jobs_log_has_the_runs_progress_as_lines(data_dir, tmp_path, monkeypatch, capsys):
    # A job's log (a file) said "training (12 steps)" and then nothing until the run ended.
    monkeypatch.setattr(launchers, "_export_torch_distributed_env", lambda: None)
    grid = load_grid(write_grid(tmp_path, data_dir, progress=True))
    (run,) = grid.runs
    assert launchers.SweepJob.of(run)()["status"] == "trained"
    err = capsys.readouterr().err
    assert "train tango: step 1/12 (8%), loss " in err and "train tango: step 12/12 (100%)" in err


def test_job_settings_come_from_the_grid_and_the_flags(data_dir, tmp_path):
    grid = load_grid(
        write_grid(
            tmp_path,
            data_dir,
            slurm={"partition": "gpu", "time": "1-00:30:00", "array_parallelism": 4, "additional": {"exclusive": True}},
        )
    )
    settings = slurm_settings(grid, {"partition": "big", "gpus_per_job": 8, "time": None, "account": None})
    params = executor_parameters(settings, "tango-lm:grid")
    assert params == {
        "name": "tango-lm:grid",
        "timeout_min": 24 * 60 + 30,
        "nodes": 1,
        "tasks_per_node": 8,
        "gpus_per_node": 8,
        "slurm_partition": "big",
        "slurm_array_parallelism": 4,
        "slurm_additional_parameters": {"exclusive": True},
    }
    assert [time_minutes(t) for t in (90, "90", "2:30", "1:00:01", "2-0", "1-2:03")] == [90, 90, 3, 61, 2880, 1563]
    for bad, message in (("soon", "not a SLURM time"), ("0:30", "under a minute")):
        with pytest.raises(UserError, match=message):
            time_minutes(bad)
    with pytest.raises(UserError, match="unknown slurm setting 'gpus'"):
        slurm_settings(grid, {"gpus": 2})
    with pytest.raises(UserError, match=r"unknown slurm setting 'partiton' \(did you mean 'partition'\?\)"):
        slurm_settings(grid, {"partiton": "gpu"})
    for amount in (float("nan"), float("inf"), 0.5):  # NaN passed as "the cluster refused the jobs"
        with pytest.raises(UserError, match="slurm setting mem_gb must be a finite number, at least 1"):
            slurm_settings(grid, {"mem_gb": amount})


def test_every_sweep_flag_is_a_slurm_setting_of_the_type_it_parses_to():
    # A flag outside SETTINGS would be refused as an unknown setting at submission, one whose type
    # SETTINGS does not take at its check; both only after the grid was loaded and planned.
    from tango_lm.cli.sweep import SLURM_FLAGS

    for key, (kind, _help) in SLURM_FLAGS.items():
        allowed = launchers.SETTINGS[key]
        assert kind in (allowed if isinstance(allowed, tuple) else (allowed,)), key


def test_a_multi_gpu_job_needs_a_parallel_run(data_dir, tmp_path):
    pytest.importorskip("submitit")  # without it, the missing extra is the error reported first
    grid = load_grid(write_grid(tmp_path, data_dir))
    settings = slurm_settings(grid, {"gpus_per_job": 8})
    with pytest.raises(UserError, match="cannot train as a job of 8 processes"):  # train.parallel is none
        submit_sweep(grid, grid.runs, settings, cluster="local")


def test_runs_their_data_refuses_are_never_submitted(data_dir, tmp_path):
    pytest.importorskip("submitit")
    grid = load_grid(write_grid(tmp_path, data_dir))
    grid.runs[0].config.model.vocab_size = 100  # the byte dataset has 257 ids
    with pytest.raises(UserError, match=r"^run seed=17-101: dataset .* nothing was submitted$"):
        submit_sweep(grid, grid.runs, slurm_settings(grid, {}), cluster="local")
    assert not (tmp_path / "sweep").exists()


def _grid_with_a_recorded_slurm_job(tmp_path, data_dir):
    """The test grid whose first run jobs.json records as SLURM job 4242_0."""
    grid = load_grid(write_grid(tmp_path, data_dir))
    grid.out_dir.mkdir(parents=True)
    (grid.out_dir / "jobs.json").write_text(
        json.dumps({"jobs": [{"run": grid.runs[0].name, "job_id": "4242_0", "cluster": "slurm"}]})
    )
    return grid


def test_only_unfinished_runs_without_a_live_job_are_submitted(data_dir, tmp_path, monkeypatch, capsys):
    submitit = pytest.importorskip("submitit")
    grid = _grid_with_a_recorded_slurm_job(tmp_path, data_dir)

    class FakeSlurmJob:
        def __init__(self, folder: str, job_id: str) -> None:
            self.state = {"4242_0": "RUNNING"}.get(job_id, "COMPLETED")

    monkeypatch.setattr(submitit, "SlurmJob", FakeSlurmJob)
    assert launchers.queued_jobs(grid.out_dir, "slurm") == ({grid.runs[0].name: "4242_0"}, {})
    rows = submit_sweep(grid, grid.runs, slurm_settings(grid, {"gpus_per_job": 0}), log=lambda _: None)
    assert [(r["status"], r["job_id"]) for r in rows] == [("queued", "4242_0")]
    # The dry run said "new" for it (inviting a second launch), and took any slurm settings.
    path = str(tmp_path / "grid.yaml")
    assert main(["sweep", path, "--launcher", "slurm", "--dry-run", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["state"], row["note"]) == ("queued", "job 4242_0")
    assert main(["sweep", path, "--launcher", "slurm", "--dry-run", "--time", "garbage"]) == 2
    assert "not a SLURM time" in helpers.assert_one_error_line(capsys.readouterr().err)
    assert main(["sweep", path, "--dry-run", "--partition", "gpu"]) == 2
    assert "applies to --launcher slurm" in helpers.assert_one_error_line(capsys.readouterr().err)


def test_a_job_sacct_cannot_place_is_not_submitted_again(data_dir, tmp_path, monkeypatch, capsys):
    # sacct lists a job only a while after sbatch, and may fail: submitit then says UNKNOWN, which
    # counted as gone, so a rerun submitted every pending or running run a second time.
    submitit = pytest.importorskip("submitit")
    grid = _grid_with_a_recorded_slurm_job(tmp_path, data_dir)

    class UnknownSlurmJob:
        def __init__(self, folder: str, job_id: str) -> None:
            self.state = "UNKNOWN"

    monkeypatch.setattr(submitit, "SlurmJob", UnknownSlurmJob)
    before = (grid.out_dir / "jobs.json").read_text()
    with pytest.raises(UserError, match=r"sacct cannot say whether job 4242_0 of run .* is still queued"):
        submit_sweep(grid, grid.runs, slurm_settings(grid, {"gpus_per_job": 0}), log=lambda _: None)
    assert (grid.out_dir / "jobs.json").read_text() == before
    assert main(["sweep", str(tmp_path / "grid.yaml"), "--launcher", "slurm", "--dry-run", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["state"], row["note"]) == ("queued", "job 4242_0: sacct cannot say its state")


@pytest.mark.parametrize("text", ['{"jobs": [{"run": "x", "job_id": "4242_0"},]}', "[]", '{"jobs": 1}'])
def test_a_jobs_file_that_cannot_be_read_is_refused_not_taken_for_none(data_dir, tmp_path, monkeypatch, capsys, text):
    # A hand-edit's trailing comma read as "no jobs": every queued run was submitted a second time
    # and the file rewritten without their records.
    submitit = pytest.importorskip("submitit")
    grid = _grid_with_a_recorded_slurm_job(tmp_path, data_dir)
    (grid.out_dir / "jobs.json").write_text(text)
    monkeypatch.setattr(submitit, "SlurmJob", lambda folder, job_id: pytest.fail("asked sacct"))
    with pytest.raises(UserError, match=r"jobs.json cannot be read \(.*\); fix it, .* or remove it if none of its"):
        submit_sweep(grid, grid.runs, slurm_settings(grid, {"gpus_per_job": 0}), log=lambda _: None)
    assert (grid.out_dir / "jobs.json").read_text() == text
    assert main(["sweep", str(tmp_path / "grid.yaml"), "--launcher", "slurm", "--dry-run"]) == 2
    assert "jobs.json cannot be read" in helpers.assert_one_error_line(capsys.readouterr().err)


def test_sweep_flags_and_a_missing_submitit_are_one_line_errors(data_dir, tmp_path, capsys, monkeypatch):
    grid = write_grid(tmp_path, data_dir)
    assert main(["sweep", str(grid), "--partition", "gpu"]) == 2
    assert "--partition applies to --launcher slurm" in helpers.assert_one_error_line(capsys.readouterr().err)
    assert main(["sweep", str(grid), "--launcher", "slurm", "--time", "whenever"]) == 2
    assert "not a SLURM time" in helpers.assert_one_error_line(capsys.readouterr().err)
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "submitit" else find_spec(name, *a)
    )
    assert main(["sweep", str(grid), "--launcher", "slurm"]) == 2
    assert "pip install 'tango-lm[cluster]'" in helpers.assert_one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "sweep").exists()


def _fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sbatch_rc: int) -> None:
    """`sbatch` and `srun` on PATH; this sbatch refuses every job as SLURM does a bad partition."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {
        "sbatch": f"echo 'sbatch: error: =====' >&2; echo 'sbatch: error: invalid partition specified: nope' >&2; exit {sbatch_rc}",
        "srun": "exit 0",
    }.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_no_sbatch_or_a_refused_submission_is_one_line(data_dir, tmp_path, capsys, monkeypatch):
    pytest.importorskip("submitit")
    grid = write_grid(tmp_path, data_dir)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no SLURM on this machine (nor anything else)
    assert main(["sweep", str(grid), "--launcher", "slurm"]) == 2
    assert "needs SLURM's sbatch, which is not on PATH" in helpers.assert_one_error_line(capsys.readouterr().err)
    monkeypatch.undo()

    _fake_slurm(tmp_path, monkeypatch, sbatch_rc=1)
    assert main(["sweep", str(grid), "--launcher", "slurm", "--partition", "nope"]) == 2
    line = helpers.assert_one_error_line(capsys.readouterr().err)  # sbatch's own message only in it
    assert line.startswith("error: the cluster refused the jobs") and "invalid partition" in line
    assert not (tmp_path / "sweep" / ".submitit").exists()  # the job files written for the refused array are gone
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / ".submitit").write_text("")  # where the job files go: this machine's disk refuses
    assert main(["sweep", str(grid), "--launcher", "slurm"]) == 2
    line = helpers.assert_one_error_line(capsys.readouterr().err)
    assert "could not write the job files under" in line and "check the disk and the path" in line


def test_the_dry_run_checks_the_job_processes_a_submission_checks(data_dir, tmp_path, capsys):
    # The dry run passed --gpus-per-job 2 for runs with train.parallel=none; the submission refused them.
    grid = write_grid(tmp_path, data_dir)
    assert main(["sweep", str(grid), "--launcher", "slurm", "--dry-run", "--gpus-per-job", "2"]) == 2
    line = helpers.assert_one_error_line(capsys.readouterr().err)
    assert "cannot train as a job of 2 processes: 2 processes were launched but train.parallel=none" in line


def test_the_hint_after_a_submission_shows_the_queued_runs_when_pasted(data_dir, tmp_path, capsys, monkeypatch):
    # It said `sweep GRID --dry-run`, which shows queued runs as new (only --launcher slurm asks
    # sacct), and left a path with a space unquoted.
    (tmp_path / "my grids").mkdir()
    grid = write_grid(tmp_path / "my grids", data_dir)
    monkeypatch.setattr(
        launchers, "submit_sweep", lambda grid, runs, *a, **k: [{"run": "r", "status": "submitted", "job_id": "7_0"}]
    )
    assert main(["sweep", str(grid), "--launcher", "slurm", "--gpus-per-job", "2", "--partition", "a b"]) == 0
    hint = capsys.readouterr().out.splitlines()[-1]
    sweep_cmd, report_cmd = (part.split("`")[1] for part in hint.split(";"))
    flags = ["--partition", "a b", "--gpus-per-job", "2"]  # the dry run checks them as the submission did
    assert shlex.split(sweep_cmd) == ["tango-lm", "sweep", str(grid), "--launcher", "slurm", *flags, "--dry-run"]
    assert shlex.split(report_cmd) == ["tango-lm", "report", str(tmp_path / "my grids" / "sweep")]


def test_an_unquoted_slurm_time_is_hours_not_base_60(data_dir, tmp_path):
    # YAML 1.1 reads 12:00:00 as the integer 43200, which SLURM took as minutes: 30 days.
    path = write_grid(tmp_path, data_dir)
    path.write_text(path.read_text() + "slurm: {time: 12:00:00}\n")
    settings = slurm_settings(load_grid(path), {})
    assert executor_parameters(settings, "x")["timeout_min"] == 12 * 60


def test_signal_delay_is_passed_under_submitits_current_name(data_dir, tmp_path):
    grid = load_grid(write_grid(tmp_path, data_dir, slurm={"signal_delay_s": 120}))
    params = executor_parameters(slurm_settings(grid, {}), "x")
    assert params["slurm_signal_delay_s"] == 120 and "signal_delay_s" not in params  # no deprecation warning


def test_a_job_that_ended_without_a_result_says_why_in_its_row(data_dir, tmp_path, monkeypatch):
    # submitit puts the reason on its message's second line, which the row cut off.
    pytest.importorskip("submitit")
    grid = load_grid(write_grid(tmp_path, data_dir))

    class CancelledJob:
        job_id = "1005_1"

        def results(self):
            raise RuntimeError("Job 1005_1 (task: 0) with path /x/1005_1_0_result.pkl\nhas not produced any output "
                               "(state: CANCELLED by 0)")  # fmt: skip

    monkeypatch.setattr(launchers, "_submit", lambda submitit, grid, runs, *a: [CancelledJob() for _ in runs])
    rows = submit_sweep(grid, grid.runs, slurm_settings(grid, {"gpus_per_job": 0}), wait=True, log=lambda _: None)
    assert rows[0]["status"] == "failed" and "has not produced any output (state: CANCELLED by 0)" in rows[0]["error"]


def test_a_job_of_several_tasks_reports_rank_0s_row(data_dir, tmp_path, monkeypatch):
    # --gpus-per-job 2 --wait: submitit's Job.result() refuses a job of several tasks, and every
    # such job that trained was reported failed ("You should use `results()` ..."), the sweep exit 1.
    grid = load_grid(write_grid(tmp_path, data_dir))

    class TwoTaskJob:
        job_id = "1006"

        def result(self):
            raise AssertionError("You should use `results()` if your job has subtasks.")

        def results(self):
            return [{"run": "rank 0's", "status": "trained"}, {"run": "rank 1's", "status": "trained"}]

    monkeypatch.setattr(launchers, "_submit", lambda submitit, grid, runs, *a: [TwoTaskJob() for _ in runs])
    (row,) = submit_sweep(grid, grid.runs, slurm_settings(grid, {"gpus_per_job": 0}), wait=True, log=lambda _: None)
    assert row == {"run": "rank 0's", "status": "trained", "job_id": "1006"}
    assert json.loads((grid.out_dir / "grid.json").read_text()) == {"runs": ["seed=17-101"]}  # for report


def test_other_ranks_of_a_job_leave_an_earlier_attempts_files_to_rank_0(data_dir, tmp_path, monkeypatch):
    # A job killed before its first checkpoint leaves config.json and metrics.jsonl; in the next
    # attempt rank 0 removes them under the run's lock, but rank 1, checking at the same time,
    # refused them ("already holds a run") and the job died, rank 0 waiting for it.
    from tango_lm.train import distributed
    from tango_lm.train.run_dir import claim_run_dir

    grid = load_grid(write_grid(tmp_path, data_dir))
    (run,) = grid.runs
    run.out_dir.mkdir(parents=True)
    (run.out_dir / "config.json").write_text("{}")
    calls = []
    monkeypatch.setattr(distributed, "launch_env", lambda: (1, 1, 2))
    monkeypatch.setattr(launchers, "_export_torch_distributed_env", lambda: None)
    monkeypatch.setattr(
        "tango_lm.train.trainer.train", lambda *a, **kw: calls.append((a, kw)) or type("R", (), {"summary": {}})
    )
    launchers.SweepJob.of(run)()
    assert calls[0][1]["prepared_by_rank_0"] is True and calls[0][0][1] is False  # a new run, not a resume
    with claim_run_dir(run.config, resume=False, main_process=False, prepared_by_rank_0=True):
        pass
    with pytest.raises(UserError, match="already holds a run \\(config.json\\)"):
        with claim_run_dir(run.config, resume=False, main_process=True, prepared_by_rank_0=True):
            pass


def test_the_data_checks_before_a_sweep_show_a_large_datasets_hashing(data_dir, tmp_path, monkeypatch, capsys):
    # A copied dataset is hashed by the sweep's data checks, before any run's line: submitting (on
    # a login node) and training locally showed nothing while it read (data/verify.py).
    import shutil

    import tango_lm.data.verify as verify

    monkeypatch.setattr(verify, "SHOWN_BYTES", 1000)  # the copy holds 3,840 bytes
    data = Path(shutil.copytree(data_dir, tmp_path / "data"))
    grid = load_grid(write_grid(tmp_path, data))

    class Checked(Exception):
        pass

    def stop(*args, **kwargs):
        raise Checked  # after the checks, before anything is queued

    monkeypatch.setattr(launchers, "queued_jobs", stop)
    settings = slurm_settings(grid, {"gpus_per_job": 0})
    if importlib.util.find_spec("submitit") is not None:
        with pytest.raises(Checked):
            submit_sweep(grid, grid.runs, settings, cluster="local", log=lambda _: None, progress="lines")
        assert capsys.readouterr().err.startswith(f"verify {data}: 1,280/1,920 tokens (67%), ")
    shutil.rmtree(tmp_path / "data")
    data = Path(shutil.copytree(data_dir, tmp_path / "data"))  # new inodes: not seen
    capsys.readouterr()
    assert main(["sweep", str(tmp_path / "grid.yaml")]) == 0  # lines: pytest's stderr is no terminal
    err = capsys.readouterr().err
    assert err.startswith(f"verify {data}: 1,280/1,920 tokens (67%), "), err
