"""`tensorboard`: event files in RUN/tensorboard, rewritten from the kept records on a resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tango_lm.errors import UserError
from tango_lm.train import metrics_file
from tango_lm.train.loggers.base import LogContext, MetricLogger, imported, scalars


class TensorBoardLogger(MetricLogger):
    name = "tensorboard"
    requires = ("tensorboard", "tensorboard")
    background = True
    RECORD = ".tango-lm.json"  # the event files this logger wrote in RUN/tensorboard

    def __init__(self, ctx: LogContext) -> None:
        SummaryWriter = imported("tensorboard", "torch.utils.tensorboard").SummaryWriter
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
