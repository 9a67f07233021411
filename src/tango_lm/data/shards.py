"""Prepared data: a directory of raw token shards plus `manifest.json` and `tokenizer.json`.

Layout of a prepared dataset directory:

    manifest.json        format tag, tokenizer, dtype, per split: shards (file, tokens, sha256),
                         total tokens and documents; max_token_id; source (provenance)
    tokenizer.json       the tokenizer's `to_dict()` (also inside the manifest)
    <split>-00000.bin    little-endian uint16 (vocab <= 65536) or uint32 token ids, one EOT
    <split>-00001.bin    after every document, documents concatenated across shard borders

A dataset is written under a sibling temporary name and renamed into place, so a crash never
leaves a half-written dataset where a complete one (or none) was expected.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator, Sized
from pathlib import Path
from typing import Any

import numpy as np

from tango_lm.data.dataset_dir import (
    FORMAT,
    MANIFEST,
    TOKENIZER_FILE,
    check_writable,
    hold_dataset_lock,
    is_prepared,
    remove_leftovers,
)
from tango_lm.data.sharded_tokens import ShardedTokens
from tango_lm.data.tokenizers import Tokenizer, tokenizer_from_dict
from tango_lm.data.verify import manifest_shards, record_verified, verify_shards
from tango_lm.errors import UserError, os_error_text
from tango_lm.progress_lines import Progress, progress_bar

__all__ = ["FORMAT", "PreparedDataset", "write_prepared", "is_prepared"]

_SPLIT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_DMMATH_DIR = re.compile(r"^dmmath-(byte|gpt2)$")  # the folders the TANGO presets and CPU sweeps train on
_REMOVE_HINT = (
    "remove the directory (or choose another --out) and run `tango-lm data prepare ...` again"  # unrecognised
)
_PREPARE_HINT = "prepare it again with `tango-lm data prepare ... --overwrite`"  # a damaged one is still there


def _dtype_for(vocab_size: int) -> np.dtype:
    """Smallest little-endian unsigned dtype that holds every id."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


