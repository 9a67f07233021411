"""What a run directory is, and what `train` checks before it writes one.

A directory holds a run when any of `RUN_FILES` is in it: the config files, the metrics log, the
best-dev record, the summary or the checkpoints. A fresh `train` (no `--resume`) refuses such a
directory, whichever of them it holds, so two runs never mix their records.

Before anything is written, `claim_run_dir` checks, reading only:

- `train.out_dir` is a directory (or does not exist yet), its `checkpoints` too;
- it is not inside a prepared dataset (a run there would be renamed away or replaced with it), nor
  inside another run (two runs' files in one tree, which `report` and `eval` read as one);
- the nearest existing directory on its path is writable, and so are the run files a resume appends to;

then takes the run directory's lock (`output_lock.py`; rank 0 alone under torchrun, since only rank
0 writes run files) and, under it, checks what the directory holds: run files without `--resume`
are refused, and so is a `checkpoints` that is a file or run files that cannot be written. Every
rank runs the checks, so under torchrun they all stop with the same error; but where rank 0 empties
the directory of an earlier attempt's files first (a sweep job's `prepared_by_rank_0`), the other
ranks do not look for run files: they could see them before rank 0 removed them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tango_lm.errors import UserError
from tango_lm.output_lock import hold_output_lock
from tango_lm.train.checkpoint import STEP_DIR, complete_steps, restore_interrupted_saves, step_of
from tango_lm.train.loggers import LOGGERS

__all__ = [
    "RUN_FILES",
    "FAILED_ATTEMPT_FILES",
    "run_files",
    "remove_run_files",
    "holds_run",
    "is_run_dir",
    "enclosing",
    "claim_run_dir",
]

RUN_FILES = ("config.json", "config.yaml", "metrics.jsonl", "best.json", "summary.json", "checkpoints")
# A sweep's record of a run's latest attempt that failed (sweep/runner.py); `report` leaves such a
# run out, and a run that finishes (a sweep's retry, or `train RUN --resume` after the error) removes them.
FAILED_ATTEMPT_FILES = ("failed.json", "failed.log")
_APPENDED = ("metrics.jsonl",)  # written in place on resume; the others are replaced by rename


def run_files(path: str | os.PathLike) -> list[str]:
    """The run files present in directory `path` (none when it is not a directory)."""
    p = Path(path)
    if not p.is_dir():
        return []
    return [name for name in RUN_FILES if os.path.lexists(p / name)]


def remove_run_files(path: str | os.PathLike) -> None:
    """Delete the run files in directory `path` (a fresh start: `quickstart --fresh`, a sweep's
    retry); any other file there stays, and so does a `checkpoints` that is a file (training
    refuses it with its own error). A linked `checkpoints` loses the link, not what it links to.
    The caller holds the run's lock."""
    for name in run_files(path):
        p = Path(path) / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.is_symlink() or name != "checkpoints":  # a link goes, not what it links to
            p.unlink()
    # A logger's own files (W&B's run id) are no run files: a start that W&B opened and another
    # logger then stopped leaves them, and the same command runs again. A fresh start removes them,
    # or the new run would continue the old W&B run.
    for name in {name for logger in LOGGERS.values() for name in logger.fresh_start_files}:
        kept = Path(path) / name
        if kept.is_file() or kept.is_symlink():
            kept.unlink()


def holds_run(path: str | os.PathLike) -> bool:
    """Whether `path` holds any run file (what a fresh `train` refuses to write into)."""
    return bool(run_files(path))


