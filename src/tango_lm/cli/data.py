"""Datasets: `data prepare`, `data train-tokenizer` and `data verify`."""

from __future__ import annotations

import argparse
from typing import Any

from tango_lm.cli.output import _print_json


def cmd_data_prepare(args: argparse.Namespace) -> None:
    from tango_lm.data.dmmath import prepare_dmmath
    from tango_lm.data.shards import hold_dataset_lock

    with hold_dataset_lock(args.out):  # a second writer stops now, not after the data is generated
        path = prepare_dmmath(
            args.out, tokenizer=args.tokenizer, train_per_module=args.train_per_module,
            test_per_module=args.test_per_module, dev_fraction=args.dev_fraction, seed=args.seed,
            include_extrapolate=args.extrapolate, workers=args.workers, overwrite=args.overwrite,
        )
    print(f"prepared {path}")


def _prepare_common(args: argparse.Namespace) -> dict[str, Any]:
    return {"tokenizer": args.tokenizer, "dev_fraction": args.dev_fraction, "test_fraction": args.test_fraction,
            "seed": args.seed, "overwrite": args.overwrite, "progress": not args.no_progress}


def cmd_data_prepare_source(args: argparse.Namespace) -> None:
    """`data prepare text|jsonl|parquet|code|lean|hf`: the library's prepare function for that source."""
    from tango_lm.data.shards import hold_dataset_lock

    with hold_dataset_lock(args.out):  # a second writer stops now, not after the input is read
        path = _prepare_source(args)
    print(f"prepared {path}")


def _prepare_source(args: argparse.Namespace) -> Any:
    from tango_lm.data.code_trees import stdlib_path
    from tango_lm.data.sources import prepare_source

    common = _prepare_common(args)
    if args.source in ("text", "jsonl", "parquet"):
        path = prepare_source(args.source, args.inputs, args.out, field=args.field, exts=args.ext,
                              split_on_blank_lines=args.split_on_blank_lines, max_docs=args.max_docs, **common)
    elif args.source == "code":
        inputs = [*args.inputs, *([str(stdlib_path())] if args.stdlib else [])]
        path = prepare_source("code", inputs, args.out, exts=args.ext or [".py"], max_bytes=args.max_file_bytes,
                              include_tests=args.include_tests, exclude_dirs=args.exclude_dir,
                              path_header=args.path_header, **common)
    elif args.source == "lean":
        path = prepare_source("lean", args.inputs, args.out, proof_weight=args.proof_weight, **common)
    else:
        path = prepare_source("hf", args.name, args.out, config=args.config, split_map=args.split_map,
                              field=args.field, max_docs=args.max_docs, streaming=args.streaming,
                              revision=args.revision, **common)
    return path


def cmd_data_prepare_mixture(args: argparse.Namespace) -> None:
    from tango_lm.data.mixture import prepare_mixture
    from tango_lm.data.shards import hold_dataset_lock

    with hold_dataset_lock(args.out):
        path = prepare_mixture(args.out, args.source_dirs, tokens=args.tokens, seed=args.seed,
                               overwrite=args.overwrite, progress=not args.no_progress)
    print(f"prepared {path}")


def cmd_data_verify(args: argparse.Namespace) -> None:
    """`data verify DIR`: re-read every shard of a prepared dataset against its manifest."""
    from tango_lm.data.verify import verify_dataset

    report = verify_dataset(args.dir)
    if args.json:
        _print_json(report)
        return
    splits = ", ".join(f"{name} {v['tokens']:,}" for name, v in report["splits"].items())
    print(f"verified {report['path']}: {report['shards']} shards, {report['tokens']:,} tokens ({splits}), "
          f"{report['documents']:,} documents; checksums, end-of-text ids and token ids match the manifest")


def cmd_data_train_tokenizer(args: argparse.Namespace) -> None:
    from tango_lm.data.bpe import TRAIN_EXTS, train_bpe

    tok = train_bpe(args.input, args.vocab_size, args.out, field=args.field, exts=args.ext or TRAIN_EXTS,
                    min_frequency=args.min_frequency, max_docs=args.max_docs, overwrite=args.overwrite,
                    progress=not args.no_progress)
    print(f"trained a BPE tokenizer with {tok.vocab_size} ids (end-of-text {tok.eot_id}): {args.out}; "
          f"use it with --tokenizer bpe:{args.out}")


