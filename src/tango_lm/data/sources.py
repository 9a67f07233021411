"""Document sources: text, JSONL and Parquet files, code trees and Hugging Face datasets.

Every source is a stream of documents (strings) that `write_prepared` tokenizes into shards;
nothing here holds a corpus in memory (one file, one Parquet row batch, or one spilled line at a
time).

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

import glob
import gzip
import hashlib
import io
import json
import os
import re
import sysconfig
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tango_lm.errors import UserError

__all__ = [
    "SPLITS",
    "SOURCE_NAMES",
    "split_of",
    "hold_out",
    "assemble_splits",
    "expand_inputs",
    "split_inputs",
    "text_documents",
    "jsonl_documents",
    "parquet_documents",
    "file_documents",
    "code_documents",
    "stdlib_path",
    "prepare_files",
    "prepare_code",
    "prepare_hf",
    "load_hf_splits",
    "parse_split_map",
    "prepare_source",
]

SPLITS = ("train", "dev", "test")
SPLIT_ALIASES = {"train": "train", "dev": "dev", "validation": "dev", "valid": "dev", "val": "dev", "test": "test"}
# Sources `prepare_source` knows (mixtures and Lean live in their own modules).
SOURCE_NAMES = ("text", "jsonl", "parquet", "code", "lean", "hf", "mixture")
DEFAULT_EXTS = {"text": (".txt",), "jsonl": (".jsonl", ".jsonl.gz"), "parquet": (".parquet",)}
# Always skipped in code trees (installed packages are not the tree's own code), and tests unless asked.
CODE_ALWAYS_EXCLUDED = ("site-packages", "dist-packages", "__pycache__", "node_modules")
CODE_TEST_DIRS = ("test", "tests")
_GLOB_CHARS = re.compile(r"[*?\[]")
_SPLIT_ENTRY = re.compile(r"^(train|dev|validation|valid|val|test)(?:[-_.].*)?$", re.IGNORECASE)
_SPLIT_ARG = re.compile(r"^([A-Za-z][A-Za-z0-9_.-]*)=(.+)$")


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
            raise UserError(f"{name} must be in [0, 1), got {f}; pick e.g. 0.02")
    if dev_fraction + test_fraction >= 1:
        raise UserError(f"dev_fraction + test_fraction must be below 1, got {dev_fraction + test_fraction}; "
                        "lower them")


class _SpillSplitter:
    """One pass over `docs`: the split read first streams through, the others spill to temp files."""

    def __init__(self, docs: Iterable[str], names: Sequence[str], assign: Callable[[str], str],
                 spill_dir: str | os.PathLike | None = None) -> None:
        self.docs, self.names, self.assign, self.spill_dir = docs, list(names), assign, spill_dir
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
        self._dir = tempfile.TemporaryDirectory(prefix=".tango-lm-spill-", dir=self.spill_dir)
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


def hold_out(docs: Iterable[str], dev_fraction: float, test_fraction: float, seed: int = 0,
             keep: Sequence[str] = (), spill_dir: str | os.PathLike | None = None) -> dict[str, Iterator[str]]:
    """Split one document stream into train/dev/test by document hash (module docstring), in one pass.

    Splits in `keep` are not held out (the source supplies them); neither are splits with fraction 0.
    The splits read after the first are spilled to a temporary directory in `spill_dir`.
    """
    fractions = {"dev": dev_fraction, "test": test_fraction}
    names = ["train"] + [s for s, f in fractions.items() if f > 0 and s not in keep]
    dev = dev_fraction if "dev" in names else 0.0
    test = test_fraction if "test" in names else 0.0
    splitter = _SpillSplitter(docs, names, lambda d: split_of(d, dev, test, seed), spill_dir)
    return {n: splitter.stream(n) for n in names}


def assemble_splits(own: dict[str, Iterable[str]], dev_fraction: float, test_fraction: float,
                    seed: int = 0, spill_dir: str | os.PathLike | None = None) -> dict[str, Iterable[str]]:
    """Splits for `write_prepared`: the source's own splits, plus dev/test held out of train when missing.

    `own` maps split names to documents; an unsplit source passes `{"train": docs}`.
    """
    _check_fractions(dev_fraction, test_fraction)
    if "train" not in own:
        raise UserError(f"the source has splits {', '.join(own)} but no train split; give one "
                        "(e.g. train=PATH)")
    missing = [s for s in ("dev", "test") if s not in own]
    if not missing:
        return dict(own)
    held = hold_out(own["train"], dev_fraction, test_fraction, seed, keep=[s for s in own if s != "train"],
                    spill_dir=spill_dir)
    out: dict[str, Iterable[str]] = {"train": held["train"]}
    for s in ("dev", "test"):
        if s in own:
            out[s] = own[s]
        elif s in held:
            out[s] = held[s]
    out.update({s: d for s, d in own.items() if s not in out})
    return out


# -- inputs -----------------------------------------------------------------------------------
def _has_ext(path: Path, exts: Sequence[str]) -> bool:
    name = path.name.lower()
    return any(name.endswith(e.lower()) for e in exts)


def _walk(root: Path, exts: Sequence[str], exclude_dirs: Sequence[str] = ()) -> Iterator[Path]:
    """Files under `root` with one of `exts`, in sorted order; hidden entries and `exclude_dirs` skipped."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in exclude_dirs)
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if not f.startswith(".") and _has_ext(p, exts) and p.is_file():
                yield p


