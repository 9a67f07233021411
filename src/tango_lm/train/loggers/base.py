"""What every logger is (`MetricLogger`), what it opens with (`LogContext`), and the scalars it logs
(the package docstring says which)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tango_lm.errors import UserError


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


def imported(package: str, module: str):
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
