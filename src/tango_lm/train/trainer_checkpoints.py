"""A trainer's checkpoints (docs/design.md §6): the state saved beside the weights, the step
directory every process takes part in writing (full state dicts, or one DCP shard per rank), and
the state `--resume` restores once train/resume.py's checks hold. A mixin of `Trainer`
(train/trainer.py), which builds every attribute declared below before it calls these."""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import torch

from tango_lm.atomic_files import write_json_atomic
from tango_lm.data.loader import WindowLoader
from tango_lm.data.shards import PreparedDataset
from tango_lm.errors import UserError
from tango_lm.models.model import LanguageModel
from tango_lm.models.registry import ARCHITECTURES
from tango_lm.train import distributed
from tango_lm.train.checkpoint import (
    SHARDS,
    begin_checkpoint,
    complete_steps,
    finish_checkpoint,
    prune_checkpoints,
    remove_unfinished,
    step_dir_name,
    step_of,
    tmp_step_dir,
)
from tango_lm.train.config import RunConfig
from tango_lm.train.nonfinite import NonFiniteGuard, check_weights, checkpoints_around_streak, finite_weights
from tango_lm.train.optim import set_fused, use_fused_adamw
from tango_lm.train.resume import (
    check_best_kept,
    check_not_past,
    check_same_eval_batch,
    check_same_run,
    compute_dtype,
    data_ids,
    open_checkpoint,
    unresumable,
)
from tango_lm.train.sharded_checkpoint import load_shards, save_shards


