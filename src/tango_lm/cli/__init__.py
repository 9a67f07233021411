"""The `tango-lm` command: parse arguments, call the library, print results.

One module per command group adds its parsers and holds its commands: `config` (params, presets,
match), `train` (train, eval, quickstart), `sweep` (sweep, report), `generate` (generate, serve,
export), `data` (data prepare, generated from the data-source registry; train-tokenizer; verify)
and `bench`. `output` turns failures into one line. Every error a user can cause is a
`UserError`: printed as one line `error: ...`, exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from tango_lm.cli import bench, config, data, generate, sweep, train
from tango_lm.cli.output import Parser, held_warnings, one_line, progress_on_terminal_only, reader_may_leave
from tango_lm.errors import UserError, os_error_text
from tango_lm.ops import dispatch as kernel_dispatch
from tango_lm.stop_signals import STOPS, exit_code, signal_name, stop_message


class _Version(argparse.Action):
    """`--version`: this package's and what it runs on (for a bug report); torch is imported only here."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_line())
        parser.exit()


def version_line() -> str:
    import importlib.util
    import platform

    import torch

    from tango_lm import __version__

    parts = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    if importlib.util.find_spec("triton") is None:
        parts.append("triton not installed")
    else:
        import triton

        parts.append(f"triton {triton.__version__}")
    if torch.cuda.is_available():
        parts.append(f"CUDA {torch.version.cuda}: {torch.cuda.get_device_name()}")
    else:
        parts.append("no CUDA device")
    return f"tango-lm {__version__} ({', '.join(parts)})"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="tango-lm", description="Train, compare, evaluate and serve TANGO and onóna LMs.")
    p.add_argument("--version", action=_Version, help="print the versions of tango-lm, Python, torch and triton")
    sub = p.add_subparsers(dest="command", required=True)
    config.add_parsers(sub)
    train.add_parsers(sub)
    sweep.add_parsers(sub)
    generate.add_parsers(sub)
    data.add_parsers(sub)
    train.add_quickstart_parser(sub)
    bench.add_parsers(sub)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags may sit between key=value overrides (`train cfg a=1 --resume b=2`): commands that take
    overrides are parsed with `parse_intermixed_args`, which argparse cannot apply at the top level."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = _subcommands(parser)
    if argv and argv[0] in commands and commands[argv[0]].intermixed:
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, whose --help lists its flags (the top one's does not)
        _command_parser(parser, argv).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return actions[0].choices if actions else {}


def _command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the (sub)command `argv` names: `data prepare text ...` -> that of `text`."""
    for word in argv:
        commands = _subcommands(parser)
        if not commands:
            break
        parser = commands.get(word, parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a failure the user can fix is one line `error: ...` and exit code 2 (cli/output.py)."""
    try:
        with held_warnings():
            args = parse_args(argv)
            kernel_dispatch.requested()  # a bad $TANGO_LM_KERNELS fails before a command writes anything
            progress_on_terminal_only(args)
            with reader_may_leave(getattr(args, "outlives_reader", False)):
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
    except STOPS as stop:  # Ctrl-C, or SIGTERM where a command stops on it; it may say how to continue
        print(stop_message(stop), file=sys.stderr)
        return exit_code(signal_name(stop))
    return code if isinstance(code, int) else 0
