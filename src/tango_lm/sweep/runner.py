"""Run a sweep grid: each combination is an ordinary training run, trained in this process, one
after another.

Restart rules, so a sweep killed at any point loses nothing and picks up where it stopped:

- *done*: `summary.json` is present and records the run's full step budget. Never touched again
  (not even its `sweep.json`).
- *resume*: the run directory holds a complete checkpoint, or a complete copy a kill left beside
  its place (`restorable_steps`; the resume puts it back); training continues from the latest
  one (the trainer truncates `metrics.jsonl` to it).
- *new* (or *retry* after a recorded failure): no checkpoint, so records a killed attempt left in
  `metrics.jsonl`/`best.json` are removed and the run starts from step 0.

A run that raises (a `UserError` or anything else) gets `failed.json` (the one-line error) and
`failed.log` (the traceback) and the sweep goes on; the next invocation retries it.
`KeyboardInterrupt` stops the sweep. One sweep at a time may use an output directory, and the
sweep holds each run directory's lock while it prepares and trains that run (`output_lock.py`):
a run another process is training is reported as not trained and left alone.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable
from typing import Any

from tango_lm.atomic_files import write_json_atomic
from tango_lm.data.dataset_dir import same_dataset_dir
from tango_lm.errors import UserError
from tango_lm.models.config import MODEL_LOGISTICS_FIELDS
from tango_lm.models.registry import without_unread_fields
from tango_lm.output_lock import OutputLocked, hold_output_lock
from tango_lm.progress_lines import Progress
from tango_lm.strict_json import read_object
from tango_lm.sweep.checks import RunChecks, check_runs
from tango_lm.sweep.grid import Grid, SweepRun, record_grid_runs
from tango_lm.train.checkpoint import restorable_step_dirs, restorable_steps
from tango_lm.train.config import BUDGET_FIELDS, LOGISTICS_FIELDS, RunConfig
from tango_lm.train.run_dir import FAILED_ATTEMPT_FILES, remove_run_files

OTHER_TOKENS = "holds other tokens than the run trained on (prepared again since)"


def _differences(run: SweepRun) -> list[str]:
    """The data, model and train fields where the run directory's config.json differs from the
    grid's run (none when it holds no config yet); data.dir compared as the directory it names,
    model fields the run's architecture does not read not compared.
    Fields one of them lacks are passed over: a run from a version of tango-lm before the field
    was added ran with what is now its default."""
    saved = read_object(run.out_dir / "config.json")
    if saved is None:
        return []
    want = run.config.to_dict()
    out = _budget_difference(saved, run)
    for section in ("data", "model", "train"):
        have, grid = saved.get(section) or {}, want[section]
        if section == "model":  # what the run computes does not depend on the fields it does not read
            arch = run.config.model.arch
            have, grid = without_unread_fields(have, arch), without_unread_fields(grid, arch)
        for key in sorted(set(have) & set(grid)):
            if section == "train" and (key in LOGISTICS_FIELDS or key in BUDGET_FIELDS):
                continue
            if section == "model" and key in MODEL_LOGISTICS_FIELDS:
                continue
            if section == "data" and key == "dir" and same_dataset_dir(have[key], grid[key]):
                continue
            if have.get(key) != grid.get(key):
                out.append(f"{section}.{key} {have.get(key)!r} there, {grid.get(key)!r} in the grid")
    return out or _other_tokens(run)


def _budget_difference(saved: dict[str, Any], run: SweepRun) -> list[str]:
    """The budget compared as the steps it trains: `steps: 12` and `tokens: 1536` (12 steps of 128
    tokens) are one budget, written two ways."""
    want = run.config.total_steps()
    try:
        have = RunConfig.from_dict(saved).total_steps()
    except (UserError, TypeError, ValueError, AttributeError):  # a config.json this version cannot read:
        have_fields, grid = saved.get("train") or {}, run.config.to_dict()["train"]  # its budget fields, then
        return [
            f"train.{key} {have_fields[key]!r} there, {grid[key]!r} in the grid"
            for key in BUDGET_FIELDS
            if key in have_fields and have_fields[key] != grid[key]
        ]
    return [] if have == want else [f"a budget of {have:,} steps there, {want:,} in the grid"]


def _other_tokens(run: SweepRun) -> list[str]:
    """The difference when the run's dataset directory was prepared again since the run trained
    on it (its latest checkpoint records the tokens of each split it read): the same path, other
    data. None for a checkpoint from before the record, or a dataset not there (yet)."""
    from tango_lm.data.dataset_dir import is_prepared
    from tango_lm.data.shards import PreparedDataset
    from tango_lm.eval.evaluate import holds_recorded_tokens

    steps = list(restorable_step_dirs(run.out_dir / "checkpoints").values())  # the one a resume takes
    recorded = (read_object(steps[-1] / "meta.json") or {}).get("data") if steps else None
    directory = run.config.data.dir
    if not recorded or not is_prepared(directory) or holds_recorded_tokens(PreparedDataset.open(directory), recorded):
        return []
    return [f"data.dir {directory} {OTHER_TOKENS}"]


def other_config_row(run: SweepRun, state: dict[str, Any], log: Callable[[str], None], prefix: str) -> dict[str, Any]:
    """The failed row of a run whose directory holds another config (its files stay as they are),
    after logging why after `prefix`; every launcher leaves such a run alone."""
    first = state["differences"][0]
    keep = "" if first.endswith(OTHER_TOKENS) else "give the grid that value to keep its results, "
    error = (
        f"{run.out_dir} holds a run of another config ({first}); {keep}delete that directory to train the "
        "grid's, or give the sweep another out_dir"
    )
    log(prefix + error)
    return _row(run, "failed", None, error)


def run_state(run: SweepRun) -> dict[str, Any]:
    """What a (re)run would do: {"state": done|resume|retry|new|other-config, ...details}. A run
    directory holding another config (the grid was edited) is neither reused as done nor resumed:
    its results would be shown as the grid's, and a resume would mix two settings."""
    out = run.out_dir
    total = run.config.total_steps()
    differences = _differences(run)
    if differences:
        return {"state": "other-config", "differences": differences, "steps": total}
    summary = read_object(out / "summary.json")
    if summary is not None and summary.get("steps") == total:
        return {"state": "done", "steps": total, "summary": summary}
    steps = restorable_steps(out / "checkpoints")  # a step a kill left beside its place counts (resume puts it back)
    if steps:
        return {"state": "resume", "from_step": steps[-1], "steps": total}
    failed = read_object(out / "failed.json")
    if failed is not None:
        return {"state": "retry", "error": failed.get("error"), "steps": total}
    return {"state": "new", "steps": total}