class TrainerCheckpoints:
    run: RunConfig
    out: Path
    ckpt_root: Path
    dataset: PreparedDataset
    dist: distributed.DistEnv
    device: torch.device
    dtype: torch.dtype | None
    model: LanguageModel
    optimizer: torch.optim.Optimizer
    loader: WindowLoader
    eval_batch_size: int
    total_steps: int
    nonfinite: NonFiniteGuard
    step: int
    tokens_seen: int
    best: dict[str, Any]
    step_times: collections.deque[float]

    def _resume(self, path: Path) -> None:
        ckpt, state = open_checkpoint(path)
        check_same_run(ckpt, state, self.run, self.dataset, self.loader, compute_dtype(self.dtype))
        batch_dependent = ARCHITECTURES[self.run.model.arch].scores_depend_on_batch
        check_same_eval_batch(state, self.run, self.eval_batch_size, batch_dependent)
        try:
            if ckpt.layout == "sharded":  # DCP reshards to this run's number of processes
                tensors, _ = distributed.sharded_state(self.model, self.optimizer)
                load_shards(ckpt.path, ckpt.meta, tensors, self.dist.active)
                distributed.load_sharded_state(self.model, self.optimizer, tensors, state["optimizer_param_groups"])
            else:  # full weights and optimizer state: the same on any number of processes
                distributed.load_full_model_state(self.model, ckpt.model_state(), self.dist)
                distributed.load_full_optimizer_state(self.model, self.optimizer, state["optimizer"], self.dist)
            set_fused(self.optimizer, use_fused_adamw(self.model))  # the checkpoint may come from another setup
            self.loader.load_state_dict(state["loader"])
            torch.set_rng_state(state["rng"]["torch"])
            cuda_rng = state["rng"].get("cuda")  # one state per GPU rank 0 saw; another node may have fewer
            if self.device.type == "cuda" and cuda_rng is not None and len(cuda_rng) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda_rng)
            self.step = int(state["step"])
            self.tokens_seen = int(state["tokens_seen"])
            self.best = dict(state["best"])
            self.nonfinite.load_state_dict(state.get("nonfinite", {}))
            # The summary's tokens/s (and MFU, per process) is the median of the final steps' times: those
            # timed on another number of processes or another device would be another setup's numbers.
            if state.get("step_times_on", self._timing_setup()) == self._timing_setup():
                self.step_times.extend(float(t) for t in state.get("step_times", []))  # none before this was saved
        except UserError as exc:
            raise unresumable(path, exc) from None
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise unresumable(path, f"checkpoint {ckpt.path} is corrupt or from another run ({first})") from None
        check_not_past(self.step, self.total_steps, self.run, ckpt.config)
        distributed.on_rank_0(  # one process hashes the best checkpoint's weights, not every rank
            self.dist,
            lambda: check_best_kept(self.best["step"], self.ckpt_root, self.run, self.step),
            f"resume {self.run.train.out_dir}",
        )
        self._write_best()  # a kill between a save and best.json must not leave it stale

    def _check_never_saved(self) -> None:
        """A run resumed with no complete checkpoint starts at step 1: refused when it had finished
        (its summary.json; its checkpoints moved away, or its only one damaged and moved out). One
        that stopped before its first good checkpoint starts over, as the non-finite guard advises."""
        if (self.out / "summary.json").exists():
            raise UserError(
                f"cannot resume {self.out}: it finished (its summary.json) but holds no complete checkpoint, so it "
                f"would train again from step 1; put its checkpoints back in {self.ckpt_root}, or train again in a "
                "new train.out_dir"
            )

    def _train_state(self, optimizer: dict[str, Any] | None = None) -> dict[str, Any]:
        """Everything but the weights. The loader position is global (the same on every rank) and
        the RNG state is rank 0's, so the state resumes on any number of processes."""
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "optimizer": self.optimizer.state_dict() if optimizer is None else optimizer,
            "loader": self.loader.state_dict(),
            "rng": rng,
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "best": {"step": self.best["step"], "dev_nll": float(self.best["dev_nll"])},
            "nonfinite": self.nonfinite.state_dict(),
            # the summary's tokens/s is the median of the final steps, some of them before a resume
            "step_times": list(self.step_times),
            "step_times_on": self._timing_setup(),
            "data": data_ids(self.dataset, self.run),
            "compute_dtype": compute_dtype(self.dtype),  # what precision "auto" gave on this device
            "eval_batch_size": self.eval_batch_size,  # per process: MoE's dev NLL depends on it
        }

    def save(self, dev_nll: float | None = None) -> Path:
        """Write the step directory. Every process calls this; rank 0 writes the files, the
        COMPLETE marker and the rename once every rank's part is on disk."""
        all_finite = distributed.mean_over_ranks(self.dist, float(not finite_weights(self.model))) == 0
        check_weights(all_finite, self.step, self._latest())  # no checkpoint holds a NaN
        # the tokens of each split the run reads: `eval --data` knows the run's data wherever it lies
        splits = {getattr(self.run.data, f"{s}_split") for s in ("train", "dev", "test")}
        data = {split: self.dataset.content_id(split) for split in sorted(splits)}
        # best_step: the checkpoint resuming from this one needs (pruning keeps it while this one stays)
        meta = {"dev_nll": dev_nll, "tokens_seen": self.tokens_seen, "data": data, "best_step": self.best["step"]}
        if self.dist.active:
            meta.update(parallel=self.dist.parallel, world_size=self.dist.world_size)
        sharded = self.run.train.checkpoint_format == "sharded"
        # Every rank writes its shard into rank 0's temporary directory; a full state, rank 0 alone.
        tag = distributed.broadcast_int(self.dist, os.getpid()) if sharded else os.getpid()
        tmp = tmp_step_dir(self.ckpt_root, self.step, tag)
        try:
            return self._write(tmp, tag, sharded, meta)
        except BaseException:  # stopped (Ctrl-C, SIGTERM) or failed mid-write: no half copy left for good
            if self.dist.is_main:
                remove_unfinished(tmp)
            raise

    def _write(self, tmp: Path, tag: int, sharded: bool, meta: dict[str, Any]) -> Path:
        """`save`'s writing, into the temporary directory `tmp` (`tmp_step_dir(..., tag)`), and the
        rename into place."""
        if self.dist.is_main:
            begin_checkpoint(self.ckpt_root, self.step, tag)
        if sharded:
            tensors, param_groups = distributed.sharded_state(self.model, self.optimizer)
            distributed.barrier(self.dist)  # the directory exists before anyone writes into it
            save_shards(tmp / SHARDS, tensors, self.dist.active)  # returns once every shard and .metadata are written
            model_state = None
            train_state = {**self._train_state({}), "optimizer_param_groups": param_groups}
            del train_state["optimizer"]  # its tensors are in the shards
        else:  # full state dicts (gathered to rank 0 under FSDP), the single-process format
            model_state = distributed.full_model_state(self.model, self.dist)
            train_state = self._train_state(distributed.full_optimizer_state(self.model, self.optimizer, self.dist))

        def finish_and_prune() -> Path:
            done = finish_checkpoint(
                tmp, self.step, model_state, train_state, self.run.to_dict(), self.dataset.tokenizer.to_dict(), meta
            )
            protect = {self.best["step"]} if self.best["step"] is not None else set()
            if self.nonfinite.in_a_row:  # the checkpoint a stopped streak's advice resumes from (nonfinite.py)
                before, _ = checkpoints_around_streak(self.ckpt_root, self.step - self.nonfinite.in_a_row + 1)
                protect |= {step_of(p) for p in before[-1:]}
            prune_checkpoints(self.ckpt_root, self.run.train.keep_last, protect)
            return done

        # a full disk stops every rank with one line; and no rank moves on (or reads it back) before
        # the checkpoint is complete
        what = f"write checkpoint {step_dir_name(self.step)} in {self.ckpt_root}"
        return distributed.on_rank_0(self.dist, finish_and_prune, what) or self.ckpt_root / step_dir_name(self.step)

    def _timing_setup(self) -> dict[str, Any]:
        """What a step's time depends on that a resume may change: the processes, the device (the
        GPU's model) and the logistics fields that change the work (compile, recomputation, FSDP)."""
        cfg = self.run.train
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type
        return {
            "world_size": self.dist.world_size,
            "device": device,
            "parallel": self.dist.parallel,
            "compile": cfg.compile,
            "activation_checkpointing": cfg.activation_checkpointing,
        }

    def _write_best(self) -> None:
        if self.best["step"] is not None and self.dist.is_main:
            write_json_atomic(self.out / "best.json", self.best)

    def _latest(self) -> str:
        steps = complete_steps(self.ckpt_root)
        return f"checkpoint {steps[-1]}" if steps else "no checkpoint (none was written yet), so nothing"
