"""`metrics.jsonl`, the run's own record (the `jsonl` logger of train/loggers.py writes it): read
back, and cut to a checkpoint's step when a run resumes, so that the log is exactly what an
uninterrupted run writes. Rank 0 alone reads and writes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NAME = "metrics.jsonl"


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the run's log ([] without one)."""
    path = run_dir / NAME
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_records(run_dir: Path, step: int) -> None:
    """Drop the records a killed attempt wrote after `step` (and a finished run's summary, which the
    next attempt writes again), and a last line cut by the kill."""
    path = run_dir / NAME
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
        if rec.get("step", 0) <= step and rec.get("event") != "summary":
            kept.append(line)
    tmp = path.with_name(f".{NAME}.tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    tmp.replace(path)


def dev_nll_at(records: list[dict[str, Any]], step: int | None) -> float | None:
    """The dev NLL logged at `step` (None where none was)."""
    at = [r["dev_nll"] for r in records if "dev_nll" in r and r.get("step") == step]
    return at[-1] if at else None
