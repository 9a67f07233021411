"""A measurement in a fresh interpreter: `python -m MODULE --child JSON` prints its result as the
last line of its stdout. A fresh process has its own allocator high-water mark and nothing another
measurement left behind (the memory suite's rows, the head bench's variants). Its failures become
this process's own: a UserError it raised is the user's one line; an allocation it could not make,
or the out-of-memory killer, a MemoryError (the suites keep what they measured before it); anything
else a RuntimeError with the end of its traceback (a bug stays a bug)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from typing import Any

from tango_lm.errors import UserError

USER_ERROR_PREFIX = "tango_lm.errors.UserError: "  # how a child's uncaught UserError ends its stderr


def is_out_of_memory_text(text: str) -> bool:
    """Whether an error's text is an allocator's refusal: CUDA's OutOfMemoryError, Python's
    MemoryError, or the CPU allocator's RuntimeError ("... can't allocate memory ...")."""
    return any(said in text for said in ("can't allocate memory", "OutOfMemoryError", "MemoryError", "out of memory"))


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation that failed here or in a child (the sizes asked for are past
    the machine's)."""
    import torch

    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and is_out_of_memory_text(str(exc))
    )


def run_child(module: str, args: dict[str, Any], what: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `python -m module --child JSON(args)` and return the JSON of its last stdout line;
    `what` names the measurement in errors ("the memory measurement of dense/standard")."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--child", json.dumps(args)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if proc.returncode != 0:
        user_error = [line for line in proc.stderr.splitlines() if line.startswith(USER_ERROR_PREFIX)]
        if user_error:  # the child's one-line error is the user's, as if raised here
            raise UserError(user_error[-1].removeprefix(USER_ERROR_PREFIX))
        if proc.returncode < 0:  # the kernel's out-of-memory killer picks the process allocating: this one
            name = signal.Signals(-proc.returncode).name if -proc.returncode in signal.valid_signals() else "a signal"
            raise MemoryError(f"{what} was killed by {name} (the out-of-memory killer, or a limit)")
        allocation = [line for line in proc.stderr.splitlines() if is_out_of_memory_text(line)]
        if allocation:  # the child's allocator refused: the line that says how much
            raise MemoryError(f"{what}: {allocation[-1].strip()[:300]}")
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
