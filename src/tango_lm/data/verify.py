"""Data is what its manifest says.

Every open of a prepared dataset (`PreparedDataset.open`) checks the manifest's layout:

- each shard path names a file inside the dataset directory (no absolute path, no `..`, no
  symlink out of it), and no file is listed twice (a test split cannot quietly be the train split);
- the dtype is `<u2` or `<u4`, each shard's size is its token count times the dtype's size;

and the contents, once per shard version: the shard's sha256 equals the manifest's, its
end-of-text ids add up, per split, to the split's documents (and one ends the split), and no id
exceeds the manifest's `max_token_id`. What a shard was found to hold is cached by its size,
modification time, change time and inode in `<cache>/verified-shards/` (cache = $TANGO_LM_CACHE
or ~/.cache/tango-lm), so a large dataset is hashed once, not at every start; an edit changes the
times, so an edited shard is hashed again. `write_prepared` records the shards it writes, so a
fresh dataset is not re-read at all.

`tango-lm data verify DIR` (`verify_dataset`) checks everything again, ignoring the cache.
Hashing reads about 0.9 GB/s (a 2-core EPYC, from the page cache): a copied 100B-token dataset
took minutes before a run's first line, so where there is more than SHOWN_BYTES to read, its
tokens are counted on a bar (lines off a terminal) when asked.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tango_lm.atomic_files import write_text_atomic
from tango_lm.errors import UserError
from tango_lm.progress_lines import Progress, token_bar

__all__ = ["DTYPES", "Shard", "manifest_shards", "verify_shards", "record_verified", "verify_dataset"]

DTYPES = ("<u2", "<u4")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_READ_BYTES = 1 << 24  # a multiple of every dtype's size
SHOWN_BYTES = 1 << 30  # about a second of hashing: less is over before a bar would say anything
_CACHE_VERSION = 1


@dataclass(frozen=True)
class Shard:
    split: str
    name: str  # as the manifest writes it
    file: Path  # inside the dataset directory
    tokens: int
    sha256: str


def manifest_shards(path: Path, manifest: dict[str, Any], hint: str) -> tuple[np.dtype, list[Shard]]:
    """The dtype and the shards `manifest` lists, each checked to be a file inside `path` of the
    recorded size; UserError (ending with `hint`) otherwise."""
    where = path / "manifest.json"
    splits = manifest.get("splits")
    if not isinstance(splits, dict):
        raise UserError(f"{where} has no splits mapping; {hint}")
    if not splits:  # nothing to verify is not a verified dataset: train would fail at its first read
        raise UserError(f"{where} lists no splits; {hint}")
    dtype_text = manifest.get("dtype")
    if dtype_text not in DTYPES:
        raise UserError(f"{where} gives token dtype {dtype_text!r}, not one of {', '.join(DTYPES)}; {hint}")
    dtype = np.dtype(dtype_text)
    root = path.resolve()
    seen: dict[Path, str] = {}
    shards = []
    for split, entry in splits.items():
        listed = entry.get("shards") if isinstance(entry, dict) else None
        if not isinstance(listed, list) or not _count(entry.get("documents")) or not _count(entry.get("tokens")):
            raise UserError(f"{where} has a malformed entry for split {split!r} (shards, tokens, documents); {hint}")
        for sh in listed:
            name, tokens, sha = (
                (sh.get(k) for k in ("file", "tokens", "sha256")) if isinstance(sh, dict) else (None,) * 3
            )
            if (
                not isinstance(name, str)
                or not name
                or "\0" in name  # no file has one (resolve() raises)
                or not _count(tokens)
                or not (isinstance(sha, str) and _HEX64.match(sha))
            ):
                raise UserError(f"{where} has a malformed shard entry in split {split!r} ({sh!r:.80}); {hint}")
            file = path / name
            resolved = file.resolve()
            if resolved == root or not resolved.is_relative_to(root):
                raise UserError(
                    f"{where} lists shard {name!r} of split {split!r}, which lies outside {path}; "
                    f"a dataset reads only its own files; {hint}"
                )
            if resolved in seen:
                raise UserError(
                    f"{where} lists the file {name!r} twice (splits {seen[resolved]!r} and {split!r}); {hint}"
                )
            seen[resolved] = split
            if not file.is_file():
                raise UserError(f"shard {name} of split {split!r} is missing from {path}; {hint}")
            size = file.stat().st_size
            if size != tokens * dtype.itemsize:
                raise UserError(
                    f"shard {file} has {size} bytes but the manifest says {tokens} tokens "
                    f"({tokens * dtype.itemsize} bytes), so it is truncated or corrupt; {hint}"
                )
            shards.append(Shard(split, name, file, tokens, sha))
        if sum(s.tokens for s in shards if s.split == split) != entry["tokens"]:
            raise UserError(
                f"{where} says split {split!r} has {entry['tokens']} tokens but its shards hold "
                f"{sum(s.tokens for s in shards if s.split == split)}; {hint}"
            )
    if not isinstance(manifest.get("max_token_id"), int) or isinstance(manifest["max_token_id"], bool):
        raise UserError(f"{where} has no integer max_token_id; {hint}")
    return dtype, shards


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def verify_shards(
    path: Path,
    manifest: dict[str, Any],
    dtype: np.dtype,
    shards: list[Shard],
    eot_id: int,
    hint: str,
    force: bool = False,
    progress: Progress = False,
) -> dict[str, Any]:
    """Check every shard's contents against the manifest (module docstring), reading only shards
    the cache has not seen in their present version (all of them with `force`; their tokens
    counted as `progress` says, when there are any). Returns totals."""
    cache = _Cache(path)
    found: dict[str, dict[str, int]] = {}
    unseen = []
    for sh in shards:
        version = _version(sh.file)
        stats = None if force else cache.get(sh.name, version, sh.sha256)
        if stats is None:
            unseen.append((sh, version))
        else:
            found[sh.name] = stats
    total = sum(sh.tokens for sh, _ in unseen)
    shown = progress if total * dtype.itemsize > SHOWN_BYTES else False
    # no bar object at all where nothing is shown: most opens read nothing
    counter = token_bar(total, f"verify {path}", shown) if shown else contextlib.nullcontext()
    with counter as bar:
        for sh, version in unseen:
            stats = _scan(sh.file, dtype, eot_id, bar)
            if stats["sha256"] != sh.sha256:
                raise UserError(
                    f"shard {sh.file} fails its sha256 checksum (the manifest records {sh.sha256[:12]}..., "
                    f"the file hashes to {stats['sha256'][:12]}...), so it changed after it was written; {hint}"
                )
            cache.put(sh.name, version, stats)
            found[sh.name] = stats
    max_id = max((found[sh.name]["max_id"] for sh in shards), default=-1)
    if max_id > manifest["max_token_id"]:
        raise UserError(
            f"{path} holds token id {max_id}, above the manifest's max_token_id "
            f"{manifest['max_token_id']}, so its shards were altered; {hint}"
        )
    for split, entry in manifest["splits"].items():
        members = [sh for sh in shards if sh.split == split]
        eots = sum(found[sh.name]["eot"] for sh in members)
        if eots != entry["documents"]:
            raise UserError(
                f"split {split!r} of {path} holds {eots} end-of-text ids but the manifest records "
                f"{entry['documents']} documents, so its shards were altered; {hint}"
            )
        nonempty = [sh for sh in members if sh.tokens]
        if nonempty and _last_token(nonempty[-1].file, dtype) != eot_id:
            raise UserError(
                f"split {split!r} of {path} does not end with an end-of-text id, so its shards were altered; {hint}"
            )
    cache.save()
    return {
        "shards": len(shards),
        "hashed": len(unseen),
        "tokens": sum(sh.tokens for sh in shards),
        "documents": sum(int(e["documents"]) for e in manifest["splits"].values()),
        "max_token_id": max_id,
    }


def record_verified(path: Path, stats: dict[str, dict[str, Any]]) -> None:
    """Remember shards just written (name -> sha256, eot, max_id), so their first open reads nothing."""
    cache = _Cache(path)
    for name, entry in stats.items():
        with contextlib.suppress(OSError):
            cache.put(name, _version(path / name), entry)
    cache.save()


def verify_dataset(path: str | os.PathLike, progress: Progress = False) -> dict[str, Any]:
    """Open the dataset at `path` and re-read every shard whatever the cache says; a summary dict."""
    from tango_lm.data.shards import PreparedDataset

    ds = PreparedDataset.open(path, verify=True, progress=progress)
    report = dict(ds.verified)
    report.update(
        path=str(ds.path),
        splits={s: {"tokens": ds.num_tokens(s), "documents": ds.num_documents(s)} for s in ds.splits},
        tokenizer=ds.tokenizer.name,
    )
    return report


# -- reading ------------------------------------------------------------------------------------
def _version(file: Path) -> dict[str, int]:
    st = file.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


def _scan(file: Path, dtype: np.dtype, eot_id: int, bar: Any = None) -> dict[str, Any]:
    """sha256, number of end-of-text ids and largest id of one shard, read in blocks (each one's
    tokens counted on `bar`, if any)."""
    h = hashlib.sha256()
    eot = 0
    max_id = -1
    try:
        with open(file, "rb") as f:
            while block := f.read(_READ_BYTES):
                h.update(block)
                ids = np.frombuffer(block, dtype=dtype)
                if len(ids):
                    eot += int(np.count_nonzero(ids == eot_id))
                    max_id = max(max_id, int(ids.max()))
                    if bar is not None:
                        bar.update(len(ids))
    except OSError as exc:
        raise UserError(f"cannot read shard {file} ({exc.strerror or exc}); check its permissions") from None
    return {"sha256": h.hexdigest(), "eot": eot, "max_id": max_id}


def _last_token(file: Path, dtype: np.dtype) -> int:
    try:
        with open(file, "rb") as f:
            f.seek(-dtype.itemsize, os.SEEK_END)
            return int(np.frombuffer(f.read(dtype.itemsize), dtype=dtype)[0])
    except OSError as exc:
        raise UserError(f"cannot read shard {file} ({exc.strerror or exc}); check its permissions") from None


# -- the cache ------------------------------------------------------------------------------------
class _Cache:
    """What the shards of one dataset directory were verified to hold, keyed by shard version."""

    def __init__(self, dataset: Path) -> None:
        from tango_lm.cache_root import cache_root

        key = hashlib.sha256(str(dataset.resolve()).encode("utf-8", "surrogateescape")).hexdigest()[:32]
        self.file = cache_root() / "verified-shards" / f"{key}.json"
        self.dataset = str(dataset.resolve())
        self.entries: dict[str, Any] = {}
        self.changed = False
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.file.read_text())
            if data.get("version") == _CACHE_VERSION and data.get("dataset") == self.dataset:
                self.entries = dict(data["shards"])

    def get(self, name: str, version: dict[str, int], sha256: str) -> dict[str, Any] | None:
        entry = self.entries.get(name)
        if not isinstance(entry, dict) or entry.get("version") != version or entry.get("sha256") != sha256:
            return None
        return entry

    def put(self, name: str, version: dict[str, int], stats: dict[str, Any]) -> None:
        self.entries[name] = {
            "version": version,
            "sha256": stats["sha256"],
            "eot": int(stats["eot"]),
            "max_id": int(stats["max_id"]),
        }
        self.changed = True

    def save(self) -> None:
        """Write the cache if anything changed; a cache that cannot be written is simply not kept."""
        if not self.changed:
            return
        data = {"version": _CACHE_VERSION, "dataset": self.dataset, "shards": self.entries}
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.file, json.dumps(data))
        except OSError:
            return
        _forget_deleted(self.file.parent)


def _forget_deleted(directory: Path, keep: int = 256) -> None:
    """Once the cache holds more than `keep` datasets, drop those whose directory is gone."""
    files = list(directory.glob("*.json"))
    if len(files) <= keep:
        return
    for f in files:
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            if not Path(json.loads(f.read_text()).get("dataset")).is_dir():
                f.unlink()
