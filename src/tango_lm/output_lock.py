"""One writer per output directory: an exclusive OS file lock (`flock`) on a lock file.

`train` (fresh or `--resume`) and `sweep` lock `OUT/.lock` inside their output directory; `data
prepare` locks `.NAME.lock` beside its `--out` (a dataset is renamed into place as a whole, so a
lock file inside it would leave with the copy it replaces). The lock is taken before the command
writes anything and held until it ends.

The OS releases a `flock` when its process dies, however it dies, so there is no stale lock to
guess about: the lock file a killed process leaves behind is simply taken by the next writer. The
holder writes its pid, host, start time and command into the file, and a refused writer names
them in its one-line error. A process may take a lock it already holds (a sweep locks each run
directory before the trainer does); it is released when the outermost holder lets go.

On release the lock file is removed, and so are the directories created to hold it when they
stayed empty: a command refused after taking the lock leaves nothing behind. A writer that took
the lock on a file another process was just removing notices (the path no longer names the file
it locked) and takes the lock again on the new file.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from tango_lm.errors import UserError

__all__ = ["LOCK_NAME", "OutputLocked", "hold_output_lock", "lock_file_for"]

LOCK_NAME = ".lock"
_held: dict[str, int] = {}  # lock files this process holds -> nesting depth


class OutputLocked(UserError):
    """Another process holds the lock on the output directory."""


def lock_file_for(directory: str | os.PathLike, beside: bool = False) -> Path:
    """The lock file of `directory`: `DIR/.lock`, or `.NAME.lock` in its parent when `beside`."""
    d = Path(os.path.abspath(directory))
    return d.parent / f".{d.name}.lock" if beside else d / LOCK_NAME


@contextlib.contextmanager
def hold_output_lock(
    directory: str | os.PathLike, command: str, hint: str, *, beside: bool = False, enabled: bool = True
) -> Iterator[Path]:
    """Hold the exclusive lock on output `directory` for the body of the `with` block.

    `command` names what holds it (shown to a refused writer); `hint` ends the refusal ("choose
    another train.out_dir"). Raises `OutputLocked` when another process holds the lock and
    `UserError` when the lock file cannot be created. `enabled=False` (torchrun ranks other than
    0, which write nothing) takes no lock. Yields the lock file's path.
    """
    lock = lock_file_for(directory, beside)
    try:
        import fcntl  # noqa: F401 - POSIX only; elsewhere outputs are not locked
    except ImportError:
        enabled = False
    key = str(lock)
    if not enabled:
        yield lock
        return
    if key in _held:  # this process holds it already
        _held[key] += 1
        try:
            yield lock
        finally:
            _held[key] -= 1
        return
    created = _make_parents(lock.parent, directory)
    try:
        fd = _acquire(lock, directory, command, hint)
    except BaseException:
        _remove_empty(created)
        raise
    _held[key] = 1
    try:
        yield lock
    finally:
        del _held[key]
        with contextlib.suppress(OSError):
            os.unlink(lock)  # before unlocking: a writer waiting on this file sees it is gone
        os.close(fd)
        _remove_empty(created)


def _make_parents(parent: Path, directory: str | os.PathLike) -> list[Path]:
    """Create `parent` and its missing ancestors; returns the ones created, outermost first."""
    missing = []
    p = parent
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            pass
        except OSError as exc:
            _remove_empty([m for m in reversed(missing) if m != d])
            raise UserError(
                f"cannot create {d} for output {directory} ({exc.strerror or exc}); choose a writable location"
            ) from None
    return list(reversed(missing))


def _remove_empty(created: list[Path]) -> None:
    for d in reversed(created):  # innermost first
        try:
            d.rmdir()
        except OSError:
            return  # not empty (another writer uses it) or gone


def _acquire(lock: Path, directory: str | os.PathLike, command: str, hint: str) -> int:
    import fcntl

    for _ in range(100):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise UserError(
                f"cannot create the lock file {lock} for {directory} ({exc.strerror or exc}); "
                "choose a writable location"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise OutputLocked(f"{directory} is in use by {holder}; wait for it to finish or {hint}") from None
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):  # no lock works here: leave no file (a holder's has its note)
                if os.stat(lock).st_size == 0:
                    os.unlink(lock)
            raise UserError(
                f"cannot lock {lock} ({exc.strerror or exc}); the file system does not support file locks, {hint}"
            ) from None
        try:
            same = os.path.samestat(os.stat(lock), os.fstat(fd))
        except FileNotFoundError:
            same = False
        if same:
            _write_holder(fd, command)
            return fd
        os.close(fd)  # we locked a file its holder had just removed: lock the new one
    raise UserError(f"cannot lock {lock}: it keeps being replaced; {hint}")


def _write_holder(fd: int, command: str) -> None:
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": command,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    data = (json.dumps(info) + "\n").encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError:
        pass  # the lock holds without the note; a refused writer then says "another process"


def _describe_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        return f"{info['command']} (pid {int(info['pid'])} on host {info['host']}, started {info['started']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another tango-lm process (it has only just started)"
