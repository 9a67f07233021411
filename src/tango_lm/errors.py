"""The one exception type a user can cause.

`UserError` carries a single sentence that says what was wrong and what to do. The CLI prints it
as `error: ...` and exits with code 2, without a traceback; library callers can catch it.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Iterable
from typing import NoReturn


class UserError(Exception):
    """A problem with the user's config, data, checkpoint or arguments (exit code 2)."""

    exit_code = 2


def os_error_text(exc: OSError) -> str:
    """`reason (path)` of an OSError, e.g. `No space left on device (runs/x/metrics.jsonl)`."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    return f"{reason} ({exc.filename})" if exc.filename else reason


def option(name: str) -> str:
    """An option as Python and the command line both spell it, for errors read by users of either:
    `max_docs` -> `max_docs (--max-docs)`."""
    return f"{name} (--{name.replace('_', '-')})"


def counted(n: int, noun: str) -> str:
    """`1 token`, `1,024 tokens`: a count with its noun in the number the count needs."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice closest to a mistyped `word`, or None when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.7)
    return close[0] if close else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the choice closest to a mistyped `word`, or nothing when none is close."""
    match = closest(word, choices)
    return f" (did you mean {match!r}?)" if match else ""


def run_script(main: Callable[[], int | None]) -> NoReturn:
    """A script's entry point (tools/*.py): exits with `main`'s code, and a UserError it raises is
    one line `error: ...` and exit code 2, as the CLI prints it, not a traceback."""
    try:
        code = main()
    except UserError as exc:
        from tango_lm.cli.output import one_line  # the CLI's own rendering of the one line

        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        code = exc.exit_code
    sys.exit(code or 0)


def path_arg(text: str) -> str:
    """An argparse type for an output path: an empty one (an unset shell variable) is refused, not
    read as the current directory (`quickstart --out ""` generated its data and runs there)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file or directory")
    return text
