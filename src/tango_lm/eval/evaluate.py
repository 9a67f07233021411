"""`tango-lm eval`: NLL of a checkpoint on a split of its (or another) prepared dataset."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from tango_lm.data.dataset_dir import same_dataset_dir
from tango_lm.data.loader import count_eval_windows, eval_batches
from tango_lm.data.shards import PreparedDataset
from tango_lm.data.tokenizers import same_tokenizer
from tango_lm.errors import UserError
from tango_lm.eval.nll import evaluate_nll
from tango_lm.progress_lines import Progress, token_bar
from tango_lm.train.checkpoint import load_checkpoint
from tango_lm.train.device import autocast_dtype, pick_device


def evaluate_checkpoint(
    checkpoint: str,
    split: str,
    data_dir: str | None = None,
    max_windows: int | str | None = None,
    device: str = "auto",
    batch_size: int | None = None,
    segment: int | None = None,
    ablate: str | None = None,
    progress: Progress = False,
) -> dict[str, Any]:
    """Mean NLL of the checkpoint on `split`, in windows of the run's sequence length. By default
    (`max_windows` None) the run's own windows on its own dataset, so the result reproduces what the
    run logged: on dev its `eval_windows` (the first ones, or those sampled with `eval_sample_seed`),
    on test its `test_windows` (None: all); on another split or dataset every window. An int takes
    the first N of those windows (of the sample on a sampled dev split), "all" every window. A model trained with `active_width` (docs/design.md §2.6)
    runs with all segments active unless `segment` picks one; its result then has a "segment" key.
    `ablate` ("A" or "B") scores a twin-table (onóna) checkpoint with one table at input and output."""
    is_count = isinstance(max_windows, int) and not isinstance(max_windows, bool) and max_windows >= 1
    if not (max_windows is None or max_windows == "all" or is_count):
        # 0 said the split was shorter than one window; 2.5 scored 2 windows
        raise UserError(f"max_windows must be a whole number of at least 1, 'all' or None (got {max_windows!r})")
    ckpt = load_checkpoint(checkpoint)
    run = ckpt.config
    try:  # the run config's parts this reads: a hand-edited or truncated config.json lacks some
        data_path = data_dir or run["data"]["dir"]
        splits = {"dev": run["data"]["dev_split"], "test": run["data"]["test_split"]}
        # The run's settings as it ended when opened through its run directory: a --resume may
        # have changed test_windows or the eval batch since the selected checkpoint was saved.
        train = {**run["train"], **(ckpt.run_train or {})}
        seq_len = train["seq_len"] or run["model"]["context_length"]
        # the trainer's eval batch: the per-process micro-batch (it matters for MoE's capacity)
        world = ckpt.meta.get("world_size") if isinstance(ckpt.meta.get("world_size"), int) else 1
        bs = batch_size or train.get("eval_batch_size") or max(1, train["batch_size"] // world)
        precision, own_windows = train["precision"], {"dev": train["eval_windows"], "test": train.get("test_windows")}
    except (KeyError, TypeError) as exc:
        what = f"no {exc}" if isinstance(exc, KeyError) else "a section that is not a mapping"
        raise UserError(
            f"checkpoint {ckpt.path} has an incomplete config.json ({what}); it is corrupt, use another checkpoint"
        ) from None
    if data_dir is None and not Path(data_path).exists():
        where = (
            "is gone; prepare it again"
            if Path(data_path).is_absolute()
            else f"is not under {Path.cwd()}; run from the folder it trained in"  # data.dir is relative
        )
        raise UserError(f"the run's dataset {data_path} (its data.dir) {where}, or pass --data DIR")
    dataset = PreparedDataset.open(data_path, progress=progress)
    if not same_tokenizer(dataset.tokenizer.to_dict(), ckpt.tokenizer):
        raise UserError(
            f"dataset {data_path} was prepared with tokenizer {_described(dataset.tokenizer.to_dict())}, not the "
            f"checkpoint's {_described(ckpt.tokenizer)}; prepare the data with the checkpoint's tokenizer"
        )
    split_name = splits.get(split, split)
    recorded = ckpt.meta.get("data")  # the tokens of each split the run read (none before the record)
    scored = recorded.get(split_name) if isinstance(recorded, dict) else None
    prepared_again = scored is not None and (
        split_name not in dataset.splits or dataset.content_id(split_name) != scored
    )  # only the split scored: more training text since leaves its test NLL the run's
    if data_dir is None and prepared_again:  # its own windows of other tokens: neither its dev nor its test NLL
        raise UserError(
            f"the run's dataset {data_path} holds other tokens than the run trained on (prepared again since); "
            "prepare it as it was to reproduce the run's numbers, or pass --data DIR to score that data"
        )
    dev = pick_device(device)
    model = ckpt.build_model(dev)
    variant = model_variant(model, ckpt, segment, ablate)
    dtype = autocast_dtype(precision, dev)
    own_data = not prepared_again and (
        data_dir is None
        or same_dataset_dir(data_dir, run["data"].get("dir"))
        or holds_recorded_tokens(dataset, recorded)  # the run's data, moved or named from elsewhere
    )
    # The split's role in the run: "dev" or "test" as asked, else by name. A run may test on its dev
    # split (test_split: dev), and `--split test` then takes the test windows, as its summary did.
    role = split if split in splits else next((k for k, name in splits.items() if name == split_name), None)
    if max_windows is None:  # the run's own windows on its own data (every window elsewhere)
        max_windows = own_windows[role] if role and own_data else None
    elif max_windows == "all":
        max_windows = None
    # A sample only when some windows are left out: every window, in any order, is the same NLL
    # (but for an MoE evaluated below its dropless capacity, whose drops depend on batch mates).
    sample_seed = train.get("eval_sample_seed") if role == "dev" and max_windows is not None else None
    tokens = dataset.tokens(split_name)
    batches = eval_batches(tokens, seq_len, bs, max_windows, sample_seed, split=repr(split_name))
    windows = count_eval_windows(tokens, seq_len, max_windows)
    with token_bar(windows * seq_len, f"eval {split_name}", progress) as bar:
        nll, scored = evaluate_nll(model, _counted(batches, bar), dev, dtype)
    res = {"checkpoint": str(ckpt.path), "step": ckpt.meta["step"], "split": split_name, "nll": nll, "tokens": scored}
    res["windows"] = windows
    if role is not None and role != split_name:  # a role's split of another name: test ('dev'), dev ('validation')
        res["role"] = role
    if sample_seed is not None and windows < count_eval_windows(tokens, seq_len):  # said of a sample only
        res["sample_seed"] = sample_seed
    return {**res, **variant}


def _counted(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], bar: Any
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches, each counted on the bar once the model has scored it."""
    for inputs, targets in batches:
        yield inputs, targets
        bar.update(inputs.numel())


