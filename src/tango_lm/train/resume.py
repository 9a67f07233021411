"""Whether a run may continue from its latest checkpoint (`tango-lm train --resume`): the same model
config, tokenizer and data tokens, and not past the steps its config trains; and, when that
checkpoint is damaged, an error that says how to continue from the one before it. The trainer
(train/trainer_checkpoints.py) restores the state once these hold."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from tango_lm.data.shards import PreparedDataset
from tango_lm.data.tokenizers import same_tokenizer
from tango_lm.errors import UserError
from tango_lm.models.registry import without_unread_fields
from tango_lm.train.checkpoint import (
    MARKER,
    SHARDS,
    Checkpoint,
    check_sum,
    complete_steps,
    load_checkpoint,
    step_dir_name,
)
from tango_lm.train.config import RunConfig

# Train settings a resume keeps (the run's config.json, which reports read, must describe the whole
# run): the tokens each step averages over (the step times saved for the throughput and the
# schedule's meaning depend on it); the model seed, whose initialization is behind the weights; AdamW's
# decay and betas, which the optimizer state restores over the config's (a new value would be recorded
# and not applied); and the dev windows and precision every best-dev comparison is made in. Others
# may change on a resume: the schedule's (lr, steps, warmup, ...) from the resumed step on, and
# eval_every, keep_last, select, loggers, ...
SAME_ON_RESUME = (
    "grad_accum",
    "seed",
    "weight_decay",
    "beta1",
    "beta2",
    "eval_windows",
    "eval_sample_seed",
    "precision",
)


def unresumable(path: Path, error: UserError | str) -> UserError:
    """A damaged latest checkpoint's error, saying how to resume from the one before it (--resume
    always takes the latest complete one, so "use another checkpoint" is not advice it can follow)."""
    text = str(error)
    for advice in ("; use another checkpoint", "; resume from another checkpoint"):
        text = text.removesuffix(advice)
    if not [p for p in complete_steps(path.parent) if p.name != path.name]:  # moving it out would start over
        return UserError(
            f"{text}; it is the run's only complete checkpoint, so the run cannot continue from another: "
            f"restore {path} from a copy, or train again in a new train.out_dir"
        )
    return UserError(
        f"{text}; --resume continues from the latest complete checkpoint: move {path} out of "
        f"{path.parent} to resume from the one before it"
    )


def open_checkpoint(path: Path) -> tuple[Checkpoint, dict[str, Any]]:
    """The checkpoint and its train state, or `unresumable`'s error."""
    try:
        ckpt = load_checkpoint(path)
        return ckpt, ckpt.train_state()
    except UserError as exc:
        raise unresumable(path, exc) from None


def data_ids(dataset: PreparedDataset, run: RunConfig) -> dict[str, str]:
    """What the loader position and the best dev NLL refer to: the train and dev splits' tokens."""
    return {split: dataset.content_id(getattr(run.data, f"{split}_split")) for split in ("train", "dev")}


def compute_dtype(autocast: torch.dtype | None) -> str:
    """The name of the dtype a run's matmuls run in (autocast's, else float32)."""
    return str(autocast or torch.float32).removeprefix("torch.")


def check_same_run(
    ckpt: Checkpoint, state: dict[str, Any], run: RunConfig, dataset: PreparedDataset, loader: Any, dtype: str
) -> None:
    """UserError unless the checkpoint's model config, tokenizer, data tokens and data order
    (`loader`'s seq_len, global batch and seed) and compute `dtype` are this run's. Another checkpoint
    of the run would not differ: these errors say to change the config back, not to move a checkpoint."""
    out = run.train.out_dir
    # Fields only other architectures read (a sweep's window, on its tango runs) change nothing here.
    arch = run.model.arch
    saved_model = without_unread_fields(ckpt.config.get("model", {}), arch)
    model = without_unread_fields(run.model.to_dict(), arch)
    if saved_model != model:
        diff = sorted(k for k in set(saved_model) | set(model) if saved_model.get(k) != model.get(k))
        # The saved values as overrides: a default that changed between versions (capacity_factor_eval)
        # is then one paste away, not a search through the checkpoint.
        saved = " ".join(f"model.{k}={json.dumps(saved_model.get(k))}" for k in diff)
        raise UserError(
            f"cannot resume {out}: its checkpoint has a different model config ({', '.join(diff)}); "
            f"resume with the original config (it had {saved}) or use a new train.out_dir"
        )
    if not same_tokenizer(ckpt.tokenizer, dataset.tokenizer.to_dict()):
        raise UserError(
            f"cannot resume {out}: dataset {dataset.path} was prepared with a different tokenizer "
            "than the checkpoint's; use the original data"
        )
    saved_ids = state.get("data") if isinstance(state, dict) else None  # none before it was saved
    if isinstance(saved_ids, dict):
        changed = [s for s, content in data_ids(dataset, run).items() if saved_ids.get(s) not in (None, content)]
        if changed:
            raise UserError(
                f"cannot resume {out}: the {' and '.join(changed)} split(s) of {dataset.path} hold other "
                "tokens than the run trained on (its data position and best dev NLL refer to those); resume "
                "with the original data or use a new train.out_dir"
            )
    saved = state.get("loader") if isinstance(state, dict) else None
    if isinstance(saved, dict):
        order = {
            "seq_len": "seq_len",
            "global_batch": "global micro-batch",
            "data_seed": "data_seed",
            "reshuffle": "reshuffle_each_epoch",
        }
        changed = [
            f"{label} {saved[k]} (now {getattr(loader, k)})"
            for k, label in order.items()
            if k in saved and saved[k] != getattr(loader, k)
        ]
        if changed:
            raise UserError(
                f"cannot resume {out}: its data position was saved with {', '.join(changed)}; resume with the same "
                "train.seq_len, train.batch_size (the global micro-batch), train.data_seed and "
                "train.reshuffle_each_epoch, or use a new train.out_dir"
            )
    saved_train, train = ckpt.config.get("train"), run.to_dict()["train"]
    saved_dtype = state.get("compute_dtype") if isinstance(state, dict) else None  # none before it was saved
    # With the dtype saved, it is what must match (`auto` and the dtype it gives are one precision).
    kept = [k for k in SAME_ON_RESUME if not (k == "precision" and isinstance(saved_dtype, str))]
    if isinstance(saved_train, dict):
        changed = [f"train.{k}={was!r} (now {now!r})" for k, was, now in _changed(saved_train, train, kept)]
        if changed:
            raise UserError(
                f"cannot resume {out}: its checkpoint was trained with {', '.join(changed)} (a resume keeps the "
                "batch per step, the model seed, AdamW's decay and betas, and the dev windows and precision its best "
                "dev NLL was measured in); resume with the original value or use a new train.out_dir"
            )

    if isinstance(saved_dtype, str) and saved_dtype != dtype:
        same = {"float32": "fp32", "bfloat16": "bf16"}.get(saved_dtype)  # the setting that gives it on any device
        fix = f"resume with train.precision={same}" if same else f"resume on a device that gives {saved_dtype}"
        raise UserError(
            f"cannot resume {out}: it trained in {saved_dtype} and train.precision={run.train.precision!r} gives "
            f"{dtype} on this device (its best dev NLL was measured in {saved_dtype}); {fix} or use a new "
            "train.out_dir"
        )


