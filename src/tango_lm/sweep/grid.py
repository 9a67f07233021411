"""Sweep grids (docs/design.md §6): a base run config and axes whose product is a list of runs.

A grid is a YAML file:

    out_dir: runs/sweeps/table1        # one run directory per combination below this
    base: tango-70m-d4                 # a preset name or YAML file, or inline model/data/train
                                       # sections (a mapping may also name a `preset:` to start from)
    axes:
      dataset: {fineweb: data/fineweb-gpt2, lean: data/lean-gpt2}   # name: prepared data dir
      tier: [70M, 160M]                # width matched per architecture (`tango-lm match`)
      depth: [4, 8]
      arch: [tango, tango-windowed, loop-transformer, untied-transformer, gau, flash]
      head: [standard, onona]
      seed: [[17, 101], [23, 103], [41, 107]]   # (model seed, data-order seed) pairs
      train.lr: [1e-3, 3e-3]           # any config field, written section.field
    slurm: {partition: gpu, gpus_per_job: 1, time: "12:00:00", array_parallelism: 16}
                                       # optional: jobs of `--launcher slurm` (sweep/launchers.py)

Axes and what they set (each value is checked in sweep/axes.py):

- `dataset`: `data.dir` (a mapping name -> directory, or a list of directories named by basename).
- `tier`: a parameter target; `70M` / `160M` use the TANGO paper's d (512 / 768) unless a
  `d_model` axis is given, other targets (`2M`, `250K`, `1500000`) use the d_model axis or the
  base's. Each architecture's `width` is matched to the target (docs/design.md §2.8) with the `standard`
  head, then the run's head is put on, so head-vs-Standard pairs share their backbone exactly
  (the onóna paper's protocol). `target_params` is the same with explicit counts.
  `arch` also takes the label of a paper's fixed geometry of an architecture (`conventional-untied`:
  seed 000 Table 6, models/fixed_geometry.py), built for the run's paper tier and depth.
- `d_model`, `depth`, `arch`, `head`: the model fields of those names.
- `seed`: `[model_seed, data_seed]` pairs, or plain model seeds (data seed from the base).

Budgets: a `train.tokens_per_param` budget is turned into `train.tokens` = TPP x the tier's
target (or, without a tier, x the count `train/config.py:tpp_reference_params` gives: the run's
model with the Standard head, or the Dense model of its shape for the onóna paper's other
backbones), so every head of a setting (and, with a tier or target, every architecture) trains on
the same tokens in the same order.

Run directories are named by the axes in the fixed order dataset, tier/target_params, d_model,
depth, arch, head, config-field axes, seed: `dataset=fineweb/tier=70M/depth=4/arch=tango/
head=standard/seed=17-101`. Each holds a normal `tango-lm train` run plus `sweep.json` (its labels);
`OUT/grid.json` lists them all (`record_grid_runs`), so that a report names those never started.
Runs that differ only in model fields their architecture does not read (a `model.window` axis
beside `tango`) are one setting: the first trains, the others are `Grid.repeats`, said, not trained.
"""

from __future__ import annotations

import copy
import fnmatch
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tango_lm.atomic_files import write_json_atomic
from tango_lm.data.dataset_dir import is_prepared
from tango_lm.errors import UserError, did_you_mean
from tango_lm.models.config import ModelConfig
from tango_lm.models.fixed_geometry import FixedGeometry
from tango_lm.models.matching import PAPER_VOCAB, TIERS, match_width, parse_tier
from tango_lm.models.registry import fixed_geometries, without_unread_fields
from tango_lm.sweep.axes import NAMED_AXES, SAFE_LABEL, SECTIONS, label_of, parse_axes
from tango_lm.train.config import (
    BUDGET_FIELDS,
    DataConfig,
    RunConfig,
    parse_yaml,
    read_yaml,
    tpp_reference_params,
    yaml_error_text,
)
from tango_lm.train.run_dir import enclosing_dataset_or_run

MAX_NAME_BYTES = 255  # one path component on common file systems (ext4, XFS, APFS)


@dataclass
class SweepRun:
    """One combination of the grid: its directory name, axis labels and validated config."""

    name: str
    labels: dict[str, Any]
    config: RunConfig
    dataset_dir: str | None = None
    # The grid's tokens_per_param behind train.tokens (`_fix_budget`): runs of one sweep may differ in
    # tokens by design then (each architecture's own count without a tier), and reports know it.
    tokens_per_param: float | None = None

    @property
    def out_dir(self) -> Path:
        return Path(self.config.train.out_dir)


