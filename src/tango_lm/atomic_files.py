"""Files written whole or not at all: a reader, a kill or a disk that fills up never leaves one
half-written (run files, sweep records, caches, tokenizers)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary sibling and rename it over `path`: a reader, or a disk that
    fills up while it is written, never leaves `path` half-written (nor the sibling behind)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.replace(tmp, path)
        except IsADirectoryError as exc:  # said of the sibling: name the file it was to replace
            raise IsADirectoryError(exc.errno, exc.strerror, str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to `path` atomically (write_text_atomic)."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True))
