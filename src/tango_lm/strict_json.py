"""Standard JSON for what other tools read (metrics.jsonl, summary.json, `--json`): a number that
is not finite is written as null. Python's json writes NaN and Infinity, which JSON.parse, jq and
other strict readers refuse (a diverged dev NLL, an infinite perplexity)."""

from __future__ import annotations

import json
import math
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
