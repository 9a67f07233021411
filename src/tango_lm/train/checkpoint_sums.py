"""The sha256 of a checkpoint's files, recorded in its meta.json at the save and checked when a
file is read: safetensors, torch.load, DCP and JSON read most flipped bits as valid values."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tango_lm.errors import UserError


def check_sum(path: Path, meta: dict[str, Any], name: str) -> None:
    """A UserError when file `name` of step directory `path` does not hash to what meta.json
    recorded at the save (safetensors, torch.load and DCP read most flipped bits as valid numbers:
    NaNs and 1e33 losses on resume)."""
    sums = meta.get("sha256")
    want = sums.get(name) if isinstance(sums, dict) else None
    if want is None:
        return
    try:
        got = file_sha256(path / name)
    except OSError:
        return  # missing or unreadable: the loader says so
    if got != want:
        raise UserError(
            f"checkpoint {path} has a {name} that does not match the sha256 in its meta.json "
            "(damaged or changed on disk); use another checkpoint"
        )


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        h = hashlib.sha256()
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()