def is_run_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is a tango-lm run: its config.json is a run config, or it holds a complete
    checkpoint. Stricter than `holds_run`, for the directories above an output (a stray
    config.json in a project folder does not make it a run)."""
    p = Path(path)
    try:
        config = json.loads((p / "config.json").read_text())
        if isinstance(config, dict) and {"model", "data", "train"} <= set(config):
            return True
    except (OSError, ValueError):
        pass
    return bool(complete_steps(p / "checkpoints"))


def enclosing(path: str | os.PathLike, predicate: Callable[[Path], bool]) -> Path | None:
    """The first of `path` and its ancestors for which `predicate` holds, or None."""
    p = Path(path).absolute()
    for candidate in (p, *p.parents):
        if candidate.is_dir() and predicate(candidate):
            return candidate
    return None


def enclosing_dataset_or_run(path: str | os.PathLike) -> tuple[Path, str] | None:
    """(the prepared dataset or run directory that `path` is or lies in, "prepared dataset" or "run
    directory"), or None: an output put there would go when the dataset is prepared again, or lie
    among the run's own files."""
    from tango_lm.data.dataset_dir import is_prepared

    for predicate, what in ((is_prepared, "prepared dataset"), (is_run_dir, "run directory")):
        holder = enclosing(path, predicate)
        if holder is not None:
            return holder, what
    return None


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor)


def _check_place(out: Path) -> None:
    from tango_lm.data.dataset_dir import is_prepared

    if out.exists() and not out.is_dir():
        raise UserError(f"train.out_dir {out} is a file, not a directory; set train.out_dir to a directory")
    dataset = enclosing(out, is_prepared)
    if dataset is not None:
        raise UserError(
            f"train.out_dir {out} is inside the prepared dataset {dataset}; set train.out_dir to a directory outside it"
        )
    outer = enclosing(out.absolute().parent, is_run_dir)  # its report, eval and pruning would meet this run
    if outer is not None:
        raise UserError(
            f"train.out_dir {out} is inside the run directory {outer}; set train.out_dir to a directory outside it"
        )
    base = _nearest_existing(out.absolute())
    if not base.is_dir():
        raise UserError(f"train.out_dir {out} lies under {base}, which is a file; set train.out_dir to a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UserError(
            f"cannot write to {base} (no permission, or a read-only file system); make it writable "
            "or set train.out_dir to a writable directory"
        )


def _check_contents(out: Path, resume: bool, run_files_checked: bool = True) -> None:
    ckpt = out / "checkpoints"
    if os.path.lexists(ckpt) and not ckpt.is_dir():
        raise UserError(f"{ckpt} is a file, not a checkpoint directory; move it away and run again")
    if ckpt.is_dir():  # a step name this run will save under, taken by a link or a file: refused at its save,
        saved = complete_steps(ckpt)  # after the run had rewritten its config and trained
        latest = step_of(saved[-1]) if saved else -1
        for entry in ckpt.iterdir():
            if (
                STEP_DIR.fullmatch(entry.name)
                and (entry.is_symlink() or not entry.is_dir())
                and step_of(entry) > latest
            ):
                kind = "link" if entry.is_symlink() else "file"
                raise UserError(f"{entry} is a {kind}, not a checkpoint directory; move it away and run again")
    if not resume and run_files_checked:
        found = run_files(out)
        if found:
            raise UserError(
                f"{out} already holds a run ({', '.join(found)}); pass --resume to continue that run "
                "or set train.out_dir to a new directory"
            )
    for target in [ckpt, *(out / name for name in _APPENDED)]:
        if target.exists() and not os.access(target, os.W_OK | (os.X_OK if target.is_dir() else 0)):
            raise UserError(
                f"cannot write to {target} (no permission, or a read-only file system); make it "
                "writable or set train.out_dir to another directory"
            )


@contextlib.contextmanager
def claim_run_dir(
    run: Any, resume: bool, main_process: bool = True, prepared_by_rank_0: bool = False
) -> Iterator[None]:
    """Check `run.train.out_dir` and hold its lock for the body of the `with` block. What the
    directory holds is checked under the lock (a writer that holds it reports that first)."""
    out = Path(run.train.out_dir)
    _check_place(out)
    with hold_output_lock(out, "tango-lm train", "set train.out_dir to another directory", enabled=main_process):
        _check_contents(out, resume, run_files_checked=main_process or not prepared_by_rank_0)
        if resume and main_process:  # before the checkpoints are listed: a kill mid-save loses no step
            restore_interrupted_saves(out / "checkpoints")
        yield
