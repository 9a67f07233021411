"""Checkpoints that lose nothing.

A checkpoint is a step directory `checkpoints/step-00000100/` holding

- `model.safetensors`: the weights (readable without unpickling anything);
- `train_state.pt`: optimizer, step, loader position, RNG and best-dev record, loaded only with
  `torch.load(weights_only=True)`;
- `config.json` (the whole run config), `tokenizer.json`, `meta.json`;
- `COMPLETE`: written last. A directory without it does not count.

It is written under a temporary name and renamed into place, so a run killed mid-save leaves the
previous checkpoint as the latest loadable one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tango_lm.errors import UserError

FORMAT = "tango-lm-checkpoint/1"
MARKER = "COMPLETE"


@dataclass
class Checkpoint:
    path: Path
    config: dict[str, Any]
    tokenizer: dict[str, Any]
    meta: dict[str, Any]

    def model_state(self) -> dict[str, torch.Tensor]:
        try:
            return load_file(str(self.path / "model.safetensors"))
        except (SafetensorError, OSError, ValueError) as exc:
            raise UserError(f"checkpoint {self.path} has unreadable weights ({exc}); use another checkpoint") from None

    def build_model(self, device: str | torch.device = "cpu") -> torch.nn.Module:
        """The model this checkpoint holds, in eval mode."""
        from tango_lm.models.config import ModelConfig
        from tango_lm.models.model import build_model

        model = build_model(ModelConfig.from_dict(dict(self.config["model"])))
        try:
            model.load_state_dict(self.model_state())
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0]
            raise UserError(f"checkpoint {self.path} does not fit its own config ({first}); it is corrupt") from None
        return model.to(device).eval()

    def train_state(self) -> dict[str, Any]:
        try:
            return torch.load(self.path / "train_state.pt", map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure here means a corrupt file
            raise UserError(
                f"checkpoint {self.path} has an unreadable train_state.pt ({type(exc).__name__}); "
                "resume from another checkpoint"
            ) from None


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


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


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temporary sibling and rename it over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _write_json(tmp, data)
    os.replace(tmp, path)


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
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    state = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": FORMAT})
    _fsync_file(tmp / "model.safetensors")
    torch.save(train_state, tmp / "train_state.pt")
    _fsync_file(tmp / "train_state.pt")
    _write_json(tmp / "config.json", config)
    _write_json(tmp / "tokenizer.json", tokenizer)
    _write_json(tmp / "meta.json", {"format": FORMAT, "step": step, **meta})
    _write_json(tmp / MARKER, {"step": step})
    if final.exists():  # re-saving a step after a resume: move the old copy aside first
        old = ckpt_root / f".old-{step_dir_name(step)}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    return final


def complete_steps(ckpt_root: Path) -> list[Path]:
    """Complete step directories, oldest first."""
    if not ckpt_root.is_dir():
        return []
    dirs = [p for p in ckpt_root.iterdir() if p.name.startswith("step-") and (p / MARKER).exists()]
    return sorted(dirs, key=lambda p: p.name)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Open a step directory, or a run directory (its best-dev checkpoint, else its latest)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist; give a run directory or a checkpoints/step-* directory")
    if path.is_dir() and not (path / MARKER).exists() and not path.name.startswith((".tmp-", "step-")):
        path = resolve_run_checkpoint(path)
    if not (path / MARKER).exists():
        raise UserError(f"checkpoint {path} is incomplete (no {MARKER} marker; the save was interrupted); use an earlier one")
    try:
        meta = json.loads((path / "meta.json").read_text())
        config = json.loads((path / "config.json").read_text())
        tokenizer = json.loads((path / "tokenizer.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"checkpoint {path} is corrupt ({type(exc).__name__}); use another checkpoint") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"checkpoint {path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return Checkpoint(path=path, config=config, tokenizer=tokenizer, meta=meta)


def resolve_run_checkpoint(run_dir: Path, which: str = "best") -> Path:
    """The best-dev checkpoint of a run directory when recorded (and `which` is 'best'), else its latest."""
    ckpt_root = run_dir / "checkpoints"
    steps = complete_steps(ckpt_root)
    if not steps:
        raise UserError(f"{run_dir} holds no complete checkpoint; train first or point at a checkpoints/step-* directory")
    best_file = run_dir / "best.json"
    if which == "best" and best_file.exists():
        try:
            best = json.loads(best_file.read_text())
            candidate = ckpt_root / step_dir_name(int(best["step"]))
            if (candidate / MARKER).exists():
                return candidate
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return steps[-1]


def prune_checkpoints(ckpt_root: Path, keep_last: int, protect: set[int]) -> None:
    """Delete all but the newest `keep_last` complete step directories, sparing `protect` steps,
    and any leftovers of interrupted saves."""
    steps = complete_steps(ckpt_root)
    for p in steps[: max(0, len(steps) - keep_last)]:
        if int(p.name.split("-")[1]) not in protect:
            shutil.rmtree(p, ignore_errors=True)
    for p in ckpt_root.iterdir() if ckpt_root.is_dir() else []:
        if p.name.startswith((".tmp-", ".old-")):
            shutil.rmtree(p, ignore_errors=True)
