"""A training run's progress as it trains: a tqdm bar on a terminal, plain lines in a log file
(progress_lines.py says why): after the first step (the run works), then at most one per
LINE_EVERY_S seconds, at each dev evaluation and at the last step, each with the loss, dev NLL,
tokens/s, MFU, peak memory, the time elapsed and the ETA.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from tqdm.auto import tqdm  # a widget in a notebook, as the bar always was

from tango_lm.progress_lines import LINE_EVERY_S, LogLines


@dataclass
class StepStats:
    """What the display shows of a step (the same numbers as its metrics.jsonl record)."""

    loss: float
    tokens_per_s: float
    mfu: float | None
    memory_mib: float
    dev_nll: float | None  # the latest dev NLL measured, at this step or before


def progress_style(progress: bool | str | None, configured: bool) -> str:
    """The display, "bar", "lines" or "none", for the command's `progress`: None, a bar if the
    run's `train.progress` asks for one; "lines", lines if it does (a command without a terminal);
    True or False, a bar or nothing whatever the run says."""
    if progress is None or progress == "lines":
        return ("bar" if progress is None else "lines") if configured else "none"
    if isinstance(progress, bool):
        return "bar" if progress else "none"
    raise ValueError(f"progress must be None, a bool or 'lines', not {progress!r}")


class _Bar:
    def __init__(self, desc: str, total: int, initial: int) -> None:
        self.bar = tqdm(total=total, initial=initial, unit="step", desc=desc, dynamic_ncols=True)

    def update(self, step: int, stats: StepStats, milestone: bool = False) -> None:
        self.bar.set_postfix(
            loss=f"{stats.loss:.3f}",
            tok_s=f"{stats.tokens_per_s:,.0f}",
            mfu=f"{stats.mfu:.1%}" if stats.mfu is not None else "-",
            mem=f"{stats.memory_mib:,.0f}MiB",
            dev=f"{stats.dev_nll:.3f}" if stats.dev_nll is not None else "-",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class ProgressLines:
    """One line per update that is due: the first, one LINE_EVERY_S after the last line, a
    milestone (a dev evaluation) or the last step. The ETA is the mean wall time per step since
    the display started (evaluations and saves included) times the steps left."""

    def __init__(
        self,
        desc: str,
        total: int,
        initial: int,
        every_s: float = LINE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        stream: TextIO | None = None,
    ) -> None:
        self.desc, self.total, self.initial = desc, total, initial
        self.lines = LogLines(every_s, clock, stream)

    def update(self, step: int, stats: StepStats, milestone: bool = False) -> None:
        if not self.lines.due(force=milestone or step >= self.total):
            return
        fields = [
            f"loss {stats.loss:.3f}",
            f"dev {stats.dev_nll:.3f}" if stats.dev_nll is not None else "dev -",
            f"{stats.tokens_per_s:,.0f} tok/s",
            f"MFU {stats.mfu:.1%}" if stats.mfu is not None else "MFU -",
            f"{stats.memory_mib:,.0f} MiB",
            f"{self.lines.elapsed()} elapsed",
            f"ETA {self.lines.eta(step - self.initial, self.total - step)}",
        ]
        self.lines.say(f"{self.desc}: step {step:,}/{self.total:,} ({step / self.total:.0%}), " + ", ".join(fields))

    def close(self) -> None:
        pass


class _Nothing:
    def update(self, step: int, stats: StepStats, milestone: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


def progress_display(style: str, desc: str, total: int, initial: int) -> Any:
    """The display of `progress_style`: update(step, StepStats, milestone) after each step, then close()."""
    if style == "bar":
        return _Bar(desc, total, initial)
    if style == "lines":
        return ProgressLines(desc, total, initial)
    return _Nothing()
