"""The `tango-lm` command: parse arguments, call the library, print results.

Every error a user can cause is a `UserError`: printed as one line `error: ...`, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tango_lm.cli_output import Parser, held_warnings, one_line, progress_on_terminal_only
from tango_lm.errors import UserError, os_error_text


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=float))


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table: columns are (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([("-" if row.get(k) is None else format(row[k], fmt)) for k, _, fmt in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    # Text columns (empty format) read left to right; numbers line up on the right.
    left = [not fmt for _, _, fmt in columns]
    lines = ["  ".join(c.ljust(w) if lj else c.rjust(w) for c, w, lj in zip(r, widths, left, strict=True)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The optional CONFIG positional may be the first override when no preset is given."""
    if args.config and "=" in args.config:
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


# -- commands -------------------------------------------------------------------------------
def cmd_params(args: argparse.Namespace) -> None:
    from tango_lm.train.config import RunConfig, apply_overrides, read_yaml

    config, overrides = _config_and_overrides(args)
    data = read_yaml(config) if config else {}
    model = RunConfig.from_dict(apply_overrides(data, overrides)).model  # validates every section
    counts = model.num_params()
    out = {**counts, "arch": model.arch, "head": model.head, "d_model": model.d_model, "width": model.width,
           "depth": model.depth, "n_heads": model.n_heads, "vocab_size": model.vocab_size,
           "flops_per_token": model.flops_per_token()}
    if args.json:
        _print_json(out)
    else:
        print(f"{model.arch} (head {model.head}): d_model={model.d_model} n_heads={model.n_heads} "
              f"width={model.width} depth={model.depth} vocab={model.vocab_size}")
        print(f"  non-embedding {counts['non_embedding']:>15,}")
        print(f"  embedding     {counts['embedding']:>15,}")
        print(f"  total         {counts['total']:>15,}")


def cmd_presets(args: argparse.Namespace) -> None:
    from tango_lm.train.config import PRESET_DIR, list_presets, load_run_config

    rows = []
    for name in list_presets():
        if args.filter and args.filter not in name:
            continue
        model = load_run_config(name, []).model
        first = (PRESET_DIR / f"{name}.yaml").read_text().splitlines()[0].lstrip("# ")
        rows.append({"name": name, "arch": model.arch, "total": model.num_params()["total"], "about": first})
    if args.json:
        _print_json(rows)
    else:
        print(_table(rows, [("name", "preset", ""), ("arch", "arch", ""), ("total", "params", ",d"),
                            ("about", "", "")]))


def cmd_match(args: argparse.Namespace) -> None:
    from tango_lm.models.matching import TIERS, _row, active_ratio_rows, conventional_untied, match_tier, parse_tier
    from tango_lm.models.table3_range import non_embedding_range, paper_range

    target, d_model = parse_tier(args.tier, args.d_model)
    contexts = list(dict.fromkeys(args.context_length))  # GAU's count (and so its width) depends on it
    fields = {"vocab_size": args.vocab_size, "gau_norm": args.gau_norm}
    rows = match_tier(target, d_model, args.depth, args.arch or None, context_length=contexts[0], **fields)
    gau = [i for i, row in enumerate(rows) if row["arch"] == "gau"]
    if gau:  # one GAU row per context length, together
        more = [match_tier(target, d_model, args.depth, ["gau"], context_length=n, **fields)[0] for n in contexts[1:]]
        rows[gau[0] + 1 : gau[0] + 1] = more
        for row, n in zip([rows[gau[0]], *more], contexts, strict=True):
            row["context_length"] = n
    conventional = conventional_untied(args.tier, args.depth, args.vocab_size)
    if conventional is not None and not args.arch:
        rows.append(_row(conventional, target, arch="conventional-untied"))
    ratios = active_ratio_rows(args.vocab_size) if args.ratios else []
    # Seed 000 Table 3's last column, and the paper's for its own tiers (same d_model and vocabulary).
    span = non_embedding_range(rows)
    paper_tier = TIERS.get(args.tier.strip().upper(), (None, None))[1] == d_model and args.vocab_size == 50257
    paper = paper_range(args.tier, args.depth) if paper_tier and not args.arch else None
    if span is not None:
        span["paper_millions"] = list(paper) if paper else None
    if args.json:
        _print_json({"target": target, "d_model": d_model, "depth": args.depth, "models": rows,
                     "non_embedding_range": span, "active_ratio": ratios})
        return
    columns = [("arch", "arch", ""), ("d_model", "d", "d"), ("n_heads", "heads", "d"), ("width", "width", "d"),
               ("non_embedding", "non-embedding", ",d"), ("total", "total", ",d"), ("gap", "gap to target", "+,d")]
    if len(contexts) > 1:
        columns.insert(4, ("context_length", "n", "d"))
    print(f"target {target:,} parameters, depth {args.depth} (matched widths at d_model={d_model})")
    print(_table(rows, columns))
    if span is not None:
        line = (f"non-embedding range (seed 000 Table 3's last column): {span['min'] / 1e6:.3f}M "
                f"({span['min_arch']}) to {span['max'] / 1e6:.3f}M ({span['max_arch']})")
        if span["paper_millions"]:
            line += f"; the paper: {span['paper_millions'][0]:.3f}M to {span['paper_millions'][1]:.3f}M"
        print(line)
    if ratios:
        print("\nactive-ratio geometries (seed 000 Table 9; 70M, depth 4)")
        print(_table(ratios, [("target_ratio", "F/d target", ""), ("realized_ratio", "F/d", ".3f"), *columns]))


