"""Checkpoints that lose nothing.

A checkpoint is a step directory `checkpoints/step-00000100/` holding

- `model.safetensors`: the weights (readable without unpickling anything);
- `train_state.pt`: optimizer, step, loader position, RNG and best-dev record, loaded only with
  `torch.load(weights_only=True)`;
- `config.json` (the whole run config), `tokenizer.json`, `meta.json` (with the sha256 of the
  weights, the train state, the config and the tokenizer: a file damaged or changed on disk is
  refused when it is read), and non-finite weights are refused (none is ever saved);
- `COMPLETE`: written last. A directory without it does not count.

It is written under a temporary name and renamed into place, so a run killed mid-save leaves the
previous checkpoint as the latest loadable one.

The sharded layout (`shards/`, torch.distributed.checkpoint) is in sharded_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tango_lm.errors import UserError
from tango_lm.train.checkpoint_files import check_sum, file_sha256, read_step_json

FORMAT = "tango-lm-checkpoint/1"
MARKER = "COMPLETE"
SHARDS = "shards"
REPLACED = ".replaced-"  # a step directory a re-save of its step moved aside (put back if the save dies)
LEFTOVERS = (".tmp-", ".old-", REPLACED)  # what interrupted saves and prunes leave beside the steps
# Their sha256 in meta.json, and each shard's as "shards/NAME" (checkpoints before it have none).
SUMMED = ("model.safetensors", "train_state.pt")
# Summed too (checkpoints before it have no sum of them): a flipped bit in config.json's depth or
# rope_theta built another model on the same weights, and eval printed its numbers.
DESCRIBED = ("config.json", "tokenizer.json")


@dataclass
class Checkpoint:
    path: Path
    config: dict[str, Any]
    tokenizer: dict[str, Any]
    meta: dict[str, Any]
    # Opened through its run directory: the run's train settings as it ended (config.json at the
    # top), which a --resume may have changed (test_windows, select) since this step was saved.
    run_train: dict[str, Any] | None = None

    @property
    def trained_length(self) -> int:
        """Positions the run trained (train.seq_len, at most the context); eval and lm-eval score
        windows of this length, and a longer sequence reads positions the model never learned."""
        context, train = self.config["model"]["context_length"], self.config.get("train")
        return min((train.get("seq_len") if isinstance(train, dict) else None) or context, context)

    def untrained_positions_note(self, positions: int, what: str) -> str | None:
        """A warning when `what` reads past the trained positions (None when it does not, and past
        the context, which is an error of its own)."""
        trained, context = self.trained_length, self.config["model"]["context_length"]
        if not trained < positions <= context:
            return None
        return (
            f"warning: {what} reads up to position {positions}, past the {trained} the run trained on "
            f"(train.seq_len={trained}, model.context_length={context}); what the model does there is untrained"
        )

    @property
    def layout(self) -> str:
        """'full' (model.safetensors + train_state.pt) or 'sharded' (DCP shards, see above)."""
        return self.meta.get("layout", "full")

    def model_state(self) -> dict[str, torch.Tensor]:
        if self.layout == "sharded":
            from tango_lm.train.sharded_checkpoint import load_sharded_model

            state = load_sharded_model(self.path, self.meta)
        else:
            self._check_sum("model.safetensors")
            try:
                state = load_file(str(self.path / "model.safetensors"))
            except (SafetensorError, OSError, ValueError) as exc:
                raise UserError(
                    f"checkpoint {self.path} has unreadable weights ({exc}); use another checkpoint"
                ) from None
        for name, tensor in state.items():  # no checkpoint is saved from non-finite weights (train/nonfinite.py)
            if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
                what = "non-finite values" if tensor.is_floating_point() else f"{tensor.dtype} values"
                raise UserError(f"checkpoint {self.path} has {what} in {name}; it is corrupt, use another checkpoint")
        return state

    def build_model(self, device: str | torch.device = "cpu") -> torch.nn.Module:
        """The model this checkpoint holds, in eval mode."""
        from tango_lm.data.tokenizers import tokenizer_from_dict
        from tango_lm.models.config import ModelConfig
        from tango_lm.models.model import build_model

        model = build_model(ModelConfig.from_dict(dict(self.config["model"])))
        ids = tokenizer_from_dict(self.tokenizer).vocab_size  # never more than the rows: training refuses it
        if ids > model.config.vocab_size:  # serve started and answered every request with a 500
            raise UserError(
                f"checkpoint {self.path} has a tokenizer of {ids:,} ids for a model of {model.config.vocab_size:,}"
                " rows; it is corrupt, use another checkpoint"
            )
        try:
            model.load_state_dict(self.model_state())
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0]
            raise UserError(f"checkpoint {self.path} does not fit its own config ({first}); it is corrupt") from None
        return model.to(device).eval()

    def train_state(self) -> dict[str, Any]:
        self._check_sum("train_state.pt")
        try:
            return torch.load(self.path / "train_state.pt", map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure here means a corrupt file
            raise UserError(
                f"checkpoint {self.path} has an unreadable train_state.pt ({type(exc).__name__}); "
                "resume from another checkpoint"
            ) from None

    def _check_sum(self, name: str) -> None:
        check_sum(self.path, self.meta, name)


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(step_dir: Path) -> int:
    """The step of a step directory (`step_dir_name`'s inverse)."""
    return int(step_dir.name.split("-")[1])


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_step_dir(ckpt_root: Path, step: int, tag: int | str) -> Path:
    """`.tmp-step-N-TAG`, where a step directory is written (TAG: the writing process's pid, or
    rank 0's under torchrun, so every rank writes its shard into the same one)."""
    return ckpt_root / f".tmp-{step_dir_name(step)}-{tag}"


def begin_checkpoint(ckpt_root: Path, step: int, tag: int | str) -> Path:
    """Create the empty temporary step directory `tmp_step_dir(...)` and return it."""
    tmp = tmp_step_dir(ckpt_root, step, tag)
    try:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as exc:
        raise write_failed(ckpt_root, step, exc) from None
    return tmp


def remove_unfinished(tmp: Path) -> None:
    """Remove a temporary step directory a stopped save left half written (Ctrl-C, SIGTERM): one
    that holds the COMPLETE marker stays, since a resume takes it up."""
    if tmp.is_dir() and not tmp.is_symlink() and not (tmp / MARKER).exists():
        shutil.rmtree(tmp, ignore_errors=True)


def write_failed(ckpt_root: Path, step: int, exc: BaseException) -> UserError:
    """The error of a save that failed (a full disk, a folder made read-only): one line, what to do."""
    text = str(exc).strip()
    reason = getattr(exc, "strerror", None) or (text.splitlines()[0][:200] if text else type(exc).__name__)
    with contextlib.suppress(OSError):  # torch.save says only "unexpected pos 576 vs 534" when the disk is full
        reason += f"; {shutil.disk_usage(ckpt_root).free / 2**20:,.1f} MiB free there"
    return UserError(
        f"cannot write checkpoint {step_dir_name(step)} in {ckpt_root} ({reason}); the partial copy was "
        "removed and earlier checkpoints are intact: free disk space or fix the folder's permissions, "
        "then continue with --resume"
    )


def _same_mode(directory: Path) -> None:
    """Give every file the mode our own JSON files got (safetensors writes 0600 whatever the umask)."""
    mode = (directory / "config.json").stat().st_mode & 0o777
    for p in directory.rglob("*"):
        if p.is_file() and (p.stat().st_mode & 0o777) != mode:
            os.chmod(p, mode)


def finish_checkpoint(
    tmp: Path,
    step: int,
    model_state: dict[str, torch.Tensor] | None,
    train_state: dict[str, Any],
    config: dict[str, Any],
    tokenizer: dict[str, Any],
    meta: dict[str, Any],
) -> Path:
    """Write the rest of a step directory begun by `begin_checkpoint` (weights unless it holds
    shards), mark it complete and rename it into place; return its final path. When a write fails
    (a full disk, whichever writer finds it) the temporary directory is removed and a UserError
    raised; earlier steps stay. Stopped (Ctrl-C, SIGTERM), it removes the directory unless complete."""
    try:
        return _finish(tmp, step, model_state, train_state, config, tokenizer, meta)
    except (OSError, SafetensorError, RuntimeError) as exc:  # safetensors and torch.save report a full disk so
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(tmp.parent, step, exc) from None
    except BaseException:  # Ctrl-C or SIGTERM mid-write: no half copy is left for good
        remove_unfinished(tmp)
        raise


def _finish(
    tmp: Path,
    step: int,
    model_state: dict[str, torch.Tensor] | None,
    train_state: dict[str, Any],
    config: dict[str, Any],
    tokenizer: dict[str, Any],
    meta: dict[str, Any],
) -> Path:
    layout: dict[str, Any] = {}
    if model_state is not None:
        state = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": FORMAT})
        _fsync_file(tmp / "model.safetensors")
    else:
        from tango_lm.train.sharded_checkpoint import shard_manifest

        layout = {"layout": "sharded", "shards": shard_manifest(tmp / SHARDS)}
    torch.save(train_state, tmp / "train_state.pt")
    _fsync_file(tmp / "train_state.pt")
    _write_json(tmp / "config.json", config)
    _write_json(tmp / "tokenizer.json", tokenizer)
    summed = [*SUMMED, *DESCRIBED, *(f"{SHARDS}/{name}" for name in layout.get("shards", {}))]
    sums = {name: file_sha256(tmp / name) for name in summed if (tmp / name).exists()}
    _write_json(tmp / "meta.json", {"format": FORMAT, "step": step, **layout, "sha256": sums, **meta})
    _same_mode(tmp)
    _write_json(tmp / MARKER, {"step": step})
    ckpt_root, final = tmp.parent, tmp.parent / step_dir_name(step)
    if os.path.lexists(final) and (final.is_symlink() or not final.is_dir()):  # not ours to move aside or delete
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(
            f"cannot write checkpoint {final.name} in {ckpt_root}: {final} is a {'link' if final.is_symlink() else 'file'}, "
            "not a checkpoint directory; move it away, then continue with --resume (earlier checkpoints are intact)"
        )
    if final.exists():  # re-saving a step after a resume: move the old copy aside first
        old = ckpt_root / f"{REPLACED}{step_dir_name(step)}-{os.getpid()}"
        os.rename(final, old)
        try:
            os.rename(tmp, final)
        except BaseException:  # a full disk, or Ctrl-C between the renames
            os.rename(old, final)  # put the earlier copy back
            raise
        shutil.rmtree(old)  # a kill between the renames: the next start puts a copy back (remove_incomplete)
    else:
        os.rename(tmp, final)
    return final


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    train_state: dict[str, Any],
    config: dict[str, Any],
    tokenizer: dict[str, Any],
    meta: dict[str, Any],
) -> Path:
    """Write a complete step directory atomically and return its path."""
    tmp = begin_checkpoint(ckpt_root, step, os.getpid())
    return finish_checkpoint(tmp, step, model_state, train_state, config, tokenizer, meta)


