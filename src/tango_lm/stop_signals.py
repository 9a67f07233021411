"""Stopping a command from outside without losing what it did.

`timeout`, `kill`, a container's stop and a cluster's time limit send SIGTERM; Ctrl-C sends SIGINT,
which Python raises as KeyboardInterrupt. Inside `stop_on_sigterm`, SIGTERM raises `Stopped` the
same way, so that `train`, `sweep` and `bench` end as they do on Ctrl-C (a checkpoint being written
removed, the loggers closed, a bench's report printed) and exit with 128 + the signal's number, as
a process killed by it would: 143 for SIGTERM, 130 for SIGINT.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Stopped(BaseException):
    """SIGTERM arrived. A BaseException, as KeyboardInterrupt is, so that no `except Exception`
    on the way (torch's, the compiler's) takes it for an error of its own. `note`: what the
    command adds to its `stopped by SIGTERM` line (how to continue)."""

    def __init__(self, signum: int, note: str = "") -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.signal = signal.Signals(signum).name
        self.note = note


STOPS = (Stopped, KeyboardInterrupt)  # what stops a command: SIGTERM (inside stop_on_sigterm), SIGINT


def signal_name(stop: BaseException) -> str:
    """'SIGTERM' or 'SIGINT' for one of `STOPS`."""
    return stop.signal if isinstance(stop, Stopped) else "SIGINT"


def with_note(stop: BaseException, note: str) -> BaseException:
    """The stop (`Stopped` or KeyboardInterrupt) again, carrying what its command's last line adds."""
    return Stopped(stop.signum, note) if isinstance(stop, Stopped) else KeyboardInterrupt(note)


def stop_message(stop: BaseException) -> str:
    """The line a stopped command ends with: 'interrupted; NOTE' (Ctrl-C) or 'stopped by SIGTERM; NOTE'."""
    if isinstance(stop, Stopped):
        return f"stopped by {stop.signal}; {stop.note}" if stop.note else f"stopped by {stop.signal}"
    return f"interrupted; {stop}" if str(stop) else "interrupted"


def exit_code(name: str) -> int:
    """The shell's code for a process ended by signal `name`: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + signal.Signals[name].value


# `timeout` (without --foreground) sends its SIGTERM to the process and then to its whole process
# group: the command gets it twice at once. A second one this soon after the first is that echo.
ECHO_S = 2.0


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises `Stopped` inside the block (main thread only: Python runs handlers there).
    The first one only: a second within `ECHO_S` is ignored (it killed a bench waiting on a child
    before it printed its report, and would a run closing its loggers), a later one gets the previous handler, so a second SIGTERM (or
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
