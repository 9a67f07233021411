"""Where the training log goes (`train.loggers`): every record the trainer writes reaches each
logger of the list, on rank 0 only. A new logger is one file with its `MetricLogger` (base.py)
plus one line in `LOGGERS` below.

- `jsonl` (always in the list): `metrics.jsonl` in the run directory, one JSON object per record.
  It is the run's own record: `--resume` truncates it and `tango-lm report` reads it.
- `tensorboard`: event files in `RUN/tensorboard` through `torch.utils.tensorboard`
  (`pip install 'tango-lm[tensorboard]'`; `tensorboard --logdir RUN`).
- `wandb`: a Weights & Biases run in project `train.wandb_project`, its files in `RUN/wandb`
  (`pip install 'tango-lm[wandb]'`). W&B's own settings apply: `WANDB_MODE=offline` logs with no
  network (`wandb sync RUN/wandb/offline-run-*` uploads later), `WANDB_ENTITY` picks the team.

Scalars: every number of a record (booleans as 0/1) is logged under `GROUP/KEY` at the record's
step, where GROUP is the record's `event` if it has one (the final `summary`: test NLL of the
selected checkpoint, ...), else `dev` for a dev-NLL record and `train` for a training record
(loss, lr, grad_norm, tokens_per_s, mfu, peak_memory_mib, tokens). TensorBoard stores them as
float32, W&B as JSON numbers.

TensorBoard and W&B run on a thread of their own (`InBackground`): the training loop only queues a
record, so a slow event-file write or a message to W&B's service never holds up a step (on a busy
CPU, calling them inline took milliseconds per record: each hands work to another thread and
waits for it to be scheduled). Closing drains the queue. A logger that fails stops the run at its
next record with a one-line error.

Resuming: TensorBoard's event file in `RUN/tensorboard` is written again from the kept records,
and the ones this logger wrote before (named in `RUN/tensorboard/.tango-lm.json`) go: they may
hold a killed attempt's steps past the checkpoint or a finished run's summary, or lack the steps
an attempt trained without TensorBoard in its list, and TensorBoard's fast (Rust) reader does not
honour a `purge_step`. Event files it did not write stay (those of an older tango-lm are hidden
with `purge_step` 0 for TensorBoard's Python reader). So its curves are metrics.jsonl's (a resume with metrics.jsonl missing, its event files then the
history's only copy, is refused); W&B continues the same run id (kept in `RUN/wandb.json`) and gets again the
kept records past the run's `starting_step` (`to_replay`). W&B cannot drop history: online, the
server ignores steps it already has (the resumed run recomputes them exactly, timings aside);
offline, the resumed attempt is a second `offline-run-*` directory of the same run id, with the
whole history up to the checkpoint (a SIGKILL loses what the first had not flushed). A run
stopped by an error, Ctrl-C or SIGTERM ends its W&B run with exit code 1, 130 or 143, failed on the dashboard.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from tango_lm.errors import UserError
from tango_lm.train.loggers.background import InBackground
from tango_lm.train.loggers.base import LogContext, MetricLogger, scalars
from tango_lm.train.loggers.jsonl_logger import JsonlLogger
from tango_lm.train.loggers.tensorboard_logger import TensorBoardLogger
from tango_lm.train.loggers.wandb_logger import WandbLogger

__all__ = [
    "LOGGERS",
    "InBackground",
    "JsonlLogger",
    "LogContext",
    "MetricLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "check_available",
    "close_loggers",
    "logger_names",
    "open_loggers",
    "scalars",
    "stopped_exit_code",
]

LOGGERS: dict[str, type[MetricLogger]] = {cls.name: cls for cls in (JsonlLogger, TensorBoardLogger, WandbLogger)}


def logger_names(field: str, value: Any) -> list[str]:
    """Validate `train.loggers`: a list (or comma-separated string) of known names with `jsonl`."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{field} must be a list of logger names such as [jsonl, tensorboard] (got {value!r})")
    for name in value:
        if name not in LOGGERS:
            raise UserError(f"{field} has unknown logger {name!r}; choose from {', '.join(LOGGERS)}")
    if len(set(value)) != len(value):
        raise UserError(f"{field} names a logger twice ({value}); list each once")
    if "jsonl" not in value:
        raise UserError(
            f"{field} must include jsonl (metrics.jsonl is the run's record that --resume and "
            f"`tango-lm report` read); write e.g. [jsonl, {', '.join(value) or 'tensorboard'}]"
        )
    return value


def check_available(names: list[str]) -> None:
    """A logger whose package is missing is an error before the run writes anything."""
    for name in names:
        requires = LOGGERS[name].requires
        if requires is not None and importlib.util.find_spec(requires[0]) is None:
            raise UserError(
                f"train.loggers includes {name} but the {requires[0]} package is not installed; "
                f"pip install 'tango-lm[{requires[1]}]' or drop {name} from train.loggers"
            )


def open_loggers(names: list[str], ctx: LogContext, kept: list[dict[str, Any]] = ()) -> list[MetricLogger]:
    """The loggers `names`, each sent again what it lacks of `kept` (a resume's metrics.jsonl)."""
    for name in names:
        LOGGERS[name].refuse(ctx)
    opened: list[MetricLogger] = []
    try:
        for name in sorted(names, key=lambda name: not LOGGERS[name].may_refuse):  # stable: W&B first
            logger = LOGGERS[name](ctx)
            opened.append(InBackground(logger) if logger.background else logger)
            for record in opened[-1].to_replay(list(kept)):
                opened[-1].log(record)
    except BaseException as exc:
        close_loggers(opened, stopped_exit_code(exc))
        raise
    return opened


def stopped_exit_code(exc: BaseException) -> int:
    """The process's exit code for a run `exc` stopped (what `close` marks a W&B run with): 130 for
    Ctrl-C, 143 for SIGTERM, 1 for anything else."""
    from tango_lm.stop_signals import STOPS, exit_code, signal_name

    return exit_code(signal_name(exc)) if isinstance(exc, STOPS) else 1


def close_loggers(loggers: list[MetricLogger], exit_code: int = 0) -> None:
    """Close every logger (each one even if another fails); the first failure is raised after.
    `exit_code`: the process's, when the run stopped (`MetricLogger.close`)."""
    failure: BaseException | None = None
    for logger in loggers:
        try:
            logger.close(exit_code)
        except BaseException as exc:  # noqa: BLE001 - close the others first
            failure = failure or exc
    if failure is not None:
        raise failure
