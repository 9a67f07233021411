"""`jsonl`: metrics.jsonl, the run's own record, one JSON object per record."""

from __future__ import annotations

from typing import Any

from tango_lm import strict_json
from tango_lm.train.loggers.base import LogContext, MetricLogger


class JsonlLogger(MetricLogger):
    name = "jsonl"

    def __init__(self, ctx: LogContext) -> None:
        self.path = ctx.out_dir / "metrics.jsonl"

    def log(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:  # opened per record: a kill loses at most the line being written
            f.write(strict_json.dumps(record) + "\n")  # a NaN dev NLL as null, which every reader takes
