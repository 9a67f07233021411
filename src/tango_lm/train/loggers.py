"""Where the training log goes (`train.loggers`): every record the trainer writes reaches each
logger of the list, on rank 0 only.

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
stopped by an error or Ctrl-C ends its W&B run with exit code 1 or 130, failed on the dashboard.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tango_lm import strict_json
from tango_lm.errors import UserError
from tango_lm.train import metrics_file


@dataclass
class LogContext:
    """What a logger needs to open: the run directory, the resolved run config and W&B's project."""

    out_dir: Path
    config: dict[str, Any]
    wandb_project: str
    resumed_step: int = 0  # the checkpoint step a resume starts from; 0 for a fresh start


class MetricLogger:
    """One destination of the training log."""

    name = ""
    requires: tuple[str, str] | None = None  # (module, tango-lm extra that installs it)
    background = False  # run on a thread of its own (InBackground)
    # May refuse to start on its settings, login or network (W&B): opened before the loggers that
    # write files at once, so a refusal leaves none behind.
    may_refuse = False
    # Files it keeps in the run directory across starts (W&B's run id, so a resume continues its
    # run): not run files, but a fresh start (`quickstart --fresh`, a sweep's retry) removes them.
    fresh_start_files: tuple[str, ...] = ()

    @classmethod
    def refuse(cls, ctx: LogContext) -> None:
        """A UserError where opening would lose what an earlier attempt logged; asked of every
        logger in the list before any opens. Nothing by default."""

    def log(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def to_replay(self, kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """On a resume: which of the records metrics.jsonl kept (steps up to the checkpoint) this
        logger lacks and is sent again at opening. None by default (metrics.jsonl has them all)."""
        return []

    def close(self, exit_code: int = 0) -> None:
        """Flush and release what the logger holds; called once at the end of the run, with the
        process's exit code when the run stopped (1 on an error, 130 on Ctrl-C)."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers as `GROUP/KEY` scalars (module docstring)."""
    group = record.get("event") or ("dev" if "dev_nll" in record else "train")
    out = {}
    for key, value in record.items():
        if key in ("step", "event") or value is None or isinstance(value, str):
            continue
        if isinstance(value, (bool, int, float)):
            out[f"{group}/{key}"] = float(value)
    return out


class JsonlLogger(MetricLogger):
    name = "jsonl"

    def __init__(self, ctx: LogContext) -> None:
        self.path = ctx.out_dir / "metrics.jsonl"

    def log(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:  # opened per record: a kill loses at most the line being written
            f.write(strict_json.dumps(record) + "\n")  # a NaN dev NLL as null, which every reader takes


class TensorBoardLogger(MetricLogger):
    name = "tensorboard"
    requires = ("tensorboard", "tensorboard")
    background = True
    RECORD = ".tango-lm.json"  # the event files this logger wrote in RUN/tensorboard

    def __init__(self, ctx: LogContext) -> None:
        SummaryWriter = _imported("tensorboard", "torch.utils.tensorboard").SummaryWriter
        log_dir = ctx.out_dir / "tensorboard"
        if log_dir.exists() and not log_dir.is_dir():
            raise UserError(
                f"{log_dir} is a file, not TensorBoard's folder; move it away or drop tensorboard from train.loggers"
            )
        # The event files it wrote before are replaced by the kept records (module docstring): removed,
        # not hidden with purge_step, which TensorBoard's Rust reader ignores (the copies would grow).
        record = log_dir / self.RECORD
        for name in _read_names(record):
            (log_dir / Path(name).name).unlink(missing_ok=True)  # a bare name: never outside the folder
        before = set(log_dir.glob("events.out.tfevents.*")) if log_dir.is_dir() else set()
        self.writer = SummaryWriter(str(log_dir), purge_step=0 if before else None, flush_secs=30)
        mine = sorted(p.name for p in set(log_dir.glob("events.out.tfevents.*")) - before)
        record.write_text(json.dumps({"event_files": mine}) + "\n")

    @classmethod
    def refuse(cls, ctx: LogContext) -> None:
        # Its event files are rewritten from metrics.jsonl's kept records: with that file gone (its
        # corruption error says "fix or remove it"), they would be the history's only copy, removed.
        log_dir, jsonl = ctx.out_dir / "tensorboard", ctx.out_dir / metrics_file.NAME
        if not ctx.resumed_step or jsonl.exists():
            return
        files = [log_dir / Path(name).name for name in _read_names(log_dir / cls.RECORD)]
        if _hold_scalars([f for f in files if f.is_file()]):  # none logged yet (log_every > save_every): no loss
            raise UserError(
                f"{jsonl} is missing, and resuming rewrites {log_dir}'s curves from it: the steps up to "
                f"{ctx.resumed_step} would be lost; restore metrics.jsonl, or move {log_dir} away (or drop "
                "tensorboard from train.loggers) to resume without them"
            )

    def to_replay(self, kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return list(kept)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)

    def close(self, exit_code: int = 0) -> None:
        self.writer.close()


class WandbLogger(MetricLogger):
    name = "wandb"
    requires = ("wandb", "wandb")
    background = True
    may_refuse = True
    ID_FILE = "wandb.json"  # its run id, which a resume continues
    fresh_start_files = (ID_FILE,)

    def __init__(self, ctx: LogContext) -> None:
        wandb = _imported("wandb", "wandb")
        id_file = ctx.out_dir / self.ID_FILE
        run_id = _read_run_id(id_file) or secrets.token_hex(4)  # W&B ids: lowercase letters and digits
        try:
            self.run = wandb.init(
                project=ctx.wandb_project,
                id=run_id,
                resume="allow",
                name=str(ctx.out_dir),
                dir=str(ctx.out_dir),
                config=ctx.config,
                # quiet: W&B's history and summary panels at the end (~30 lines) buried the run's
                # one-line outcome; the run's address still shows
                settings=wandb.Settings(console="off", quiet=True),
            )
        except Exception as exc:  # noqa: BLE001 - wandb raises its own error types for login and network problems
            _retire_service(wandb)
            # All of it, on one line: a settings error's first line ("1 validation error for Settings")
            # does not say which setting.
            said = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
            said = said if len(said) <= 300 else said[:297] + "..."
            online = os.environ.get("WANDB_MODE", "").lower() in ("", "online")
            fix = (  # not online, a login is not what is missing: the error (a bad project name, say) is the fix
                "run `wandb login`, or set WANDB_MODE=offline to log without a network"
                if online
                else "fix what it names"
            )
            raise UserError(f"wandb could not start a run ({said}); {fix}, or drop wandb from train.loggers") from None
        from tango_lm.atomic_files import write_json_atomic

        write_json_atomic(id_file, {"run_id": run_id, "project": ctx.wandb_project})  # a kill leaves it whole

    def log(self, record: dict[str, Any]) -> None:
        # Records of one step (training, dev, summary) merge into one history row at that step.
        self.run.log(scalars(record), step=int(record.get("step", 0)))

    def to_replay(self, kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # The steps this W&B run does not have: offline, a resumed attempt starts a new offline
        # directory (all of them: a SIGKILL lost the previous one's unflushed history); online,
        # those past the server's last step.
        return [r for r in kept if r.get("step", 0) >= self.run.starting_step]

    def close(self, exit_code: int = 0) -> None:
        # The exit code marks a stopped run as failed on the dashboard (0 shows it as finished).
        import wandb

        try:
            self.run.finish(exit_code=exit_code)
        except Exception:
            _retire_service(wandb)
            raise


class InBackground(MetricLogger):
    """Another logger's `log` calls, made in order on a thread of its own."""

    def __init__(self, inner: MetricLogger) -> None:
        self.inner, self.name = inner, inner.name
        self.records: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"tango-lm {inner.name} logger", daemon=True)
        self.thread.start()

    def log(self, record: dict[str, Any]) -> None:
        self._raise_failure()
        self.records.put(dict(record))

    def to_replay(self, kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.inner.to_replay(kept)

    def _run(self) -> None:
        while (record := self.records.get()) is not None:
            if self.error is None:
                try:
                    self.inner.log(record)
                except Exception as exc:  # noqa: BLE001 - reported on the training thread
                    self.error = exc

    def close(self, exit_code: int = 0) -> None:
        self.records.put(None)
        self.thread.join()
        self.inner.close(exit_code if self.error is None else exit_code or 1)
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self.error is not None:
            first = str(self.error).strip().splitlines()[0] if str(self.error).strip() else type(self.error).__name__
            raise UserError(
                f"the {self.name} logger failed ({first}); fix that and continue with --resume, or drop "
                f"{self.name} from train.loggers"
            )


def _hold_scalars(event_files: list[Path]) -> bool:
    """Whether TensorBoard event files hold a logged value (a new file holds only its header); a
    file TensorBoard cannot read counts as holding some."""
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    except Exception:  # noqa: BLE001 - not importable: the logger's own start says so
        return bool(event_files)
    for path in event_files:
        try:
            if any(event.summary.value for event in EventFileLoader(str(path)).Load()):
                return True
        except Exception:  # noqa: BLE001 - unreadable: kept, as if it held values
            return True
    return False


def _read_names(path: Path) -> list[str]:
    """The event files a TensorBoard record names ([] without a readable one)."""
    try:
        names = json.loads(path.read_text()).get("event_files")
    except (OSError, ValueError, AttributeError):
        return []
    return (
        [n for n in names if isinstance(n, str) and n.startswith("events.out.tfevents.")]
        if isinstance(names, list)
        else []
    )


def _read_run_id(path: Path) -> str | None:
    """The W&B run id a run's earlier attempts logged to: None for a run that has none yet; a file
    that names none is refused (a new id would start a second W&B run and lose the first's)."""
    if not path.exists():
        return None
    try:
        run_id = json.loads(path.read_text()).get("run_id")
    except (OSError, ValueError, AttributeError) as exc:
        run_id = exc
    if isinstance(run_id, str) and run_id:
        return run_id
    raise UserError(
        f"{path} names no W&B run id ({run_id if isinstance(run_id, Exception) else 'no run_id'}); restore it "
        "(the id is in the run's wandb/*-run-*/run-ID.wandb file names), or remove it to log the rest of this "
        "run as a new W&B run"
    )


def _imported(package: str, module: str):
    """The module `module` of the logger's `package`: one installed that fails to import (a broken
    install, a version clash) is a one-line error, as a missing one is (`check_available`)."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any error a package's import raises
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"the {package} package fails to import ({said}); reinstall it (pip install 'tango-lm[{package}]') "
            f"or drop {package} from train.loggers"
        ) from None


def _retire_service(wandb) -> None:
    """Stop W&B's service process after a failure (one it lost contact with, say): the next
    `wandb.init` in this process (a sweep's next run) then starts a new one instead of reusing the
    broken connection, and W&B's exit hook has nothing left to fail on."""
    with contextlib.suppress(Exception):  # the failure being reported is the one that matters
        wandb.teardown()


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
    Ctrl-C, 1 for anything else."""
    return 130 if isinstance(exc, KeyboardInterrupt) else 1


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
