"""A grid's axes and SLURM settings as the sweep reads them, unit by unit: what each value becomes
(a label, minutes, submitit's parameter), which are refused, and the record of submitted jobs.
Each case is one a changed line had passed."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from tango_lm.errors import UserError
from tango_lm.sweep import launchers
from tango_lm.sweep.axes import label_of, parse_axes
from tango_lm.sweep.launchers import executor_parameters, read_jobs, time_minutes


def test_one_minute_is_enough_time():
    assert time_minutes("1") == time_minutes("1:00") == time_minutes("0:01:00") == 1
    with pytest.raises(UserError, match="under a minute"):
        time_minutes("0:59")


def test_every_slurm_setting_reaches_submitit_under_its_name():
    # An account dropped here billed every job to the default account, without a word.
    settings = {"gpus_per_job": 1, "timeout_min": 60, "account": "proj42", "qos": "high", "constraint": "a100"}
    params = executor_parameters(settings, "x")
    assert (params["slurm_account"], params["slurm_qos"], params["slurm_constraint"]) == ("proj42", "high", "a100")


def test_a_later_submission_keeps_the_record_of_jobs_still_queued(tmp_path):
    # Erased, the next rerun took run-a's queued job for gone and submitted it again.
    launchers._record_jobs(tmp_path, "slurm", [("run-a", "1_0")])
    launchers._record_jobs(tmp_path, "slurm", [("run-b", "2_0")])
    launchers._record_jobs(tmp_path, "slurm", [("run-a", "3_0")])  # resubmitted: its newest job only
    assert sorted((e["run"], e["job_id"]) for e in read_jobs(tmp_path)) == [("run-a", "3_0"), ("run-b", "2_0")]


# SLURM's states of a job not finished (sacct(1), JOB STATE CODES)
LIVE = ["PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUE_HOLD"]


@pytest.mark.parametrize("state", LIVE)
def test_a_job_in_any_live_state_counts_as_queued(tmp_path, monkeypatch, state):
    # A requeued (preempted) job taken for gone would be submitted a second time.
    pytest.importorskip("submitit")
    import submitit

    launchers._record_jobs(tmp_path, "slurm", [("r1", "7_0")])
    monkeypatch.setattr(submitit, "SlurmJob", lambda folder, job_id: types.SimpleNamespace(state=f"{state} by 0"))
    assert launchers.queued_jobs(tmp_path, "slurm") == ({"r1": "7_0"}, {})


def test_a_tier_is_one_value_however_it_is_cased():
    assert parse_axes({"tier": ["70m"]}, Path("g.yaml"))["tier"] == ["70M"]


@pytest.mark.parametrize(
    ("axes", "said"),
    [
        ({"tier": ["70m", "70M"]}, "repeats"),
        ({"depth": [0]}, "positive"),
        ({"train.out_dir": ["a", "b"]}, "out_dir"),
        ({"dataset": ["/a/x", "/b/x"]}, "alike"),
        ({"dataset": {}}, "empty"),
        ({"dataset": {".hidden": "/d"}}, ".hidden"),
    ],
)
def test_axes_that_would_collide_empty_or_escape_the_sweep_are_refused(axes, said):
    with pytest.raises(UserError, match=said):
        parse_axes(axes, Path("g.yaml"))


def test_a_boolean_label_is_lower_case_as_run_directories_have_it():
    assert (label_of(True), label_of(False)) == ("true", "false")