def cmd_train(args: argparse.Namespace) -> None:
    from tango_lm.train.config import load_run_config
    from tango_lm.train.trainer import train

    run = load_run_config(*_config_and_overrides(args))
    if args.no_progress:
        run.train.progress = False
    result = train(run, resume=args.resume)
    from tango_lm.train.distributed import is_main_process

    if not is_main_process():  # under torchrun, rank 0 alone reports
        return
    s = result.summary
    if args.json:
        _print_json(s)
        return
    print(_table([s], [("arch", "arch", ""), ("params_total", "params", ",d"), ("tokens", "tokens", ",d"),
                       ("best_dev_nll", "best dev NLL", ".4f"), ("test_nll", "test NLL", ".4f"),
                       ("tokens_per_s", "tokens/s", ",.0f")]))
    print(f"run directory: {s['out_dir']} (test NLL from step {s['selected_step']})")


def cmd_eval(args: argparse.Namespace) -> None:
    from tango_lm.eval.evaluate import evaluate_checkpoint

    if args.windows is not None and args.windows < 1:
        raise UserError(f"--windows must be at least 1 (got {args.windows}); leave it out to evaluate every window")
    if args.ppl:
        return _eval_ppl(args)
    res = evaluate_checkpoint(args.checkpoint, args.split, data_dir=args.data, max_windows=args.windows,
                              device=args.device, segment=_parse_segment(args.segment), ablate=args.ablate)
    if args.json:
        _print_json(res)
    else:
        segment = f", segment {res['segment']}" if "segment" in res else ""
        segment += f", table {res['ablate']} only" if "ablate" in res else ""
        segment += f", windows sampled with seed {res['sample_seed']}" if "sample_seed" in res else ""
        print(f"{res['split']} NLL {res['nll']:.4f} nats/token over {res['tokens']:,} tokens "
              f"({res['checkpoint']}, step {res['step']}{segment})")


def _eval_ppl(args: argparse.Namespace) -> None:
    """`eval CHECKPOINT --ppl FILE --format text|wikitext|lambada`: external perplexity (docs/design.md §6)."""
    from tango_lm.eval.perplexity import evaluate_checkpoint_file

    res = evaluate_checkpoint_file(args.checkpoint, args.ppl, args.format, stride=args.stride, device=args.device)
    if args.json:
        _print_json(res)
    elif res["format"] == "lambada":
        print(f"LAMBADA-style last-word perplexity {res['last_word_perplexity']:.3f}, accuracy {res['accuracy']:.4f} "
              f"over {res['examples']:,} examples ({res['checkpoint']}, step {res['step']})")
    else:
        print(f"{res['format']}: word perplexity {res['word_perplexity']:.3f}, {res['nll']:.4f} nats/token, "
              f"{res['bits_per_byte']:.4f} bits/byte over {res['documents']:,} documents, {res['tokens']:,} tokens, "
              f"{res['words']:,} words (context {res['context']}, stride {res['stride']}; {res['checkpoint']}, "
              f"step {res['step']})")


