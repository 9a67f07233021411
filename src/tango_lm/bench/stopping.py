"""Stopping a benchmark early without losing what it measured.

A long suite on a lent or batch-scheduled GPU is often ended from outside: `timeout` and a
cluster's time limit send SIGTERM, a user presses Ctrl-C (SIGINT). Inside `stop_on_sigterm`,
SIGTERM raises `Stopped`, as SIGINT raises `KeyboardInterrupt`; every suite catches either in its
timed rounds (`StopRecord`) and reports what those rounds measured, the report names the suite
stopped, and `tango-lm bench` prints it (table or JSON) before it exits with 128 + the signal's
number, as a process killed by it would.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


class Stopped(BaseException):
    """SIGTERM arrived. A BaseException, as KeyboardInterrupt is, so that no `except Exception`
    on the way (torch's, the compiler's) takes it for an error of its own."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signal = signal.Signals(signum).name


STOPS = (Stopped, KeyboardInterrupt)  # what ends a benchmark early: SIGTERM, SIGINT


def signal_name(stop: BaseException) -> str:
    """'SIGTERM' or 'SIGINT' for one of `STOPS`."""
    return stop.signal if isinstance(stop, Stopped) else "SIGINT"


class StopRecord:
    """The stop that ended a suite's `timed_rounds` early, if one did: `record` is None or
    {"signal", "timed_rounds_done", "timed_rounds"}, as the suite's report carries it."""

    def __init__(self, timed_rounds: int) -> None:
        self.timed_rounds = timed_rounds
        self.record: dict[str, Any] | None = None

    def stop(self, stop: BaseException, timed_rounds_done: int) -> None:
        self.record = {
            "signal": signal_name(stop),
            "timed_rounds_done": max(0, timed_rounds_done),
            "timed_rounds": self.timed_rounds,
        }

    def unless_stopped(self, measure: Callable[[], T]) -> T | None:
        """What a suite measures after its rounds, until a stop: then None (the rounds still count)."""
        if self.record is not None:
            return None
        try:
            return measure()
        except STOPS as stop:
            self.stop(stop, self.timed_rounds)
            return None


def stopped_line(stopped: dict[str, Any], counted: str, meaning: str = "") -> str:
    """The line under a stopped suite's table: 'STOPPED by SIGTERM after 2 of 8 {counted}: {meaning}'."""
    line = f"STOPPED by {stopped['signal']} after {stopped['timed_rounds_done']} of {stopped['timed_rounds']} {counted}"
    return f"{line}: {meaning}" if meaning else line


def exit_code(name: str) -> int:
    """The shell's code for a process ended by signal `name`: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + signal.Signals[name].value


# `timeout` (without --foreground) sends its SIGTERM to the process and then to its whole process
# group: the bench gets it twice at once. A second one this soon after the first is that echo.
ECHO_S = 2.0


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises `Stopped` inside the block (main thread only: Python runs handlers there).
    The first one only: a second within `ECHO_S` is ignored (it killed a bench waiting on a child
    before it printed its report), a later one gets the previous handler, so a second SIGTERM (or
    `timeout --kill-after`'s SIGKILL) still ends a process that does not stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    first: list[float] = []

    def stop(signum: int, frame: Any) -> None:
        if not first:
            first.append(time.monotonic())
            raise Stopped(signum)
        if time.monotonic() - first[0] < ECHO_S:
            return
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action: end the process, as the signal would
            os.kill(os.getpid(), signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
