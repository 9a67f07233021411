"""A checkpoint's files read back with their damage named: the sha256 of each, recorded in its
meta.json at the save and checked when a file is read (safetensors, torch.load, DCP and JSON read
most flipped bits as valid values), and its JSON files parsed with the file and the fault said."""

from __future__ import annotations

import hashlib
import json
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


def read_step_json(path: Path, name: str) -> dict[str, Any]:
    """The JSON object in file `name` of step directory `path`; a UserError that names the file and
    what is wrong with it (it said only "is corrupt (JSONDecodeError)")."""
    try:
        data = json.loads((path / name).read_text(encoding="utf-8"))
        if isinstance(data, dict):
            return data
        problem = f"has a {name} that is a {type(data).__name__}, not a mapping"
    except FileNotFoundError:
        problem = f"has no {name}"
    except OSError as exc:
        problem = f"has a {name} that cannot be read ({exc.strerror or type(exc).__name__})"
    except UnicodeDecodeError as exc:
        problem = f"has a {name} that is not UTF-8 text (byte {exc.start})"
    except json.JSONDecodeError as exc:
        problem = f"has a {name} that is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    raise UserError(f"checkpoint {path} {problem}; it is corrupt, use another checkpoint")
