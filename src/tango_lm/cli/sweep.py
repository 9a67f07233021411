"""Sweeps and reports: `sweep` and `report`."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from tango_lm.cli.output import JSON_HELP, NO_PROGRESS_HELP, _print_json, _table, command_progress
from tango_lm.errors import UserError, counted, path_arg
from tango_lm.stop_signals import STOPS, stop_on_sigterm, with_note

# The slurm settings (sweep/launchers.py SETTINGS) that `sweep` also takes as flags, over the grid's: a
# flag added here is parsed, checked against --launcher and handed to the launcher.
SLURM_FLAGS: dict[str, tuple[type, str]] = {
    "partition": (str, "partition (overrides the grid's slurm.partition)"),
    "account": (str, "account to charge"),
    "gpus_per_job": (int, "GPUs per run, one process each (default 1)"),
    "time": (str, "time limit per job, minutes or [D-]HH:MM:SS (default 24:00:00)"),
    "array_parallelism": (int, "jobs of the array running at once"),
    "cpus_per_task": (int, "CPUs per process"),
    "mem_gb": (float, "memory per job in GB"),
}


def add_slurm_arguments(parser: Any) -> None:
    """The SLURM_FLAGS as `--name` options, each None when not given."""
    for key, (kind, help_text) in SLURM_FLAGS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=kind, default=None, help=f"slurm: {help_text}")


def slurm_flags(args: Any) -> dict[str, Any]:
    """The SLURM_FLAGS' values on the command line (None where not given)."""
    return {key: getattr(args, key) for key in SLURM_FLAGS}


def cmd_sweep(args: argparse.Namespace) -> int:
    from tango_lm.sweep import load_grid, plan_rows, run_sweep
    from tango_lm.sweep.runner import check_runs_to_train
    from tango_lm.train.distributed import launch_env

    if launch_env()[2] > 1:  # every process took the sweep's lock, and the second said another sweep held it
        raise UserError(
            "tango-lm sweep runs in one process, not under torchrun; for several GPUs per run use "
            "--launcher slurm --gpus-per-job N, or launch each run with torchrun ... tango-lm train RUN_CONFIG"
        )
    grid = load_grid(args.grid, check_data=not args.dry_run)
    runs = grid.select(args.only)
    if not runs:
        repeats = grid.repeats_selected(args.only)
        why = ""
        if repeats:  # a run trained as another: say so, not only that nothing matched
            first, fields = grid.repeats[repeats[0]]
            unread = ", ".join(f"model.{f}" for f in fields)
            why = f" ({repeats[0]} is trained as {first}: its architecture does not read {unread})"
        raise UserError(f"--only {' '.join(args.only)} matches none of the {len(grid.runs)} runs of {args.grid}{why}")
    flags = slurm_flags(args)
    if args.launcher != "slurm":
        given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None] + (
            ["--wait"] if args.wait else []
        )
        if given:
            raise UserError(f"{given[0]} applies to --launcher slurm; add --launcher slurm or drop it")
        if grid.slurm:  # the grid's slurm: settings are checked whatever runs it now (a typo there waited)
            from tango_lm.sweep.launchers import slurm_settings

            slurm_settings(grid, {})
    if args.dry_run:
        if args.launcher == "slurm":  # the settings checked as a submission would, before any warning
            from tango_lm.sweep.launchers import check_job_processes, mark_queued, slurm_settings
            from tango_lm.sweep.runner import TRAINS, run_state

            settings = slurm_settings(grid, flags)
            check_job_processes([r for r in runs if run_state(r)["state"] in TRAINS], settings)  # those it submits
        checks = check_runs_to_train(grid, runs, progress=command_progress(args))
        rows = plan_rows(grid, runs, checks)
        if args.launcher == "slurm":  # and the runs whose jobs are live shown as queued
            mark_queued(grid, rows)
        checks.say_warnings()  # once nothing is left to fail: an error line is said alone
        if args.json:
            _print_json(rows)
            return 0
        print(
            _table(
                rows,
                [
                    ("run", "run", ""),
                    ("state", "state", ""),
                    ("width", "width", ""),
                    ("params", "params", ",d"),
                    ("steps", "steps", ",d"),
                    ("tokens", "tokens", ",d"),
                    ("note", "note", ""),
                ],
            )
        )
        print(f"{counted(len(runs), 'run')} under {grid.out_dir} (dry run: nothing trained)")
        return 0
    log = (lambda _msg: None) if args.json else (lambda msg: print(msg, flush=True))
    if args.launcher == "slurm":
        from tango_lm.sweep.launchers import slurm_settings, submit_sweep

        settings = slurm_settings(grid, flags)
        progress = False if args.json else command_progress(args)
        rows = submit_sweep(grid, runs, settings, wait=args.wait, log=log, progress=progress)
        if not args.wait:
            if args.json:
                _print_json(rows)
            else:
                print(_table(rows, [("run", "run", ""), ("status", "status", ""), ("job_id", "job", "")]))
                given = "".join(  # the dry run checks the jobs' processes: with the same flags
                    f" --{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in flags.items() if v is not None
                )
                print(
                    f"`tango-lm sweep {shlex.quote(args.grid)} --launcher slurm{given} --dry-run` shows their state; "
                    f"`tango-lm report {shlex.quote(str(grid.out_dir))}` summarizes finished runs"
                )
            return 0
    else:
        try:
            with stop_on_sigterm():  # `timeout`, `kill` or a container's stop end it as Ctrl-C does
                rows = run_sweep(grid, runs, progress=False if args.json else command_progress(args, bar=None), log=log)
        except STOPS as stop:  # finished runs are kept and the interrupted one resumes from its checkpoint
            raise with_note(stop, "run the same command again to continue the sweep") from None
    failed = [r for r in rows if r["status"] == "failed"]
    if args.json:
        _print_json(rows)
    else:
        print()
        print(
            _table(
                rows,
                [
                    ("run", "run", ""),
                    ("status", "status", ""),
                    ("steps", "steps", ",d"),
                    ("best_dev_nll", "best dev NLL", ".4f"),
                    ("test_nll", "test NLL", ".4f"),
                    ("error", "error", ""),
                ],
            )
        )
        print(
            f"{len(rows) - len(failed)} of {len(rows)} runs finished under {grid.out_dir}; "
            f"`tango-lm report {shlex.quote(str(grid.out_dir))}` summarizes them"
        )
    return 1 if failed else 0