def expand_inputs(inputs: Sequence[str | os.PathLike], exts: Sequence[str],
                  exclude_dirs: Sequence[str] = ()) -> list[Path]:
    """Files named by `inputs` (files, directories walked recursively for `exts`, glob patterns), in order.

    Raises UserError for an input that does not exist, or when nothing matches.
    """
    if not inputs:
        raise UserError("no input files given; name files, directories or glob patterns")
    files: list[Path] = []
    for item in inputs:
        text = str(item)
        p = Path(text).expanduser()
        if p.is_dir():
            found = list(_walk(p, exts, exclude_dirs))
        elif p.is_file():
            found = [p]
        elif _GLOB_CHARS.search(text):
            found = []
            for m in sorted(glob.glob(str(p), recursive=True)):
                mp = Path(m)
                found.extend(_walk(mp, exts, exclude_dirs) if mp.is_dir() else [mp] if mp.is_file() else [])
        else:
            raise UserError(f"input {text} does not exist; check the path")
        if not found:
            raise UserError(f"no {'/'.join(exts)} files at {text}; check the path or pass --ext")
        files.extend(found)
    return list(dict.fromkeys(files))


def split_inputs(inputs: Sequence[str | os.PathLike], exts: Sequence[str]) -> dict[str, list[str]]:
    """Group inputs by the split they belong to (module docstring); `{"train": inputs}` when unsplit.

    `SPLIT=PATH` inputs name their split (validation/valid/val mean dev); otherwise a single input
    directory whose top-level entries are named after splits provides them.
    """
    items = [str(i) for i in inputs]
    explicit = [_SPLIT_ARG.match(i) for i in items]
    if any(m and not Path(i).exists() for m, i in zip(explicit, items, strict=True)):
        out: dict[str, list[str]] = {}
        for m, i in zip(explicit, items, strict=True):
            if m is None or Path(i).exists():
                raise UserError(f"input {i} has no split; when one input is SPLIT=PATH, write all of them so")
            out.setdefault(SPLIT_ALIASES.get(m.group(1).lower(), m.group(1)), []).append(m.group(2))
        return out
    if len(items) == 1 and Path(items[0]).is_dir():
        out, others = {}, []
        for entry in sorted(Path(items[0]).iterdir()):
            if entry.name.startswith(".") or not (entry.is_dir() or _has_ext(entry, exts)):
                continue
            m = _SPLIT_ENTRY.match(entry.name)
            if m:
                out.setdefault(SPLIT_ALIASES[m.group(1).lower()], []).append(str(entry))
            else:
                others.append(entry.name)
        if "train" in out and len(out) > 1:
            if others:
                raise UserError(f"{items[0]} has split entries ({', '.join(out)}) and also {', '.join(others)}; "
                                "move those away or name each input as SPLIT=PATH")
            return out
    return {"train": items}