TRAINS = ("new", "resume", "retry")  # the states of runs a sweep trains or submits


def check_runs_to_train(
    grid: Grid, runs: list[SweepRun], doing: str | None = None, progress: Progress = False
) -> RunChecks:
    """The data checks (sweep/checks.py) of the runs that would train, whose warnings the caller
    says (`say_warnings`); with `doing` ("trained"), a refused run is a UserError. `progress`: how
    the hashing of a dataset's shards not seen before shows (data/verify.py)."""
    checks = check_runs(grid, [run for run in runs if run_state(run)["state"] in TRAINS], progress)
    if doing is not None:
        checks.raise_refused(doing)
    return checks


def plan_rows(grid: Grid, runs: list[SweepRun], checks: RunChecks | None = None) -> list[dict[str, Any]]:
    """One row per run for `--dry-run`: its state, size and budget; a run its data refuses
    (`checks`, or `check_runs_to_train`'s) has the reason as its note."""
    refused = (checks or check_runs_to_train(grid, runs)).refused
    rows = []
    for run in runs:
        state = run_state(run)
        m = run.config.model
        counts = m.num_params()
        note = {
            "resume": f"from step {state.get('from_step')}",
            "retry": state.get("error"),
            "other-config": "; ".join(state.get("differences", [])),
        }.get(state["state"])
        if run.config.data.dir in grid.missing_data.values():
            note = f"data missing: {run.config.data.dir}"
        if run.name in refused:
            note = f"refused: {refused[run.name]}"
        rows.append(
            {
                "run": run.name,
                "state": state["state"],
                "arch": m.arch,
                "head": m.head,
                "d_model": m.d_model,
                "width": m.width,
                "depth": m.depth,
                "params": counts["total"],
                "steps": state["steps"],
                "tokens": state["steps"]
                * run.config.train.batch_size
                * run.config.train.grad_accum
                * run.config.seq_len(),
                "note": note,
            }
        )
    return rows


