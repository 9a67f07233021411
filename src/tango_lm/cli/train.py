"""Training and evaluation: `train`, `eval` and `quickstart`."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from tango_lm.cli.config import _config_and_overrides
from tango_lm.cli.output import (
    CHECKPOINT_HELP,
    CONFIG_HELP,
    DEVICE_HELP,
    JSON_HELP,
    NO_PROGRESS_HELP,
    _print_json,
    _table,
    add_overrides,
    command_progress,
)
from tango_lm.errors import UserError, counted, path_arg
from tango_lm.eval.perplexity import FORMATS as PPL_FORMATS
from tango_lm.stop_signals import STOPS, stop_on_sigterm, with_note


def cmd_train(args: argparse.Namespace) -> None:
    from tango_lm.train.config import load_run_config
    from tango_lm.train.distributed import is_main_process, launch_env
    from tango_lm.train.trainer import train

    source, overrides = _config_and_overrides(args)
    run = load_run_config(source, overrides)
    try:  # lines without a terminal, nothing with --no-progress: this command's, not the run's config
        with stop_on_sigterm():  # `timeout`, `kill` or a container's stop end it as Ctrl-C does
            result = train(run, resume=args.resume, progress=command_progress(args, bar=None))
    except STOPS as stop:
        _, _, processes = launch_env()  # under torchrun, rank 0 alone says how to continue
        given = [*([source] if source else []), *overrides]
        said = _how_to_continue(run, given, processes) if is_main_process() else ""
        raise with_note(stop, said) from None
    if not is_main_process():  # under torchrun, rank 0 alone reports
        return
    s = result.summary
    if args.json:
        _print_json(s)
        return
    print(
        _table(
            [s],
            [
                ("arch", "arch", ""),
                ("head", "head", ""),  # the two papers' comparisons differ in one or the other
                ("params_total", "params", ",d"),
                ("tokens", "tokens", ",d"),
                ("selected_dev_nll", "dev NLL", ".4f"),
                ("test_nll", "test NLL", ".4f"),
                ("tokens_per_s", "tokens/s", ",.0f"),
            ],
        )
    )
    print(f"run directory: {s['out_dir']} (dev and test NLL of the checkpoint of step {s['selected_step']})")


def _how_to_continue(run: Any, given: list[str], processes: int = 1) -> str:
    """What the `interrupted` line adds for a run: the command that continues it (to paste into a
    shell; under torchrun, in the same launch), and from where. The run directory's own config
    continues it once that holds this run's config; before (stopped while the model was built, or
    with overrides not yet written), the command as given, with --resume."""
    import json
    import shlex
    from pathlib import Path

    from tango_lm.train.checkpoint import restorable_steps

    out_dir = Path(run.train.out_dir)
    steps = restorable_steps(out_dir / "checkpoints")  # one a kill left beside its place too (resume puts it back)
    where = f"from its checkpoint of step {steps[-1]}" if steps else "from the start (no checkpoint was saved yet)"
    try:
        saved = json.loads((out_dir / "config.json").read_text()) if (out_dir / "config.yaml").is_file() else None
    except (OSError, ValueError):
        saved = None
    if saved == json.loads(json.dumps(run.to_dict())):
        command = f"`tango-lm train {shlex.quote(str(out_dir))} --resume`"
    else:
        command = f"`tango-lm train {shlex.join([*given, '--resume'])}`"
    if processes > 1:
        command += f", launched by torchrun as this run was ({processes} processes),"
    return f"{command} continues the run {where}"


def cmd_eval(args: argparse.Namespace) -> None:
    from tango_lm.eval.evaluate import evaluate_checkpoint

    if args.windows not in (None, "all") and (
        not args.windows.isascii() or not args.windows.isdigit() or int(args.windows) < 1
    ):
        raise UserError(
            f"--windows takes a positive number or 'all' (got {args.windows!r}); leave it out for the run's own windows"
        )
    split_only = [f"--{n}" for n in ("split", "data", "windows") if getattr(args, n) is not None]
    ppl_only = [f"--{n}" for n in ("format", "stride") if getattr(args, n) is not None]
    if args.ppl and split_only:
        verb = "scores" if len(split_only) == 1 else "score"
        raise UserError(f"{' and '.join(split_only)} {verb} a dataset split and --ppl a file; give one or the other")
    if not args.ppl and ppl_only:
        verb, them = ("goes", "it") if len(ppl_only) == 1 else ("go", "them")
        raise UserError(
            f"{' and '.join(ppl_only)} {verb} with --ppl FILE (a file's perplexity); add --ppl or leave {them} out"
        )
    if args.ppl:
        return _eval_ppl(args)
    res = evaluate_checkpoint(
        args.checkpoint,
        "test" if args.split is None else args.split,  # --split "" is the dataset's error, not the test split
        data_dir=args.data,
        max_windows=args.windows if args.windows in (None, "all") else int(args.windows),
        device=args.device,
        segment=_parse_segment(args.segment),
        ablate=args.ablate,
        progress=command_progress(args),
    )
    asked = int(args.windows) if args.windows not in (None, "all") else None
    if asked is not None and asked > res["windows"]:  # said, not silent: the NLL is over fewer windows
        print(f"note: --windows {asked}: the split has {res['windows']:,}, all of them scored", file=sys.stderr)
    if args.json:
        _print_json(res)
    else:
        sampled = f", windows sampled with seed {res['sample_seed']}" if "sample_seed" in res else ""
        split = f"{res['role']} ({res['split']!r})" if "role" in res else res["split"]  # as the trainer says it
        print(
            f"{split} NLL {res['nll']:.4f} nats/token over {res['tokens']:,} tokens "
            f"({res['checkpoint']}, step {res['step']}{_variant(res)}{sampled})"
        )


def _variant(res: dict) -> str:
    """The printed labels of `evaluate.model_variant`."""
    text = f", segment {res['segment']}" if "segment" in res else ""
    return text + (f", table {res['ablate']} only" if "ablate" in res else "")


def _eval_ppl(args: argparse.Namespace) -> None:
    """`eval CHECKPOINT --ppl FILE --format text|document|wikitext|lambada`: external perplexity (docs/design.md §6)."""
    from tango_lm.eval.perplexity import evaluate_checkpoint_file

    res = evaluate_checkpoint_file(
        args.checkpoint,
        args.ppl,
        args.format or "text",
        stride=args.stride,
        device=args.device,
        segment=_parse_segment(args.segment),
        ablate=args.ablate,
        progress=command_progress(args),
    )
    if args.json:
        _print_json(res)
    elif res["format"] == "lambada":
        print(
            f"LAMBADA-style last-word perplexity {perplexity_text(res['last_word_perplexity'])}, accuracy {res['accuracy']:.4f} "
            f"over {counted(res['examples'], 'example')} ({res['checkpoint']}, step {res['step']}{_variant(res)})"
        )
    else:
        print(
            f"{res['format']}: token perplexity {perplexity_text(res['token_perplexity'])}, word perplexity "
            f"{perplexity_text(res['word_perplexity'])}, {res['nll']:.4f} nats/token, "
            f"{res['bits_per_byte']:.4f} bits/byte over {counted(res['documents'], 'document')}, {counted(res['tokens'], 'token')}, "
            f"{counted(res['words'], 'word')} (context {res['context']}, stride {res['stride']}; {res['checkpoint']}, "
            f"step {res['step']}{_variant(res)})"
        )


def perplexity_text(value: float) -> str:
    """Three decimals, or four digits with an exponent past a million (an untrained model's word
    perplexity printed as 5256006514061996.000: sixteen digits, twelve of them noise)."""
    return f"{value:.3e}" if abs(value) >= 1e6 else f"{value:.3f}"


def _parse_segment(text: str) -> int | None:
    """`--segment all|K` (rotating narrow-width models, docs/design.md §2.6): None for all segments."""
    if text.strip().lower() == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--segment must be 'all' or a segment number, got {text!r}") from None


def cmd_quickstart(args: argparse.Namespace) -> None:
    from tango_lm.quickstart import run_quickstart

    # --json: stdout holds the JSON alone; the steps and the table go to stderr.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        rows = run_quickstart(args.out, steps=args.steps, fresh=args.fresh, progress=command_progress(args))
    if args.json:
        _print_json(rows)


def add_parsers(sub: Any) -> None:
    """`train`, `eval`."""
    s = sub.add_parser("train", help="train a model from a preset or YAML file")
    s.add_argument("config", nargs="?", help=CONFIG_HELP)
    add_overrides(s, "section.key=value overrides, e.g. train.steps=100")
    s.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in train.out_dir")
    s.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    s.add_argument("--json", action="store_true", help=JSON_HELP)
    s.set_defaults(func=cmd_train, outlives_reader=True)

    s = sub.add_parser("eval", help="NLL of a checkpoint on a split")
    s.add_argument("checkpoint", help=CHECKPOINT_HELP)
    s.add_argument("--split", default=None, help="dev, test (the default), or another split of the dataset")
    s.add_argument("--data", default=None, help="prepared dataset (default: the one the run trained on)")
    s.add_argument(
        "--windows",
        default=None,
        help="N: the first N windows (of the sample with train.eval_sample_seed); all: every window; default: "
        "the run's own (dev: eval_windows, test: test_windows) on its own data, every window otherwise",
    )
    s.add_argument(
        "--ablate",
        choices=["A", "B", "a", "b"],
        default=None,
        help="score a twin-table (onóna) checkpoint with table A or B alone at input and output",
    )
    s.add_argument(
        "--segment", default="all", help="models trained with active_width: 'all' columns (default) or one segment K"
    )
    s.add_argument("--ppl", default=None, metavar="FILE", help="external perplexity of a local file instead of a split")
    s.add_argument(
        "--format",
        default=None,
        choices=PPL_FORMATS,
        help=(
            "--ppl file format: blank-line documents (text, the default), the whole file as one document "
            "(document: a source file, a book), raw WikiText, or LAMBADA lines/JSONL"
        ),
    )
    s.add_argument(
        "--stride",
        type=int,
        default=None,
        help="--ppl rolling-window stride (default: the window, the run's train.seq_len)",
    )
    s.add_argument("--device", default="auto", help=DEVICE_HELP)
    s.add_argument("--json", action="store_true", help=JSON_HELP)
    s.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    s.set_defaults(func=cmd_eval, outlives_reader=True)


def add_quickstart_parser(sub: Any) -> None:
    """`quickstart`."""
    s = sub.add_parser("quickstart", help="DM Math, TANGO vs Loop Transformer++ at matched parameters, on a CPU")
    s.add_argument(
        "--out",
        default="runs/quickstart",
        type=path_arg,
        help="directory of the dataset and the two runs (default: %(default)s)",
    )
    s.add_argument("--steps", type=int, default=None, help="optimizer steps per model")
    s.add_argument("--fresh", action="store_true", help="retrain even if finished runs exist")
    s.add_argument("--json", action="store_true", help=JSON_HELP)
    s.set_defaults(func=cmd_quickstart, outlives_reader=True)
