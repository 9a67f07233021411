"""`wandb`: a Weights & Biases run, continued by a resume under the id kept in RUN/wandb.json."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from tango_lm.errors import UserError
from tango_lm.train.loggers.base import LogContext, MetricLogger, imported, scalars


class WandbLogger(MetricLogger):
    name = "wandb"
    requires = ("wandb", "wandb")
    background = True
    may_refuse = True
    ID_FILE = "wandb.json"  # its run id, which a resume continues
    fresh_start_files = (ID_FILE,)

    def __init__(self, ctx: LogContext) -> None:
        wandb = imported("wandb", "wandb")
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


def _retire_service(wandb) -> None:
    """Stop W&B's service process after a failure (one it lost contact with, say): the next
    `wandb.init` in this process (a sweep's next run) then starts a new one instead of reusing the
    broken connection, and W&B's exit hook has nothing left to fail on."""
    with contextlib.suppress(Exception):  # the failure being reported is the one that matters
        wandb.teardown()