@dataclass
class Grid:
    path: Path
    out_dir: Path
    axes: dict[str, list[Any]]
    runs: list[SweepRun] = field(default_factory=list)
    missing_data: dict[str, str] = field(default_factory=dict)  # dataset name -> directory
    # A run that differs from an earlier one only in model fields its architecture does not read (a
    # window axis on TANGO) -> (that run, which trains the one setting in its stead, those fields): not in `runs`.
    repeats: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    slurm: dict[str, Any] = field(default_factory=dict)  # job settings for --launcher slurm (sweep/launchers.py)

    def select(self, patterns: list[str] | None) -> list[SweepRun]:
        """Runs whose name matches any pattern: a plain substring, or a glob matched against the
        name or any part of it from a `/` on (`tier=70M/*` selects `dataset=fw/tier=70M/...`)."""
        if not patterns:
            return list(self.runs)
        return [r for r in self.runs if any(_matches(r.name, p) for p in patterns)]

    def repeats_selected(self, patterns: list[str]) -> list[str]:
        """The `repeats` (runs trained as another) that `patterns` would select, as `select` does."""
        return [name for name in self.repeats if any(_matches(name, p) for p in patterns)]


def _matches(name: str, pattern: str) -> bool:
    if any(c in pattern for c in "*?["):
        parts = name.split("/")
        return any(fnmatch.fnmatchcase("/".join(parts[i:]), pattern) for i in range(len(parts)))
    return pattern in name