STEP_DIR = re.compile(r"step-[0-9]+")  # a step directory's whole name (`step_dir_name`)


def complete_steps(ckpt_root: Path) -> list[Path]:
    """Complete step directories, oldest first. Only names `step_dir_name` writes: a user's copy
    beside them (`step-00000040.bak`) ended a run in a traceback, and `step-00000030-backup` was
    read as step 30 and pruned."""
    if not ckpt_root.is_dir():
        return []
    dirs = [p for p in ckpt_root.iterdir() if STEP_DIR.fullmatch(p.name) and (p / MARKER).exists()]
    return sorted(dirs, key=lambda p: p.name)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Open a step directory, or a run directory (the checkpoint it selected: resolve_run_checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist; give a run directory or a checkpoints/step-* directory")
    if not path.is_dir():  # a config.yaml given where its run was meant: no save was interrupted
        raise UserError(f"{path} is a file, not a checkpoint; give a run directory or a checkpoints/step-* directory")
    run_train = None
    if not (path / MARKER).exists() and not path.name.startswith((".tmp-", "step-")):
        run_train = _run_train(path)
        path = resolve_run_checkpoint(path)
    if not (path / MARKER).exists():
        written = ("meta.json", "config.json", "tokenizer.json", *SUMMED, SHARDS)  # a save killed midway leaves some
        if not any((path / name).exists() for name in written):
            raise UserError(f"{path} holds no checkpoint; give a run directory or a checkpoints/step-* directory")
        raise UserError(
            f"checkpoint {path} is incomplete (no {MARKER} marker; the save was interrupted); use an earlier one"
        )
    meta = read_step_json(path, "meta.json")
    for name in DESCRIBED:
        check_sum(path, meta, name)
    config = read_step_json(path, "config.json")
    tokenizer = read_step_json(path, "tokenizer.json")
    if meta.get("format") != FORMAT:
        raise UserError(f"checkpoint {path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    if not isinstance(meta.get("step"), int):
        raise UserError(f"checkpoint {path} has a meta.json without its step; it is corrupt, use another checkpoint")
    if not isinstance(config.get("model"), dict):
        raise UserError(
            f"checkpoint {path} has a config.json without a model section; it is corrupt, use another checkpoint"
        )
    return Checkpoint(path=path, config=config, tokenizer=tokenizer, meta=meta, run_train=run_train)


def _run_train(run_dir: Path) -> dict[str, Any] | None:
    """The train section of the run's own config.json (None when missing or unreadable)."""
    with contextlib.suppress(OSError, ValueError, LookupError, TypeError):
        train = json.loads((run_dir / "config.json").read_text())["train"]
        return train if isinstance(train, dict) else None
    return None


def resolve_run_checkpoint(run_dir: Path, which: str = "best") -> Path:
    """The checkpoint a run selected (`which` "best"): its best-dev one when recorded (the latest
    before the first dev NLL; a recorded one that is gone is an error), or its latest for a run with
    train.select=final (the onóna protocol, which reports the final model); `which` "latest": its latest."""
    ckpt_root = run_dir / "checkpoints"
    steps = complete_steps(ckpt_root)
    if not steps and complete_steps(run_dir):  # RUN/checkpoints itself
        raise UserError(
            f"{run_dir} is a run's checkpoints folder; give the run directory {run_dir.parent} (the checkpoint "
            f"it selected) or one step directory, such as {complete_steps(run_dir)[-1]}"
        )
    if not steps:
        raise UserError(
            f"{run_dir} holds no complete checkpoint; train first or point at a checkpoints/step-* directory"
        )
    # The run's own setting (a resume may have changed it), else the latest checkpoint's.
    train = _run_train(run_dir) or _run_train(steps[-1]) or {}
    if train.get("select") == "final":
        which = "latest"
    best_file = run_dir / "best.json"
    if which == "best" and best_file.exists():  # (none before the first dev NLL: the latest is all there is)
        # Never another checkpoint in its place: its numbers would be reported as the run's.
        instead = f"point at one of its checkpoints/step-* directories (the latest is {steps[-1]})"
        try:
            best = json.loads(best_file.read_text())
            step = best["step"]
            if isinstance(step, bool) or not isinstance(step, int):  # int() had taken 4.7 and true
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError):
            raise UserError(
                f"{best_file} cannot be read, so the run's best-dev checkpoint is unknown; {instead}"
            ) from None
        candidate = ckpt_root / step_dir_name(step)
        if not (candidate / MARKER).exists():
            raise UserError(
                f"the run's best-dev checkpoint {candidate} (named by {best_file}) is missing or incomplete; "
                f"restore it, or {instead}"
            )
        with contextlib.suppress(OSError, ValueError, AttributeError):  # its own meta.json is checked when opened
            saved = json.loads((candidate / "meta.json").read_text()).get("dev_nll")
            if isinstance(saved, float) and saved != best.get("dev_nll"):  # a flipped digit names another step
                raise UserError(
                    f"{best_file} names step {step} with dev NLL {best.get('dev_nll')!r}, but that checkpoint "
                    f"measured {saved!r}: it is damaged; restore it, or {instead}"
                )
        return candidate
    return steps[-1]


def prune_checkpoints(ckpt_root: Path, keep_last: int, protect: set[int]) -> None:
    """Delete all but the newest `keep_last` complete step directories, sparing `protect` steps
    and the best-dev step each kept one names (`best_step` in its meta.json: resuming from it
    needs that one, say when the newest is damaged and moved out), and any leftovers of
    interrupted saves. A step directory is renamed to `.old-*` before it is deleted, so a kill
    mid-deletion never leaves a half-deleted `step-*` that looks complete."""
    steps = complete_steps(ckpt_root)
    kept = steps[max(0, len(steps) - keep_last) :]
    protect = protect | {b for p in kept if (b := named_best_step(p)) is not None}
    for p in steps[: max(0, len(steps) - keep_last)]:
        if step_of(p) not in protect:
            old = ckpt_root / f".old-{p.name}-{os.getpid()}"
            os.rename(p, old)
            shutil.rmtree(old, ignore_errors=True)
    for p in ckpt_root.iterdir() if ckpt_root.is_dir() else []:
        if p.name.startswith(LEFTOVERS):
            shutil.rmtree(p, ignore_errors=True)


def named_best_step(step_dir: Path) -> int | None:
    """The best-dev step a step directory's training state names (its meta.json's `best_step`;
    None when it names none, or was saved before it was recorded)."""
    try:
        best = json.loads((step_dir / "meta.json").read_text()).get("best_step")
    except (OSError, ValueError, AttributeError):
        return None
    return best if isinstance(best, int) and not isinstance(best, bool) else None


_COPY_NAME = re.compile(
    rf"^(?:\.tmp-|{re.escape(REPLACED)})(step-\d+)-[^-/]+$"
)  # .tmp-step-N-TAG, .replaced-step-N-PID


def _interrupted_saves(ckpt_root: Path) -> dict[Path, Path]:
    """Step directory -> the complete copy to put in its place, for each step a kill left with no
    complete `step-*` but a complete copy beside it (a save stopped after its COMPLETE marker, or a
    re-save of the step between its two renames): its new copy if complete, else the one it
    replaced. A pruned step's `.old-*` is never put back (its deletion had begun), nor a copy whose
    place is taken by a link or a file (the rename could not take it)."""
    copies: dict[Path, Path] = {}
    if not ckpt_root.is_dir():
        return copies
    for prefix in (REPLACED, ".tmp-"):  # the new copy, listed last, wins
        for p in sorted(ckpt_root.glob(f"{prefix}step-*")):
            name = _COPY_NAME.match(p.name)
            if name is None or not (p / MARKER).exists() or not p.is_dir() or p.is_symlink():
                continue
            final = ckpt_root / name[1]
            free = not os.path.lexists(final) or (final.is_dir() and not final.is_symlink())
            if free and not (final / MARKER).exists():
                copies[final] = p
    return copies


def restorable_step_dirs(ckpt_root: Path) -> dict[int, Path]:
    """Step -> the directory that holds it, for each step a resume can continue from: the complete
    step directories and the copies `restore_interrupted_saves` would put back (read only: a dry
    run and a sweep's plan ask; the copies are listed first, so one put back meanwhile, by
    another process, is found in its place)."""
    copies = {step_of(final): copy for final, copy in _interrupted_saves(ckpt_root).items()}
    return dict(sorted({**copies, **{step_of(p): p for p in complete_steps(ckpt_root)}}.items()))


def restorable_steps(ckpt_root: Path) -> list[int]:
    """The steps of `restorable_step_dirs`, oldest first."""
    return list(restorable_step_dirs(ckpt_root))


def restore_interrupted_saves(ckpt_root: Path) -> None:
    """Put back each step `_interrupted_saves` finds, in place of an incomplete `step-*` (never
    loadable) if one is there. Call it only while no other process writes checkpoints here."""
    for final, copy in _interrupted_saves(ckpt_root).items():
        if final.is_dir():
            shutil.rmtree(final)
        os.rename(copy, final)


def remove_incomplete(ckpt_root: Path) -> None:
    """Delete what interrupted saves and prunes left (`LEFTOVERS` and `step-*` directories without
    the COMPLETE marker, never loadable), after putting back what `restore_interrupted_saves` can.
    Call it only while no other process writes checkpoints here (at the start of a run, under the
    run's lock)."""
    restore_interrupted_saves(ckpt_root)
    for p in ckpt_root.iterdir() if ckpt_root.is_dir() else []:
        if p.name.startswith(LEFTOVERS) or (p.name.startswith("step-") and not (p / MARKER).exists()):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
