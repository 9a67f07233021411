"""The training loop (docs/design.md §6): AdamW, warmup + WSD/cosine, clipping, accumulation, bf16 autocast,
optional torch.compile and activation checkpointing, dev NLL on a schedule, best-dev checkpoint,
test NLL of the selected checkpoint, JSONL metrics, a progress bar (lines in a log file), and exact resume.

Under torchrun the same loop runs data-parallel (train/distributed.py, docs/distributed.md): every
process reads its slice of the same global batches, the logged loss is the all-reduced global mean,
and only rank 0 logs, shows progress and writes files (every rank takes part in gathering a
checkpoint). Without torchrun nothing changes: one process trains exactly as it always has."""

from __future__ import annotations

import collections
import contextlib
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tango_lm import strict_json
from tango_lm.atomic_files import write_json_atomic, write_text_atomic
from tango_lm.config_checks import (
    check_budget_agrees,
    check_data_fits_model,
    check_fits_memory,
    check_kernels_installed,
    start_of_run_warnings,
)
from tango_lm.data.loader import WindowLoader, eval_batches
from tango_lm.data.shards import PreparedDataset
from tango_lm.errors import UserError, os_error_text
from tango_lm.eval.nll import evaluate_nll
from tango_lm.layers.active_width import keep_inactive_columns, segment_for_step
from tango_lm.models.model import build_model
from tango_lm.models.params import active_non_embedding_params
from tango_lm.train import distributed, metrics_file
from tango_lm.train.checkpoint import complete_steps, load_checkpoint, remove_incomplete, step_dir_name, step_of
from tango_lm.train.compiled_forward import CompiledForward, with_eager_fallback
from tango_lm.train.config import RunConfig, dump_yaml, tpp_reference_params
from tango_lm.train.cpu_allocator import keep_freed_memory
from tango_lm.train.device import autocast, autocast_dtype, deterministic_kernels, to_device
from tango_lm.train.loggers import (
    LogContext,
    MetricLogger,
    check_available,
    close_loggers,
    open_loggers,
    stopped_exit_code,
)
from tango_lm.train.nonfinite import NonFiniteGuard
from tango_lm.train.optim import build_optimizer, lr_at
from tango_lm.train.progress_display import StepStats, progress_display, progress_style
from tango_lm.train.run_dir import FAILED_ATTEMPT_FILES, claim_run_dir
from tango_lm.train.start_vote import StartVote
from tango_lm.train.trainer_checkpoints import TrainerCheckpoints
from tango_lm.train.utilization import matmul_peak, peak_memory_mib, reset_peak_memory

THROUGHPUT_WINDOW = 100  # the papers' throughput: median over the final 100 updates


@dataclass
class TrainResult:
    """What a run produced; also written to `summary.json`."""

    summary: dict[str, Any]
    losses: dict[int, float] = field(default_factory=dict)  # optimizer step (1-based) -> train loss


