"""Text, JSONL and Parquet files: the files the inputs name, and the documents in them.

Inputs are files, directories (walked recursively for the source's extensions), glob patterns,
or `SPLIT=PATH` items; a single input directory whose top-level entries are named after splits
keeps those splits (splits.py). Readers stream: one file, or one Parquet row batch, at a time.
"""

from __future__ import annotations

import argparse
import codecs
import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tango_lm.data.inputs import INPUTS_HELP, _has_ext, files_per_split, refuse_split_named_training, split_inputs
from tango_lm.data.source import HeldOutSource, _limit
from tango_lm.errors import UserError, option
from tango_lm.progress_lines import Progress

__all__ = [
    "FileSource",
    "TextSource",
    "JsonlSource",
    "ParquetSource",
    "text_documents",
    "jsonl_documents",
    "parquet_documents",
    "file_documents",
    "prepare_files",
]

# A JSON escape such as "\ud800" without its pair (scraped web text has them) decodes to a lone
# surrogate, which no UTF-8 encoder takes; json.loads has already joined every valid pair.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

READ_ERRORS = (OSError, EOFError, zlib.error)  # gzip adds a truncated file and a damaged stream


def without_lone_surrogates(text: str) -> str:
    """A string from JSON with each unpaired surrogate as U+FFFD, a UTF-8 decoder's replacement."""
    return _LONE_SURROGATE.sub("\ufffd", text)