SLURM_FLAGS = ("partition", "account", "gpus_per_job", "time", "array_parallelism", "cpus_per_task", "mem_gb")


def cmd_sweep(args: argparse.Namespace) -> int:
    from tango_lm.sweep import load_grid, plan_rows, run_sweep

    grid = load_grid(args.grid, check_data=not args.dry_run)
    runs = grid.select(args.only)
    if not runs:
        raise UserError(f"--only {' '.join(args.only)} matches none of the {len(grid.runs)} runs of {args.grid}")
    if args.dry_run:
        rows = plan_rows(grid, runs)
        if args.json:
            _print_json(rows)
            return 0
        print(_table(rows, [("run", "run", ""), ("state", "state", ""), ("width", "width", ""),
                            ("params", "params", ",d"), ("steps", "steps", ",d"), ("tokens", "tokens", ",d"),
                            ("note", "note", "")]))
        print(f"{len(runs)} runs under {grid.out_dir} (dry run: nothing trained)")
        return 0
    log = (lambda _msg: None) if args.json else (lambda msg: print(msg, flush=True))
    slurm_flags = {k: getattr(args, k) for k in SLURM_FLAGS}
    if args.launcher == "slurm":
        from tango_lm.sweep.launchers import slurm_settings, submit_sweep

        rows = submit_sweep(grid, runs, slurm_settings(grid, slurm_flags), wait=args.wait, log=log)
        if not args.wait:
            if args.json:
                _print_json(rows)
            else:
                print(_table(rows, [("run", "run", ""), ("status", "status", ""), ("job_id", "job", "")]))
                print(f"`tango-lm sweep {args.grid} --dry-run` shows their state; `tango-lm report {grid.out_dir}` "
                      "summarizes finished runs")
            return 0
    else:
        given = [f"--{k.replace('_', '-')}" for k, v in slurm_flags.items() if v is not None] + (["--wait"] if args.wait else [])
        if given:
            raise UserError(f"{given[0]} applies to --launcher slurm; add --launcher slurm or drop it")
        rows = run_sweep(grid, runs, progress=False if args.no_progress or args.json else None, log=log)
    failed = [r for r in rows if r["status"] == "failed"]
    if args.json:
        _print_json(rows)
    else:
        print()
        print(_table(rows, [("run", "run", ""), ("status", "status", ""), ("steps", "steps", ",d"),
                            ("best_dev_nll", "best dev NLL", ".4f"), ("test_nll", "test NLL", ".4f"),
                            ("error", "error", "")]))
        print(f"{len(rows) - len(failed)} of {len(rows)} runs finished under {grid.out_dir}; "
              f"`tango-lm report {grid.out_dir}` summarizes them")
    return 1 if failed else 0