class Trainer(TrainerCheckpoints):
    def __init__(
        self,
        run: RunConfig,
        resume: bool = False,
        warnings: bool = True,
        progress: bool | str | None = None,
        start_vote: StartVote | None = None,
    ) -> None:
        # Checked as a config file is: a RunConfig built in Python skipped every check (a schedule
        # "cosin" trained WSD, dev_split "train" selected on training text, grad_accum 0 NaN steps).
        self.run = run = RunConfig.from_dict(run.to_dict())
        self.say_warnings = warnings  # start_of_run_warnings on stderr (a sweep says them once for all its runs)
        # The command's display (lines without a terminal, --no-progress) over train.progress, never
        # written into the run's config: a run resumed on a terminal draws its bar again.
        self.progress_style = progress_style(progress, run.train.progress)
        cfg = run.train
        distributed.check_launch(run, distributed.launch_env()[2])  # before anything is read or written
        check_available(cfg.loggers)
        self.out = Path(cfg.out_dir)
        self.ckpt_root = self.out / "checkpoints"
        existing = complete_steps(self.ckpt_root)
        if existing and not resume:
            raise UserError(
                f"{self.out} already holds checkpoints; pass --resume to continue that run or set train.out_dir to a new directory"
            )
        if resume and not Path(run.data.dir).is_absolute() and not Path(run.data.dir).exists():
            raise UserError(  # a run continued from another folder than the one it trained in
                f"the run's dataset {run.data.dir} (its data.dir, relative) is not under {Path.cwd()}; resume from "
                "the folder it trained in, or pass data.dir=DIR (the same tokens anywhere resume)"
            )
        # a copied dataset's shards are hashed once: minutes for a large one, shown as the run's progress is
        shown = {"bar": True, "lines": "lines"}.get(self.progress_style, False)
        self.dataset = PreparedDataset.open(run.data.dir, progress=shown if distributed.launch_env()[0] == 0 else False)
        check_data_fits_model(run, self.dataset)
        self.seq_len = run.seq_len()
        if self.seq_len > run.model.context_length:
            raise UserError(
                f"train.seq_len={self.seq_len} is longer than model.context_length={run.model.context_length}; lower seq_len"
            )
        self.dist = distributed.setup(run, start_vote)  # one process: no process group, the configured device
        self.device = self.dist.device
        if self.device.type == "cpu":
            keep_freed_memory()  # no page faults on every step's activations (cpu_allocator.py)
        self.dtype = autocast_dtype(cfg.precision, self.device)
        if not resume:
            check_budget_agrees(run)
        self.total_steps = run.total_steps()

        check_kernels_installed(run.model, self.device)
        check_fits_memory(
            run.model,
            self.device,
            self.dist.world_size if self.dist.parallel == "fsdp" else 1,
            tokens=cfg.batch_size // self.dist.world_size * run.seq_len(),
        )
        self.nonfinite = NonFiniteGuard(cfg.max_nonfinite_steps)
        self._stop: UserError | None = None  # set by a step that ends a streak of skips too long
        torch.manual_seed(cfg.seed)  # every process builds the same initial model
        self.model = build_model(run.model).to(self.device)
        self.model.set_activation_checkpointing(cfg.activation_checkpointing)
        self.ddp: torch.nn.Module | None = None
        if self.dist.parallel == "fsdp":
            distributed.shard_fsdp(self.model)  # in place: the optimizer below holds the shards
        elif self.dist.parallel == "ddp":
            self.ddp = distributed.wrap_ddp(self.model, self.dist, run.model.arch)
        forward = self.ddp if self.ddp is not None else self.model.nll
        # eager again if compiling fails; one graph per segment of a rotating width
        self.step_fn = CompiledForward(forward, graphs=self.model.num_segments or 1) if cfg.compile else forward
        self.optimizer = build_optimizer(self.model, cfg)
        # batch_size is the global micro-batch: each process takes its slice of the same order.
        self.loader = WindowLoader(
            self.dataset.tokens(run.data.train_split),
            self.seq_len,
            cfg.batch_size // self.dist.world_size,
            cfg.data_seed,
            self.dist.rank,
            self.dist.world_size,
            cfg.reshuffle_each_epoch,
            cfg.grad_accum,
        )
        # Each eval batch runs on one process: by default the per-process training micro-batch.
        self.eval_batch_size = cfg.eval_batch_size or cfg.batch_size // self.dist.world_size
        self.dev_batches = list(
            eval_batches(
                self.dataset.tokens(run.data.dev_split),
                self.seq_len,
                self.eval_batch_size,
                cfg.eval_windows,
                cfg.eval_sample_seed,
                split=f"dev ({run.data.dev_split!r})",
            )
        )
        # The test split is read only after training; a missing or too short one fails now.
        test = self.dataset.tokens(run.data.test_split)
        eval_batches(
            test, self.seq_len, self.eval_batch_size, cfg.test_windows, split=f"test ({run.data.test_split!r})"
        )
        self.step = 0
        self.tokens_seen = 0
        self.best: dict[str, Any] = {"step": None, "dev_nll": float("inf")}
        self.step_times: collections.deque[float] = collections.deque(maxlen=THROUGHPUT_WINDOW)  # all it is read for
        self.loggers: list[MetricLogger] | None = None  # opened by fit(), on rank 0
        self.peak_flops: float | None = None  # the MFU denominator, measured by fit() on rank 0
        self.peak_measured_again = False
        distributed.barrier(self.dist)  # rank 0 has put back an interrupted save (claim_run_dir): list them again
        existing = complete_steps(self.ckpt_root)
        distributed.check_same_step(self.dist, step_of(existing[-1]) if existing else 0, self.ckpt_root)
        if resume and not existing:  # --resume would train from step 1 over a run that had checkpoints
            distributed.on_rank_0(self.dist, self._check_never_saved, f"resume {self.out}")
        if existing:
            self._resume(existing[-1])

    # -- logging ------------------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        if self.loggers is None:  # a record outside fit(): the JSONL log alone
            self.loggers = open_loggers(["jsonl"], self._log_context())
        for logger in self.loggers:
            logger.log(record)

    def _log_context(self) -> LogContext:
        return LogContext(self.out, self.run.to_dict(), self.run.train.wandb_project, self.step)

    def _mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs per second per process over the start-up matmul peak (bench/peak.py). A run
        that beats it shows the peak was measured while the machine was busy: measured again, once."""
        if not self.peak_flops:
            return None
        flops = self.run.model.flops_per_token(self.seq_len) * tokens_per_s / self.dist.world_size
        if flops > self.peak_flops and not self.peak_measured_again:
            self.peak_flops, self.peak_measured_again = matmul_peak(self.device, self.dtype, again=True), True
        return flops / self.peak_flops

    def _records(self) -> list[dict[str, Any]]:
        """metrics.jsonl's records, on rank 0 (train/metrics_file.py); [] elsewhere."""
        return metrics_file.read_records(self.out) if self.dist.is_main else []

    def _kept_records(self) -> list[dict[str, Any]]:
        """The records metrics.jsonl keeps when training (re)starts: those up to the checkpoint, but
        for a finished run's summary (the next end writes it again)."""
        if not self.step:
            return []
        return [r for r in self._records() if r.get("step", 0) <= self.step and r.get("event") != "summary"]

    # -- loop ---------------------------------------------------------------------------------
    def evaluate_dev(self) -> float:
        nll, _ = evaluate_nll(self.model, self.dev_batches, self.device, self.dtype, env=self.dist)
        return nll

    def train_step(self) -> float:
        cfg = self.run.train
        lr = lr_at(self.step, self.total_steps, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        # Rotating narrow-width training (docs/design.md §2.6): step n runs only segment n mod segments of the
        # gated width; the inactive columns get no gradient and `keep_inactive_columns` keeps AdamW
        # (weight decay, momentum) from moving them. Outside a step every column is active.
        segments = self.model.num_segments
        if segments is not None:
            self.model.set_active_segment(segment_for_step(self.step, segments))
        # The sums stay on the device in float64 (the additions Python's floats made, in the same
        # order), are averaged over processes in one collective and read once with the norm: one
        # wait for the GPU per step, not 2 + A (and under DDP not one more per all-reduced value).
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        aux_total = torch.zeros_like(total)
        aux_of = getattr(self.model.backbone, "aux_loss", None)  # MoE: the load-balancing term in the loss
        for micro in range(cfg.grad_accum):
            inputs, targets = (to_device(x, self.device) for x in self.loader.next_batch())

            def forward_backward(inputs: torch.Tensor = inputs, targets: torch.Tensor = targets) -> torch.Tensor:
                with autocast(self.device, self.dtype):
                    loss = self.step_fn(inputs, targets)
                (loss / cfg.grad_accum).backward()
                return loss

            # DDP all-reduces (averages) gradients in the last micro-batch's backward only.
            with distributed.grad_sync(self.ddp, micro == cfg.grad_accum - 1):
                loss = with_eager_fallback(forward_backward, self.step_fn)
            total += loss.detach().double()
            aux = aux_of() if aux_of is not None else None
            if aux is not None:
                aux_total += aux.detach().double()
        norm = distributed.grad_norm_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
        # the global batch's loss and aux loss: with equal tokens per process, the mean of theirs
        means = distributed.mean_over_ranks_on_device(self.dist, torch.stack([total, aux_total]) / cfg.grad_accum)
        loss, aux_loss, grad_norm = torch.cat([means, norm.detach().double().to(self.device).reshape(1)]).tolist()
        skip = self.nonfinite.skip(loss, grad_norm)  # both values are global: every rank decides alike
        if not skip:
            with keep_inactive_columns(self.model, self.optimizer):
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.set_active_segment(None)
        self.step += 1
        self.tokens_seen += cfg.grad_accum * cfg.batch_size * self.seq_len
        self._last = {"lr": lr, "grad_norm": grad_norm if math.isfinite(grad_norm) else None}
        if aux_of is not None:  # logged apart: loss - aux_loss is the NLL that other models log as loss
            self._last["aux_loss"] = aux_loss
        if skip:  # a skipped step still counts: its batch is consumed (train/nonfinite.py)
            self._last["skipped"] = True
            self._stop = self.nonfinite.report(self.step, loss, grad_norm, self.ckpt_root, warn=self.dist.is_main)
        return loss

    def fit(self) -> TrainResult:
        cfg = self.run.train
        try:
            # Rank 0 readies the run's files and loggers, and every process learns whether it could
            # (W&B without a key, a full disk). The records kept are read once: the dashboards get
            # what they lack, the bar the last dev NLL.
            kept = distributed.on_rank_0(self.dist, self._ready_run_files, "start the run", (UserError, OSError)) or []
            reset_peak_memory(self.device)  # this run's peak, not the largest of a sweep's runs before it
            with deterministic_kernels(cfg.compile and self.device.type == "cpu"):
                result = self._fit(kept)
        except BaseException as exc:
            loggers, self.loggers = self.loggers or [], None
            with contextlib.suppress(Exception):  # the error that stopped training is the one to report
                close_loggers(loggers, stopped_exit_code(exc))
            raise
        loggers, self.loggers = self.loggers or [], None
        close_loggers(loggers)
        return result

    def _ready_run_files(self) -> list[dict[str, Any]]:
        """Rank 0's start of a run: its folder, loggers and config files; returns the kept records."""
        cfg = self.run.train
        self.out.mkdir(parents=True, exist_ok=True)
        remove_incomplete(self.ckpt_root)  # left by a process killed while saving or pruning
        kept = self._kept_records()
        # Loggers first: one that cannot start (W&B without a key) leaves no run file behind, so
        # the same command runs again once it is fixed, without --resume; and a resume it stops
        # leaves the run as it was (a finished run kept its summary, which `report` reads).
        self.loggers = open_loggers(cfg.loggers, self._log_context(), kept)
        # What a killed attempt logged past the checkpoint (all of it, before the first one), and
        # the summary of an earlier end (a budget since raised), stale once the run trains on.
        metrics_file.truncate_records(self.out, self.step)
        (self.out / "summary.json").unlink(missing_ok=True)
        config = self.run.to_dict()
        t = config["train"]
        if t["tokens_per_param"] is not None and t["steps"] is None and t["tokens"] is None:
            # The tokens it gives, beside it: the count it multiplies has changed between versions,
            # and `train RUN --resume` (which reads this config) keeps the budget the run began with.
            t["tokens"] = max(1, int(t["tokens_per_param"] * tpp_reference_params(self.run.model)))
        write_json_atomic(self.out / "config.json", config)
        write_text_atomic(self.out / "config.yaml", dump_yaml(config))  # read back by `train RUN --resume`
        self.peak_flops = matmul_peak(self.device, self.dtype)
        for warning in start_of_run_warnings(self.run, self.dataset) if self.say_warnings else ():
            print(f"warning: {warning}", file=sys.stderr)  # now: the CLI holds warnings to a command's end
        return kept

    def _fit(self, kept: list[dict[str, Any]]) -> TrainResult:
        cfg = self.run.train
        losses: dict[int, float] = {}
        tokens_per_step = cfg.grad_accum * cfg.batch_size * self.seq_len  # the global batch
        style = self.progress_style if self.dist.is_main else "none"
        display = progress_display(style, f"train {self.run.model.arch}", self.total_steps, self.step)
        # the bar's dev NLL: after a resume, the last one measured before the checkpoint
        dev_nll = next((r["dev_nll"] for r in reversed(kept) if "dev_nll" in r), None)
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            loss = self.train_step()
            dt = time.perf_counter() - t0
            self.step_times.append(dt)
            losses[self.step] = loss
            tokens_per_s = tokens_per_step / dt
            mfu, memory = self._mfu(tokens_per_s), peak_memory_mib(self.device)
            if self.step % cfg.log_every == 0 or self.step == self.total_steps or "skipped" in self._last:
                self._log(
                    {
                        "step": self.step,
                        "loss": loss if math.isfinite(loss) else None,
                        "tokens": self.tokens_seen,
                        "tokens_per_s": tokens_per_s,
                        "mfu": mfu,
                        "peak_memory_mib": memory,
                        **self._last,
                    }
                )
            if self._stop is not None:  # after the step's "skipped" record; every rank has the same error
                raise self._stop
            evaluated = self.step % cfg.eval_every == 0 or self.step == self.total_steps
            if evaluated:
                dev_nll = self._evaluate_and_save()
            elif self.step % cfg.save_every == 0:
                self.save()
            display.update(self.step, StepStats(loss, tokens_per_s, mfu, memory, dev_nll), milestone=evaluated)
        display.close()
        # A resume whose budget was lowered to its checkpoint's step trains nothing; that step is
        # now the last and gets the last step's dev NLL (and best-dev check) if it had none (rank 0
        # alone reads the log: every rank follows its answer).
        unscored = not any("dev_nll" in r and r.get("step") == self.step for r in kept)
        if not losses and self.step and distributed.broadcast_int(self.dist, int(unscored)):
            self._evaluate_and_save()
        return TrainResult(self.finish(), losses)

    def _evaluate_and_save(self) -> float:
        """Dev NLL at this step: logged, the best-dev record updated, and the checkpoint saved when
        it improved, at the last step or on `save_every`."""
        cfg = self.run.train
        dev_nll = self.evaluate_dev()
        improved = dev_nll < self.best["dev_nll"]
        if improved:
            self.best = {"step": self.step, "dev_nll": dev_nll}
        self._log({"step": self.step, "dev_nll": dev_nll, "tokens": self.tokens_seen, "best": improved})
        if improved or self.step == self.total_steps or self.step % cfg.save_every == 0:
            self.save(dev_nll)
        if improved:
            self._write_best()
        return dev_nll

    def _selected_dev_nll(self, step: int) -> float | None:
        """The dev NLL logged at `step`; else the one its checkpoint recorded (a metrics.jsonl
        deleted, as its error allows for a corrupt one, lost the record, not the number)."""
        logged = metrics_file.dev_nll_at(self._records(), step)
        if logged is not None:
            return logged
        try:
            return load_checkpoint(self.ckpt_root / step_dir_name(step)).meta.get("dev_nll")
        except UserError:
            return None

    def finish(self) -> dict[str, Any]:
        """Evaluate the selected checkpoint on the test split and write `summary.json`."""
        cfg = self.run.train
        if cfg.select == "best" and self.best["step"] is not None and self.best["step"] != self.step:
            best = load_checkpoint(self.ckpt_root / f"step-{self.best['step']:08d}")
            distributed.load_full_model_state(self.model, best.model_state(), self.dist)
        selected = self.best["step"] if cfg.select == "best" and self.best["step"] is not None else self.step
        test_tokens = self.dataset.tokens(self.run.data.test_split)
        test_nll, n_test = evaluate_nll(
            self.model,
            eval_batches(test_tokens, self.seq_len, self.eval_batch_size, cfg.test_windows),
            self.device,
            self.dtype,
            env=self.dist,
        )
        recent = list(self.step_times)
        tokens_per_step = cfg.grad_accum * cfg.batch_size * self.seq_len
        tokens_per_s = tokens_per_step / statistics.median(recent) if recent else None
        params = self.run.model.num_params()
        summary = {
            "arch": self.run.model.arch,
            "head": self.run.model.head,
            "params_total": params["total"],
            "params_non_embedding": params["non_embedding"],
            "params_active_non_embedding": active_non_embedding_params(self.run.model),
            "steps": self.step,
            "tokens": self.tokens_seen,
            "skipped_steps": self.nonfinite.skipped,
            "selected_step": selected,
            "best_dev_nll": self.best["dev_nll"] if math.isfinite(self.best["dev_nll"]) else None,  # none finite
            # the selected checkpoint's own (select: final reports the final one, not the best)
            "selected_dev_nll": self._selected_dev_nll(selected),
            "test_nll": test_nll,
            "test_tokens": n_test,
            "tokens_per_s": tokens_per_s,
            "flops_per_token": self.run.model.flops_per_token(self.seq_len),
            "mfu": self._mfu(tokens_per_s) if tokens_per_s else None,
            "mfu_peak_flop_per_s": self.peak_flops,  # the denominator (measured again if a step beat it)
            "peak_memory_mib": peak_memory_mib(self.device),
            "out_dir": str(self.out),
        }
        if self.dist.is_main:
            for name in FAILED_ATTEMPT_FILES:  # an earlier attempt's failure, outdated now (removed first: a kill
                (self.out / name).unlink(missing_ok=True)  # between the two leaves no summary beside it)
            write_json_atomic(self.out / "summary.json", strict_json.finite_or_null(summary))
        self._log({"event": "summary", "step": self.step, **summary})
        return summary


def train(
    run: RunConfig,
    resume: bool = False,
    warnings: bool = True,
    progress: bool | str | None = None,
    prepared_by_rank_0: bool = False,
) -> TrainResult:
    """Train a run to its budget (resuming from its latest checkpoint when asked); `warnings=False`
    leaves the start-of-run warnings unsaid (a sweep says them once for all its runs), and
    `progress` overrides train.progress for this command only. Under torchrun
    every process calls this; it joins the process group and leaves it at the end. The run directory is
    checked and locked first (train/run_dir.py; `prepared_by_rank_0`: a sweep job's): one writer per run."""
    run = RunConfig.from_dict(run.to_dict())  # checked as a config file is, before the run directory is claimed
    vote = StartVote()  # under torchrun: a process that stops before the group forms stops the others too
    try:
        try:
            with claim_run_dir(run, resume, distributed.launch_env()[0] == 0, prepared_by_rank_0):
                return Trainer(run, resume=resume, warnings=warnings, progress=progress, start_vote=vote).fit()
        except BaseException as exc:
            vote.failed(exc)  # nothing where the group formed (or this process's vote was cast)
            raise
    except OSError as exc:  # a disk that filled up or a folder made read-only while training
        raise UserError(
            f"training in {run.train.out_dir} stopped: {os_error_text(exc)}; earlier checkpoints are "
            "intact: fix that and continue with --resume"
        ) from None
    except RuntimeError as exc:
        if not distributed.lost_contact(exc):
            raise
        said = " ".join(str(exc).split())[:200]
        raise UserError(  # the process that stopped first says why; this one need not add a traceback
            f"process {distributed.launch_env()[0]} lost contact with the others ({said}): one of them stopped "
            "(its own error, or torchrun's report, says why); fix that and continue with --resume"
        ) from None
    finally:
        distributed.teardown()