def check_same_eval_batch(state: dict[str, Any], run: RunConfig, eval_batch: int, batch_dependent: bool) -> None:
    """UserError when a model whose scores depend on batch mates (MoE: expert capacity is per forward)
    would measure dev NLL in other batches than the checkpoint's best was (another
    train.eval_batch_size, or its default batch_size / processes on another number of processes)."""
    saved = state.get("eval_batch_size") if isinstance(state, dict) else None  # none before it was saved
    if batch_dependent and isinstance(saved, int) and saved != eval_batch:
        raise UserError(
            f"cannot resume {run.train.out_dir}: its dev NLL was measured in batches of {saved} windows per process, "
            f"which an MoE layer's expert capacity depends on, and this run would use {eval_batch}; set "
            f"train.eval_batch_size={saved} or use a new train.out_dir"
        )


def _changed(saved: dict[str, Any], now: dict[str, Any], keys: Iterable[str]) -> list[tuple[str, Any, Any]]:
    """(field, saved value, value now) of each of `keys` the checkpoint's train config holds otherwise."""
    return [(k, saved[k], now[k]) for k in keys if saved.get(k, now[k]) != now[k]]


# train fields that may change on a resume and apply from the resumed step on
SCHEDULE = ("lr", "schedule", "warmup_steps", "min_lr_ratio", "decay_fraction", "grad_clip")


def check_not_past(step: int, total_steps: int, run: RunConfig, saved_config: dict[str, Any] | None = None) -> None:
    """UserError for a checkpoint past the budget, or for a schedule changed on a run with no step
    left to train: the new values would describe steps they never trained (the config was rewritten)."""
    if step > total_steps:
        raise UserError(
            f"cannot resume {run.train.out_dir}: its latest checkpoint is at step {step}, past the {total_steps} "
            "steps this config trains; raise train.steps (or tokens) or use a new train.out_dir"
        )
    saved = (saved_config or {}).get("train")
    if step < total_steps or not isinstance(saved, dict):
        return
    changed = [f"train.{k}={now!r} (was {was!r})" for k, was, now in _changed(saved, run.to_dict()["train"], SCHEDULE)]
    if changed:
        raise UserError(
            f"cannot resume {run.train.out_dir} with {', '.join(changed)}: it has trained all {total_steps} steps, "
            "so the change would apply to none and only rewrite its record; raise train.steps (or tokens) to train "
            "on with it, or leave it out"
        )


def check_best_kept(best_step: int | None, ckpt_root: Path, run: RunConfig, resumed_step: int) -> None:
    """A run that reports its best-dev checkpoint needs it at the end: refuse now, not after
    training, when it was deleted (say, to free disk), its save never completed or its weights are
    damaged (not hashed again when it is the checkpoint being resumed, whose loading checked them)."""
    if run.train.select != "best" or best_step is None:
        return
    path = ckpt_root / step_dir_name(best_step)
    if not (path / MARKER).exists():
        why = "is missing or incomplete"
    else:
        why = None if best_step == resumed_step else _damaged_weights(path)
    if why:  # its weights are read at the end (a flipped bit was found only after the remaining steps)
        raise UserError(
            f"cannot resume {run.train.out_dir}: its best-dev checkpoint {step_dir_name(best_step)}, which the run "
            f"reports at the end, {why}; restore it, or resume with train.select=final"
        )


def _damaged_weights(path: Path) -> str | None:
    """Why the model weights of complete step directory `path` cannot be read as saved, or None."""
    try:
        meta = load_checkpoint(path).meta
        for name in meta.get("sha256") or {}:
            if name == "model.safetensors" or name.startswith(f"{SHARDS}/"):  # what test scoring loads
                check_sum(path, meta, name)
    except UserError as exc:
        return f"cannot be read ({str(exc).split('; ')[0]})"  # its advice ("use another") is not train's
    return None