# -- readers ----------------------------------------------------------------------------------
def _open_text(path: Path) -> io.TextIOBase:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


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
            raise UserError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it or leave it out") from None
        except OSError as e:
            raise UserError(f"cannot read {path} ({e.strerror or e}); check the file") from None


def jsonl_documents(files: Iterable[Path], field: str = "text") -> Iterator[str]:
    """The string `field` of every JSON object, one object per line (`.gz` files are decompressed)."""
    for path in files:
        try:
            with _open_text(path) as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except ValueError as e:
                        raise UserError(f"{path}, line {lineno}: not valid JSON ({e}); fix or remove that line") from None
                    value = row.get(field, None) if isinstance(row, dict) else None
                    if not isinstance(value, str):
                        what = "has no field" if not isinstance(row, dict) or field not in row else "has a non-string"
                        raise UserError(f"{path}, line {lineno}: the object {what} {field!r}; "
                                        "choose the text field with --field")
                    if value.strip():
                        yield value
        except UnicodeDecodeError as e:
            raise UserError(f"{path} is not UTF-8 text ({e.reason}); convert it to UTF-8") from None
        except (OSError, EOFError) as e:
            raise UserError(f"cannot read {path} ({e}); check the file") from None


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
            raise UserError(f"the Parquet file {path} has no column {field!r} (columns: {', '.join(names)}); "
                            "choose one with --field")
        kind = pf.schema_arrow.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise UserError(f"column {field!r} of {path} holds {kind}, not text; choose a text column with --field")
        try:
            for batch in pf.iter_batches(batch_size=batch_rows, columns=[field]):
                for value in batch.column(0).to_pylist():
                    if value is not None and value.strip():
                        yield value
        except (OSError, pa.ArrowException) as e:
            raise UserError(f"cannot read the Parquet file {path} ({e}); check the file") from None


def file_documents(kind: str, files: Iterable[Path], field: str = "text", split_on_blank_lines: bool = False,
                   batch_rows: int = 1024) -> Iterator[str]:
    """Documents of `files` read as `kind` ("text", "jsonl" or "parquet")."""
    if kind == "text":
        return text_documents(files, split_on_blank_lines)
    if kind == "jsonl":
        return jsonl_documents(files, field)
    if kind == "parquet":
        return parquet_documents(files, field, batch_rows)
    raise UserError(f"unknown file kind {kind!r}; choose text, jsonl or parquet")


_COMMENT = {".py": "#", ".sh": "#", ".rb": "#", ".pl": "#", ".r": "#", ".yaml": "#", ".yml": "#", ".toml": "#",
            ".lean": "--", ".hs": "--", ".sql": "--", ".lua": "--"}


def stdlib_path() -> Path:
    """Python's standard library directory, the default code tree (about 12 MB of `.py` without tests)."""
    return Path(sysconfig.get_paths()["stdlib"])


