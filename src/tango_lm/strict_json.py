"""Standard JSON for what other tools read (metrics.jsonl, summary.json, `--json`): a number that
is not finite is written as null. Python's json writes NaN and Infinity, which JSON.parse, jq and
other strict readers refuse (a diverged dev NLL, an infinite perplexity). And the one way such a
record of tango-lm's own is read back where a damaged one means "not there" (`read_object`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def finite_or_null(value: Any) -> Any:
    """`value` with every non-finite float inside it (dicts, lists, tuples) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """`json.dumps` of `finite_or_null(value)`; refuses what would still not be standard JSON."""
    return json.dumps(finite_or_null(value), allow_nan=False, **kwargs)


def read_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None where the file is missing, unreadable, not UTF-8, not JSON or
    not an object, so its reader treats a damaged record (a disk that filled) as none written."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: JSONDecodeError and UnicodeDecodeError
        return None
    return data if isinstance(data, dict) else None
