"""Progress where no bar can be drawn: plain lines for a log file.

A batch job's log (SLURM, `nohup`, `> log 2>&1`) is no terminal, so the command line draws no
bar there (its redraws would pile up as one endless line), and a long command said nothing until
it ended. Without a terminal the commands that run long write lines instead: training its own
(train/progress_display.py), data preparation, verification and evaluation `CountLines`, each at
most one per LINE_EVERY_S seconds plus the first and the last (`LogLines` times them all).

`progress` arguments take True (a tqdm bar), False (nothing) or "lines".
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any, Literal, TextIO

from tango_lm.errors import counted

Progress = bool | Literal["lines"]

LINE_EVERY_S = 30.0


def duration_text(seconds: float) -> str:
    """12s, 4m05s, 1h23m, 2d03h: two units at most, as an ETA is read."""
    if not math.isfinite(seconds):
        return "?"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


class LogLines:
    """When a progress line is due and its times: the first line, then one per `every_s`, or one
    forced (an evaluation, the end); the time since `start` and the ETA at the rate so far. Both
    kinds of lines (`CountLines`, training's `ProgressLines`) are said through one of these."""

    def __init__(
        self, every_s: float = LINE_EVERY_S, clock: Callable[[], float] = time.monotonic, stream: TextIO | None = None
    ) -> None:
        self.every_s, self.clock, self.stream = every_s, clock, stream
        self.start = clock()
        self.last: float | None = None  # when the last line was said

    def due(self, force: bool = False) -> bool:
        now = self.clock()
        if not (force or self.last is None or now - self.last >= self.every_s):
            return False
        self.last = now
        return True

    def elapsed(self) -> str:
        """The time from the start to the line being said (after `due`)."""
        return duration_text(self.last - self.start)

    def eta(self, done: int, left: int) -> str:
        """`left` more units at the time per unit of the `done` so far ("?" before any)."""
        return duration_text((self.last - self.start) / done * left if done > 0 else math.inf)

    def say(self, line: str) -> None:
        print(line, file=self.stream or sys.stderr, flush=True)


class CountLines:
    """The part of tqdm's interface the data commands use (update, set_postfix, set_postfix_str,
    reset, iteration, close, `with`), said as lines such as `tokenize train: 12,345/100,000 docs
    (12%), tokens 5,432,100, tok_s 4.2e+06, 1m05s elapsed, ETA 7m55s`: after the first update, at
    most one per `every_s`, and at close the count it ended at."""

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        desc: str = "",
        total: int | None = None,
        unit: str = "it",
        every_s: float = LINE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        stream: TextIO | None = None,
        **_bar_only: Any,  # tqdm's options for drawing (leave, dynamic_ncols): nothing to draw here
    ) -> None:
        if total is None and isinstance(iterable, Sized):  # as tqdm counts a list it wraps
            total = len(iterable)
        self.iterable, self.desc, self.total, self.unit = iterable, desc, total, unit
        self.lines = LogLines(every_s, clock, stream)
        self.n, self.postfix = 0, ""
        self.said_n: int | None = None
        self.closed = False

    def __iter__(self) -> Iterator[Any]:
        assert self.iterable is not None, "CountLines was given nothing to iterate"
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> CountLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.lines.due():
            self._say()

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self.postfix = ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in values.items())

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def reset(self, total: int | None = None) -> None:
        self.n, self.total, self.lines.start = 0, total, self.lines.clock()

    def close(self) -> None:
        if not self.closed and self.n and self.said_n != self.n and self.lines.due(force=True):
            self._say()
        self.closed = True

    def _say(self) -> None:
        self.said_n = self.n
        if self.total:
            count = f"{self.n:,}/{counted(self.total, self.unit)} ({self.n / self.total:.0%})"
        else:
            count = counted(self.n, self.unit)
        fields = [count, *([self.postfix] if self.postfix else []), f"{self.lines.elapsed()} elapsed"]
        if self.total and self.n:
            fields.append(f"ETA {self.lines.eta(self.n, max(self.total - self.n, 0))}")
        self.lines.say(f"{self.desc}: " + ", ".join(fields))


def progress_bar(progress: Progress, **options: Any) -> Any:
    """tqdm's bar for `progress` True (tqdm.auto: a widget in a notebook), lines for "lines",
    nothing for False; `options` are tqdm's (iterable, desc, total, unit, leave)."""
    if progress == "lines":
        return CountLines(**options)
    from tqdm.auto import tqdm

    return tqdm(**options, disable=not progress)


def token_bar(total_tokens: int, desc: str, progress: Progress) -> Any:
    """Tokens against their total, so it shows tokens/s and an ETA: those an evaluation feeds the
    model (`tango-lm eval`, `--ppl`, lm-eval's rolling log-likelihoods) or a dataset's verification
    reads (data/verify.py); tqdm's short unit on a bar, the word in lines."""
    if progress == "lines":
        return CountLines(total=total_tokens, desc=desc, unit="token")
    return progress_bar(progress, total=total_tokens, desc=desc, unit="tok", unit_scale=True, leave=False)