def run_sweep(
    grid: Grid,
    runs: list[SweepRun] | None = None,
    progress: bool | str | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Train every run of the grid that is not finished; returns one status row per run.
    `progress` overrides the runs' `train.progress` when given (train/progress_display.py)."""
    runs = grid.runs if runs is None else runs
    if grid.missing_data:
        name, directory = next(iter(grid.missing_data.items()))
        raise UserError(f"dataset {name!r} ({directory}) is not prepared; prepare it before running the sweep")
    # where the runs draw bars (None: on a terminal) or lines, so does the hashing of their data
    checks = check_runs_to_train(grid, runs, "trained", "lines" if progress == "lines" else progress is not False)
    rows: list[dict[str, Any]] = []
    with hold_output_lock(grid.out_dir, "tango-lm sweep", "stop it first"):
        record_grid_runs(grid)
        checks.say_warnings()
        for i, run in enumerate(runs, 1):
            head = f"[{i}/{len(runs)}] {run.name}"
            state = run_state(run)
            if state["state"] == "done":
                log(f"{head}: finished before, skipped")
                rows.append(_row(run, "skipped", state["summary"]))
                continue
            if state["state"] == "other-config":
                rows.append(other_config_row(run, state, log, f"{head}: not trained: "))
                continue
            try:
                with hold_output_lock(run.out_dir, "tango-lm sweep", "stop it first"):
                    rows.append(_train_one(run, head, log, progress))
            except (OutputLocked, UserError) as exc:  # another process trains it, or its directory is a file:
                log(f"{head}: not trained: {exc}")  # record nothing there, and go on with the others
                rows.append(_row(run, "failed", None, str(exc)))
            finally:
                _release_memory()
            write_json_atomic(grid.out_dir / "status.json", {"runs": rows, "total": len(runs)})
    return rows


def _train_one(
    run: SweepRun, head: str, log: Callable[[str], None], progress: bool | str | None = None
) -> dict[str, Any]:
    """Train (or resume, or retry) one run whose directory this process holds locked."""
    from tango_lm.train.trainer import train

    state = run_state(run)  # again, under the lock
    _prepare_dir(run, state)
    how = {"resume": f"resuming from step {state.get('from_step')}", "retry": "retrying after a failure"}
    log(f"{head}: {how.get(state['state'], 'training')} ({state['steps']} steps)")
    t0 = time.time()
    try:
        # warnings=False: the sweep said them once for all its runs (check_runs_to_train)
        summary = train(run.config, resume=state["state"] == "resume", warnings=False, progress=progress).summary
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - record every failure and go on with the sweep
        error = _record_failure(run, exc)
        log(f"{head}: failed: {error}")
        return _row(run, "failed", None, error)
    return _row(run, "resumed" if state["state"] == "resume" else "trained", summary, seconds=time.time() - t0)


def _prepare_dir(run: SweepRun, state: dict[str, Any]) -> None:
    out = run.out_dir
    out.mkdir(parents=True, exist_ok=True)
    for name in FAILED_ATTEMPT_FILES:
        (out / name).unlink(missing_ok=True)
    if state["state"] in ("new", "retry"):  # what an attempt killed before its first checkpoint left
        remove_run_files(out)
    budget = {} if run.tokens_per_param is None else {"tokens_per_param": run.tokens_per_param}
    write_json_atomic(out / "sweep.json", {"name": run.name, "labels": run.labels, **budget})


def _record_failure(run: SweepRun, exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    error = f"{type(exc).__name__}: {text}" if not isinstance(exc, UserError) else text
    run.out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        run.out_dir / "failed.json",
        {"error": error, "type": type(exc).__name__, "time": time.strftime("%Y-%m-%dT%H:%M:%S")},
    )
    (run.out_dir / "failed.log").write_text("".join(traceback.format_exception(exc)))
    return error


def _row(
    run: SweepRun, status: str, summary: dict[str, Any] | None, error: str | None = None, seconds: float | None = None
) -> dict[str, Any]:
    s = summary or {}
    return {
        "run": run.name,
        "status": status,
        "steps": s.get("steps"),
        "best_dev_nll": s.get("best_dev_nll"),
        "test_nll": s.get("test_nll"),
        "tokens_per_s": s.get("tokens_per_s"),
        "seconds": seconds,
        "error": error,
        "out_dir": str(run.out_dir),
    }


def _release_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - freeing memory is best effort
        pass
