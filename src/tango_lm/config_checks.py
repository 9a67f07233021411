"""Numbers a config may hold: finite, in range, a model whose training state fits in memory, and
data the run can read.

Errors, checked before anything is written:

- every float field of every section is finite (`train.lr=.nan`, `model.init_std=.inf` are refused
  when the value is read, in `models.config.check_type`);
- the model's real-valued fields are in range (`MODEL_RANGES`: a norm epsilon, RoPE base or init
  std of zero or below would divide by zero or produce NaN in the first forward);
- the weights, gradients and AdamW's two moments (16 bytes per parameter in fp32; split over the
  processes under FSDP) fit in the memory of the device that trains them (`check_fits_memory`),
  so a mistyped width stops at once instead of swapping or dying in the allocator;
- a dataset's token ids fit the model's table (`check_data_fits_model`), and the splits the run
  scores (`scored_splits`) hold a window of its context (`check_splits_fit_run`).
- a new run's `train.tokens` and `train.tokens_per_param`, both set, agree (`check_budget_agrees`);
- the packages the kernels asked for are installed (`check_kernels_installed`).

Warnings, said when a run starts (`start_of_run_warnings`): a table mostly of rows the data's
tokenizer never produces (`unused_table_rows`), as when byte-level data meets the default
GPT-2-sized vocabulary; a warmup as long as the run (`warmup_past_the_run`); a scored split with
fewer windows than the run asks of it (`fewer_windows_than_asked`); a model field this
architecture does not read set away from its default (`unread_model_fields`); and what the
architecture itself warns of (`Architecture.warnings`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tango_lm.errors import UserError, counted

if TYPE_CHECKING:
    from tango_lm.data.shards import PreparedDataset
    from tango_lm.train.config import RunConfig

__all__ = [
    "MODEL_RANGES",
    "TRAIN_BYTES_PER_PARAM",
    "check_finite",
    "check_model_numbers",
    "check_fits_memory",
    "check_data_fits_model",
    "unused_table_rows",
    "warmup_past_the_run",
    "start_of_run_warnings",
]

# Tables are often padded past the tokenizer to a multiple of 64 or 128 (GPT-2's 50,257 ids to
# 50,304 rows, bytes' 257 to 320); more unused rows than both of these is a vocab_size left at its
# default (GPT-2's) or mistyped, not padding.
UNUSED_ROWS_WARNING = (128, 0.1)  # (rows, share of the table)

# field -> (lowest allowed value, whether the bound itself is allowed)
MODEL_RANGES: dict[str, tuple[float, bool]] = {
    "norm_eps": (0.0, False),
    "rope_theta": (0.0, False),
    "init_std": (0.0, False),
    "gdn_expand_v": (0.0, False),
    "capacity_factor_train": (0.0, False),
    "capacity_factor_eval": (0.0, False),
    "aux_loss_weight": (0.0, True),
}
TRAIN_BYTES_PER_PARAM = 16  # fp32 weights + gradients + AdamW exp_avg + exp_avg_sq


def check_finite(name: str, value: float | int, default: Any = None) -> float:
    """`value` as a finite float, or UserError naming the field (and its `default`, when it is a
    number, as the value to give: one example for every field offered rope_theta 1e-3)."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        usual = isinstance(default, (int, float)) and not isinstance(default, bool) and math.isfinite(default)
        hint = f"give a number such as its default, {default!r}" if usual else "give a finite number"
        raise UserError(f"{name} must be a finite number (got {value!r}); {hint}")
    return number


def check_model_numbers(cfg: Any) -> None:
    """UserError unless every field of `MODEL_RANGES` is in its range."""
    for name, (low, inclusive) in MODEL_RANGES.items():
        value = getattr(cfg, name)
        if value is None:  # left to the architecture's validate (a derived default it could not fill)
            continue
        if value < low or (value == low and not inclusive):
            bound = f"at least {low:g}" if inclusive else f"above {low:g}"
            raise UserError(f"model.{name} must be {bound} (got {value!r})")


def check_fits_memory(model_cfg: Any, device: Any, shards: int = 1, tokens: int = 0) -> None:
    """UserError when the model's training state cannot fit in `device`'s memory (`shards`
    processes share it under FSDP), or the least its backward keeps for a micro-batch of `tokens`
    per process cannot; devices whose size is unknown are not checked."""
    params = model_cfg.num_params()["total"]
    need = params * TRAIN_BYTES_PER_PARAM / max(1, shards)
    have, where = _device_memory(device)
    if have is None:
        return
    # Every block application keeps at least its input (the residual stream) for the backward, even
    # with activation checkpointing, in 2 bytes at the least: a looped model's depth costs no
    # parameters, so a mistyped depth (1e9) got past the parameters' check and filled the memory.
    kept = model_cfg.depth * tokens * model_cfg.d_model * 2
    if kept > have:
        raise UserError(
            f"model.depth={model_cfg.depth:,} applications each keep their input for the backward, {tokens:,} tokens "
            f"x d_model={model_cfg.d_model} per process: at least {kept / 2**30:,.1f} GiB, more than the "
            f"{have / 2**30:,.1f} GiB of {where}; lower model.depth, train.batch_size or the context length"
        )
    if need <= have:
        return
    per = f" per process of {shards}" if shards > 1 else ""
    raise UserError(
        f"the model has {params:,} parameters: training keeps {TRAIN_BYTES_PER_PARAM} bytes per parameter (weights, "
        f"gradients and AdamW's moments), {need / 2**30:,.1f} GiB{per}, more than the {have / 2**30:,.1f} GiB of {where}; "
        "lower model.width, model.d_model or model.depth"
    )


