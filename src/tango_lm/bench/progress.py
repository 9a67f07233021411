"""What a running benchmark is doing, on stderr (its report goes to stdout).

The suites alternate their models run by run, so a round (every model once) is their unit. On a
terminal a bar counts the runs, names the one under way and gives the ETA; in a log (stderr not a
terminal, as under `tools/gpu_suites.sh`) one line per warm-up run with its seconds, where
compiling (torch.compile, CUDA graphs, Triton's autotuning) shows, and one per timed round with
the time left, so a suite stopped by a time limit leaves in its log how far it got and what took
the time. Used as a context manager, it closes itself and names a stop that ended the block.
A suite whose every run is a whole measurement (the memory suite's subprocesses) asks
for a line per run (`every_run`). `tango-lm bench` picks "bar" or "lines" by its stderr, "none" with `--quiet` (the
library's default: a caller that wants progress asks for it).
"""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm

from tango_lm.stop_signals import STOPS, signal_name

MODES = ("bar", "lines", "none")
LINE_EVERY_S = 10.0  # a log gets a timed-round line at most this often


class Progress:
    """Progress of `rounds` rounds of `runs_per_round` runs, the first `warmup_rounds` untimed."""

    def __init__(
        self,
        suite: str,
        rounds: int,
        runs_per_round: int,
        warmup_rounds: int,
        mode: str = "none",
        every_run: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r}: one of {', '.join(MODES)}")
        self.suite, self.rounds, self.warmup, self.every_run = suite, rounds, warmup_rounds, every_run
        self.runs, self.total = 0, rounds * runs_per_round
        self.enabled, self.terminal = mode != "none", mode == "bar"
        self.start = self.round_start = self.last_line = time.perf_counter()
        self.bar = tqdm(total=self.total, desc=suite, unit="run", disable=not self.terminal, leave=False)

    def run_start(self, label: str) -> None:
        if self.terminal:
            self.bar.set_description_str(f"{self.suite} {label}")

    def run_done(self, round_index: int, label: str, seconds: float) -> None:
        """One model's run of round `round_index` (0-based; the first `warmup_rounds` are warm-up)."""
        self.runs += 1
        if self.terminal:
            self.bar.set_postfix_str(f"last {seconds:.1f} s", refresh=False)
            self.bar.update(1)
        elif self.enabled and round_index < self.warmup:
            self._line(f"warm-up {round_index + 1}/{self.warmup}: {label} {seconds:.1f} s")
        elif self.enabled and self.every_run:
            self._line(f"{self.runs}/{self.total}: {label} {seconds:.1f} s")

    def round_done(self, round_index: int) -> None:
        """In lines: the first timed round, then at most one line per LINE_EVERY_S seconds."""
        now = time.perf_counter()
        timed, done = self.rounds - self.warmup, round_index + 1 - self.warmup
        if self.enabled and not self.terminal and done > 0 and (done == 1 or now - self.last_line >= LINE_EVERY_S):
            left = (now - self.round_start) * (timed - done)
            self._line(f"timed round {done}/{timed}: {now - self.round_start:.1f} s (about {left:.0f} s left)")
            self.last_line = now
        self.round_start = now

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type | None, stop: BaseException | None, traceback: object) -> None:
        """Closes it; a stop (SIGTERM, Ctrl-C) leaving the block is named in the last line."""
        self.close(signal_name(stop) if isinstance(stop, STOPS) else None)

    def close(self, stopped_by: str | None = None) -> None:
        self.bar.close()
        if self.enabled:
            how = f"stopped by {stopped_by} after" if stopped_by else "done in"
            self._line(f"{how} {time.perf_counter() - self.start:.1f} s")

    def _line(self, text: str) -> None:
        print(f"{self.suite}: {text}", file=sys.stderr, flush=True)
