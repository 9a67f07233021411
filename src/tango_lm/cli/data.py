"""Datasets: `data prepare`, `data train-tokenizer` and `data verify`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tango_lm.cli.output import JSON_HELP, NO_PROGRESS_HELP, _print_json, command_progress
from tango_lm.errors import counted, path_arg


def cmd_data_prepare(args: argparse.Namespace) -> None:
    """`data prepare SOURCE ...`: the registered source (data/sources.py) the arguments describe."""
    from tango_lm.data.dataset_dir import hold_dataset_lock
    from tango_lm.data.shards import PreparedDataset
    from tango_lm.data.sources import SOURCES

    with hold_dataset_lock(args.out):  # a second writer stops now, not after the input is read or generated
        source = SOURCES[args.source].from_args(args)
        # lines without a terminal (a batch job's log): tokenizing a large corpus takes hours
        path = source.prepare(args.out, overwrite=args.overwrite, progress=command_progress(args))
    # The fractions' flags are named only where the source has them (a mixture, DM Math: not).
    print_prepared(PreparedDataset.open(path), fractions=hasattr(args, "dev_fraction"))
    for line in source.summary():
        print(line)
    for line in source.warnings():
        print(f"warning: {line}", file=sys.stderr)


def print_prepared(ds: Any, fractions: bool = True) -> None:
    """Each split's size, and a warning for a dev or test split without documents."""
    sizes = ", ".join(
        f"{s} {counted(ds.num_documents(s), 'document')} ({counted(ds.num_tokens(s), 'token')})" for s in ds.splits
    )
    print(f"prepared {ds.path}: {sizes}")
    for split in ("dev", "test"):  # what `tango-lm train` scores by default
        if split not in ds.splits or not ds.num_documents(split):
            hint = f"more documents or a larger --{split}-fraction" if fractions else f"sources with {split} documents"
            print(
                f"warning: the {split} split has no documents, and training scores {split} windows; give {hint}",
                file=sys.stderr,
            )


def cmd_data_verify(args: argparse.Namespace) -> None:
    """`data verify DIR`: re-read every shard of a prepared dataset against its manifest."""
    from tango_lm.data.verify import verify_dataset

    report = verify_dataset(args.dir, progress=command_progress(args))
    if args.json:
        _print_json(report)
        return
    splits = ", ".join(f"{name} {v['tokens']:,}" for name, v in report["splits"].items())
    print(
        f"verified {report['path']}: {counted(report['shards'], 'shard')}, "
        f"{counted(report['tokens'], 'token')} ({splits}), "
        f"{counted(report['documents'], 'document')}; checksums, end-of-text ids and token ids match the manifest"
    )


def cmd_data_train_tokenizer(args: argparse.Namespace) -> None:
    from tango_lm.data.bpe import TRAIN_EXTS, train_bpe
    from tango_lm.data.code_trees import CODE_ALWAYS_EXCLUDED

    tok = train_bpe(
        args.input,
        args.vocab_size,
        args.out,
        field=args.field,
        exts=args.ext or TRAIN_EXTS,
        min_frequency=args.min_frequency,
        max_docs=args.max_docs,
        exclude_dirs=(*CODE_ALWAYS_EXCLUDED, *args.exclude_dir),
        overwrite=args.overwrite,
        progress=command_progress(args),
    )
    print(
        f"trained a BPE tokenizer with {tok.vocab_size} ids (end-of-text {tok.eot_id}): {args.out}; "
        f"use it with --tokenizer bpe:{args.out}"
    )


def _add_train_tokenizer_parser(dsub: Any) -> None:
    t = dsub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on files")
    t.add_argument("--input", nargs="+", required=True, help="files, directories or glob patterns")
    t.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        help="ids in the tokenizer, end-of-text included (257 to 2**24); fewer when the corpus has too few distinct merges",
    )
    t.add_argument("--out", required=True, type=path_arg, help="tokenizer JSON to write, e.g. tokenizer.json")
    t.add_argument("--field", default="text", help="JSONL/Parquet field holding the text")
    t.add_argument("--ext", action="append", help="file extensions read from directories (repeatable)")
    t.add_argument(
        "--exclude-dir",
        action="append",
        default=[],
        help="directory name or pattern (*_test) not to walk (repeatable; site-packages, dist-packages, __pycache__ and node_modules never are)",
    )
    t.add_argument(
        "--min-frequency", type=int, default=2, help="merge only pairs seen this often (default %(default)s)"
    )
    t.add_argument("--max-docs", type=int, default=None, help="train on at most N documents (default: all)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    t.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    t.set_defaults(func=cmd_data_train_tokenizer, outlives_reader=True)


def add_parsers(sub: Any) -> None:
    """`data prepare SOURCE`, `data train-tokenizer`, `data verify`."""
    from tango_lm.data.sources import SOURCES

    s = sub.add_parser("data", help="prepare datasets")
    dsub = s.add_subparsers(dest="data_command", required=True)
    d = dsub.add_parser("prepare", help="prepare a dataset")
    dsrc = d.add_subparsers(dest="source", required=True)
    for name, source in SOURCES.items():
        t = dsrc.add_parser(name, help=source.help)
        source.add_arguments(t)
        t.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)  # every source alike
        t.set_defaults(func=cmd_data_prepare, outlives_reader=True)
    _add_train_tokenizer_parser(dsub)
    v = dsub.add_parser(
        "verify",
        help="check every shard of a prepared dataset against its manifest (sha256, end-of-text ids, token ids)",
    )
    v.add_argument("dir", help="prepared dataset directory")
    v.add_argument("--json", action="store_true", help=JSON_HELP)
    v.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    v.set_defaults(func=cmd_data_verify)
