"""Hugging Face datasets: a Hub name, a local data directory or a `save_to_disk` directory."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tango_lm.data.source import HeldOutSource, _limit
from tango_lm.data.splits import SPLIT_ALIASES
from tango_lm.errors import UserError, option
from tango_lm.progress_lines import LogLines, Progress

__all__ = ["HFSource", "load_hf_splits", "parse_split_map", "hf_documents", "prepare_hf"]

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


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _root_cause(e: BaseException) -> BaseException:
    """The innermost exception `e` was raised from (datasets wraps a bad file's ArrowInvalid in
    "An error occurred while generating the dataset")."""
    seen = {id(e)}
    while (inner := e.__cause__ or e.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        e = inner
    return e


def _hf_error(name: str, e: Exception, logged: list[str] | None = None) -> UserError:
    first = _first_line(e)
    if isinstance(e, ConnectionError) or type(e).__name__ in ("OfflineModeIsEnabled", "LocalEntryNotFoundError"):
        return UserError(
            f"cannot reach the Hugging Face Hub for dataset {name!r} ({first}); check the network, "
            "or prepare it once online so the datasets cache has it"
        )
    if type(e).__name__ in ("DatasetNotFoundError", "FileNotFoundError", "DataFilesNotFoundError"):
        return UserError(f"dataset {name!r} was not found on the Hub or on disk ({first}); check the name")
    return UserError(f"cannot load dataset {name!r}: {_detail(e, logged)}")


def _detail(e: BaseException, logged: list[str] | None) -> str:
    """What went wrong, in one line: the error `datasets` logged (only it names a bad file), else
    the innermost cause's first line."""
    return logged[-1] if logged else _first_line(_root_cause(e))


