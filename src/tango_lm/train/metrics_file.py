"""`metrics.jsonl`, the run's own record (the `jsonl` logger of train/loggers/ writes it): read
back, and cut to a checkpoint's step when a run resumes, so that the log is exactly what an
uninterrupted run writes. Rank 0 alone reads and writes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tango_lm.errors import UserError

NAME = "metrics.jsonl"


def parse(path: Path) -> tuple[list[tuple[str, dict[str, Any]]], bool]:
    """The log's (line, record) pairs, and whether a partial last line (a kill mid-write) was left out.
    Any other line that is not a JSON object (with an integer step, if any) is corruption the reader
    cannot repair: a UserError."""
    try:
        lines = path.read_text().split("\n")
    except (OSError, UnicodeDecodeError):
        raise UserError(f"{path} cannot be read as text; it is corrupt, fix or remove it") from None
    pairs = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
            if all(not rest.strip() for rest in lines[i + 1 :]):  # a record cut by a kill is never valid JSON
                return pairs, True
        step = rec.get("step", 0) if isinstance(rec, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):  # resume cuts the log by step
            raise UserError(
                f"{path} line {i + 1} is not a JSON record (an object, its step an integer); the file is "
                "corrupt, fix or remove it"
            )
        pairs.append((line, rec))
    return pairs, False


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every complete record of the run's log ([] without one)."""
    path = run_dir / NAME
    return [rec for _, rec in parse(path)[0]] if path.exists() else []


def truncate_records(run_dir: Path, step: int) -> None:
    """Drop the records a killed attempt wrote after `step` (and a finished run's summary, which the
    next attempt writes again), and a last line cut by the kill."""
    path = run_dir / NAME
    if not path.exists():
        return
    kept = [line for line, rec in parse(path)[0] if rec.get("step", 0) <= step and rec.get("event") != "summary"]
    tmp = path.with_name(f".{NAME}.tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    tmp.replace(path)


def dev_nll_at(records: list[dict[str, Any]], step: int | None) -> float | None:
    """The dev NLL logged at `step` (None where none was)."""
    at = [r["dev_nll"] for r in records if "dev_nll" in r and r.get("step") == step]
    return at[-1] if at else None