def code_documents(roots: Sequence[str | os.PathLike], exts: Sequence[str] = (".py",),
                   exclude_dirs: Sequence[str] = CODE_ALWAYS_EXCLUDED + CODE_TEST_DIRS, max_bytes: int = 1 << 20,
                   path_header: bool = False, stats: dict[str, int] | None = None) -> Iterator[str]:
    """One document per source file under `roots`, walked in sorted order.

    Skipped (and counted in `stats`): files over `max_bytes`, binary files (a NUL byte) and files
    that are not UTF-8. With `path_header` each document starts with a comment naming the file's
    path relative to its root (`# path: pkg/mod.py`; `//` or `--` where the language wants it).
    """
    stats = stats if stats is not None else {}
    for key in ("files", "skipped_large", "skipped_binary", "skipped_undecodable"):
        stats.setdefault(key, 0)
    for root in roots:
        root_path = Path(root).expanduser()
        if not root_path.exists():
            raise UserError(f"input {root} does not exist; check the path")
        files = [root_path] if root_path.is_file() else _walk(root_path, exts, exclude_dirs)
        for path in files:
            try:
                if path.stat().st_size > max_bytes:
                    stats["skipped_large"] += 1
                    continue
                data = path.read_bytes()
            except OSError:
                stats["skipped_undecodable"] += 1
                continue
            if b"\0" in data:
                stats["skipped_binary"] += 1
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                stats["skipped_undecodable"] += 1
                continue
            if not text.strip():
                continue
            stats["files"] += 1
            if path_header:
                rel = path.name if path == root_path else path.relative_to(root_path).as_posix()
                comment = next((c for e, c in _COMMENT.items() if path.name.lower().endswith(e)), "//")
                text = f"{comment} path: {rel}\n{text}"
            yield text


# -- prepare ----------------------------------------------------------------------------------
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
    progress: bool = True,
) -> Path:
    """Prepare text (`.txt`), JSONL or Parquet files as a dataset (splits: module docstring).

    `inputs` are files, directories (walked for `exts`), glob patterns or `SPLIT=PATH` items;
    `max_docs` caps the documents read from each of the source's splits.
    """
    from tango_lm.data.shards import check_writable, write_prepared

    if kind not in ("text", "jsonl", "parquet"):
        raise UserError(f"unknown file kind {kind!r}; choose text, jsonl or parquet")
    _check_fractions(dev_fraction, test_fraction)
    if max_docs is not None and max_docs < 1:
        raise UserError(f"max_docs must be at least 1, got {max_docs}; omit it to read everything")
    exts = tuple(exts or DEFAULT_EXTS[kind])
    tok = _tokenizer(tokenizer)
    check_writable(out_dir, overwrite)
    groups = split_inputs(inputs, exts)
    files = {s: expand_inputs(paths, exts) for s, paths in groups.items()}  # fail on missing paths now
    own = {s: _limit(file_documents(kind, f, field, split_on_blank_lines, batch_rows), max_docs)
           for s, f in files.items()}
    splits = assemble_splits(own, dev_fraction, test_fraction, seed, _spill_dir(out_dir))
    source = {"name": kind, "inputs": [str(i) for i in inputs], "files": {s: len(f) for s, f in files.items()},
              "own_splits": sorted(groups), "field": field if kind != "text" else None,
              "split_on_blank_lines": split_on_blank_lines if kind == "text" else None,
              "dev_fraction": dev_fraction, "test_fraction": test_fraction, "seed": seed, "max_docs": max_docs}
    return write_prepared(out_dir, tok, splits, source, progress=progress, overwrite=overwrite)


