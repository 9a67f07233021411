"""What a `tango-lm` command prints when it fails: one line, `error: ...`, and nothing else.

- Bad arguments (a missing option, a value of the wrong type) are a `UserError` like any other,
  not argparse's usage block: `Parser.error` raises it, naming the `--help` to read.
- Warnings a command raises (a torch UserWarning, say) are held back while it runs: printed when it
  succeeds, dropped when it fails, so the error is the one line on stderr.
- Progress bars are drawn on a terminal only: redirected to a file or a pipe, stderr gets no bars
  (and nothing a failing command would have to take back).
- The error line is one line: control characters in it (a newline in a file name) are escaped.
- An OSError no other handler turned into a sentence (a full disk, an unreadable file) still gets
  one line with its reason and path.
- When the reader of its output leaves (`tango-lm sweep grid.yaml | head`, `2>&1 | head`), a
  command that trains or writes files (its parser sets `outlives_reader`) goes on with its output
  sent to /dev/null (`reader_may_leave`); one whose output is its product stops there, exit code 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import warnings
from collections.abc import Iterator
from typing import Any, NoReturn

from tango_lm import strict_json
from tango_lm.errors import UserError, did_you_mean

__all__ = [
    "Parser",
    "add_overrides",
    "one_line",
    "held_warnings",
    "progress_on_terminal_only",
    "command_progress",
    "reader_may_leave",
    "JSON_HELP",
    "NO_PROGRESS_HELP",
    "CONFIG_HELP",
    "CHECKPOINT_HELP",
    "DEVICE_HELP",
]

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# The positional argument of eval, generate, serve and export (train/checkpoint.py, resolve_run_checkpoint).
CHECKPOINT_HELP = (
    "run directory (the checkpoint it selected: best dev, or its last with train.select=final) "
    "or a checkpoints/step-* directory"
)

# The flags many commands share, said once.
CONFIG_HELP = "preset name, YAML file, or run directory (its config; optional)"
JSON_HELP = "print the result as one JSON document on stdout (progress and notes go to stderr)"
NO_PROGRESS_HELP = "no progress bar, nor the progress lines written instead when stderr is not a terminal"
DEVICE_HELP = "auto (CUDA, else MPS, else the CPU; the default), cpu, cuda, cuda:N or mps"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` says each option's default where its line does not: a value that is not None, an
    empty list or a flag's False (argparse's own ArgumentDefaultsHelpFormatter also says "default:
    None" of every option that has none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text, value = action.help, action.default
        if not text or not action.option_strings or "default" in text or action.nargs == 0:
            return text  # nargs 0: a flag (store_true, store_const), whose default is its absence
        if value is None or value is argparse.SUPPRESS or value == []:
            return text
        shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        return f"{text} (default {shown.replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one-line UserErrors and whose help says every option's
    default (its subparsers inherit this class)."""

    intermixed = False  # takes key=value overrides between its flags (`add_overrides`)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        choice = _INVALID_CHOICE.search(message)  # a mistyped command: name the one meant
        if choice:
            # Python 3.11 quotes the choices, 3.12 and later do not
            message += did_you_mean(choice["word"], [c.strip().strip("'") for c in choice["choices"].split(",")])
        raise UserError(f"{self.prog}: {message}; see `{self.prog} --help`")


_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<word>[^']*)' \(choose from (?P<choices>.*)\)$")


def one_line(message: str) -> str:
    """`message` with control characters escaped (a newline becomes the two characters `\\n`)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], message)


def add_overrides(parser: Parser, help: str) -> None:
    """The `key=value` overrides positional; flags may then sit between them (`train cfg a=1
    --resume b=2`), which `cli.parse_args` parses with `parse_intermixed_args`."""
    parser.add_argument("overrides", nargs="*", help=help)
    parser.intermixed = True


@contextlib.contextmanager
def held_warnings() -> Iterator[None]:
    """Collect the warnings raised in the block and print them after it, unless it raised a UserError."""
    failed = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            try:
                yield
            except UserError:
                failed = True
                raise
    finally:
        for w in [] if failed else caught:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def progress_on_terminal_only(args: Any) -> None:
    """Commands draw bars only when stderr is a terminal: `args.no_progress` is set otherwise, also
    for commands without a `--no-progress` flag (they read it with getattr). Without one and
    without --no-progress, `args.progress_lines` is set: the commands that run long (train, sweep,
    quickstart, data prepare, data train-tokenizer, eval) write lines instead (`command_progress`),
    which a batch job's log can hold."""
    terminal = _is_terminal(sys.stderr)
    args.progress_lines = not terminal and not getattr(args, "no_progress", False)
    if not terminal:
        args.no_progress = True


def command_progress(args: Any, bar: bool | None = True) -> bool | str | None:
    """What a command passes for `progress`: "lines" in a log file, False with --no-progress, else
    `bar` (`train` and `sweep` pass None: the run's `train.progress` decides). Arguments parsed
    without `main` (a command called from Python) have neither attribute: a bar."""
    if getattr(args, "progress_lines", False):
        return "lines"
    return False if getattr(args, "no_progress", False) else bar


class _ReaderMayLeave:
    """A command's stdout or stderr whose reader may leave: the first write or flush that finds the
    pipe closed points the stream's file descriptor at /dev/null (or, without one, drops what
    follows), and the command goes on (a sweep had stopped after its first run, exit code 0, at the
    BrokenPipeError of its next line; `2>&1 | head`, a training run at its next warning)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._gone = False  # the reader left and the stream has no descriptor to point elsewhere

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._to_devnull()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._to_devnull()

    def _to_devnull(self) -> None:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())  # what the stream still buffers goes there too
            os.close(devnull)
        except (OSError, ValueError):  # no descriptor (a StringIO, a closed stream)
            self._gone = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def reader_may_leave(active: bool) -> Iterator[None]:
    """While a command whose parser sets `outlives_reader` runs, a reader that leaves its stdout or
    stderr does not stop it (`_ReaderMayLeave`). A stream that is None (`>&-`: print writes nothing)
    is left so."""
    if not active:
        yield
        return
    saved = {name: getattr(sys, name) for name in ("stdout", "stderr")}
    guarded = {name: _ReaderMayLeave(stream) for name, stream in saved.items() if stream is not None}
    for name, stream in guarded.items():
        setattr(sys, name, stream)
    try:
        yield
    finally:
        for name, stream in guarded.items():
            stream.flush()  # before the interpreter's own flush at exit, which would report the closed pipe
            setattr(sys, name, saved[name])


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _print_json(data: Any) -> None:
    """Standard JSON: a non-finite number (an infinite word perplexity, say) is null, not Python's
    `Infinity`, which strict parsers refuse."""
    # default=float first: numpy and torch scalars become floats, which strict_json can then check.
    print(strict_json.dumps(json.loads(json.dumps(data, default=float)), indent=2))


def _cell(value: Any, fmt: str) -> str:
    """A table cell: "-" for none; a value its column's number format does not take (a damaged
    summary.json's "x" for a test NLL) as it is, not a ValueError traceback."""
    if value is None:
        return "-"
    try:
        return format(value, fmt)
    except (TypeError, ValueError):
        return str(value)


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table: columns are (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([_cell(row.get(k), fmt) for k, _, fmt in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    # Text columns (empty format) read left to right; numbers line up on the right.
    left = [not fmt for _, _, fmt in columns]
    lines = [
        "  ".join(c.ljust(w) if lj else c.rjust(w) for c, w, lj in zip(r, widths, left, strict=True)).rstrip()
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