def check_kernels_installed(model_cfg: Any, device: Any) -> None:
    """The packages the kernels asked for need ($TANGO_LM_KERNELS=triton; an architecture's own,
    such as model.gdn_backend=fla on CUDA: `Architecture.check_packages`), checked before a run
    writes its config: the ops check only at their first call, and the same command then found a
    run directory it had to --resume."""
    from tango_lm.models.registry import ARCHITECTURES
    from tango_lm.ops.dispatch import check_requested_installed

    check_requested_installed()
    ARCHITECTURES[model_cfg.arch].check_packages(model_cfg, device.type == "cuda")


def check_decode_fits_memory(model_cfg: Any, device: Any, rows: int, positions: int, what: str) -> None:
    """UserError when `rows` sequences of `positions` cannot be decoded in `device`'s memory: each
    row keeps at least its logits over the vocabulary and a d_model-wide state per position in fp32
    (a lower bound: caches hold more), so `generate --num-samples 100000000` is refused at once
    instead of filling the memory (the kernel's OOM killer, or a traceback after 44 s)."""
    have, where = _device_memory(device)
    need = rows * (model_cfg.vocab_size + positions * model_cfg.d_model) * 4
    if have is None or need <= have:
        return
    raise UserError(
        f"{rows:,} rows of {positions:,} positions need at least {need / 2**30:,.1f} GiB to decode (logits over "
        f"{model_cfg.vocab_size:,} ids and a {model_cfg.d_model}-wide state per position, in fp32), more than the "
        f"{have / 2**30:,.1f} GiB of {where}; lower {what}"
    )


def _device_memory(device: Any) -> tuple[int | None, str]:
    kind = getattr(device, "type", str(device))
    if kind == "cuda":
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory, f"GPU {index}"
    if kind in ("cpu", "mps"):
        return _host_memory(), "this machine's memory"
    return None, kind


def _host_memory() -> int | None:
    """Physical memory, or the container's (cgroup) limit when that is lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def check_data_fits_model(run: RunConfig, dataset: PreparedDataset) -> None:
    """Every token id of the dataset (and of its tokenizer) has a row in the model's table."""
    tok = dataset.tokenizer
    if tok.vocab_size > run.model.vocab_size or dataset.max_token_id >= run.model.vocab_size:
        raise UserError(
            f"dataset {dataset.path} uses tokenizer {tok.name!r} with {tok.vocab_size} ids but model.vocab_size is "
            f"{run.model.vocab_size}; set model.vocab_size={tok.vocab_size} or prepare the data with the model's tokenizer"
        )


def scored_splits(run: RunConfig) -> list[tuple[str, str, int | None]]:
    """(role, split, windows scored on it: None for every one) of the run's dev and test splits."""
    return [("dev", run.data.dev_split, run.train.eval_windows), ("test", run.data.test_split, run.train.test_windows)]


def check_budget_agrees(run: RunConfig) -> None:
    """A new run whose `train.tokens` and `train.tokens_per_param` are both set (and no `steps`)
    trains on `tokens`: a run directory's config records the tokens its TPP gave its own model,
    and used for another model (`train runs/x d_model=64 train.out_dir=runs/y`) or with its TPP
    edited, it trained the old count under the new TPP's name. They must agree; a resumed run
    keeps the tokens it began with (not checked)."""
    from tango_lm.train.config import tpp_reference_params

    t = run.train
    if t.steps is not None or t.tokens is None or t.tokens_per_param is None:
        return
    reference = tpp_reference_params(run.model)
    given = int(t.tokens_per_param * reference)
    if given != t.tokens:
        raise UserError(
            f"train.tokens={t.tokens:,} and train.tokens_per_param={t.tokens_per_param:g} both set the budget and "
            f"disagree for this model ({t.tokens_per_param:g} x {reference:,} parameters is {given:,} tokens; a run "
            "directory's config records the tokens of its own model); set one of them to null"
        )


def check_splits_fit_run(run: RunConfig, dataset: PreparedDataset) -> None:
    """What a run checks of its splits when it starts, without starting it (a sweep checks every run
    before training or submitting any): the training split holds a global batch of windows, and the
    dev and test splits a window each (UserError otherwise, the run's own message)."""
    from tango_lm.data.loader import WindowLoader, eval_batches

    cfg, seq_len = run.train, run.seq_len()
    WindowLoader(dataset.tokens(run.data.train_split), seq_len, cfg.batch_size, cfg.data_seed)
    for role, split, windows in scored_splits(run):
        eval_batches(
            dataset.tokens(split), seq_len, cfg.eval_batch_size or cfg.batch_size, windows, split=f"{role} ({split!r})"
        )