def prepare_code(
    inputs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    tokenizer: Any = "gpt2",
    *,
    exts: Sequence[str] = (".py",),
    include_tests: bool = False,
    exclude_dirs: Sequence[str] = (),
    max_bytes: int = 1 << 20,
    path_header: bool = False,
    dev_fraction: float = 0.02,
    test_fraction: float = 0.02,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Prepare source trees (default: Python's standard library) as a dataset, one document per file.

    Directories named in `exclude_dirs`, in CODE_ALWAYS_EXCLUDED, and test/tests (unless
    `include_tests`) are skipped, as are hidden ones. Files are held out to dev/test by the hash
    of their text (module docstring).
    """
    from tango_lm.data.shards import check_writable, write_prepared

    _check_fractions(dev_fraction, test_fraction)
    roots = [str(i) for i in inputs] or [str(stdlib_path())]
    exclude_dirs = (*CODE_ALWAYS_EXCLUDED, *(() if include_tests else CODE_TEST_DIRS), *exclude_dirs)
    tok = _tokenizer(tokenizer)
    check_writable(out_dir, overwrite)
    for r in roots:
        root = Path(r).expanduser()
        if not root.exists():
            raise UserError(f"input {r} does not exist; check the path")
        if root.is_dir() and next(_walk(root, exts, exclude_dirs), None) is None:
            raise UserError(f"no {'/'.join(exts)} files under {r}; check the path or --ext")
    stats: dict[str, int] = {}
    docs = code_documents(roots, exts, exclude_dirs, max_bytes, path_header, stats)
    splits = assemble_splits({"train": docs}, dev_fraction, test_fraction, seed, _spill_dir(out_dir))
    # `stats` is filled while the documents stream and is serialized with the manifest at the end.
    source = {"name": "code", "roots": roots, "exts": list(exts), "exclude_dirs": list(exclude_dirs),
              "max_bytes": max_bytes, "path_header": path_header, "dev_fraction": dev_fraction,
              "test_fraction": test_fraction, "seed": seed, "stats": stats}
    return write_prepared(out_dir, tok, splits, source, progress=progress, overwrite=overwrite)


# -- Hugging Face datasets --------------------------------------------------------------------
_HF_HINT = "install it with pip install 'tango-lm[hf]'"


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise UserError(f"Hugging Face datasets need the package `datasets`; {_HF_HINT}") from None
    return datasets


def parse_split_map(text: str | None) -> dict[str, str] | None:
    """`"train=train,dev=validation"` -> {"train": "train", "dev": "validation"} (ours = theirs)."""
    if not text:
        return None
    out: dict[str, str] = {}
    for item in text.split(","):
        ours, sep, theirs = item.strip().partition("=")
        if not sep or not ours.strip() or not theirs.strip():
            raise UserError(f"bad --split-map item {item!r}; write OURS=THEIRS pairs, e.g. train=train,dev=validation")
        out[ours.strip()] = theirs.strip()
    return out


def _hf_error(name: str, e: Exception) -> UserError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, ConnectionError) or type(e).__name__ in ("OfflineModeIsEnabled", "LocalEntryNotFoundError"):
        return UserError(f"cannot reach the Hugging Face Hub for dataset {name!r} ({first}); check the network, "
                         "or prepare it once online so the datasets cache has it")
    if type(e).__name__ in ("DatasetNotFoundError", "FileNotFoundError", "DataFilesNotFoundError"):
        return UserError(f"dataset {name!r} was not found on the Hub or on disk ({first}); check the name")
    return UserError(f"cannot load dataset {name!r}: {first}")


def load_hf_splits(name: str, config: str | None = None, split_map: dict[str, str] | None = None,
                   streaming: bool = True, revision: str | None = None) -> dict[str, Any]:
    """Our split name -> a `datasets` split of `name` (a Hub name, a local data directory, or a
    `save_to_disk` directory). Without `split_map`: train, validation/valid/dev -> dev, test."""
    datasets = _import_datasets()
    local = Path(name).expanduser()
    try:
        if local.is_dir() and any((local / f).is_file() for f in ("dataset_dict.json", "state.json")):
            loaded = datasets.load_from_disk(str(local))
            if streaming:
                loaded = ({k: v.to_iterable_dataset() for k, v in loaded.items()} if hasattr(loaded, "keys")
                          else loaded.to_iterable_dataset())
        else:
            loaded = datasets.load_dataset(name, config, revision=revision, streaming=streaming)
    except UserError:
        raise
    except Exception as e:  # datasets raises many types (ValueError for configs, ConnectionError, ...)
        raise _hf_error(name, e) from None
    available = dict(loaded.items()) if hasattr(loaded, "keys") else {"train": loaded}
    if split_map:
        for theirs in split_map.values():
            if theirs not in available:
                raise UserError(f"dataset {name!r} has no split {theirs!r} (splits: {', '.join(available)}); "
                                "fix --split-map")
        return {SPLIT_ALIASES.get(ours, ours): available[theirs] for ours, theirs in split_map.items()}
    out: dict[str, Any] = {}
    for theirs, ds in available.items():
        ours = SPLIT_ALIASES.get(theirs.lower())
        if ours and ours not in out:
            out[ours] = ds
    if not out:
        raise UserError(f"dataset {name!r} has splits {', '.join(available)} and none is train/validation/test; "
                        "map them with --split-map, e.g. train={next(iter(available))}")
    return out


def hf_documents(ds: Iterable[dict[str, Any]], field: str, where: str) -> Iterator[str]:
    """The string `field` of each row of a `datasets` split; network failures become UserError."""
    try:
        for i, row in enumerate(ds):
            value = row.get(field) if isinstance(row, dict) else None
            if not isinstance(value, str):
                if isinstance(row, dict) and field not in row:
                    raise UserError(f"{where} has no field {field!r} (fields: {', '.join(row)}); choose one with --field")
                if value is None:
                    continue
                raise UserError(f"{where}, row {i}: field {field!r} is not text; choose a text field with --field")
            if value.strip():
                yield value
    except (ConnectionError, OSError) as e:
        raise UserError(f"lost the connection while reading {where} ({e}); run the command again") from None


def prepare_hf(
    name: str,
    out_dir: str | os.PathLike,
    tokenizer: Any = "gpt2",
    *,
    config: str | None = None,
    split_map: dict[str, str] | str | None = None,
    field: str = "text",
    max_docs: int | None = None,
    streaming: bool | None = None,
    revision: str | None = None,
    dev_fraction: float = 0.02,
    test_fraction: float = 0.02,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Prepare a Hugging Face dataset (e.g. HuggingFaceFW/fineweb-edu) as a dataset.

    `streaming=None` streams when `max_docs` is set (reads only what it needs) and otherwise lets
    `datasets` download and cache the whole dataset, so preparing it again reuses the cache.
    `max_docs` caps the documents read from each split; splits the dataset lacks are held out of
    train (module docstring).
    """
    from tango_lm.data.shards import check_writable, write_prepared

    _check_fractions(dev_fraction, test_fraction)
    if max_docs is not None and max_docs < 1:
        raise UserError(f"max_docs must be at least 1, got {max_docs}; omit it to read everything")
    if isinstance(split_map, str):
        split_map = parse_split_map(split_map)
    streaming = max_docs is not None if streaming is None else streaming
    tok = _tokenizer(tokenizer)
    check_writable(out_dir, overwrite)
    loaded = load_hf_splits(name, config, split_map, streaming=streaming, revision=revision)
    own = {s: _limit(hf_documents(ds, field, f"split {s!r} of dataset {name!r}"), max_docs)
           for s, ds in loaded.items()}
    splits = assemble_splits(own, dev_fraction, test_fraction, seed, _spill_dir(out_dir))
    source = {"name": "hf", "dataset": name, "config": config, "revision": revision,
              "split_map": split_map, "own_splits": sorted(loaded), "field": field, "max_docs": max_docs,
              "streaming": streaming, "datasets_version": getattr(_import_datasets(), "__version__", None),
              "dev_fraction": dev_fraction, "test_fraction": test_fraction, "seed": seed}
    return write_prepared(out_dir, tok, splits, source, progress=progress, overwrite=overwrite)


def prepare_source(name: str, *args: Any, **kwargs: Any) -> Path:
    """Prepare a dataset from the source called `name` (one of SOURCE_NAMES); arguments as that source's."""
    if name in ("text", "jsonl", "parquet"):
        return prepare_files(name, *args, **kwargs)
    if name == "code":
        return prepare_code(*args, **kwargs)
    if name == "lean":
        from tango_lm.data.lean import prepare_lean

        return prepare_lean(*args, **kwargs)
    if name == "hf":
        return prepare_hf(*args, **kwargs)
    if name == "mixture":
        from tango_lm.data.mixture import prepare_mixture

        return prepare_mixture(*args, **kwargs)
    raise UserError(f"unknown data source {name!r}; choose one of: {', '.join(SOURCE_NAMES)}, dmmath")
