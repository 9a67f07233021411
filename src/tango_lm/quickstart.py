"""`tango-lm quickstart`: the whole pipeline on a laptop CPU in about five minutes.

It generates a small DeepMind Mathematics set with DeepMind's generator (byte-level tokens, so
the vocabulary projection does not dominate a tiny model), trains TANGO and a Loop
Transformer++ matched to TANGO's parameter count on the same tokens in the same order, and
prints one table. Runs already finished are reused; interrupted ones resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tango_lm.data.dataset_dir import is_prepared
from tango_lm.data.dmmath import prepare_dmmath
from tango_lm.errors import UserError
from tango_lm.models.config import ModelConfig
from tango_lm.models.matching import match_width
from tango_lm.output_lock import hold_output_lock
from tango_lm.progress_lines import Progress
from tango_lm.strict_json import read_object
from tango_lm.train.checkpoint import restorable_steps
from tango_lm.train.config import DataConfig, RunConfig, TrainConfig
from tango_lm.train.run_dir import remove_run_files
from tango_lm.train.trainer import train

D_MODEL, DEPTH, SEQ_LEN, TARGET_PARAMS = 128, 4, 256, 1_000_000
DEFAULT_STEPS, BATCH = 150, 8
TRAIN_PER_MODULE, TEST_PER_MODULE = 150, 20


def quickstart_models() -> list[ModelConfig]:
    """TANGO nearest TARGET_PARAMS, and a Loop Transformer++ matched to TANGO's exact total."""
    base = ModelConfig(
        arch="tango", d_model=D_MODEL, depth=DEPTH, width=D_MODEL, vocab_size=257, context_length=SEQ_LEN
    )
    tango = match_width(base, TARGET_PARAMS)
    loop = match_width(tango.replace(arch="loop-transformer"), tango.num_params()["total"])
    return [tango, loop]


def run_quickstart(
    out: str = "runs/quickstart", steps: int | None = None, fresh: bool = False, progress: Progress = True
) -> list[dict[str, Any]]:
    if steps is not None and steps < 1:
        raise UserError(f"--steps must be at least 1 (got {steps})")
    root = Path(out)
    if root.exists() and not root.is_dir():  # before any progress line: the one line is the error
        raise UserError(f"--out {out} is a file; give a directory for the quickstart's data and runs")
    data_dir = root / "dmmath-byte"
    if not is_prepared(data_dir):
        print(f"[1/3] generating DeepMind Mathematics into {data_dir} ...", flush=True)
        prepare_dmmath(
            data_dir,
            tokenizer="byte",
            train_per_module=TRAIN_PER_MODULE,
            test_per_module=TEST_PER_MODULE,
            seed=0,
            progress=progress,
        )
    else:
        print(f"[1/3] using the prepared data in {data_dir}", flush=True)
    rows = []
    total = DEFAULT_STEPS if steps is None else steps
    # 15 warmup steps (a tenth of the default), fewer for a short run: quickstart has no flag to
    # lower them, so the run's "warmup not below the steps" warning would name a fix it cannot take.
    warmup = min(15, total // 10)
    for i, model in enumerate(quickstart_models()):
        run_dir = root / model.arch
        if fresh and run_dir.exists():
            _remove_run_files(run_dir, fresh)
        run = RunConfig(
            model=model,
            data=DataConfig(dir=str(data_dir)),
            train=TrainConfig(
                out_dir=str(run_dir),
                steps=total,
                batch_size=BATCH,
                lr=3e-3,
                warmup_steps=warmup,
                eval_every=25,
                eval_windows=64,
                save_every=25,
                log_every=5,
            ),
        )
        print(
            f"[{2 + i}/3] training {model.arch} ({model.num_params()['total']:,} parameters, width {model.width})",
            flush=True,
        )
        summary_file = run_dir / "summary.json"
        summary = None if fresh else read_object(summary_file)  # damaged: resumed from its checkpoints below
        if summary is not None and summary.get("steps") == run.total_steps():
            print(f"      finished before; reusing {summary_file}")
            rows.append(summary)
            continue
        done = restorable_steps(run_dir / "checkpoints")  # step numbers (a Path compared with an int raised)
        if done and done[-1] > run.total_steps():  # resume's own advice (raise train.steps) is no flag here
            raise UserError(
                f"{run_dir} has trained {done[-1]} steps, more than the {run.total_steps()} asked for; "
                "add --fresh to retrain it, or give --steps of at least that"
            )
        if not done and run_dir.exists():  # an attempt stopped before its first checkpoint: start it again
            _remove_run_files(run_dir, fresh)
        rows.append(train(run, resume=bool(done), progress=progress).summary)
    print()
    print(format_table(rows))
    print(
        f"\nRun directories and metrics.jsonl are under {root}/; `tango-lm eval {root}/tango --split test` "
        "re-scores a model."
    )
    return rows


def _remove_run_files(run_dir: Path, fresh: bool) -> None:
    """The run's own files (--fresh, or an attempt stopped before its first checkpoint), under its
    lock (a run in progress is refused, not deleted); any other file in the folder stays."""
    hint = "stop it first, or leave out --fresh" if fresh else "wait for it to finish or stop it first"
    with hold_output_lock(run_dir, "tango-lm quickstart", hint):
        remove_run_files(run_dir)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'model':<18}{'params':>10}{'tokens':>10}{'dev NLL':>10}{'test NLL':>10}{'tokens/s':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['arch']:<18}{r['params_total']:>10,}{r['tokens']:>10,}{_nll(r['best_dev_nll']):>10}"
            f"{_nll(r['test_nll']):>10}{r['tokens_per_s'] or 0:>10,.0f}"
        )
    lines.append(
        "NLL in nats per token (a byte, or the end-of-text after each question); test NLL of the best-dev "
        "checkpoint (DM Math interpolate split)."
    )
    return "\n".join(lines)


def _nll(value: float | None) -> str:
    """A table cell: '-' for no finite NLL (a diverged run's summary has null)."""
    return "-" if value is None else f"{value:.4f}"
