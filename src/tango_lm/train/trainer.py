"""The training loop (SPEC 6): AdamW, warmup + WSD/cosine, clipping, accumulation, bf16 autocast,
optional torch.compile, dev NLL on a schedule, best-dev checkpoint, test NLL of the selected
checkpoint, JSONL metrics, a progress bar, and exact resume."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from tango_lm.data.loader import WindowLoader, eval_batches
from tango_lm.data.shards import PreparedDataset
from tango_lm.data.tokenizers import same_tokenizer
from tango_lm.errors import UserError
from tango_lm.eval.nll import evaluate_nll
from tango_lm.layers.active_width import keep_inactive_columns, segment_for_step
from tango_lm.models.model import build_model
from tango_lm.train.checkpoint import (
    complete_steps,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    write_json_atomic,
)
from tango_lm.train.config import RunConfig
from tango_lm.train.device import autocast, autocast_dtype, pick_device
from tango_lm.train.optim import build_optimizer, lr_at

THROUGHPUT_WINDOW = 100  # the papers' throughput: median over the final 100 updates


@dataclass
class TrainResult:
    """What a run produced; also written to `summary.json`."""

    summary: dict[str, Any]
    losses: dict[int, float] = field(default_factory=dict)  # optimizer step (1-based) -> train loss


def check_data_fits_model(run: RunConfig, dataset: PreparedDataset) -> None:
    tok = dataset.tokenizer
    if tok.vocab_size > run.model.vocab_size or dataset.max_token_id >= run.model.vocab_size:
        raise UserError(
            f"dataset {dataset.path} uses tokenizer {tok.name!r} with {tok.vocab_size} ids but model.vocab_size is "
            f"{run.model.vocab_size}; set model.vocab_size={tok.vocab_size} or prepare the data with the model's tokenizer"
        )


class Trainer:
    def __init__(self, run: RunConfig, resume: bool = False) -> None:
        self.run = run
        cfg = run.train
        self.out = Path(cfg.out_dir)
        self.ckpt_root = self.out / "checkpoints"
        existing = complete_steps(self.ckpt_root)
        if existing and not resume:
            raise UserError(
                f"{self.out} already holds checkpoints; pass --resume to continue that run or set train.out_dir to a new directory"
            )
        self.dataset = PreparedDataset.open(run.data.dir)
        check_data_fits_model(run, self.dataset)
        self.seq_len = run.seq_len()
        if self.seq_len > run.model.context_length:
            raise UserError(
                f"train.seq_len={self.seq_len} is longer than model.context_length={run.model.context_length}; lower seq_len"
            )
        self.device = pick_device(cfg.device)
        self.dtype = autocast_dtype(cfg.precision, self.device)
        self.total_steps = run.total_steps()

        torch.manual_seed(cfg.seed)
        self.model = build_model(run.model).to(self.device)
        self.step_fn = torch.compile(self.model.nll) if cfg.compile else self.model.nll
        self.optimizer = build_optimizer(self.model, cfg)
        self.loader = WindowLoader(
            self.dataset.tokens(run.data.train_split), self.seq_len, cfg.batch_size, cfg.data_seed
        )
        eval_bs = cfg.eval_batch_size or cfg.batch_size
        self.dev_batches = list(
            eval_batches(self.dataset.tokens(run.data.dev_split), self.seq_len, eval_bs, cfg.eval_windows)
        )
        self.step = 0
        self.tokens_seen = 0
        self.best: dict[str, Any] = {"step": None, "dev_nll": float("inf")}
        self.step_times: list[float] = []
        if existing:
            self._resume(existing[-1])

    # -- state --------------------------------------------------------------------------------
    def _resume(self, path: Path) -> None:
        ckpt = load_checkpoint(path)
        saved_model = ckpt.config.get("model", {})
        if saved_model != self.run.model.to_dict():
            diff = sorted(k for k in set(saved_model) | set(self.run.model.to_dict())
                          if saved_model.get(k) != self.run.model.to_dict().get(k))
            raise UserError(
                f"cannot resume {self.out}: its checkpoint has a different model config ({', '.join(diff)}); "
                "resume with the original config or use a new train.out_dir"
            )
        if not same_tokenizer(ckpt.tokenizer, self.dataset.tokenizer.to_dict()):
            raise UserError(
                f"cannot resume {self.out}: dataset {self.dataset.path} was prepared with a different tokenizer "
                "than the checkpoint's; use the original data"
            )
        state = ckpt.train_state()
        try:
            self.model.load_state_dict(ckpt.model_state())
            self.optimizer.load_state_dict(state["optimizer"])
            self.loader.load_state_dict(state["loader"])
            torch.set_rng_state(state["rng"]["torch"])
            if self.device.type == "cuda" and state["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state_all(state["rng"]["cuda"])
            self.step = int(state["step"])
            self.tokens_seen = int(state["tokens_seen"])
            self.best = dict(state["best"])
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"checkpoint {ckpt.path} is corrupt or from another run ({first}); resume from another checkpoint") from None
        self._truncate_metrics(self.step)
        self._write_best()  # a kill between a save and best.json must not leave it stale

    def _train_state(self) -> dict[str, Any]:
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "optimizer": self.optimizer.state_dict(),
            "loader": self.loader.state_dict(),
            "rng": rng,
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "best": {"step": self.best["step"], "dev_nll": float(self.best["dev_nll"])},
        }

    def save(self, dev_nll: float | None = None) -> Path:
        path = save_checkpoint(
            self.ckpt_root,
            self.step,
            self.model.state_dict(),
            self._train_state(),
            self.run.to_dict(),
            self.dataset.tokenizer.to_dict(),
            {"dev_nll": dev_nll, "tokens_seen": self.tokens_seen},
        )
        protect = {self.best["step"]} if self.best["step"] is not None else set()
        prune_checkpoints(self.ckpt_root, self.run.train.keep_last, protect)
        return path

    def _write_best(self) -> None:
        if self.best["step"] is not None:
            write_json_atomic(self.out / "best.json", self.best)

    # -- logging ------------------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def _truncate_metrics(self, step: int) -> None:
        """Drop records a killed run wrote after the checkpoint we resume from, so the log is
        exactly what an uninterrupted run writes."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by the kill
            if rec.get("step", 0) <= step and rec.get("event") != "summary":
                kept.append(line)
        tmp = path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        tmp.replace(path)

    # -- loop ---------------------------------------------------------------------------------
    def evaluate_dev(self) -> float:
        nll, _ = evaluate_nll(self.model, self.dev_batches, self.device, self.dtype)
        return nll

    def train_step(self) -> float:
        cfg = self.run.train
        lr = lr_at(self.step, self.total_steps, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        # Rotating narrow-width training (SPEC 2.6): step n runs only segment n mod segments of the
        # gated width; the inactive columns get no gradient and `keep_inactive_columns` keeps AdamW
        # (weight decay, momentum) from moving them. Outside a step every column is active.
        segments = self.model.num_segments
        if segments is not None:
            self.model.set_active_segment(segment_for_step(self.step, segments))
        total = 0.0
        for _ in range(cfg.grad_accum):
            inputs, targets = self.loader.next_batch()
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            with autocast(self.device, self.dtype):
                loss = self.step_fn(inputs, targets)
            (loss / cfg.grad_accum).backward()
            total += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        with keep_inactive_columns(self.model, self.optimizer):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.set_active_segment(None)
        self.step += 1
        self.tokens_seen += cfg.grad_accum * cfg.batch_size * self.seq_len
        self._last = {"lr": lr, "grad_norm": float(grad_norm)}
        return total / cfg.grad_accum

    def fit(self) -> TrainResult:
        cfg = self.run.train
        self.out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.out / "config.json", self.run.to_dict())
        (self.out / "config.yaml").write_text(yaml.safe_dump(self.run.to_dict(), sort_keys=False))
        if self.step == 0:
            self._truncate_metrics(0)  # records of an attempt killed before its first checkpoint
        losses: dict[int, float] = {}
        tokens_per_step = cfg.grad_accum * cfg.batch_size * self.seq_len
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not cfg.progress, unit="step",
                   desc=f"train {self.run.model.arch}", dynamic_ncols=True)
        dev_nll = None
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            loss = self.train_step()
            dt = time.perf_counter() - t0
            self.step_times.append(dt)
            losses[self.step] = loss
            if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                self._log({"step": self.step, "loss": loss, "tokens": self.tokens_seen,
                           "tokens_per_s": tokens_per_step / dt, **self._last})
            is_last = self.step == self.total_steps
            if self.step % cfg.eval_every == 0 or is_last:
                dev_nll = self.evaluate_dev()
                improved = dev_nll < self.best["dev_nll"]
                if improved:
                    self.best = {"step": self.step, "dev_nll": dev_nll}
                self._log({"step": self.step, "dev_nll": dev_nll, "tokens": self.tokens_seen, "best": improved})
                if improved or is_last or self.step % cfg.save_every == 0:
                    self.save(dev_nll)
                if improved:
                    self._write_best()
            elif self.step % cfg.save_every == 0:
                self.save()
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}",
                            dev=f"{dev_nll:.3f}" if dev_nll is not None else "-", refresh=False)
            bar.update(1)
        bar.close()
        return TrainResult(self.finish(), losses)

    def finish(self) -> dict[str, Any]:
        """Evaluate the selected checkpoint on the test split and write `summary.json`."""
        cfg = self.run.train
        if cfg.select == "best" and self.best["step"] is not None and self.best["step"] != self.step:
            best = load_checkpoint(self.ckpt_root / f"step-{self.best['step']:08d}")
            self.model.load_state_dict(best.model_state())
        selected = self.best["step"] if cfg.select == "best" and self.best["step"] is not None else self.step
        test_tokens = self.dataset.tokens(self.run.data.test_split)
        test_nll, n_test = evaluate_nll(
            self.model,
            eval_batches(test_tokens, self.seq_len, cfg.eval_batch_size or cfg.batch_size, cfg.test_windows),
            self.device,
            self.dtype,
        )
        recent = self.step_times[-THROUGHPUT_WINDOW:]
        tokens_per_step = cfg.grad_accum * cfg.batch_size * self.seq_len
        params = self.run.model.num_params()
        summary = {
            "arch": self.run.model.arch,
            "head": self.run.model.head,
            "params_total": params["total"],
            "params_non_embedding": params["non_embedding"],
            "steps": self.step,
            "tokens": self.tokens_seen,
            "selected_step": selected,
            "best_dev_nll": self.best["dev_nll"],
            "test_nll": test_nll,
            "test_tokens": n_test,
            "tokens_per_s": tokens_per_step / statistics.median(recent) if recent else None,
            "flops_per_token": self.run.model.flops_per_token(self.seq_len),
            "out_dir": str(self.out),
        }
        write_json_atomic(self.out / "summary.json", summary)
        self._log({"event": "summary", "step": self.step, **summary})
        return summary


def train(run: RunConfig, resume: bool = False) -> TrainResult:
    """Train a run to its budget (resuming from its latest checkpoint when asked)."""
    return Trainer(run, resume=resume).fit()