def unused_table_rows(run: RunConfig, dataset: PreparedDataset) -> str | None:
    """A warning when most of the model's table is rows the data's tokenizer never produces: the
    run is valid, but those rows count in the parameters and FLOPs a comparison reports, and the
    softmax spreads probability over them."""
    vocab, ids = run.model.vocab_size, dataset.tokenizer.vocab_size
    rows, share = UNUSED_ROWS_WARNING
    if vocab - ids <= max(rows, share * vocab):
        return None
    return (
        f"model.vocab_size is {vocab:,} but the data's tokenizer {dataset.tokenizer.name!r} has {ids:,} ids: "
        f"{vocab - ids:,} rows of the vocabulary tables are never a token, yet count in the parameters and FLOPs; "
        f"set model.vocab_size={ids} unless that is what you want"
    )


def warmup_past_the_run(run: RunConfig) -> str | None:
    """A warning when warmup is as long as the run: the schedule then warms up over all steps but
    the last (train/optim.lr_at), and the run never trains at its learning rate (a preset's 200
    warmup steps under a short smoke-test budget, say)."""
    steps, warmup = run.total_steps(), run.train.warmup_steps
    if warmup < steps:
        return None
    return (
        f"train.warmup_steps={warmup} is not below the run's {counted(steps, 'step')}: the learning "
        f"rate warms up over all but the last step and never trains at train.lr={run.train.lr:g}; lower "
        "train.warmup_steps or train longer"
    )


def fewer_windows_than_asked(run: RunConfig, dataset: PreparedDataset) -> list[str]:
    """A warning per split that holds fewer windows than the run scores on it (`eval_windows`,
    `test_windows`): every window is scored, so its NLL is over fewer windows than the config says,
    and runs on splits of other sizes compare over other counts (the onóna protocol's 1,024)."""
    from tango_lm.data.loader import count_eval_windows

    out = []
    for role, split, asked in scored_splits(run):
        if asked is None:
            continue
        held = count_eval_windows(dataset.tokens(split), run.seq_len())
        if held < asked:
            field = "eval_windows" if role == "dev" else "test_windows"
            scored = "that one" if held == 1 else f"those {held:,}"
            out.append(
                f"the {role} split ({split!r}) holds {counted(held, 'window')} of {run.seq_len():,} tokens, fewer than "
                f"train.{field}={asked:,}: its NLL is over {scored}"
            )
    return out


def start_of_run_warnings(run: RunConfig, dataset: PreparedDataset, sweep_archs: Iterable[str] = ()) -> list[str]:
    """Every warning a run gets when it starts, one line each. A sweep names its architectures: its
    base sets each one's fields for every run, so only fields none of them reads are warned."""
    from tango_lm.models.registry import ARCHITECTURES

    warnings = (
        unused_table_rows(run, dataset),
        warmup_past_the_run(run),
        *fewer_windows_than_asked(run, dataset),
        *unread_model_fields(run.model, also_read_by=sweep_archs),
        *ARCHITECTURES[run.model.arch].warnings(run.model, run.seq_len()),
    )
    return [w for w in warnings if w]


def unread_model_fields(cfg: Any, also_read_by: Iterable[str] = ()) -> list[str]:
    """A warning per field only other architectures read (`Architecture.reads`) that `cfg` sets away
    from its default: nothing would use it (n_kv_heads=2 on a Transformer++ trains full attention).
    Fields one of `also_read_by` (a sweep's other architectures) reads are not warned."""
    from tango_lm.models.config import DERIVED_DEFAULTS, ModelConfig
    from tango_lm.models.registry import ARCHITECTURES, fields_not_read_by

    arch = ARCHITECTURES[cfg.arch]
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    out = []
    for name in fields_not_read_by({cfg.arch, *also_read_by}):
        unset = [defaults[name]]
        if name in DERIVED_DEFAULTS:  # filled from other fields when not given
            inputs, derive = DERIVED_DEFAULTS[name]
            unset.append(derive(*(getattr(cfg, i) for i in inputs)))
        if name == "n_kv_heads":  # filled with n_heads (plain multi-head attention)
            unset.append(cfg.n_heads)
        value = getattr(cfg, name)
        if value in unset:
            continue
        readers = ", ".join(a for a, c in ARCHITECTURES.items() if name in c.reads)
        out.append(f"model.{name}={value!r} is read only by {readers}: {cfg.arch} does not use it")
    heads_read = any(ARCHITECTURES[a].uses_heads for a in also_read_by if a in ARCHITECTURES)
    if not arch.uses_heads and cfg.n_heads is not None and not heads_read:
        out.append(f"model.n_heads={cfg.n_heads} is not used by {cfg.arch} (one head of qk_dim, no multi-head split)")
    return out