def cmd_report(args: argparse.Namespace) -> None:
    from pathlib import Path

    from tango_lm.eval.report import write_report

    res = write_report(args.dir, args.out, split=args.split, plots=not args.no_plots, reference=args.reference)
    for w in res["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    if args.json:
        _print_json(res["report"])
        return
    print((Path(res["out"]) / "report.md").read_text())
    print(f"wrote {len(res['files'])} files to {res['out']}")


def _parse_segment(text: str) -> int | None:
    """`--segment all|K` (rotating narrow-width models, docs/design.md §2.6): None for all segments."""
    if text.strip().lower() == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--segment must be 'all' or a segment number, got {text!r}") from None


def cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from tango_lm.data.tokenizers import tokenizer_from_dict
    from tango_lm.serve.generate import check_sampling, generate, room_for_new_tokens
    from tango_lm.train.checkpoint import load_checkpoint
    from tango_lm.train.device import pick_device

    check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens or 0)  # before the slow load
    if args.num_samples < 1:
        raise UserError(f"--num-samples must be at least 1 (got {args.num_samples})")
    prompt_text = _utf8_prompt(args.prompt).replace("\\n", "\n")
    ckpt = load_checkpoint(args.checkpoint)
    device = pick_device(args.device)
    model = ckpt.build_model(device)
    tok = tokenizer_from_dict(ckpt.tokenizer)
    ids = tok.encode(prompt_text)
    if not ids:
        raise UserError("the prompt is empty; give some text with --prompt")
    room = room_for_new_tokens(len(ids), model.config.context_length)
    if room < 1:
        raise UserError(f"the prompt has {len(ids)} tokens, more than the model's context of "
                        f"{model.config.context_length}; shorten it")
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else min(DEFAULT_NEW_TOKENS, room)
    prompt = torch.tensor([ids] * args.num_samples, device=device)
    out = generate(model, prompt, max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, eos_id=None if args.no_stop else tok.eot_id)
    texts = []
    for row in out.tolist():
        new = row[len(ids):]
        if not args.no_stop and tok.eot_id in new:
            new = new[: new.index(tok.eot_id)]
        texts.append(tok.decode(new))
    if args.max_new_tokens is None and room < DEFAULT_NEW_TOKENS:
        print(f"note: at most {room} new tokens (not {DEFAULT_NEW_TOKENS}): the prompt's {len(ids)} tokens fill the "
              f"rest of the model's context of {model.config.context_length}", file=sys.stderr)
    if args.json:
        _print_json({"prompt": args.prompt, "completions": texts, "checkpoint": str(ckpt.path)})
        return
    for i, text in enumerate(texts):
        if i:
            print("-" * 40)
        print(prompt_text + text)


def cmd_serve(args: argparse.Namespace) -> None:
    import importlib.util

    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        raise UserError("tango-lm serve needs FastAPI and uvicorn; pip install 'tango-lm[serve]'")
    from tango_lm.serve.server import serve

    serve(args.checkpoint, host=args.host, port=args.port, model_name=args.model_name, device=args.device,
          max_batch_size=args.max_batch_size, batch_wait_ms=args.batch_wait_ms, threads=args.threads)


DEFAULT_NEW_TOKENS = 64