class _ShardWriter:
    """Appends token arrays to fixed-size shards of one split, hashing each shard as it goes."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int, eot_id: int) -> None:
        self.directory, self.split, self.dtype = directory, split, dtype
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.stats: dict[str, dict[str, Any]] = {}  # per shard: end-of-text ids, largest id, sha256
        self.eot_id = eot_id
        self._file = None
        self._hash = None
        self._in_shard = 0

    def _open_next(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = open(self.directory / name, "wb")
        self._hash = hashlib.sha256()
        self._in_shard = 0
        self.shards.append({"file": name, "tokens": 0, "sha256": ""})
        self.stats[name] = {"eot": 0, "max_id": -1}

    def _close_current(self) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards[-1]["tokens"] = self._in_shard
        self.shards[-1]["sha256"] = self.stats[self.shards[-1]["file"]]["sha256"] = self._hash.hexdigest()
        self._file = None

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        start = 0
        while start < len(ids):
            if self._file is None or self._in_shard == self.shard_tokens:
                self._close_current()
                self._open_next()
            take = min(len(ids) - start, self.shard_tokens - self._in_shard)
            part = ids[start : start + take]
            chunk = part.tobytes()
            self._file.write(chunk)
            stats = self.stats[self.shards[-1]["file"]]
            stats["eot"] += int(np.count_nonzero(part == self.eot_id))
            stats["max_id"] = max(stats["max_id"], int(part.max()))
            self._hash.update(chunk)
            self._in_shard += take
            start += take

    def close(self) -> None:
        self._close_current()


def _batched(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


_BLOCK_TOKENS = 1 << 22  # int64 ids held at once while writing (32 MiB), however long a document


def _flatten(encoded: list[Any], eot_id: int) -> np.ndarray:
    lengths = np.fromiter((len(e) + 1 for e in encoded), dtype=np.int64, count=len(encoded))
    flat = np.empty(int(lengths.sum()), dtype=np.int64)
    ends = np.cumsum(lengths)
    for ids, end, length in zip(encoded, ends, lengths, strict=True):
        flat[end - length : end - 1] = ids
    flat[ends - 1] = eot_id
    return flat


def _token_blocks(encoded: list[Any], eot_id: int, limit: int = _BLOCK_TOKENS) -> Iterator[np.ndarray]:
    """The documents' ids, each followed by `eot_id`, in order, as int64 blocks of about `limit`
    tokens: the same tokens as one concatenation, never a copy of a whole long document."""
    group: list[Any] = []
    size = 0
    for ids in encoded:
        if group and size + len(ids) + 1 > limit:
            yield _flatten(group, eot_id)
            group, size = [], 0
        if len(ids) + 1 > limit:
            for start in range(0, len(ids), limit):
                yield np.asarray(ids[start : start + limit], dtype=np.int64)
            yield np.array([eot_id], dtype=np.int64)
            continue
        group.append(ids)
        size += len(ids) + 1
    if group:
        yield _flatten(group, eot_id)


def _write_split(
    directory: Path,
    split: str,
    docs: Iterable[str],
    tokenizer: Tokenizer,
    dtype: np.dtype,
    shard_tokens: int,
    progress: Progress,
    batch_docs: int,
) -> tuple[dict[str, Any], int, dict[str, dict[str, Any]]]:
    """Tokenize one split into shards; returns its manifest entry, its largest token id and what
    each shard holds (for the verification cache)."""
    writer = _ShardWriter(directory, split, dtype, shard_tokens, tokenizer.eot_id)
    n_docs = n_tokens = 0
    max_id = -1
    started = time.perf_counter()
    total = len(docs) if isinstance(docs, Sized) else None  # a known count gives the bar an ETA
    with progress_bar(progress, desc=f"tokenize {split}", total=total, unit="doc", leave=True) as bar:
        for batch in _batched(docs, batch_docs):
            encoded = tokenizer.encode_batch(batch)
            for flat in _token_blocks(encoded, tokenizer.eot_id):
                lo, hi = int(flat.min()), int(flat.max())
                if lo < 0 or hi >= tokenizer.vocab_size:
                    raise ValueError(f"tokenizer {tokenizer.name} produced id outside [0, vocab_size)")
                max_id = max(max_id, hi)
                writer.write(flat)
                n_tokens += len(flat)
            del encoded  # before the next batch is encoded: not two batches of lists at once
            n_docs += len(batch)
            # the numbers first: a log line (progress_lines.py) is said at the update
            bar.set_postfix(tokens=n_tokens, tok_s=f"{n_tokens / (time.perf_counter() - started):.3g}", refresh=False)
            bar.update(len(batch))
    writer.close()
    entry = {"shards": writer.shards, "tokens": n_tokens, "documents": n_docs}
    return entry, max_id, writer.stats


def write_prepared(
    out_dir: str | os.PathLike,
    tokenizer: Tokenizer,
    splits: dict[str, Iterable[str]],
    source: dict[str, Any],
    shard_tokens: int = 2**24,
    progress: Progress = True,
    *,
    overwrite: bool = False,
    batch_docs: int = 1024,
) -> Path:
    """Tokenize the documents of each split into a prepared dataset at `out_dir` and return its path.

    Each document is encoded, followed by the tokenizer's EOT id. The dataset is built in the
    sibling directory `.<name>.tmp-<pid>` and renamed into place; an existing complete dataset
    is only replaced with `overwrite=True`, and stays untouched if anything fails before the
    final rename.
    """
    out = Path(out_dir).absolute()
    if shard_tokens < 1:
        raise ValueError("shard_tokens must be positive")
    for split in splits:
        if not _SPLIT_NAME.match(split):
            raise UserError(f"invalid split name {split!r}; use letters, digits, '-', '_' or '.'")
    with hold_dataset_lock(out):
        check_writable(out, overwrite)
        remove_leftovers(out)
        return _write_prepared(out, tokenizer, splits, source, shard_tokens, progress, batch_docs)


def _write_prepared(
    out: Path,
    tokenizer: Tokenizer,
    splits: dict[str, Iterable[str]],
    source: dict[str, Any],
    shard_tokens: int,
    progress: Progress,
    batch_docs: int,
) -> Path:
    dtype = _dtype_for(tokenizer.vocab_size)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir()
        split_entries: dict[str, Any] = {}
        shard_stats: dict[str, dict[str, Any]] = {}
        max_id = -1
        for split, docs in splits.items():
            entry, split_max, stats = _write_split(
                tmp, split, docs, tokenizer, dtype, shard_tokens, progress, batch_docs
            )
            split_entries[split] = entry
            shard_stats.update(stats)
            max_id = max(max_id, split_max)
        held = {s: e["documents"] for s, e in split_entries.items() if s != "train" and e["documents"]}
        if split_entries.get("train", {"documents": 0})["documents"] == 0 and held:
            raise UserError(
                f"all {sum(held.values())} documents went to {' and '.join(held)} (held out by hash, or the "
                f"source's own splits) and none to train, so no dataset was written to {out}; give more "
                "documents or lower --dev-fraction / --test-fraction"
            )
        if split_entries.get("train", {"documents": 0})["documents"] == 0:
            raise UserError(
                f"the input holds no {'train ' if split_entries else ''}documents (empty or whitespace-only), "
                f"so no dataset was written to {out}; check the input files"
            )
        tok_dict = tokenizer.to_dict()
        manifest = {
            "format": FORMAT,
            "tokenizer": tok_dict,
            "dtype": dtype.str,
            "splits": split_entries,
            "max_token_id": max_id,
            "source": source,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / TOKENIZER_FILE).write_text(json.dumps(tok_dict, indent=2) + "\n", encoding="utf-8")
        # The manifest goes last: its presence is what makes the directory a dataset.
        with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
            f.write(json.dumps(manifest, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        _move_into_place(tmp, out)
    except OSError as exc:  # a full disk, an unwritable folder: nothing half-written stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(
            f"cannot write the dataset {out}: {os_error_text(exc)}; nothing was written or replaced, "
            "free disk space or choose a writable output directory"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    record_verified(out, shard_stats)  # its first open need not read it back
    return out


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an existing `out` is renamed away first and deleted after."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if old.exists():
        shutil.rmtree(old)
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)  # put the previous dataset back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _create_hint(path: Path) -> str:
    """The command that makes the dataset: whole for the DeepMind Mathematics folders the presets
    name (generated here, no download), a pointer to the sources otherwise."""
    if match := _DMMATH_DIR.match(path.name):
        return f"create it with `tango-lm data prepare dmmath --out {path} --tokenizer {match[1]}`"
    return f"create it with `tango-lm data prepare SOURCE --out {path} ...` (`tango-lm data prepare --help` lists them)"


class PreparedDataset:
    """A prepared dataset opened for reading; shards are memory-mapped, not loaded."""

    def __init__(self, path: Path, manifest: dict[str, Any], tokenizer: Tokenizer) -> None:
        self.path = path
        self.manifest = manifest
        self.tokenizer = tokenizer
        self.dtype = np.dtype(manifest["dtype"])
        self.verified: dict[str, Any] = {}  # what `open` checked (data/verify.py)
        self._cache: dict[str, np.ndarray] = {}

    @classmethod
    def open(cls, path: str | os.PathLike, verify: bool = False, progress: Progress = False) -> PreparedDataset:
        """Open and check the dataset at `path` (data/verify.py): the manifest's layout and shard
        sizes every time, each shard's contents once per shard version; `verify=True` re-reads
        every shard whatever the verification cache says; `progress`: how the reading shows."""
        p = Path(path)
        if not p.is_dir():
            why = "a file, not a directory" if p.exists() else "directory missing"
            raise UserError(f"no prepared dataset at {p} ({why}); {_create_hint(p)}")
        try:
            with open(p / MANIFEST, encoding="utf-8") as f:
                manifest = json.load(f)
        except FileNotFoundError:
            raise UserError(f"{p} has no {MANIFEST}, so it is not a prepared dataset; {_create_hint(p)}") from None
        except (OSError, ValueError) as e:
            raise UserError(f"the manifest {p / MANIFEST} cannot be parsed ({e}); {_REMOVE_HINT}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            found = manifest.get("format") if isinstance(manifest, dict) else None
            raise UserError(f"{p / MANIFEST} has format {found!r}, expected {FORMAT!r}; {_REMOVE_HINT}")
        tok_dict = manifest.get("tokenizer")
        try:
            tokenizer = tokenizer_from_dict(tok_dict)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UserError(f"{p / MANIFEST} has an unreadable tokenizer ({e}); {_PREPARE_HINT}") from None
        dtype, shards = manifest_shards(p, manifest, _PREPARE_HINT)
        if dtype.itemsize == 2 and tokenizer.vocab_size > 2**16:
            raise UserError(f"{p / MANIFEST} stores {tokenizer.vocab_size} token ids as uint16; {_PREPARE_HINT}")
        verified = verify_shards(
            p, manifest, dtype, shards, tokenizer.eot_id, _PREPARE_HINT, force=verify, progress=progress
        )
        if manifest["max_token_id"] >= tokenizer.vocab_size:  # the shards hold no more (verify_shards)
            raise UserError(
                f"{p / MANIFEST} records token id {manifest['max_token_id']}, past its tokenizer's "
                f"{tokenizer.vocab_size} ids, so it was altered; {_PREPARE_HINT}"
            )
        ds = cls(p, manifest, tokenizer)
        ds.verified = verified
        return ds

    @property
    def splits(self) -> list[str]:
        """Names of the splits, in the order they were written."""
        return list(self.manifest["splits"])

    @property
    def max_token_id(self) -> int:
        """Largest token id in any split (-1 when the dataset is empty)."""
        return int(self.manifest["max_token_id"])

    @property
    def source(self) -> dict[str, Any]:
        """The provenance dict given to `write_prepared`."""
        return self.manifest.get("source", {})

    def _entry(self, split: str) -> dict[str, Any]:
        entry = self.manifest["splits"].get(split)
        if entry is None:
            raise UserError(f"split {split!r} is not in {self.path}; available splits: {', '.join(self.splits)}")
        return entry

    def num_tokens(self, split: str) -> int:
        """Number of tokens (EOTs included) in `split`."""
        return int(self._entry(split)["tokens"])

    def num_documents(self, split: str) -> int:
        """Number of documents in `split`."""
        return int(self._entry(split)["documents"])

    def content_id(self, split: str) -> str:
        """A sha256 of `split`'s tokens in order (from its shards' recorded sha256s): equal for the
        same tokens wherever the dataset lies and however often it was prepared."""
        sums = "\n".join(
            str(sh.get("sha256", "")) + ":" + str(sh.get("tokens", "")) for sh in self._entry(split)["shards"]
        )
        return hashlib.sha256(sums.encode()).hexdigest()

    def tokens(self, split: str) -> np.ndarray | ShardedTokens:
        """All tokens of `split` as a read-only 1-D array: its shard's memmap, or a view over its shards'
        memmaps (data/sharded_tokens.py; never a copy of the split in memory)."""
        if split in self._cache:
            return self._cache[split]
        shards = self._entry(split)["shards"]
        try:
            maps = [
                np.memmap(self.path / sh["file"], dtype=self.dtype, mode="r", shape=(int(sh["tokens"]),))
                for sh in shards
                if int(sh["tokens"]) > 0
            ]
        except OSError as exc:
            raise UserError(
                f"cannot read shard {exc.filename or self.path} of split {split!r} "
                f"({exc.strerror or exc}); check its permissions"
            ) from None
        if not maps:
            arr = np.empty(0, dtype=self.dtype)
        elif len(maps) == 1:
            arr = maps[0]
        else:
            arr = ShardedTokens(maps, self.dtype)
        self._cache[split] = arr
        return arr

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s}={self.num_tokens(s)}" for s in self.splits)
        return f"PreparedDataset({str(self.path)!r}, tokenizer={self.tokenizer.name}, {sizes})"
