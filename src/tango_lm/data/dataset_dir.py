"""Where a prepared dataset lives (data/shards.py writes and reads it): what marks a directory as
one, what may be written where (never inside a run or another dataset, never over files that are
not the dataset's), the one-writer lock of an output directory, and what killed writers left
beside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from tango_lm.errors import UserError
from tango_lm.output_lock import hold_output_lock

FORMAT = "tango-lm-shards/1"
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*-\d{5}\.bin")  # shards._ShardWriter's: split-00000.bin


def is_prepared(path: str | os.PathLike) -> bool:
    """Whether `path` holds a complete prepared dataset (a manifest with our format tag)."""
    try:
        with open(Path(path) / MANIFEST, encoding="utf-8") as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def same_dataset_dir(a: Any, b: Any) -> bool:
    """Whether two data.dir values name one directory (`data/x` and its absolute path)."""
    return a == b or (isinstance(a, str) and isinstance(b, str) and Path(a).resolve() == Path(b).resolve())


def check_writable(out_dir: str | os.PathLike, overwrite: bool) -> None:
    """Raise UserError when writing a dataset to `out_dir` would clobber something it should not.

    Callers that spend a long time producing the documents call this first to fail fast.
    """
    from tango_lm.train.run_dir import enclosing, is_run_dir

    out = Path(out_dir)
    run = enclosing(out, is_run_dir)
    if run is not None:
        raise UserError(f"{out} is inside the run directory {run}; choose an output directory outside it")
    outer = enclosing(out.absolute().parent, is_prepared)  # replacing that one would take this one with it
    if outer is not None:
        raise UserError(f"{out} is inside the prepared dataset {outer}; choose an output directory outside it")
    if not out.exists():
        return
    if is_prepared(out):
        if not overwrite:
            raise UserError(
                f"{out} already holds a prepared dataset; pass --overwrite (overwrite=True in Python) to replace it "
                "or choose another output directory"
            )
        others = sorted(p.name for p in out.iterdir() if p.name not in _dataset_files(out))
        if others:  # replacing the directory would take them with it
            named = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            raise UserError(
                f"{out} holds {named} beside the prepared dataset; --overwrite replaces the whole directory, "
                f"so move {'it' if len(others) == 1 else 'them'} out first or choose another output directory"
            )
        return
    # Never delete a directory we did not write, even with overwrite.
    if not out.is_dir() or any(out.iterdir()):
        raise UserError(f"{out} exists and is not a prepared dataset; choose another path or remove it")


def _dataset_files(out: Path) -> set[str]:
    """The names a prepared dataset's directory holds: its manifest, tokenizer and the shards its
    manifest lists. A manifest too damaged to list them (`data verify` sends its user to --overwrite)
    leaves the names _ShardWriter writes; an intact one, only its own (a user's results-00001.bin
    beside it stays a reason to refuse)."""
    with open(out / MANIFEST, encoding="utf-8") as f:
        listed = _listed_shards(json.load(f).get("splits"))
    if listed is None:
        listed = [p.name for p in out.iterdir() if SHARD_NAME.fullmatch(p.name)]
    return {MANIFEST, TOKENIZER_FILE, *listed}


def _listed_shards(splits: Any) -> list[str] | None:
    """The shard files a manifest's splits list, or None when any entry is malformed."""
    if not isinstance(splits, dict):
        return None
    names = []
    for entry in splits.values():
        shards = entry.get("shards") if isinstance(entry, dict) else None
        if not isinstance(shards, list):
            return None
        for shard in shards:
            if not isinstance(shard, dict) or not isinstance(shard.get("file"), str):
                return None
            names.append(shard["file"])
    return names


def hold_dataset_lock(out_dir: str | os.PathLike) -> contextlib.AbstractContextManager:
    """The one-writer lock of a dataset output directory (`.NAME.lock` beside it; output_lock.py)."""
    return hold_output_lock(out_dir, "tango-lm data prepare", "choose another output directory", beside=True)


def remove_leftovers(out: Path) -> None:
    """Temporary and replaced copies of `out`, and the held-out documents spilled for it
    (splits.spill_prefix), that killed writers left beside it (we hold its lock)."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.((tmp|old)-\d+|spill-\d+-[a-z0-9_]+)$")
    for p in out.parent.iterdir() if out.parent.is_dir() else []:
        if pattern.match(p.name) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
