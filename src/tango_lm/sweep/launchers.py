"""Where a sweep's runs train: `tango-lm sweep GRID --launcher local|slurm`.

- `local` (the default, sweep/runner.py): this process trains the runs one after another.
- `slurm`: every unfinished run becomes one job of a SLURM job array, submitted through
  `submitit` (`pip install 'tango-lm[cluster]'`). A job is an ordinary run directory trained by
  `SweepJob`: it resumes from its latest checkpoint when it starts again, so a job that is
  preempted or reaches its time limit is requeued (submitit's checkpoint/requeue: SLURM's
  USR2 signal before the limit) and continues where its last checkpoint left it, up to three
  times. The command returns once the jobs are queued (`OUT/.submitit/` holds each job's logs,
  `OUT/jobs.json` the run -> job id map); `--wait` waits and prints the results table.
  Rerunning it skips finished runs and runs whose job is still queued or running.

Job settings come from the grid's `slurm:` mapping, overridden by the command's flags:

    partition, account, qos, constraint   SLURM's names for them
    gpus_per_job     GPUs per job (default 1); with N > 1 the job starts N processes on one node,
                     one per GPU, with the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE,
                     MASTER_ADDR, MASTER_PORT): the grid's train.parallel must be ddp or fsdp
    time             per job: minutes, or SLURM's [D-]HH:MM[:SS] (default 24:00:00)
    signal_delay_s   how long before the time limit a job is told to requeue (submitit's 90 s)
    array_parallelism   jobs of the array that run at once
    cpus_per_task, mem_gb
    additional       other sbatch options, e.g. {exclusive: true}
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tango_lm.atomic_files import write_json_atomic
from tango_lm.errors import UserError, did_you_mean, os_error_text
from tango_lm.output_lock import hold_output_lock
from tango_lm.progress_lines import Progress
from tango_lm.sweep.grid import Grid, SweepRun, record_grid_runs
from tango_lm.sweep.runner import _row, _train_one, check_runs_to_train, other_config_row, run_state

SLURM_CLUSTER = "slurm"  # submitit's executor; the tests use its "local" executor instead
DEFAULT_TIME = "24:00:00"
ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUE_HOLD"}
SETTINGS = {
    "partition": str,
    "account": str,
    "qos": str,
    "constraint": str,
    "gpus_per_job": int,
    "time": (str, int),
    "array_parallelism": int,
    "cpus_per_task": int,
    "mem_gb": (int, float),
    "signal_delay_s": int,
    "additional": dict,
}


class SweepJob:
    """One run of a grid as a submitit job (picklable; submitit calls `checkpoint` to requeue it)."""

    def __init__(
        self, name: str, labels: dict[str, Any], config: dict[str, Any], tokens_per_param: float | None = None
    ) -> None:
        self.name, self.labels, self.config = name, labels, config
        self.tokens_per_param = tokens_per_param  # the grid's budget behind train.tokens (sweep.json)

    @classmethod
    def of(cls, run: SweepRun) -> SweepJob:
        return cls(run.name, run.labels, run.config.to_dict(), run.tokens_per_param)

    def __call__(self) -> dict[str, Any]:
        from tango_lm.train.config import RunConfig
        from tango_lm.train.distributed import launch_env
        from tango_lm.train.trainer import train

        _export_torch_distributed_env()
        config = RunConfig.from_dict(self.config)
        run = SweepRun(name=self.name, labels=self.labels, config=config, tokens_per_param=self.tokens_per_param)
        state = run_state(run)
        if state["state"] == "done":
            print(f"{run.name}: finished before, skipped", flush=True)
            return _row(run, "skipped", state["summary"])
        if state["state"] == "other-config":  # another config trained there since the submission
            return other_config_row(run, state, lambda line: print(line, flush=True), f"{run.name}: not trained: ")
        if launch_env()[0] != 0:  # the other processes of a multi-GPU job write nothing
            # rank 0 removes what an attempt killed before its first checkpoint left (_prepare_dir):
            # these ranks must not refuse those files, which they may see before it does
            resume = state["state"] == "resume"
            return _row(run, "trained", train(run.config, resume, progress=False, prepared_by_rank_0=True).summary)
        with hold_output_lock(run.out_dir, "a tango-lm sweep job", "wait for that job or cancel it"):
            # a job's log is a file: progress as lines (train/progress_display.py)
            return _train_one(run, run.name, lambda msg: print(msg, flush=True), progress="lines")

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Requeue the same run: it resumes from its latest checkpoint."""
        import submitit

        return submitit.helpers.DelayedSubmission(SweepJob(self.name, self.labels, self.config, self.tokens_per_param))