def _prepare_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", default="gpt2", help="gpt2, byte, or bpe:PATH (data train-tokenizer)")
    p.add_argument("--dev-fraction", type=float, default=0.02,
                   help="share of documents held out as dev by document hash when the source has no dev split")
    p.add_argument("--test-fraction", type=float, default=0.02, help="the same for test")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out split hash")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def _add_source_parsers(dsrc: Any) -> None:
    """`data prepare` sources other than dmmath (tango_lm.data.sources, lean, mixture)."""
    inputs_help = "files, directories, glob patterns, or SPLIT=PATH (train=a dev=b); a directory with " \
                  "train*/validation*/test* entries keeps its splits"
    for name, help_text, ext in (("text", "plain-text files (one document per file)", ".txt"),
                                 ("jsonl", "JSON Lines files, one document per line", ".jsonl, .jsonl.gz, .json"),
                                 ("parquet", "Parquet files, read in row batches", ".parquet")):
        t = dsrc.add_parser(name, help=help_text)
        t.add_argument("inputs", nargs="+", help=inputs_help)
        _prepare_options(t)
        t.add_argument("--ext", action="append", help=f"file extension read from directories (default {ext})")
        t.add_argument("--field", default="text", help="JSONL/Parquet field holding the text")
        t.add_argument("--split-on-blank-lines", action="store_true", help="text: one document per paragraph")
        t.add_argument("--max-docs", type=int, default=None, help="read at most N documents per split")
        t.set_defaults(func=cmd_data_prepare_source)

    t = dsrc.add_parser("code", help="source trees, one document per file (default: Python's stdlib)")
    t.add_argument("inputs", nargs="*", help="directories or files (none: Python's standard library)")
    _prepare_options(t)
    t.add_argument("--stdlib", action="store_true", help="add Python's standard library (sysconfig stdlib)")
    t.add_argument("--ext", action="append", help="file extension (repeatable; default .py)")
    t.add_argument("--include-tests", action="store_true", help="keep test/tests directories")
    t.add_argument("--exclude-dir", action="append", default=[], help="directory name to skip (repeatable)")
    t.add_argument("--max-file-bytes", type=int, default=1 << 20, help="skip files larger than this")
    t.add_argument("--path-header", action="store_true", help="start each document with a path comment")
    t.set_defaults(func=cmd_data_prepare_source)

    t = dsrc.add_parser("lean", help="Lean files plus proof-completion examples, weighted equally")
    t.add_argument("inputs", nargs="+", help=inputs_help)
    _prepare_options(t)
    t.add_argument("--proof-weight", type=float, default=0.5,
                   help="share of each split's tokens from proof-completion examples (0.5 = equal weight)")
    t.set_defaults(func=cmd_data_prepare_source)

    t = dsrc.add_parser("hf", help="a Hugging Face dataset by name (needs pip install 'tango-lm[hf]')")
    t.add_argument("name", help="Hub name (HuggingFaceFW/fineweb-edu), local data directory or save_to_disk directory")
    _prepare_options(t)
    t.add_argument("--config", default=None, help="dataset configuration, e.g. sample-10BT")
    t.add_argument("--split-map", default=None, help="OURS=THEIRS pairs, e.g. train=train,dev=validation")
    t.add_argument("--field", default="text")
    t.add_argument("--max-docs", type=int, default=None, help="read at most N documents per split")
    t.add_argument("--streaming", action=argparse.BooleanOptionalAction, default=None,
                   help="stream instead of downloading and caching (default: stream when --max-docs is set)")
    t.add_argument("--revision", default=None)
    t.set_defaults(func=cmd_data_prepare_source)

    t = dsrc.add_parser("mixture", help="weighted mixture of prepared datasets that share a tokenizer")
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--source", dest="source_dirs", action="append", required=True, metavar="DIR:WEIGHT",
                   help="a prepared dataset and its token weight (repeatable)")
    t.add_argument("--tokens", type=int, default=None,
                   help="train tokens (default: each document at most once)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--overwrite", action="store_true")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_data_prepare_mixture)


def _add_train_tokenizer_parser(dsub: Any) -> None:
    t = dsub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on files")
    t.add_argument("--input", nargs="+", required=True, help="files, directories or glob patterns")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--out", required=True, help="tokenizer JSON to write, e.g. tokenizer.json")
    t.add_argument("--field", default="text", help="JSONL/Parquet field holding the text")
    t.add_argument("--ext", action="append", help="file extensions read from directories (repeatable)")
    t.add_argument("--min-frequency", type=int, default=2)
    t.add_argument("--max-docs", type=int, default=None)
    t.add_argument("--overwrite", action="store_true")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_data_train_tokenizer)


def add_parsers(sub: Any) -> None:
    """`data prepare SOURCE`, `data train-tokenizer`, `data verify`."""
    s = sub.add_parser("data", help="prepare datasets")
    dsub = s.add_subparsers(dest="data_command", required=True)
    d = dsub.add_parser("prepare", help="prepare a dataset")
    dsrc = d.add_subparsers(dest="source", required=True)
    m = dsrc.add_parser("dmmath", help="DeepMind Mathematics from DeepMind's generator")
    m.add_argument("--out", required=True, help="output directory")
    m.add_argument("--tokenizer", default="gpt2", help="gpt2 or byte")
    m.add_argument("--train-per-module", type=int, default=300)
    m.add_argument("--test-per-module", type=int, default=30)
    m.add_argument("--dev-fraction", type=float, default=0.05)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--extrapolate", action="store_true", help="also write the extrapolate split")
    m.add_argument("--workers", type=int, default=None)
    m.add_argument("--overwrite", action="store_true")
    m.set_defaults(func=cmd_data_prepare)
    _add_source_parsers(dsrc)
    _add_train_tokenizer_parser(dsub)
    v = dsub.add_parser("verify", help="check every shard of a prepared dataset against its manifest (sha256, "
                                       "end-of-text ids, token ids)")
    v.add_argument("dir", help="prepared dataset directory")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_data_verify)