def _utf8_prompt(text: str) -> str:
    """The prompt, or a UserError when the shell passed bytes that are not UTF-8 (Python keeps
    them as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(text[exc.start])
        byte = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"character U+{bad:04X}"
        raise UserError(f"--prompt is not valid UTF-8 ({byte} at character {exc.start}); pass UTF-8 text") from None
    return text


def cmd_export(args: argparse.Namespace) -> None:
    from tango_lm.serve.hf_export import export_hf

    out = export_hf(args.checkpoint, args.hf, overwrite=args.overwrite)
    if args.json:
        _print_json(out)
    else:
        print(f"exported {out['checkpoint']} to {out['hf_dir']}; load it with AutoModelForCausalLM.from_pretrained("
              f"{out['hf_dir']!r}, trust_remote_code=True) where tango-lm is installed")


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
    from tango_lm.data.sources import prepare_source, stdlib_path

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


def cmd_quickstart(args: argparse.Namespace) -> None:
    from tango_lm.quickstart import run_quickstart

    rows = run_quickstart(args.out, steps=args.steps, fresh=args.fresh)
    if args.json:
        _print_json(rows)


def cmd_bench(args: argparse.Namespace) -> None:
    from tango_lm.bench.suite import run

    report = run(args)
    if args.json:
        _print_json(report)


# -- parser ---------------------------------------------------------------------------------
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
    from tango_lm.data.sources import DEFAULT_EXTS

    inputs_help = "files, directories, glob patterns, or SPLIT=PATH (train=a dev=b); a directory with " \
                  "train*/validation*/test* entries keeps its splits"
    for name, help_text in (("text", "plain-text files (one document per file)"),
                            ("jsonl", "JSON Lines files, one document per line"),
                            ("parquet", "Parquet files, read in row batches")):
        ext = ", ".join(DEFAULT_EXTS[name])
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


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="tango-lm", description="Train, compare, evaluate and serve TANGO and onóna LMs.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("params", help="parameter counts of a model config")
    s.add_argument("config", nargs="?", help="preset name or YAML file (optional)")
    s.add_argument("overrides", nargs="*", help="key=value overrides, e.g. arch=tango d_model=512")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_params)

    s = sub.add_parser("presets", help="list the named presets")
    s.add_argument("filter", nargs="?", help="only presets whose name contains this")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_presets)

    s = sub.add_parser("match", help="widths that match each architecture to a parameter tier (docs/design.md §2.8)")
    s.add_argument("--tier", required=True, help="70M, 160M, or a parameter count such as 25M or 1500000")
    s.add_argument("--depth", type=int, required=True)
    s.add_argument("--d-model", type=int, default=None, help="width d (default: 512 for 70M, 768 for 160M)")
    s.add_argument("--arch", action="append", help="only these architectures (repeatable)")
    s.add_argument("--vocab-size", type=int, default=50257)
    s.add_argument("--context-length", type=int, nargs="+", default=[1024],
                   help="GAU's context length(s): its relative bias, so its width, depends on it (one row each)")
    s.add_argument("--gau-norm", choices=("rmsnorm", "layernorm"), default="rmsnorm",
                   help="GAU/FLASH norm: rmsnorm (design.md §2.7) or layernorm with a bias (docs/table3-ranges.md)")
    s.add_argument("--ratios", action="store_true", help="also print the active-ratio geometries (Table 9)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_match)

    s = sub.add_parser("train", help="train a model from a preset or YAML file")
    s.add_argument("config", nargs="?", help="preset name or YAML file (optional)")
    s.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.steps=100")
    s.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in train.out_dir")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("eval", help="NLL of a checkpoint on a split")
    s.add_argument("checkpoint", help="run directory (its best-dev checkpoint) or checkpoints/step-* directory")
    s.add_argument("--split", default="test", help="dev, test, or another split of the dataset")
    s.add_argument("--data", default=None, help="prepared dataset (default: the one the run trained on)")
    s.add_argument("--windows", type=int, default=None,
                   help="evaluate only the first N windows (a run with train.eval_sample_seed: the first N of its sample)")
    s.add_argument("--ablate", choices=["A", "B", "a", "b"], default=None,
                   help="score a twin-table (onóna) checkpoint with table A or B alone at input and output")
    s.add_argument("--segment", default="all",
                   help="models trained with active_width: 'all' columns (default) or one segment K")
    s.add_argument("--ppl", default=None, metavar="FILE", help="external perplexity of a local file instead of a split")
    s.add_argument("--format", default="text", choices=("text", "wikitext", "lambada"),
                   help="--ppl file format: blank-line documents, raw WikiText, or LAMBADA lines/JSONL")
    s.add_argument("--stride", type=int, default=None, help="--ppl rolling-window stride (default: the context)")
    s.add_argument("--device", default="auto")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_eval)

    s = sub.add_parser("sweep", help="train every run of a grid (architectures x datasets x tiers x depths x seeds)")
    s.add_argument("grid", help="grid YAML, e.g. configs/sweeps/dmmath-cpu.yaml")
    s.add_argument("--dry-run", action="store_true", help="list the runs and their state; train nothing")
    s.add_argument("--only", action="append", metavar="PATTERN",
                   help="only runs whose name matches (glob, or substring; repeatable)")
    s.add_argument("--launcher", choices=("local", "slurm"), default="local",
                   help="local: train here, one run after another; slurm: one job per run (sweep/launchers.py)")
    s.add_argument("--partition", default=None, help="slurm: partition (overrides the grid's slurm.partition)")
    s.add_argument("--account", default=None, help="slurm: account to charge")
    s.add_argument("--gpus-per-job", type=int, default=None, help="slurm: GPUs per run, one process each (default 1)")
    s.add_argument("--time", default=None, help="slurm: time limit per job, minutes or [D-]HH:MM:SS (default 24:00:00)")
    s.add_argument("--array-parallelism", type=int, default=None, help="slurm: jobs of the array running at once")
    s.add_argument("--cpus-per-task", type=int, default=None, help="slurm: CPUs per process")
    s.add_argument("--mem-gb", type=float, default=None, help="slurm: memory per job in GB")
    s.add_argument("--wait", action="store_true", help="slurm: wait for the jobs and print the results table")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_sweep)

    s = sub.add_parser("report", help="paper-style tables and plots of a directory of runs")
    s.add_argument("dir", help="a sweep's out_dir (or any directory of run directories)")
    s.add_argument("--out", default=None, help="report directory (default: DIR/report)")
    s.add_argument("--split", default="test", choices=("test", "dev"),
                   help="test: test NLL of the selected checkpoint; dev: its dev NLL")
    s.add_argument("--reference", default=None, help="model whose per-seed margins to give (default: each row's best)")
    s.add_argument("--no-plots", action="store_true")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_report)

    s = sub.add_parser("generate", help="sample text from a checkpoint")
    s.add_argument("checkpoint", help="run directory (its best-dev checkpoint) or checkpoints/step-* directory")
    s.add_argument("--prompt", required=True, help="text to continue (\\n for a newline)")
    s.add_argument("--max-new-tokens", type=int, default=None,
                   help="default 64, or as many as the prompt leaves room for in the context")
    s.add_argument("--temperature", type=float, default=1.0, help="0 for greedy decoding")
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--num-samples", type=int, default=1)
    s.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    s.add_argument("--device", default="auto")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="serve a checkpoint over HTTP with the OpenAI completions API")
    s.add_argument("checkpoint", help="run directory (its best-dev checkpoint) or checkpoints/step-* directory")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port (the address is printed)")
    s.add_argument("--model-name", default=None, help="the model id clients send (default: the run directory's name)")
    s.add_argument("--max-batch-size", type=int, default=32, help="rows decoded together at most")
    s.add_argument("--batch-wait-ms", type=float, default=20.0,
                   help="how long the first request of a batch waits for others to arrive")
    s.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch (default: PyTorch's choice)")
    s.add_argument("--device", default="auto")
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("export", help="write a checkpoint as a Hugging Face transformers directory")
    s.add_argument("checkpoint", help="run directory (its best-dev checkpoint) or checkpoints/step-* directory")
    s.add_argument("--hf", required=True, metavar="DIR", help="output directory (AutoModelForCausalLM, remote code)")
    s.add_argument("--overwrite", action="store_true", help="replace the export's files in a non-empty DIR")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_export)

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

    s = sub.add_parser("quickstart", help="DM Math, TANGO vs Loop Transformer++ at matched parameters, on a CPU")
    s.add_argument("--out", default="runs/quickstart")
    s.add_argument("--steps", type=int, default=None, help="optimizer steps per model")
    s.add_argument("--fresh", action="store_true", help="retrain even if finished runs exist")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_quickstart)

    s = sub.add_parser("bench", help="benchmark suites: training (TANGO vs matched Loop Transformer++ by default), "
                                     "decoding, windowed TANGO, head memory")
    from tango_lm.bench.suite import add_arguments as add_bench_arguments

    add_bench_arguments(s)
    s.set_defaults(func=cmd_bench)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags may sit between key=value overrides (`train cfg a=1 --resume b=2`): commands that take
    overrides are parsed with `parse_intermixed_args`, which argparse cannot apply at the top level."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if argv and argv[0] in ("train", "params"):
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one command; a failure the user can fix is one line `error: ...` and exit code 2 (cli_output.py)."""
    try:
        with held_warnings():
            args = parse_args(argv)
            progress_on_terminal_only(args)
            code = args.func(args)
    except UserError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # one no other handler put into words: a full disk, an unreadable file
        if isinstance(exc, BrokenPipeError):  # `tango-lm ... | head`: the reader left; that is not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        print(f"error: {one_line(os_error_text(exc))}; check the disk and the path", file=sys.stderr)
        return UserError.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
