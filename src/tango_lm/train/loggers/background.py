"""A logger's `log` calls made on a thread of its own, so a slow one never holds up a step."""

from __future__ import annotations

import queue
import threading
from typing import Any

from tango_lm.errors import UserError
from tango_lm.train.loggers.base import MetricLogger


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