def cmd_report(args: argparse.Namespace) -> None:
    from pathlib import Path

    from tango_lm.eval.report import write_report

    res = write_report(args.dir, args.out, split=args.split, plots=not args.no_plots, reference=args.reference)
    for w in res["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    if args.json:
        _print_json(res["report"])
        return
    print((Path(res["out"]) / "report.md").read_text())
    print(f"wrote {len(res['files'])} files to {res['out']}")


def add_parsers(sub: Any) -> None:
    """`sweep`, `report`."""
    s = sub.add_parser("sweep", help="train every run of a grid (architectures x datasets x tiers x depths x seeds)")
    s.add_argument("grid", help="grid YAML, e.g. configs/sweeps/dmmath-cpu.yaml")
    s.add_argument("--dry-run", action="store_true", help="list the runs and their state; train nothing")
    s.add_argument(
        "--only",
        action="append",
        metavar="PATTERN",
        help="only runs whose name matches: a substring, or a glob from the start of the name or of any part (tier=70M/*); repeatable",
    )
    s.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="local: train here, one run after another; slurm: one job per run (sweep/launchers.py)",
    )
    add_slurm_arguments(s)
    s.add_argument("--wait", action="store_true", help="slurm: wait for the jobs and print the results table")
    s.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    s.add_argument("--json", action="store_true", help=JSON_HELP)
    s.set_defaults(func=cmd_sweep, outlives_reader=True)

    s = sub.add_parser("report", help="paper-style tables and plots of a directory of runs")
    s.add_argument("dir", help="a sweep's out_dir (or any directory of run directories)")
    s.add_argument("--out", default=None, type=path_arg, help="report directory (default: DIR/report)")
    s.add_argument(
        "--split",
        default="test",
        choices=("test", "dev"),
        help="test: test NLL of the selected checkpoint; dev: its dev NLL",
    )
    s.add_argument("--reference", default=None, help="model whose per-seed margins to give (default: each row's best)")
    s.add_argument("--no-plots", action="store_true", help="tables only, no plots/ (and no matplotlib needed)")
    s.add_argument("--json", action="store_true", help=JSON_HELP)
    s.set_defaults(func=cmd_report, outlives_reader=True)