# -- readers ----------------------------------------------------------------------------------
def _open_text(path: Path) -> io.TextIOBase:
    # utf-8-sig: a byte-order mark some editors write is not text (JSON refuses it on line 1).
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def _bad_utf8_offset(path: Path) -> int | None:
    """The file offset of the first byte that is not UTF-8 (of the decompressed stream for `.gz`).
    A text file read line by line decodes in chunks, and its error counts from the chunk."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    fed = 0
    with gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:  # e.object: the bytes it held back from before, then chunk
                return fed - (len(e.object) - len(chunk)) + e.start
            fed += len(chunk)
    try:
        decoder.decode(b"", final=True)  # a character cut off by the end of the file
    except UnicodeDecodeError as e:
        return fed - len(e.object) + e.start
    return None


def text_documents(files: Iterable[Path], split_on_blank_lines: bool = False) -> Iterator[str]:
    """One document per file, or with `split_on_blank_lines` one per paragraph (lines streamed)."""
    for path in files:
        try:
            with _open_text(path) as f:
                if not split_on_blank_lines:
                    doc = f.read()
                    if doc.strip():
                        yield doc
                    continue
                para: list[str] = []
                for line in f:
                    if line.strip():
                        para.append(line)
                    elif para:
                        yield "".join(para).rstrip("\n")
                        para = []
                if para:
                    yield "".join(para).rstrip("\n")
        except UnicodeDecodeError as e:
            at = _bad_utf8_offset(path)
            raise UserError(
                f"{path} is not UTF-8 text ({e.reason} at byte {e.start if at is None else at}); "
                "convert it or leave it out"
            ) from None
        except READ_ERRORS as e:
            raise UserError(f"cannot read {path} ({getattr(e, 'strerror', None) or e}); check the file") from None


def jsonl_documents(files: Iterable[Path], field: str = "text") -> Iterator[str]:
    """The string `field` of every JSON object, one object per line (`.gz` files are decompressed);
    an object whose `field` is null is no document (as a null in Parquet)."""
    seen_field = False
    for path in files:
        try:
            with _open_text(path) as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line.rstrip("\r\n"))
                    except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
                        # the file's line and the column in it (json would count the newline as a line)
                        where = f", column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
                        why = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                        raise UserError(
                            f"{path}, line {lineno}{where}: not valid JSON ({why}); fix or remove that line"
                        ) from None
                    if not isinstance(row, dict):  # --field cannot fix a line that is a list or a number
                        raise UserError(
                            f"{path}, line {lineno}: a JSON {type(row).__name__}, not an object such as "
                            f'{{"{field}": "..."}}; fix or remove that line'
                        )
                    value = row.get(field, None)
                    if value is None and field in row:
                        continue  # a null text, as Parquet's null rows: no document
                    if not isinstance(value, str):
                        what = "has no field" if field not in row else "has a non-string"
                        # Rows before it had the field: this line is the fault, not the field's name.
                        if seen_field:
                            fix = "fix or remove that line"
                        else:  # as the Parquet and Hugging Face sources say: the fields there are
                            fix = f"choose the text field with --field (fields: {', '.join(row) or 'none'})"
                        raise UserError(f"{path}, line {lineno}: the object {what} {field!r}; {fix}")
                    seen_field = True
                    if value.strip():
                        yield without_lone_surrogates(value)
        except UnicodeDecodeError as e:
            raise UserError(f"{path} is not UTF-8 text ({e.reason}); convert it to UTF-8") from None
        except READ_ERRORS as e:
            raise UserError(f"cannot read {path} ({e}); check the file") from None


def _is_text(pa: Any, kind: Any) -> bool:
    """Arrow text: string, large_string, string_view, or a dictionary of them (pandas' Categorical)."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    is_view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)


def parquet_documents(files: Iterable[Path], field: str = "text", batch_rows: int = 1024) -> Iterator[str]:
    """The string column `field` of Parquet files, read `batch_rows` rows at a time; nulls skipped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in files:
        try:
            pf = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise UserError(f"cannot read the Parquet file {path} ({e}); check the file") from None
        names = pf.schema_arrow.names
        if field not in names:
            raise UserError(
                f"the Parquet file {path} has no column {field!r} (columns: {', '.join(names)}); "
                "choose one with --field"
            )
        kind = pf.schema_arrow.field(field).type
        if not _is_text(pa, kind):
            raise UserError(f"column {field!r} of {path} holds {kind}, not text; choose a text column with --field")
        try:
            for batch in pf.iter_batches(batch_size=batch_rows, columns=[field]):
                for value in batch.column(0).to_pylist():
                    if value is not None and value.strip():
                        yield value
        except (OSError, pa.ArrowException) as e:
            raise UserError(f"cannot read the Parquet file {path} ({e}); check the file") from None
        except UnicodeDecodeError as e:  # a string column holding other bytes (Arrow does not check them)
            raise UserError(
                f"{path} is not UTF-8 text ({e.reason} in column {field!r}); convert it or leave it out"
            ) from None


def file_documents(
    kind: str, files: Iterable[Path], field: str = "text", split_on_blank_lines: bool = False, batch_rows: int = 1024
) -> Iterator[str]:
    """Documents of `files` read as `kind` ("text", "jsonl" or "parquet")."""
    if kind == "text":
        return text_documents(files, split_on_blank_lines)
    if kind == "jsonl":
        return jsonl_documents(files, field)
    if kind == "parquet":
        return parquet_documents(files, field, batch_rows)
    raise UserError(f"unknown file kind {kind!r}; choose text, jsonl or parquet")


@dataclass(kw_only=True)
class FileSource(HeldOutSource):
    """Text (`.txt`), JSONL or Parquet files (`kind`) as a dataset (splits: splits.py).

    `inputs` are files, directories (walked for `exts`), glob patterns or `SPLIT=PATH` items;
    `max_docs` caps the documents read from each of the source's splits.
    """

    kind: ClassVar[str] = ""
    default_exts: ClassVar[tuple[str, ...]] = ()

    inputs: Sequence[str | os.PathLike]
    field: str = "text"
    exts: Sequence[str] | None = None
    split_on_blank_lines: bool = False
    max_docs: int | None = None
    batch_rows: int = 1024

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("inputs", nargs="+", help=INPUTS_HELP)
        cls.add_common_arguments(parser)
        parser.add_argument(
            "--ext",
            action="append",
            help=f"file extension read from directories, and that a named file of this kind may have "
            f"(default {', '.join(cls.default_exts)})",
        )
        if cls.kind == "text":  # each kind offers only the options it reads
            parser.add_argument("--split-on-blank-lines", action="store_true", help="one document per paragraph")
        else:
            parser.add_argument("--field", default="text", help="the field holding the text (default %(default)s)")
        parser.add_argument("--max-docs", type=int, default=None, help="read at most N documents per split")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FileSource:
        return cls(
            inputs=args.inputs,
            field=getattr(args, "field", "text"),
            exts=args.ext,
            split_on_blank_lines=getattr(args, "split_on_blank_lines", False),
            max_docs=args.max_docs,
            **cls.common_options(args),
        )

    def check(self) -> None:
        super().check()
        if self.kind == "text" and self.field != "text":
            raise UserError(f"text files have no fields (field={self.field!r}); read JSONL or Parquet for that")
        if self.kind != "text" and self.split_on_blank_lines:
            raise UserError(f"split_on_blank_lines reads text files, not {self.kind}; drop it")
        if self.max_docs is not None and self.max_docs < 1:
            raise UserError(f"{option('max_docs')} must be at least 1, got {self.max_docs}; omit it to read everything")

    def read(self, tokenizer: Any, out_dir: Path, progress: Progress) -> dict[str, Iterable[str]]:
        exts = tuple(self.exts or self.default_exts)
        self._groups = split_inputs(self.inputs, exts)
        self._files = files_per_split(self._groups, exts)  # fail on missing or shared paths now
        refuse_split_named_training(self.inputs, self._files)
        self._refuse_other_kinds(exts)
        own = {
            s: _limit(
                file_documents(self.kind, f, self.field, self.split_on_blank_lines, self.batch_rows), self.max_docs
            )
            for s, f in self._files.items()
        }
        return self.held_out_splits(own, out_dir)

    def _refuse_other_kinds(self, exts: Sequence[str]) -> None:
        """A file named by hand whose name says it is another kind (data.jsonl given to `text`)
        would be read as this kind: its JSON syntax trained as text, with no word."""
        for path in (p for files in self._files.values() for p in files if not _has_ext(p, exts)):
            for other in FILE_SOURCES.values():
                ext = next((e for e in other.default_exts if path.name.lower().endswith(e)), None)
                if other.kind != self.kind and ext:
                    raise UserError(
                        f"{path} is a {other.kind} file by its name; prepare it with `tango-lm data prepare "
                        f"{other.kind}` (or pass --ext {ext} to read it as {self.kind})"
                    )

    def fingerprint(self) -> dict[str, Any]:
        kind = self.kind
        return {
            "name": kind,
            "inputs": [str(i) for i in self.inputs],
            "files": {s: len(f) for s, f in self._files.items()},
            "own_splits": sorted(self._groups),
            "field": self.field if kind != "text" else None,
            "split_on_blank_lines": self.split_on_blank_lines if kind == "text" else None,
            **self.held_out_record(),
            "max_docs": self.max_docs,
        }


class TextSource(FileSource):
    name = kind = "text"
    help = "plain-text files (one document per file)"
    default_exts = (".txt",)


class JsonlSource(FileSource):
    name = kind = "jsonl"
    help = "JSON Lines files, one document per line"
    default_exts = (".jsonl", ".jsonl.gz")


class ParquetSource(FileSource):
    name = kind = "parquet"
    help = "Parquet files, read in row batches"
    default_exts = (".parquet",)


FILE_SOURCES = {cls.kind: cls for cls in (TextSource, JsonlSource, ParquetSource)}


def prepare_files(
    kind: str,
    inputs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    tokenizer: Any = "gpt2",
    *,
    field: str = "text",
    exts: Sequence[str] | None = None,
    split_on_blank_lines: bool = False,
    dev_fraction: float = 0.02,
    test_fraction: float = 0.02,
    seed: int = 0,
    max_docs: int | None = None,
    batch_rows: int = 1024,
    overwrite: bool = False,
    progress: Progress = True,
) -> Path:
    """Prepare text (`.txt`), JSONL or Parquet files as a dataset (FileSource)."""
    if kind not in FILE_SOURCES:
        raise UserError(f"unknown file kind {kind!r}; choose text, jsonl or parquet")
    source = FILE_SOURCES[kind](
        inputs=inputs,
        tokenizer=tokenizer,
        field=field,
        exts=exts,
        split_on_blank_lines=split_on_blank_lines,
        dev_fraction=dev_fraction,
        test_fraction=test_fraction,
        seed=seed,
        max_docs=max_docs,
        batch_rows=batch_rows,
    )
    return source.prepare(out_dir, overwrite=overwrite, progress=progress)