def _export_torch_distributed_env() -> None:
    """In a job of several tasks, set what torchrun would (each task keeps every GPU visible and
    takes GPU LOCAL_RANK, as under torchrun)."""
    import submitit

    if submitit.JobEnvironment().num_tasks > 1:
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def slurm_settings(grid: Grid, flags: dict[str, Any]) -> dict[str, Any]:
    """The grid's `slurm:` mapping with the command's flags (those not None) on top, checked."""
    if not isinstance(grid.slurm, dict):
        raise UserError(f"slurm in sweep grid {grid.path} must be a mapping such as {{partition: gpu, time: 12:00:00}}")
    settings = {**grid.slurm, **{k: v for k, v in flags.items() if v is not None}}
    for key, value in settings.items():
        kind = SETTINGS.get(key)
        if kind is None:
            raise UserError(
                f"unknown slurm setting {key!r}{did_you_mean(key, SETTINGS)}; settings are {', '.join(SETTINGS)}"
            )
        if isinstance(value, bool) or not isinstance(value, kind):
            raise UserError(f"slurm setting {key} has the wrong type ({value!r})")
    for key in ("gpus_per_job", "array_parallelism", "cpus_per_task", "mem_gb", "signal_delay_s"):
        least = 0 if key == "gpus_per_job" else 1
        # `not >=`: a NaN (`mem_gb: .nan`) is no amount either
        if key in settings and not (math.isfinite(settings[key]) and settings[key] >= least):
            raise UserError(f"slurm setting {key} must be a finite number, at least {least} (got {settings[key]})")
    settings.setdefault("gpus_per_job", 1)
    settings["timeout_min"] = time_minutes(settings.pop("time", DEFAULT_TIME))
    return settings


