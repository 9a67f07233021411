"""What a sweep checks of its runs against their data before it trains or submits any of them.

A grid's configs are validated when it is read (sweep/grid.py), and each run's logger packages
are checked installed here (`check_available`), but two things need the prepared data as well:
whether the dataset's token ids fit each run's table (`check_data_fits_model`), and the warnings a
run gets when it starts (`start_of_run_warnings`: a table mostly of unused rows, a warmup as long
as the run, splits with fewer windows than it scores, an architecture's own). Checked here, up front, a vocabulary too small
for the data stops the sweep before the first run instead of failing every run (or every queued
SLURM job) one after another, and a warning shared by many runs is said once, in the dry run too.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from tango_lm.config_checks import (
    check_budget_agrees,
    check_data_fits_model,
    check_splits_fit_run,
    start_of_run_warnings,
)
from tango_lm.data.shards import PreparedDataset
from tango_lm.errors import UserError
from tango_lm.progress_lines import Progress
from tango_lm.sweep.grid import Grid, SweepRun
from tango_lm.train.loggers import check_available


@dataclass
class RunChecks:
    """The runs' data checks: the refused runs with their one-line errors, and each distinct
    warning with the runs that get it (in the grid's order)."""

    refused: dict[str, str] = field(default_factory=dict)  # run name -> error
    warnings: dict[str, list[str]] = field(default_factory=dict)  # warning -> run names
    checked: int = 0  # runs checked
    repeats: list[str] = field(default_factory=list)  # the grid's runs trained as another (`Grid.repeats`)

    def raise_refused(self, doing: str) -> None:
        """UserError naming the first refused run (and how many more) before `doing` anything."""
        if not self.refused:
            return
        name, error = next(iter(self.refused.items()))
        more = f" (and {len(self.refused) - 1} more)" if len(self.refused) > 1 else ""
        raise UserError(f"run {name}{more}: {error}; nothing was {doing}")

    def say_warnings(self) -> None:
        """The warnings on stderr, once each. Said once the sweep holds its directory and nothing
        is left to refuse it (a command that fails prints its error line alone)."""
        for line in [*self.warning_lines(self.checked), *self.repeats]:
            print(f"warning: {line}", file=sys.stderr)

    def warning_lines(self, total: int) -> list[str]:
        """One line per distinct warning, saying which of the `total` runs it concerns."""
        lines = []
        for text, names in self.warnings.items():
            if len(names) == total:
                which = "every run" if total > 1 else "the run"
            elif len(names) == 1:
                which = f"run {names[0]}"
            else:
                which = f"{len(names)} of {total} runs, {names[0]} first"
            lines.append(f"{text} ({which})")
        return lines


def check_runs(grid: Grid, runs: list[SweepRun], progress: Progress = False) -> RunChecks:
    """Check each run against its dataset; datasets the grid lacks (a dry run's `missing_data`)
    are passed over. Each dataset is opened once."""
    checks = RunChecks(checked=len(runs), repeats=repeat_lines(grid, {run.name for run in runs}))
    missing = set(grid.missing_data.values())
    datasets: dict[str, PreparedDataset] = {}
    archs = {run.config.model.arch for run in grid.runs}  # the whole grid's, whichever runs are left
    for run in runs:
        try:  # a logger's package missing here failed every run (or queued job) one after another
            check_available(run.config.train.loggers)
        except UserError as exc:
            checks.refused[run.name] = str(exc)
            continue
        directory = run.config.data.dir
        if directory in missing:
            continue
        if directory not in datasets:
            datasets[directory] = PreparedDataset.open(directory, progress=progress)
        try:
            check_data_fits_model(run.config, datasets[directory])
            check_splits_fit_run(run.config, datasets[directory])
            check_budget_agrees(run.config)
        except UserError as exc:
            checks.refused[run.name] = str(exc)
            continue
        # By design a sweep's base sets the fields of each architecture it compares (window for
        # windowed TANGO, qk_dim for GAU) for every run: only fields none of them reads are warned.
        for text in start_of_run_warnings(run.config, datasets[directory], sweep_archs=archs):
            checks.warnings.setdefault(text, []).append(run.name)
    return checks


def repeat_lines(grid: Grid, training: set[str]) -> list[str]:
    """One line per architecture and fields it does not read that tell runs of the grid apart:
    those runs are one setting, trained once (`Grid.repeats`); said where that run is among the
    runs `training` (not for a repeat of a run `--only` left out)."""
    arch = {run.name: run.config.model.arch for run in grid.runs}
    groups: dict[tuple[str, tuple[str, ...]], list[tuple[str, str]]] = {}
    for name, (first, fields) in grid.repeats.items():
        if first in training:
            groups.setdefault((arch[first], fields), []).append((name, first))
    lines = []
    for (name, fields), pairs in groups.items():
        which = ", ".join(f"model.{f}" for f in fields)
        one = len(pairs) == 1
        runs = "a run of the grid that differs" if one else f"{len(pairs)} runs of the grid that differ"
        lines.append(
            f"{name} does not read {which}: {runs} from another only there {'is' if one else 'are'} one setting "
            f"with it, trained once ({pairs[0][0]} is {pairs[0][1]})"
        )
    return lines
