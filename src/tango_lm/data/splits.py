"""The split policy: the splits a source keeps, and dev/test held out of train by document hash.

Splits:
- A source that has its own splits keeps them: Hugging Face splits (train; validation/valid/dev ->
  dev; test), inputs given as `SPLIT=PATH` (`train=a.jsonl dev=b.jsonl`), or a single input
  directory whose top-level entries are named after splits (`train.jsonl`, `validation/`,
  `test-00000-of-00002.parquet`, ...).
- A split the source lacks (all of them for an unsplit source) is held out of train by document
  hash: with u = blake2b(seed, document text) read as a number in [0, 1), a document goes to test
  when u < test_fraction, to dev when u < test_fraction + dev_fraction, otherwise to train. The
  assignment depends only on the text and the seed, so identical documents land in the same split
  (no train/test leakage through duplicates), it is stable when documents are added or removed,
  and realized fractions match the requested ones only approximately. A held-out split with
  fraction 0 is left out. The held-out documents are found in one pass while train streams
  through, and spilled to a temporary file (next to the output directory) until `write_prepared`
  reads that split.
- Empty (whitespace-only) documents are skipped everywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from tango_lm.errors import UserError, option

__all__ = ["SPLITS", "SPLIT_ALIASES", "split_of", "hold_out", "assemble_splits"]

SPLITS = ("train", "dev", "test")
SPLIT_ALIASES = {"train": "train", "dev": "dev", "validation": "dev", "valid": "dev", "val": "dev", "test": "test"}


# -- split policy ---------------------------------------------------------------------------
def _unit(key: str, seed: int) -> float:
    h = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8, key=str(seed).encode()[:64])
    return int.from_bytes(h.digest(), "little") / 2.0**64


def split_of(key: str, dev_fraction: float, test_fraction: float, seed: int = 0) -> str:
    """The split ("train", "dev" or "test") a document with text (or key) `key` is held out to."""
    u = _unit(key, seed)
    if u < test_fraction:
        return "test"
    if u < test_fraction + dev_fraction:
        return "dev"
    return "train"


def _check_fractions(dev_fraction: float, test_fraction: float) -> None:
    for name, f in (("dev_fraction", dev_fraction), ("test_fraction", test_fraction)):
        if not 0 <= f < 1:
            raise UserError(f"{option(name)} must be in [0, 1), got {f}; pick e.g. 0.02")
    if dev_fraction + test_fraction >= 1:
        raise UserError(
            f"{option('dev_fraction')} + {option('test_fraction')} must be below 1, got {dev_fraction + test_fraction}; lower them"
        )


def spill_prefix(output_name: str | None) -> str:
    """The name prefix of a spill folder for the output `output_name` (beside it): `.NAME.spill-PID-`."""
    return f".{output_name or 'tango-lm'}.spill-{os.getpid()}-"


class _SpillSplitter:
    """One pass over `docs`: the split read first streams through, the others spill to temp files."""

    def __init__(
        self,
        docs: Iterable[str],
        names: Sequence[str],
        assign: Callable[[str], str],
        spill_dir: str | os.PathLike | None = None,
        spill_name: str | None = None,
    ) -> None:
        self.docs, self.names, self.assign, self.spill_dir = docs, list(names), assign, spill_dir
        # Named after the output it is for (`spill_prefix`), so that a writer killed mid-way leaves
        # a folder the next writer of that output, holding its lock, knows to remove.
        self.prefix = spill_prefix(spill_name)
        self._dir: tempfile.TemporaryDirectory | None = None
        self._unread: set[str] = set()
        self._state = "new"  # new -> running -> done

    def stream(self, name: str) -> Iterator[str]:
        if self._state == "new":
            yield from self._drive(name)
        elif self._state == "done":
            yield from self._read_spill(name)
        else:
            raise RuntimeError(f"split {name!r} was read while another split of the same source was being read")

    def _drive(self, name: str) -> Iterator[str]:
        self._state = "running"
        if self.spill_dir is not None:
            Path(self.spill_dir).mkdir(parents=True, exist_ok=True)
        self._dir = tempfile.TemporaryDirectory(prefix=self.prefix, dir=self.spill_dir)
        self._unread = {n for n in self.names if n != name}
        files = {n: open(Path(self._dir.name) / f"{n}.jsonl", "w", encoding="utf-8") for n in self._unread}
        try:
            for doc in self.docs:
                split = self.assign(doc)
                if split == name:
                    yield doc
                elif split in files:
                    files[split].write(json.dumps(doc, ensure_ascii=False) + "\n")
        finally:
            for f in files.values():
                f.close()
        self._state = "done"
        if not self._unread:
            self._dir.cleanup()

    def _read_spill(self, name: str) -> Iterator[str]:
        with open(Path(self._dir.name) / f"{name}.jsonl", encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)
        self._unread.discard(name)
        if not self._unread:
            self._dir.cleanup()


def hold_out(
    docs: Iterable[str],
    dev_fraction: float,
    test_fraction: float,
    seed: int = 0,
    keep: Sequence[str] = (),
    spill_dir: str | os.PathLike | None = None,
    key: Callable[[str], str] | None = None,
    spill_name: str | None = None,
) -> dict[str, Iterator[str]]:
    """Split one document stream into train/dev/test by document hash (module docstring), in one pass.

    Splits in `keep` are not held out (the source supplies them); neither are splits with fraction 0.
    The splits read after the first are spilled to a temporary directory in `spill_dir`, named
    after the output `spill_name` it is for (`spill_prefix`). `key`:
    the part of a document that is hashed (default: all of it; a code tree's text without the
    path header it added, so that copies of a file at other paths stay in one split).
    """
    fractions = {"dev": dev_fraction, "test": test_fraction}
    names = ["train"] + [s for s, f in fractions.items() if f > 0 and s not in keep]
    dev = dev_fraction if "dev" in names else 0.0
    test = test_fraction if "test" in names else 0.0
    text_of = key or (lambda d: d)
    splitter = _SpillSplitter(docs, names, lambda d: split_of(text_of(d), dev, test, seed), spill_dir, spill_name)
    return {n: splitter.stream(n) for n in names}


def assemble_splits(
    own: dict[str, Iterable[str]],
    dev_fraction: float,
    test_fraction: float,
    seed: int = 0,
    spill_dir: str | os.PathLike | None = None,
    key: Callable[[str], str] | None = None,
    spill_name: str | None = None,
) -> dict[str, Iterable[str]]:
    """Splits for `write_prepared`: the source's own splits, plus dev/test held out of train when missing.

    `own` maps split names to documents; an unsplit source passes `{"train": docs}`. `key`, `spill_dir`
    and `spill_name`: as `hold_out`'s.
    """
    _check_fractions(dev_fraction, test_fraction)
    if "train" not in own:
        raise UserError(
            f"the source has splits {', '.join(own)} but no train split; give one (train=PATH among the inputs, or train=THEIRS in --split-map)"
        )
    missing = [s for s in ("dev", "test") if s not in own]
    if not missing:
        return dict(own)
    keep = [s for s in own if s != "train"]
    held = hold_out(
        own["train"], dev_fraction, test_fraction, seed, keep=keep, spill_dir=spill_dir, key=key, spill_name=spill_name
    )
    out: dict[str, Iterable[str]] = {"train": held["train"]}
    for s in ("dev", "test"):
        if s in own:
            out[s] = own[s]
        elif s in held:
            out[s] = held[s]
    out.update({s: d for s, d in own.items() if s not in out})
    return out