def time_minutes(value: str | int) -> int:
    """SLURM's time formats (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S) -> whole minutes."""
    text = str(value).strip()
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        raise UserError(f"slurm time {value!r} is not a SLURM time; write minutes or [D-]HH:MM:SS, e.g. 12:00:00")
    days, a, b, c = match.groups()
    parts = [int(a), int(b or 0), int(c or 0)]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        seconds = int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    elif c is not None:  # H:M:S
        seconds = parts[0] * 3600 + parts[1] * 60 + parts[2]
    elif b is not None:  # M:S
        seconds = parts[0] * 60 + parts[1]
    else:  # M
        seconds = parts[0] * 60
    if seconds < 60:
        raise UserError(f"slurm time {value!r} is under a minute; give each job time to train and checkpoint")
    return -(-seconds // 60)


def executor_parameters(settings: dict[str, Any], job_name: str) -> dict[str, Any]:
    """submitit AutoExecutor parameters for the settings (one node per job, one task per GPU)."""
    gpus = settings["gpus_per_job"]
    params: dict[str, Any] = {
        "name": job_name,
        "timeout_min": settings["timeout_min"],
        "nodes": 1,
        "tasks_per_node": max(gpus, 1),
        "gpus_per_node": gpus,
    }
    for key in ("cpus_per_task", "mem_gb"):
        if key in settings:
            params[key] = settings[key]
    # submitit deprecated the unprefixed signal_delay_s (a warning on every sweep that set it)
    for key in ("partition", "array_parallelism", "constraint", "qos", "account", "signal_delay_s"):
        if key in settings:
            params[f"slurm_{key}"] = settings[key]
    if settings.get("additional"):
        params["slurm_additional_parameters"] = dict(settings["additional"])
    return params


def submit_sweep(
    grid: Grid,
    runs: list[SweepRun],
    settings: dict[str, Any],
    wait: bool = False,
    log: Callable[[str], None] = print,
    cluster: str | None = None,
    progress: Progress = False,
) -> list[dict[str, Any]]:
    """Queue every unfinished run as one job of an array; with `wait`, return each job's row.
    `progress`: how the data checks before submitting show a dataset's hashing (data/verify.py)."""
    if importlib.util.find_spec("submitit") is None:
        raise UserError("--launcher slurm submits through submitit; pip install 'tango-lm[cluster]'")
    import submitit

    cluster = cluster or SLURM_CLUSTER
    if grid.missing_data:
        name, directory = next(iter(grid.missing_data.items()))
        raise UserError(f"dataset {name!r} ({directory}) is not prepared; prepare it before submitting the sweep")
    rows: list[dict[str, Any]] = []
    todo = []
    for run in runs:
        state = run_state(run)
        if state["state"] == "done":
            rows.append(_row(run, "skipped", state["summary"]))
            continue
        if state["state"] == "other-config":  # as the local launcher: never submitted
            rows.append(other_config_row(run, state, log, f"{run.name}: not submitted: "))
            continue
        todo.append(run)
    check_job_processes(todo, settings)
    checks = check_runs_to_train(grid, todo, "submitted", progress)
    with hold_output_lock(grid.out_dir, "tango-lm sweep", "stop it first"):
        queued, unknown = queued_jobs(grid.out_dir, cluster)
        refuse_unknown_jobs(grid.out_dir, {r.name: unknown[r.name] for r in todo if r.name in unknown})
        for run in [r for r in todo if r.name in queued]:
            log(f"{run.name}: already queued as job {queued[run.name]}, not submitted again")
            rows.append({**_row(run, "queued", None), "job_id": queued[run.name]})
        todo = [r for r in todo if r.name not in queued]
        jobs = []
        if todo:
            jobs = _submit(submitit, grid, todo, settings, cluster)
            _record_jobs(grid.out_dir, cluster, [(run.name, job.job_id) for run, job in zip(todo, jobs, strict=True)])
        record_grid_runs(grid)  # once the cluster took the jobs: a refused submission leaves nothing
    checks.say_warnings()  # after sbatch took the jobs: its refusal is the one line said
    for run, job in zip(todo, jobs, strict=True):
        log(f"{run.name}: submitted as job {job.job_id}")
    if not wait:
        return rows + [
            {**_row(run, "submitted", None), "job_id": job.job_id} for run, job in zip(todo, jobs, strict=True)
        ]
    for run, job in zip(todo, jobs, strict=True):
        try:
            row = job.results()[0]  # rank 0's: result() refuses a job of several tasks (--gpus-per-job 2)
        except Exception as exc:  # noqa: BLE001 - a job that died (cancelled, out of memory, ...) is one failed row
            # submitit says why on its second line ("has not produced any output (state: CANCELLED ...)"):
            # the whole message in one line, cut at 300 characters
            text = " ".join(str(exc).split()) or type(exc).__name__
            row = _row(run, "failed", None, f"job {job.job_id}: {text[:300]}")
        rows.append({**row, "job_id": job.job_id})
        log(f"{run.name}: job {job.job_id} {row['status']}")
    return rows


def check_job_processes(runs: list[SweepRun], settings: dict[str, Any]) -> None:
    """UserError for the first of `runs` that cannot train as a job of `--gpus-per-job` processes
    (a submission and its dry run say it before anything is queued)."""
    from tango_lm.train.distributed import check_launch

    processes = max(settings["gpus_per_job"], 1)
    for run in runs:
        try:
            check_launch(run.config, processes)
        except UserError as exc:
            raise UserError(f"run {run.name} cannot train as a job of {processes} processes: {exc}") from None


def _submit(submitit: Any, grid: Grid, runs: list[SweepRun], settings: dict[str, Any], cluster: str) -> list[Any]:
    """One job array of `runs`; a refused submission (sbatch's own error: a partition that does not
    exist, a time over the limit) is a UserError, and the job files written for it are removed."""
    if cluster == "slurm" and shutil.which("sbatch") is None:
        raise UserError(
            "--launcher slurm needs SLURM's sbatch, which is not on PATH here: submit from a login node of "
            "the cluster, or train on this machine with --launcher local"
        )
    folder = grid.out_dir / ".submitit"
    existed = folder.exists()
    before = set(folder.rglob("*")) if existed else set()
    said, complained = io.StringIO(), io.StringIO()  # sbatch's words: in the one error line, not before it
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(complained):
            executor = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
            executor.update_parameters(**executor_parameters(settings, f"tango-lm:{grid.path.stem}"))
            with executor.batch():
                jobs = [executor.submit(SweepJob.of(run)) for run in runs]
    except Exception as exc:  # noqa: BLE001 - submitit raises its own types and RuntimeError for sbatch's refusals
        for path in sorted(set(folder.rglob("*")) - before, reverse=True):  # files before their folders
            with contextlib.suppress(OSError):
                if path.is_file():
                    path.unlink()
                else:
                    path.rmdir()
        if not existed:  # made for this submission: no folder of job files is left of it either
            with contextlib.suppress(OSError):
                folder.rmdir()
        if isinstance(exc, OSError):  # this machine's disk, not the cluster
            raise UserError(
                f"could not write the job files under {folder} ({os_error_text(exc)}); check the disk and the path"
            ) from None
        said = " ".join((str(exc).strip() or complained.getvalue()).split()) or type(exc).__name__
        raise UserError(  # all of it: a site's submit plugin may put the reason on its second line
            f"the cluster refused the jobs ({said[:600]}); fix the slurm settings and submit again"
        ) from None
    sys.stdout.write(said.getvalue())
    sys.stderr.write(complained.getvalue())
    return jobs


def queued_jobs(out_dir: Path, cluster: str) -> tuple[dict[str, str], dict[str, str]]:
    """Runs of `OUT/jobs.json` whose SLURM job is still pending or running (asked through
    submitit, i.e. sacct), and those whose job's state sacct cannot give (a job it does not list yet,
    right after sbatch, or sacct failing): run -> job id each. Jobs of other executors cannot be
    asked about and count as gone."""
    if cluster != "slurm":
        return {}, {}
    recorded = read_jobs(out_dir)
    import submitit

    active, unknown = {}, {}
    for entry in recorded:
        if not isinstance(entry, dict) or entry.get("cluster") != "slurm":
            continue
        run, job_id = str(entry.get("run")), str(entry.get("job_id"))
        job = submitit.SlurmJob(folder=str(out_dir / ".submitit"), job_id=job_id)
        try:
            state = job.state.split()[0] if job.state.strip() else "UNKNOWN"
        except Exception:  # noqa: BLE001 - submitit's sacct call failing in a way it does not bypass
            state = "UNKNOWN"
        if state in ACTIVE:
            active[run] = job_id
        elif state == "UNKNOWN":  # not "gone": submitting it again would train it twice
            unknown[run] = job_id
    return active, unknown


def read_jobs(out_dir: Path) -> list[dict[str, Any]]:
    """`OUT/jobs.json`'s entries ([] when there is none). One it cannot read is refused, not taken
    for "no jobs": that would submit queued runs a second time and drop their records."""
    path = out_dir / "jobs.json"
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        jobs = data.get("jobs") if isinstance(data, dict) else None
        if not isinstance(jobs, list):
            raise ValueError('it holds no "jobs" list')
    except (OSError, ValueError) as exc:
        why = os_error_text(exc) if isinstance(exc, OSError) else str(exc).splitlines()[0]
        raise UserError(
            f'{path} cannot be read ({why}); fix it, a JSON object {{"jobs": [{{"run": ..., "job_id": '
            f"...}}, ...]}}, or remove it if none of its jobs is still queued"
        ) from None
    return [e for e in jobs if isinstance(e, dict)]


def refuse_unknown_jobs(out_dir: Path, unknown: dict[str, str]) -> None:
    """UserError naming the jobs sacct cannot say are gone, for runs about to be submitted."""
    if unknown:
        run, job_id = next(iter(unknown.items()))
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise UserError(
            f"sacct cannot say whether job {job_id} of run {run}{more} is still queued (it lists a job only "
            f"a while after sbatch, or it failed); run the command again in a minute, or, if those jobs are "
            f"gone, remove their entries from {out_dir / 'jobs.json'}"
        )


def mark_queued(grid: Grid, rows: list[dict[str, Any]]) -> None:
    """`--dry-run --launcher slurm`: a run whose job is still pending or running is `queued` (a
    submission would skip it), not `new` (which invites training it a second time); one whose job's
    state sacct cannot give is `queued` too, with that said."""
    if importlib.util.find_spec("submitit") is None:
        return  # nothing was submitted from here, then
    queued, unknown = queued_jobs(grid.out_dir, SLURM_CLUSTER)
    for row in rows:
        if row["state"] == "done":
            continue
        if row["run"] in queued:
            row["state"], row["note"] = "queued", f"job {queued[row['run']]}"
        elif row["run"] in unknown:
            row["state"], row["note"] = "queued", f"job {unknown[row['run']]}: sacct cannot say its state"


def _record_jobs(out_dir: Path, cluster: str, jobs: list[tuple[str, str]]) -> None:
    path = out_dir / "jobs.json"
    old = read_jobs(out_dir)
    names = {name for name, _ in jobs}
    when = time.strftime("%Y-%m-%dT%H:%M:%S")
    entries = [e for e in old if e.get("run") not in names]
    entries += [{"run": name, "job_id": job_id, "cluster": cluster, "submitted": when} for name, job_id in jobs]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"jobs": entries})


__all__ = ["SweepJob", "queued_jobs", "slurm_settings", "submit_sweep", "time_minutes"]