def load_grid(path: str | Path, check_data: bool = True) -> Grid:
    """Read and validate a grid YAML; every combination's config is built (and validated) here,
    so a malformed grid fails before anything trains. `check_data=False` records dataset
    directories that are not prepared in `Grid.missing_data` instead of raising."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"sweep grid {path} does not exist; give a grid YAML such as configs/sweeps/dmmath-cpu.yaml")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"sweep grid {path} is not text (not UTF-8); give a grid YAML") from None
    except OSError as exc:
        raise UserError(f"cannot read sweep grid {path} ({exc.strerror or exc}); check its permissions") from None
    try:
        spec = parse_yaml(text)
    except Exception as exc:  # noqa: BLE001 - every YAML error, RepeatedKey included
        raise UserError(f"sweep grid {path} {yaml_error_text(exc)}") from None
    if not isinstance(spec, dict):
        raise UserError(f"sweep grid {path} must be a mapping with base, axes and out_dir")
    keys = ("base", "axes", "out_dir", "description", "slurm")
    unknown = sorted(set(spec) - set(keys), key=str)
    if unknown:
        hint = did_you_mean(unknown[0], keys) if isinstance(unknown[0], str) else ""
        raise UserError(
            f"unknown key {unknown[0]!r}{hint} in sweep grid {path}; keys are base, axes, out_dir, description and slurm"
        )
    out_dir = spec.get("out_dir", f"runs/sweeps/{path.stem}")
    if not isinstance(out_dir, str) or not out_dir:
        raise UserError(f"out_dir in sweep grid {path} must be a directory path (got {out_dir!r})")
    # before the sweep writes its status and locks there
    inside = enclosing_dataset_or_run(out_dir)
    if inside is not None:
        holder, what = inside
        where = "is" if holder == Path(out_dir).absolute() else "is inside"
        raise UserError(
            f"sweep grid {path}: out_dir {out_dir} {where} the {what} {holder}; choose a directory outside it"
        )
    base = _base_sections(spec.get("base"), path)
    axes = parse_axes({} if spec.get("axes") is None else spec["axes"], path)  # `axes: []` is not "no axes"
    grid = Grid(path=path, out_dir=Path(out_dir), axes=axes, slurm=spec.get("slurm") or {})

    if "dataset" in axes:  # (what it is, its name in missing_data, directory)
        datasets = [(f"dataset {name!r}", name, directory) for name, directory in axes["dataset"]]
    elif "data.dir" in axes:
        datasets = [(f"axis data.dir value {d!r}", f"data.dir={d}", d) for d in axes["data.dir"]]
    else:
        datasets = [("the base's data.dir", "data.dir", base["data"].get("dir", DataConfig().dir))]
    for what, name, directory in datasets:
        if not isinstance(directory, str) or not is_prepared(directory):
            if check_data or not isinstance(directory, str):
                raise UserError(
                    f"{what} of sweep grid {path}: {directory} is not a prepared dataset (directory missing or "
                    "incomplete); prepare it with `tango-lm data prepare` or fix the grid"
                )
            grid.missing_data[name] = directory

    order = [a for a in NAMED_AXES if a in axes and a != "seed"]
    order += sorted(a for a in axes if "." in a)
    order += ["seed"] if "seed" in axes else []
    names: dict[str, dict[str, Any]] = {}
    settings: dict[str, str] = {}  # each run's config but its out_dir -> its name
    computed: dict[str, SweepRun] = {}  # the same without the model fields its architecture does not read
    for combo in itertools.product(*(axes[a] for a in order)):
        values = dict(zip(order, combo, strict=True))
        run = _make_run(base, values, grid, path)
        if run.name in names:
            raise UserError(
                f"sweep grid {path} gives two runs the same directory {run.name}; make axis values distinct"
            )
        names[run.name] = values
        # values written two ways (tier 20K and 20000, seed 17 and [17, 101] with data seed 101)
        # would train one setting twice and report its seeds as a mean of copies
        config = run.config.to_dict()
        config["train"].pop("out_dir")
        key = json.dumps(config, sort_keys=True)
        if key in settings:
            raise UserError(
                f"sweep grid {path}: runs {settings[key]} and {run.name} are one setting (the same config "
                "once their values are resolved); list each value once"
            )
        settings[key] = run.name
        same = json.dumps({**config, "model": without_unread_fields(config["model"])}, sort_keys=True)
        if same in computed:  # it would train (and `report` average) a copy of that run
            first, mine = computed[same], config["model"]
            differ = tuple(sorted(k for k, v in first.config.model.to_dict().items() if mine.get(k) != v))
            grid.repeats[run.name] = (first.name, differ)
            continue
        computed[same] = run
        grid.runs.append(run)
    return grid


# -- base config ------------------------------------------------------------------------------
def _base_sections(base: Any, grid_path: Path) -> dict[str, dict[str, Any]]:
    if base is None:
        return {"model": {}, "data": {}, "train": {}}
    if isinstance(base, str):
        data = _read_base(base, grid_path)
    elif isinstance(base, dict):
        data = copy.deepcopy(base)
        preset = data.pop("preset", None)
        if preset is not None:
            if not isinstance(preset, str):
                raise UserError(f"base.preset in sweep grid {grid_path} must be a preset name or YAML file")
            start = _read_base(preset, grid_path)
            own = data.get("train") if isinstance(data.get("train"), dict) else {}
            if any(key in own for key in BUDGET_FIELDS) and isinstance(start.get("train"), dict):
                for key in BUDGET_FIELDS:  # the grid's budget replaces the preset's, whichever kind each is
                    start["train"].pop(key, None)
            for section, values in data.items():
                if section == "model" and isinstance(values, dict) and isinstance(start.get(section, {}), dict):
                    # as the same fields given as overrides: a d_model without n_heads keeps head widths
                    # (a plain update kept the preset's 16 heads, 4 channels each at d_model 64)
                    start["model"] = ModelConfig.overridden(start.get("model") or {}, values)
                elif isinstance(values, dict) and isinstance(start.get(section, {}), dict):
                    start.setdefault(section, {}).update(values)
                else:
                    start[section] = values
            data = start
    else:
        raise UserError(
            f"base in sweep grid {grid_path} must be a preset name, a YAML file or model/data/train sections"
        )
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise UserError(
            f"unknown base section {unknown[0]!r} in sweep grid {grid_path}; sections are model, data and train"
        )
    out = {}
    for section in SECTIONS:
        values = data.get(section) or {}
        if not isinstance(values, dict):
            raise UserError(f"base.{section} in sweep grid {grid_path} must be a mapping of field: value")
        out[section] = dict(values)
    return out  # validated per run, once the axes have filled it in


def _read_base(source: str, grid_path: Path) -> dict[str, Any]:
    beside = grid_path.parent / source
    if not Path(source).exists() and beside.is_file():
        source = str(beside)  # a base file named relative to the grid
    return copy.deepcopy(read_yaml(source))


# -- one combination ---------------------------------------------------------------------------
def _make_run(base: dict[str, dict[str, Any]], values: dict[str, Any], grid: Grid, path: Path) -> SweepRun:
    parts, labels = [], {}
    sections = copy.deepcopy(base)
    model, data, train = sections["model"], sections["data"], sections["train"]
    dataset_dir = None
    for axis, value in values.items():
        if axis == "dataset":
            name, dataset_dir = value
            data["dir"] = dataset_dir
            label = name
        else:
            label = label_of(value)
        if not SAFE_LABEL.match(label):
            raise UserError(
                f"value {label!r} of axis {axis!r} in sweep grid {path} cannot name a directory; "
                "use letters, digits, '.', '_', '+' or '-'"
            )
        parts.append(f"{axis}={label}")
        labels[axis] = list(value) if axis == "seed" else (label if axis == "dataset" else value)
    name = "/".join(parts) or "run"
    where = f"run {name} of sweep grid {path}"
    long = next((part for part in parts if len(part.encode()) > MAX_NAME_BYTES), None)
    if long is not None:  # a directory name the file system would refuse when the run starts
        raise UserError(
            f"sweep grid {path}: the run directory name {long[:60]}... is {len(long.encode())} bytes, over the "
            f"{MAX_NAME_BYTES} a file system takes; give that axis shorter values"
        )

    target = None
    d_model = values.get("d_model")
    if "tier" in values:
        tier = values["tier"]
        fallback = None if tier in TIERS else model.get("d_model", 256)
        target, tier_d = parse_tier(tier, d_model if d_model is not None else fallback)
        d_model = tier_d
    elif "target_params" in values:
        target = values["target_params"]
    # The model.* axes and d_model as one set of overrides, so the head shape follows them as on the
    # command line (the base's n_heads and GQA group are read once).
    model_axes = {k.partition(".")[2]: v for k, v in values.items() if k.startswith("model.")}
    if d_model is not None and d_model != model.get("d_model"):
        model_axes["d_model"] = d_model
    if model_axes:
        model = sections["model"] = ModelConfig.overridden(model, model_axes)
    if "depth" in values:
        model["depth"] = values["depth"]
    arch = values.get("arch")
    fixed = fixed_geometries().get(arch)  # a paper's geometry of an architecture: set below, from the tier
    if arch is not None:
        model["arch"] = fixed[0] if fixed else arch
    head = values.get("head", model.get("head", "standard"))
    model["head"] = head
    if target is not None:
        model["width"] = model.get("d_model", 256)  # a valid start; the matcher sets the width
    if "seed" in values:
        train["seed"], data_seed = values["seed"]
        if data_seed is not None:
            train["data_seed"] = data_seed
    budget_axes = [axis for axis in values if axis in {f"train.{key}" for key in BUDGET_FIELDS}]
    if len(budget_axes) > 1:
        raise UserError(f"axes {' and '.join(budget_axes)} of sweep grid {path} both set the budget; keep one")
    for axis, value in values.items():
        if "." in axis and not axis.startswith("model."):
            section, _, key = axis.partition(".")
            if axis in budget_axes:  # the axis's budget replaces the base's, whichever kind each is
                for other in BUDGET_FIELDS:
                    train.pop(other, None)
            sections[section][key] = value
    head = model["head"]  # a model.head axis too (matching below is done with the Standard head)
    train["out_dir"] = str(grid.out_dir / name)
    try:
        run = RunConfig.from_dict(sections)
        if fixed:
            run.model = _fixed_geometry(run.model, *fixed, values["tier"])
        elif target is not None:
            run.model = match_width(run.model.replace(head="standard"), target).replace(head=head)
        tokens_per_param = _fix_budget(run, target)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    return SweepRun(name=name, labels=labels, config=run, dataset_dir=dataset_dir, tokens_per_param=tokens_per_param)


def _fixed_geometry(model: ModelConfig, arch: str, geometry: FixedGeometry, tier: str) -> ModelConfig:
    shape = geometry.config(arch, tier, model.depth, model.vocab_size)
    if shape is None:
        raise UserError(
            f"{geometry.source} has no {geometry.label} geometry for tier {tier} at depth {model.depth}; "
            f"use {geometry.where()}"
        )
    if model.vocab_size != PAPER_VOCAB:  # its embedding is part of the tier's count (as `tango-lm match` leaves it out)
        params = shape.replace(head=model.head).num_params()["total"]
        raise UserError(
            f"{geometry.label} is {geometry.source}'s fixed shape, which has the {tier} tier's parameters only with "
            f"the GPT-2 vocabulary ({PAPER_VOCAB}); with model.vocab_size={model.vocab_size} it has {params:,}, "
            f"not matched to the other runs: set model.vocab_size={PAPER_VOCAB}, or compare {arch}, which is matched"
        )
    return model.replace(arch=arch, d_model=shape.d_model, n_heads=shape.n_heads, width=shape.width)


def _fix_budget(run: RunConfig, target: int | None) -> float | None:
    """Turn a tokens_per_param budget into train.tokens (module docstring); the TPP it turned, if any."""
    t = run.train
    if t.tokens_per_param is None or t.steps is not None or t.tokens is not None:
        return None
    reference = target if target is not None else tpp_reference_params(run.model)
    tokens_per_param, t.tokens, t.tokens_per_param = t.tokens_per_param, int(t.tokens_per_param * reference), None
    return tokens_per_param


GRID_RUNS_FILE = "grid.json"


def record_grid_runs(grid: Grid) -> None:
    """`OUT/grid.json`: every run directory of the grid (the whole grid, whatever `--only` selects),
    relative to `OUT`; `report` names those that never started (a killed sweep's later runs)."""
    names = [
        r.out_dir.relative_to(grid.out_dir).as_posix() for r in grid.runs if r.out_dir.is_relative_to(grid.out_dir)
    ]
    grid.out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(grid.out_dir / GRID_RUNS_FILE, {"runs": names})
