"""What every data source provides, and what the sources share.

A data source makes a prepared dataset (shards.py) from some input: files, a code tree, a Hugging
Face dataset, DeepMind's generator, other prepared datasets. Each is a `DataSource` subclass, a
dataclass of its options, that provides

- its command-line arguments: `add_arguments` fills `tango-lm data prepare NAME`'s parser and
  `from_args` turns the parsed arguments into the source's options;
- `prepare(out_dir)`: check the options, resolve the tokenizer, refuse an output that may not be
  written, read the documents of every split and tokenize them into shards, in that order, so a
  bad option or output fails before anything is read;
- `fingerprint()`: the manifest's `source` record, what the dataset was made from and how (its
  name first, its options, and what reading found: files, splits, counts). It is called once,
  after `read` returns its streams and before they are consumed; the manifest is written after
  the last document. So a count that reading finds belongs in a mutable container the record
  holds (as `code_trees.py`'s `stats` dict): a plain number is copied as it stood, often 0;
- optionally `summary()` and `warnings()`: lines `data prepare` prints after the split sizes (a
  mixture's realized shares).

A new source is one file with its subclass plus one line in `data/sources.py`'s `SOURCES`; the
command line is generated from that registry.

Every source is a stream of documents (strings) that `write_prepared` tokenizes into shards (one
of a known number, a list or a `KnownCount`, gets a bar with an ETA); nothing here holds a corpus
in memory (one file, one Parquet row batch, or one spilled line at a time).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tango_lm.errors import path_arg
from tango_lm.progress_lines import Progress

__all__ = ["DataSource", "HeldOutSource", "KnownCount"]


class KnownCount:
    """A stream of documents whose number is known before it is read: `write_prepared`'s bar then
    shows an ETA (a list has a length already)."""

    def __init__(self, documents: Iterable[Any], count: int) -> None:
        self.documents, self.count = documents, count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Any]:
        return iter(self.documents)


class DataSource:
    """One way to make a prepared dataset (module docstring); subclasses are dataclasses of options."""

    name: ClassVar[str] = ""  # `tango-lm data prepare NAME` and the manifest's source name
    help: ClassVar[str] = ""  # one line in `tango-lm data prepare --help`

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add this source's arguments, `--out` and `--overwrite` among them."""
        raise NotImplementedError

    @staticmethod
    def add_overwrite_argument(p: argparse.ArgumentParser) -> None:
        """`--overwrite`, said once for every source."""
        p.add_argument(
            "--overwrite",
            action="store_true",
            help="replace a prepared dataset already in --out (one holding other files, or a folder that is not a dataset, is never touched)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DataSource:
        """The source the parsed arguments describe."""
        raise NotImplementedError

    def check(self) -> None:
        """Raise UserError for options this source cannot prepare, before anything is read or written."""

    def open_tokenizer(self) -> Any:
        """The tokenizer that writes the shards."""
        raise NotImplementedError

    def read(self, tokenizer: Any, out_dir: Path, progress: Progress) -> dict[str, Iterable[Any]]:
        """The documents of every split, in the order the splits are written. `out_dir` is where
        the dataset goes (held-out documents wait beside it)."""
        raise NotImplementedError

    def fingerprint(self) -> dict[str, Any]:
        """The manifest's `source` record (module docstring): called after `read`, before its
        documents stream; counts found while they stream go in a container the record holds."""
        raise NotImplementedError

    def summary(self) -> list[str]:
        """Lines `data prepare` prints after the split sizes, on what reading found that the sizes
        do not say (after `prepare`)."""
        return []

    def warnings(self) -> list[str]:
        """What `data prepare` warns of after preparing, one line each, without `warning: `."""
        return []

    def prepare(self, out_dir: str | os.PathLike, *, overwrite: bool = False, progress: Progress = True) -> Path:
        """Write the prepared dataset to `out_dir` and return its path."""
        from tango_lm.data.dataset_dir import check_writable
        from tango_lm.data.shards import write_prepared

        self.check()
        tok = self.open_tokenizer()
        check_writable(out_dir, overwrite)
        splits = self.read(tok, Path(out_dir), progress)
        return write_prepared(out_dir, tok, splits, self.fingerprint(), progress=progress, overwrite=overwrite)


@dataclass(kw_only=True)
class HeldOutSource(DataSource):
    """A source of documents whose missing dev and test splits are held out of train by document
    hash (splits.py), with the tokenizer and hold-out options every such source shares."""

    tokenizer: Any = "gpt2"  # a name (gpt2, byte, bpe:PATH) or a Tokenizer
    dev_fraction: float = 0.02
    test_fraction: float = 0.02
    seed: int = 0

    def check(self) -> None:
        from tango_lm.data.splits import _check_fractions

        _check_fractions(self.dev_fraction, self.test_fraction)

    def held_out_record(self) -> dict[str, Any]:
        """The hold-out options, for the source's manifest record (`fingerprint`)."""
        return {"dev_fraction": self.dev_fraction, "test_fraction": self.test_fraction, "seed": self.seed}

    def open_tokenizer(self) -> Any:
        return _tokenizer(self.tokenizer)

    def held_out_splits(
        self, own: dict[str, Iterable[str]], out_dir: Path, key: Callable[[str], str] | None = None
    ) -> dict[str, Iterable[str]]:
        """`own` (split -> documents; `{"train": docs}` for an unsplit source) plus the dev and test
        splits it lacks, held out of train by the hash of each document (or of its `key`)."""
        from tango_lm.data.splits import assemble_splits

        out = Path(out_dir).absolute()
        return assemble_splits(
            own, self.dev_fraction, self.test_fraction, self.seed, _spill_dir(out), key, spill_name=out.name
        )

    @staticmethod
    def add_common_arguments(p: argparse.ArgumentParser) -> None:
        """`--out`, the tokenizer and hold-out options and `--overwrite` (the command adds
        `--no-progress` to every source)."""
        p.add_argument("--out", required=True, type=path_arg, help="output directory")
        p.add_argument("--tokenizer", default="gpt2", help="gpt2, byte, or bpe:PATH (data train-tokenizer)")
        p.add_argument(
            "--dev-fraction",
            type=float,
            default=0.02,
            help="share of documents held out as dev by document hash when the source has no dev split",
        )
        p.add_argument("--test-fraction", type=float, default=0.02, help="the same for test")
        p.add_argument("--seed", type=int, default=0, help="seed of the held-out split hash")
        DataSource.add_overwrite_argument(p)

    @staticmethod
    def common_options(args: argparse.Namespace) -> dict[str, Any]:
        """The options `add_common_arguments` parsed, as keyword arguments of the source."""
        return {
            "tokenizer": args.tokenizer,
            "dev_fraction": args.dev_fraction,
            "test_fraction": args.test_fraction,
            "seed": args.seed,
        }


def _tokenizer(tokenizer: Any):
    from tango_lm.data.tokenizers import Tokenizer, get_tokenizer

    return tokenizer if isinstance(tokenizer, Tokenizer) else get_tokenizer(tokenizer)


def _spill_dir(out_dir: str | os.PathLike) -> Path:
    """Held-out documents wait beside the output (same disk), not in a possibly small /tmp."""
    return Path(out_dir).absolute().parent


def _limit(docs: Iterable[str], max_docs: int | None) -> Iterator[str]:
    for i, doc in enumerate(docs):
        if max_docs is not None and i >= max_docs:
            return
        yield doc
