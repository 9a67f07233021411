"""Stopping a benchmark early without losing what it measured.

A long suite on a lent or batch-scheduled GPU is often ended from outside: `timeout` and a
cluster's time limit send SIGTERM, a user presses Ctrl-C (SIGINT). Inside `stop_on_sigterm`,
SIGTERM raises `Stopped`, as SIGINT raises `KeyboardInterrupt`; every suite catches either in its
timed rounds (`StopRecord`) and reports what those rounds measured, the report names the suite
stopped, and `tango-lm bench` prints it (table or JSON) before it exits with 128 + the signal's
number, as a process killed by it would (`stop_signals.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from tango_lm.stop_signals import STOPS, signal_name

T = TypeVar("T")


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