class _KeptErrors(logging.Handler):
    """The first lines of the error records it is handed (`_logged_errors`)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage().strip()
        self.lines.append(text.splitlines()[0] if text else record.levelname)


@contextlib.contextmanager
def _logged_errors(kept: _KeptErrors | None = None) -> Iterator[list[str]]:
    """The first lines of the errors `datasets` logs meanwhile (a bad file's name is only there),
    kept off stderr: the one error line says them. `kept`: a handler to reuse (one per reader: a
    read swaps it in and out, which costs no handler's creation per row)."""
    kept = kept if kept is not None else _KeptErrors()
    logger = logging.getLogger("datasets")
    handlers, propagate = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [kept], False
    try:
        yield kept.lines
    finally:
        logger.handlers, logger.propagate = handlers, propagate


@contextlib.contextmanager
def _quiet_hub(datasets: Any, progress: Progress) -> Iterator[None]:
    """No log lines from `datasets` / `huggingface_hub` (an offline Hub name logs a retry a second
    before the one error line) and their progress bars only with `progress` on a terminal. Parts a
    `datasets` module lacks (another version, a stand-in) are left alone."""
    loggers = [getattr(getattr(datasets, "utils", None), "logging", None)]
    try:
        import huggingface_hub.utils as hub

        loggers.append(hub.logging)
    except ImportError:
        pass
    loggers = [lg for lg in loggers if lg is not None and hasattr(lg, "get_verbosity")]
    was = [lg.get_verbosity() for lg in loggers]
    bars = getattr(datasets, "is_progress_bar_enabled", None)
    had_bars = bars() if bars else None
    for lg in loggers:
        lg.set_verbosity_error()
    if bars:
        (
            datasets.enable_progress_bars
            if progress is True and sys.stderr.isatty()
            else datasets.disable_progress_bars
        )()
    try:
        yield
    finally:
        for lg, level in zip(loggers, was, strict=True):
            lg.set_verbosity(level)
        if bars:
            (datasets.enable_progress_bars if had_bars else datasets.disable_progress_bars)()


def load_hf_splits(
    name: str,
    config: str | None = None,
    split_map: dict[str, str] | None = None,
    streaming: bool = True,
    revision: str | None = None,
    progress: Progress = False,
) -> dict[str, Any]:
    """Our split name -> a `datasets` split of `name` (a Hub name, a local data directory, or a
    `save_to_disk` directory). Without `split_map`: train, validation/valid/dev -> dev, test."""
    datasets = _import_datasets()
    with _quiet_hub(datasets, progress), _logged_errors() as logged:
        lines = LogLines() if progress == "lines" else None
        loaded = _load(datasets, name, config, streaming, revision, logged, lines)
    available = dict(loaded.items()) if hasattr(loaded, "keys") else {"train": loaded}
    if split_map:
        for theirs in split_map.values():
            if theirs not in available:
                raise UserError(
                    f"dataset {name!r} has no split {theirs!r} (splits: {', '.join(available)}); fix --split-map"
                )
        return {SPLIT_ALIASES.get(ours.lower(), ours): available[theirs] for ours, theirs in split_map.items()}
    out: dict[str, Any] = {}
    for theirs, ds in available.items():
        ours = SPLIT_ALIASES.get(theirs.lower())
        if ours and ours not in out:
            out[ours] = ds
    if not out:
        raise UserError(
            f"dataset {name!r} has splits {', '.join(available)} and none is train/validation/test; "
            f"map them with --split-map, e.g. train={next(iter(available))}"
        )
    return out


def _load(
    datasets: Any,
    name: str,
    config: str | None,
    streaming: bool,
    revision: str | None,
    logged: list[str],
    lines: LogLines | None = None,
) -> Any:
    """`datasets`' dataset (dict) for `name`: a `save_to_disk` directory, else `load_dataset`.
    `lines` (a log file): a line as a whole dataset's download and conversion starts and one as it
    ends, which can take hours without a word (the library's bars are for a terminal)."""
    local = Path(name).expanduser()
    try:
        if local.is_dir() and any((local / f).is_file() for f in ("dataset_dict.json", "state.json")):
            for flag, value in (("--config", config), ("--revision", revision)):
                if value is not None:  # load_from_disk has neither: the manifest would record one not applied
                    raise UserError(
                        f"{flag} {value} does not apply to {name}, a save_to_disk directory (it holds one "
                        f"configuration and no revisions); drop {flag}"
                    )
            loaded = datasets.load_from_disk(str(local))
            if streaming:
                loaded = (
                    {k: v.to_iterable_dataset() for k, v in loaded.items()}
                    if hasattr(loaded, "keys")
                    else loaded.to_iterable_dataset()
                )
            return loaded
        if lines is None or streaming:  # a stream reads as it tokenizes, whose lines say how far it is
            return datasets.load_dataset(name, config, revision=revision, streaming=streaming)
        what = name if config is None else f"{name} ({config})"
        lines.say(f"hf: downloading and converting {what}, whole (--streaming reads it as it tokenizes)")
        loaded = datasets.load_dataset(name, config, revision=revision, streaming=streaming)
        lines.due(force=True)
        lines.say(f"hf: loaded {what} in {lines.elapsed()}")
        return loaded
    except UserError:
        raise
    except Exception as e:  # datasets raises many types (ValueError for configs, ConnectionError, ...)
        raise _hf_error(name, e, logged) from None


def hf_documents(ds: Iterable[dict[str, Any]], field: str, where: str, local: bool = False) -> Iterator[str]:
    """The string `field` of each row of a `datasets` split. What fails while `datasets` reads (a
    dropped connection, a bad file of a local or streamed dataset) becomes one UserError."""
    rows, kept = iter(ds), _KeptErrors()
    i = -1
    while True:
        # datasets logs a bad file as it reads it: caught around each read only, never held while
        # this generator is suspended (two of them closed out of order would leave it swapped)
        with _logged_errors(kept) as logged:
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as e:  # datasets' readers raise many types (ArrowInvalid, ValueError, OSError, ...)
                if isinstance(e, ConnectionError) or (isinstance(e, OSError) and not local):
                    raise UserError(f"lost the connection while reading {where} ({e}); run the command again") from None
                raise UserError(f"cannot read {where}: {_detail(e, logged)}") from None
        i += 1
        value = row.get(field) if isinstance(row, dict) else None
        if not isinstance(value, str):
            if isinstance(row, dict) and field not in row:
                raise UserError(f"{where} has no field {field!r} (fields: {', '.join(row)}); choose one with --field")
            if value is None:
                continue
            raise UserError(f"{where}, row {i}: field {field!r} is not text; choose a text field with --field")
        if value.strip():
            yield value


@dataclass(kw_only=True)
class HFSource(HeldOutSource):
    """A Hugging Face dataset (e.g. HuggingFaceFW/fineweb-edu) as a dataset.

    `streaming=None` streams when `max_docs` is set (reads only what it needs) and otherwise lets
    `datasets` download and cache the whole dataset, so preparing it again reuses the cache.
    `max_docs` caps the documents read from each split; splits the dataset lacks are held out of
    train (splits.py).
    """

    name = "hf"
    help = "a Hugging Face dataset by name (needs pip install 'tango-lm[hf]')"

    dataset: str  # a Hub name, a local data directory or a `save_to_disk` directory
    config: str | None = None
    split_map: dict[str, str] | str | None = None  # ours -> theirs, or "train=train,dev=validation"
    field: str = "text"
    max_docs: int | None = None
    streaming: bool | None = None
    revision: str | None = None

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "name", help="Hub name (HuggingFaceFW/fineweb-edu), local data directory or save_to_disk directory"
        )
        cls.add_common_arguments(parser)
        parser.add_argument("--config", default=None, help="dataset configuration, e.g. sample-10BT")
        parser.add_argument("--split-map", default=None, help="OURS=THEIRS pairs, e.g. train=train,dev=validation")
        parser.add_argument("--field", default="text", help="the column holding the text (default %(default)s)")
        parser.add_argument("--max-docs", type=int, default=None, help="read at most N documents per split")
        parser.add_argument(
            "--streaming",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="stream instead of downloading and caching (default: stream when --max-docs is set)",
        )
        parser.add_argument("--revision", default=None, help="a Hub branch, tag or commit to pin (default: main)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HFSource:
        return cls(
            dataset=args.name,
            config=args.config,
            split_map=args.split_map,
            field=args.field,
            max_docs=args.max_docs,
            streaming=args.streaming,
            revision=args.revision,
            **cls.common_options(args),
        )

    def check(self) -> None:
        super().check()
        if self.max_docs is not None and self.max_docs < 1:
            raise UserError(f"{option('max_docs')} must be at least 1, got {self.max_docs}; omit it to read everything")
        split_map = self.split_map
        self._split_map = parse_split_map(split_map) if isinstance(split_map, str) else split_map
        ours = [SPLIT_ALIASES.get(name.lower()) for name in self._split_map or {}]
        for name, split in zip(self._split_map or {}, ours, strict=True):
            if split is None:
                raise UserError(
                    f"--split-map names our split {name!r}; the splits are train, dev (or validation, valid, val) and test"
                )
            if ours.count(split) > 1:  # the later would replace the earlier, its documents lost
                raise UserError(
                    f"--split-map maps the dataset's splits to our split {split!r} twice; give each of ours one split"
                )
        theirs = list((self._split_map or {}).values())
        shared = sorted({t for t in theirs if theirs.count(t) > 1})
        if shared:  # a test split that is the train split would report the NLL of training text
            raise UserError(
                f"--split-map maps two of our splits to the dataset's split {shared[0]!r}; give each its own split"
            )

    @property
    def streams(self) -> bool:
        return self.max_docs is not None if self.streaming is None else self.streaming

    def read(self, tokenizer: Any, out_dir: Path, progress: Progress) -> dict[str, Iterable[str]]:
        name = self.dataset
        self._loaded = load_hf_splits(
            name, self.config, self._split_map, streaming=self.streams, revision=self.revision, progress=progress
        )
        local = Path(name).expanduser().exists()
        own = {
            s: _limit(hf_documents(ds, self.field, f"split {s!r} of dataset {name!r}", local), self.max_docs)
            for s, ds in self._loaded.items()
        }
        return self.held_out_splits(own, out_dir)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "name": "hf",
            "dataset": self.dataset,
            "config": self.config,
            "revision": self.revision,
            "split_map": self._split_map,
            "own_splits": sorted(self._loaded),
            "field": self.field,
            "max_docs": self.max_docs,
            "streaming": self.streams,
            "datasets_version": getattr(_import_datasets(), "__version__", None),
            **self.held_out_record(),
        }


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
    progress: Progress = True,
) -> Path:
    """Prepare the Hugging Face dataset `name` as a dataset (HFSource)."""
    source = HFSource(
        dataset=name,
        tokenizer=tokenizer,
        config=config,
        split_map=split_map,
        field=field,
        max_docs=max_docs,
        streaming=streaming,
        revision=revision,
        dev_fraction=dev_fraction,
        test_fraction=test_fraction,
        seed=seed,
    )
    return source.prepare(out_dir, overwrite=overwrite, progress=progress)