def _described(tokenizer: dict[str, Any]) -> str:
    """Name and fingerprint: two trained BPEs share the name 'bpe'."""
    return f"{tokenizer.get('name')!r} ({str(tokenizer.get('fingerprint'))[:12]}, {tokenizer.get('vocab_size')} ids)"


def model_variant(model: Any, ckpt: Any, segment: int | None, ablate: str | None) -> dict[str, Any]:
    """Run `model` with one segment of a rotating narrow width (None: all columns) and, for a
    twin-table head, `ablate` ("A" or "B": that table alone at input and output); returns the
    result's labels for them ("segment" for models trained with active_width, "ablate")."""
    model.set_active_segment(segment)
    labels: dict[str, Any] = {}
    if ablate is not None:
        if ablate.upper() not in ("A", "B"):
            raise UserError(f"--ablate takes A or B (got {ablate!r})")
        if not model.head.twin_tables:
            from tango_lm.heads.registry import HEADS

            twins = " or ".join(name for name, head in HEADS.items() if head.twin_tables)
            raise UserError(
                f"--ablate needs a checkpoint of onóna's twin mixture (head {twins}); "
                f"{ckpt.path} has head {ckpt.config['model'].get('head')!r}"
            )
        model.head.ablation = ablate.lower()
        labels["ablate"] = ablate.upper()
    if model.num_segments is not None:  # trained with active_width: say which columns ran
        labels["segment"] = "all" if segment is None else segment
    return labels


def holds_recorded_tokens(dataset: PreparedDataset, recorded: Any) -> bool:
    """Whether `dataset` holds the tokens a checkpoint recorded for each split the run read
    (checkpoints from before the record have none: then only the run's own path counts)."""
    return (
        isinstance(recorded, dict)
        and bool(recorded)
        and all(split in dataset.splits and dataset.content_id(split) == content for split, content in recorded.items())
    )
