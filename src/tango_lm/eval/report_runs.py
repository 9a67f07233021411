"""The runs a report reads (eval/report.py): every finished run directory below a root, its
labels (sweep.json, else its config), its reported NLL and its learning curves, and the warnings
met on the way (damaged inputs: see report.py's docstring)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tango_lm.errors import UserError
from tango_lm.models.config import MODEL_LOGISTICS_FIELDS, ModelConfig
from tango_lm.strict_json import read_object
from tango_lm.sweep.grid import GRID_RUNS_FILE
from tango_lm.train import metrics_file
from tango_lm.train.config import (
    BUDGET_FIELDS,
    LOGISTICS_FIELDS,
    DataConfig,
    TrainConfig,
    budget_steps,
    tpp_reference_params,
)

ROW_AXES = ("dataset", "tier", "depth")
MODEL_AXES = ("arch", "head", "seed")


@dataclass
class RunRecord:
    """One finished run: its labels, its reported NLL and its learning curves."""

    path: Path
    dataset: str
    tier: str
    depth: int
    arch: str
    head: str
    seed: str
    extras: tuple[tuple[str, Any], ...]
    value: float
    test_nll: float | None
    dev_nll: float | None
    tokens_per_s: float | None
    params_total: int | None
    tokens: int | None
    train_curve: list[tuple[int, float]] = field(default_factory=list)
    dev_curve: list[tuple[int, float]] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.arch if self.head == "standard" else f"{self.arch}+{self.head}"

    @property
    def row(self) -> tuple[Any, ...]:
        return (self.dataset, self.tier, self.depth, self.extras)


NO_TIER = "-"  # the tier of a plain run, which no grid matched to a parameter target


# -- reading ----------------------------------------------------------------------------------
def _load_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        raise UserError(f"{path} is truncated or corrupt (not valid JSON); {what}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is corrupt (not a JSON object); {what}")
    return data


CORRUPT_RUN = "rerun it (or its sweep) or delete the run directory"


def read_metrics(path: Path, warnings: list[str]) -> list[dict[str, Any]]:
    """Records of a `metrics.jsonl`; a partial last line is skipped with a warning."""
    if not path.exists():
        warnings.append(f"{path} is missing; no learning curves for this run")
        return []
    pairs, cut = metrics_file.parse(path)
    if cut:
        warnings.append(f"{path}: skipped a partial last line (the run was cut while logging)")
    return [rec for _, rec in pairs]


def _seed_label(seed: Any, data_seed: Any = None) -> str:
    if isinstance(seed, list):
        seed, data_seed = (seed + [None])[:2]
    return str(seed) if data_seed is None else f"{seed}/{data_seed}"


def _numbers(record: dict[str, Any], *keys: str) -> bool:
    return all(isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool) for k in keys)


def read_run(run_dir: Path, split: str, warnings: list[str]) -> RunRecord | None:
    """A finished run's record, or None (with a warning) when it has not finished."""
    config = _load_json(run_dir / "config.json", "the run's config is needed to label it")
    summary_path = run_dir / "summary.json"
    failed = run_dir / "failed.json"
    if not summary_path.exists():
        why = "failed" if failed.exists() else "unfinished"
        warnings.append(f"{run_dir}: no summary.json ({why}); left out of the report")
        return None
    # A summary from before the latest attempt, which failed (a grid edit, say); one written after it
    # is a run finished by `train RUN --resume` (which now removes failed.json; earlier versions did not).
    if failed.exists() and failed.stat().st_mtime >= summary_path.stat().st_mtime:
        warnings.append(f"{run_dir}: its latest attempt failed (failed.json); left out of the report")
        return None
    rewrite = f"`tango-lm train {run_dir} --resume` writes it again (as rerunning its sweep does), or delete the run"
    summary = _load_json(summary_path, rewrite)  # (it named only a sweep, of plain runs too)
    sweep_path = run_dir / "sweep.json"
    labels = _load_json(sweep_path, "rerun the sweep to rewrite it").get("labels", {}) if sweep_path.exists() else {}
    if not isinstance(labels, dict):
        raise UserError(f"{sweep_path} is corrupt (its labels are not a mapping); rerun the sweep to rewrite it")
    try:
        model, train, data = config["model"], config["train"], config["data"]
        test_nll = summary["test_nll"]
        best_dev = summary["best_dev_nll"]
    except (KeyError, TypeError) as exc:
        raise UserError(f"{run_dir} has a config.json or summary.json without field {exc}; it is corrupt") from None
    if not all(isinstance(section, dict) for section in (model, train, data)):
        raise UserError(f"{run_dir / 'config.json'} is corrupt (a section is not a mapping); {CORRUPT_RUN}")
    depth = labels.get("depth", model.get("depth", 0))
    if not isinstance(depth, int) or isinstance(depth, bool):
        raise UserError(f"{run_dir} records depth {depth!r}, not a number; {CORRUPT_RUN}")

    metrics = read_metrics(run_dir / "metrics.jsonl", warnings)
    # A skipped step (non-finite loss) logs "loss": null; it has no point on the curve.
    # MoE's loss holds its load-balancing term, logged apart: the curve is the NLL every model logs.
    train_curve = [
        (int(r["tokens"]), float(r["loss"]) - (float(r["aux_loss"]) if _numbers(r, "aux_loss") else 0.0))
        for r in metrics
        if _numbers(r, "loss", "tokens")
    ]
    dev_curve = [
        (int(r["tokens"]), float(r["dev_nll"]))
        for r in metrics
        if _numbers(r, "dev_nll", "tokens") and r.get("event") != "summary"
    ]
    selected = summary.get("selected_step")
    # A diverged dev NLL is null in metrics.jsonl: the selected checkpoint then has no dev NLL (left
    # out below), not the best one's, which under select: final is another checkpoint's.
    at_selected = [
        r["dev_nll"] for r in metrics if "dev_nll" in r and r.get("step") == selected and r.get("event") != "summary"
    ]
    if "selected_dev_nll" in summary:  # the trainer's own record (null: none finite at that step)
        dev_nll = summary["selected_dev_nll"]
    else:  # a summary from before it: the log, else the best (what select: best selects)
        dev_nll = at_selected[-1] if at_selected else best_dev
    dev_nll = float(dev_nll) if _numbers({"dev_nll": dev_nll}, "dev_nll") else None
    value = test_nll if split == "test" else dev_nll
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        warnings.append(f"{run_dir}: its {split} NLL is {value!r}; left out of the report")
        return None
    tier = labels.get("tier", labels.get("target_params", NO_TIER))
    extras = tuple(
        sorted((k, v) for k, v in labels.items() if k not in (*ROW_AXES, *MODEL_AXES, "tier", "target_params"))
    )
    return RunRecord(
        path=run_dir,
        dataset=str(labels.get("dataset", Path(str(data.get("dir", "-"))).name)),
        tier=str(tier),
        depth=depth,
        arch=str(labels.get("arch", model.get("arch"))),
        head=str(labels.get("head", model.get("head", "standard"))),
        # what the run trained with (a grid's plain seed 1 is its base's data_seed too: 1/101)
        seed=_seed_label(train.get("seed"), train.get("data_seed")),
        extras=extras,
        value=float(value),
        test_nll=test_nll,
        dev_nll=dev_nll,
        **{k: summary[k] if _numbers(summary, k) else None for k in ("tokens_per_s", "params_total", "tokens")},
        train_curve=train_curve,
        dev_curve=dev_curve,
    )


def _never_started(root: Path) -> list[str]:
    """The runs of the sweep's grid (its grid.json) with nothing to report: a killed sweep's later
    runs have no directory, and a table of the others read as the whole grid."""
    path = root / GRID_RUNS_FILE
    if not path.is_file():
        return []
    try:
        names = json.loads(path.read_text())["runs"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):  # not an assert: python -O
        return [f"{path} is unreadable; runs of the grid that never started are not named"]
    missing = [n for n in names if not any((root / n / f).exists() for f in ("config.json", "failed.json"))]
    if not missing:
        return []
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return [f"{len(missing)} of the grid's {len(names)} runs never started ({shown}); the tables hold the others"]


def _run_files(root: Path) -> tuple[list[Path], list[Path]]:
    """Every config.json and failed.json below `root`, outside checkpoint directories, sorted.
    os.walk and not rglob: a live sweep renames and removes its old checkpoints while a report
    reads, and os.walk passes over a directory gone mid-walk where rglob raises. Linked directories
    are followed (a folder of links to runs is a comparison), each real directory once: a run linked
    twice would count twice, and a link to a parent would never end."""
    configs, failures = [], []
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = [d for d in dirnames if d != "checkpoints"]  # a checkpoint's config.json is no run
        configs += [Path(dirpath, "config.json")] if "config.json" in filenames else []
        failures += [Path(dirpath, "failed.json")] if "failed.json" in filenames else []
    return sorted(configs), sorted(failures)


def collect_runs(root: str | Path, split: str = "test", skip: Path | None = None) -> tuple[list[RunRecord], list[str]]:
    """Every finished run below `root` and the warnings met on the way."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root} is not a directory; give the sweep's out_dir or a directory of run directories")
    if split not in ("test", "dev"):
        raise UserError(f"--split must be test or dev (got {split!r})")
    warnings: list[str] = []
    records = []
    configs, failures = _run_files(root)
    for config in configs:
        run_dir = config.parent
        if skip and run_dir.is_relative_to(skip):
            continue
        rec = read_run(run_dir, split, warnings)
        if rec is not None:
            records.append(rec)
    for failed in failures:  # runs that failed before writing their config
        if not (failed.parent / "config.json").exists():
            warnings.append(f"{failed.parent}: failed before training ({failed.name}); left out of the report")
    warnings += _never_started(root)
    settings = {r.path: _resolved_setting(r.path) for r in records}  # each config.json read once
    records = _label_other_training(records, settings)
    records = _separate_other_settings(root, records, settings, warnings)
    if not records:
        raise UserError(f"no finished runs under {root} (no run directory with config.json and summary.json)")
    return records, warnings


# Fields that do not change what a run computes (where and how it logged, checkpointed or compiled;
# a kernel or chunk choice) or that are axes of their own; the others, where runs of one row differ,
# label the rows. eval_batch_size changes MoE's scores only (expert capacity is per forward).
NEUTRAL = {
    "train": LOGISTICS_FIELDS | {"seed", "data_seed", "eval_batch_size"},
    "model": MODEL_LOGISTICS_FIELDS | {"head"},
    "data": set(),
}
# A config.json from before a field existed ran with what is now its default (as sweep/runner.py reads it).
DEFAULTS = {
    section: {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    for section, cls in (("train", TrainConfig), ("model", ModelConfig), ("data", DataConfig))
}


def _label_other_training(records: list[RunRecord], settings: dict[Path, dict[str, Any]]) -> list[RunRecord]:
    """In one row (and, for train and data fields, across its depths: the depth table compares
    them), each train or data field where runs differ, and each model field where runs of one
    architecture differ, becomes a label of its own (a column). Without this, runs of another lr or
    length (plain run directories carry no labels of what they varied) were paired and ranked as if
    they differed only by head or architecture. Runs of one sweep are compared the same way (a grid
    edited since some of its runs trained leaves those beside the new ones), except in the token
    budgets the grid derived from one tokens_per_param (each architecture's own count, by design)."""
    from tango_lm.models.registry import architecture_of

    derived = {r.path: _derived_budget(r.path) for r in records}
    labels: dict[Path, list[tuple[str, Any]]] = {r.path: [] for r in records}
    rows: dict[tuple[Any, ...], list[RunRecord]] = {}
    depths: dict[tuple[Any, ...], list[RunRecord]] = {}  # a row's runs at every depth: the depth table's
    for r in records:
        rows.setdefault(r.row, []).append(r)
        depths.setdefault((r.dataset, r.tier, r.extras), []).append(r)
    groups: list[tuple[str, list[RunRecord], set[str]]] = []
    for runs in depths.values():  # training and data compared across depths too (the model differs by design)
        batch_dependent = any(getattr(architecture_of(r.arch), "scores_depend_on_batch", False) for r in runs)  # MoE
        neutral_train = NEUTRAL["train"] - ({"eval_batch_size"} if batch_dependent else set())
        if all(settings[r.path]["train"].get("select") == "final" for r in runs):
            neutral_train = neutral_train | {"eval_every"}  # it only picks the best-dev checkpoint
        groups += [("train", runs, neutral_train), ("data", runs, NEUTRAL["data"])]
    for row in rows.values():
        groups += [("model", [r for r in row if r.arch == arch], NEUTRAL["model"]) for arch in {r.arch for r in row}]
    for section, runs, neutral in groups:
        for key in sorted({k for r in runs for k in settings[r.path][section]} - neutral):
            known = [(r, settings[r.path][section][key]) for r in runs if key in settings[r.path][section]]
            name = f"{section}.{key}"
            budgets = {derived[r.path] for r, _ in known}
            by_design = name == "train.tokens" and len(budgets) == 1 and None not in budgets
            if by_design or all(v == w for _, v in known for _, w in known):
                continue
            for r, v in known:  # not twice where a sweep's axis (model.d_model's is d_model) labels it
                if name not in dict(r.extras) and not (name == "model.d_model" and "d_model" in dict(r.extras)):
                    labels[r.path].append((name, v if _hashable(v) else json.dumps(v)))
    return [replace(r, extras=(*r.extras, *labels[r.path])) if labels[r.path] else r for r in records]


def _resolved_setting(run_dir: Path) -> dict[str, dict[str, Any]]:
    """`_setting` as a run of today would write it: the model validated (derived fields such as
    n_kv_heads and capacity_factor_eval filled), train fields an older config.json lacks at their
    defaults, seq_len resolved, and no model field its architecture does not read."""
    from tango_lm.models.registry import without_unread_fields

    setting = _setting(run_dir)
    out = {section: {**DEFAULTS[section], **(setting[section] or {})} for section in ("train", "model", "data")}
    try:
        out["model"] = ModelConfig.from_dict(dict(setting["model"] or {})).to_dict()
    except (UserError, TypeError, ValueError):  # a field since removed, say: compared as written
        pass
    # Fields only other architectures read change nothing this run computed: a tango run beside a
    # windowed one (the sweep's base sets window for both) is one setting with a tango run without.
    out["model"] = without_unread_fields(out["model"])
    if out["train"].get("seq_len") is None:  # None: the model's context length
        out["train"]["seq_len"] = out["model"].get("context_length")
    # One budget whichever kind config.json wrote it in: `steps: 100` and the `tokens` of 100
    # steps trained alike, so both are compared (and labelled) as the tokens they train.
    trained = _trained_tokens(out, (read_object(run_dir / "summary.json") or {}).get("steps"))
    if trained is not None:
        out["train"].update({key: None for key in BUDGET_FIELDS}, tokens=trained)
    return out


def _trained_tokens(setting: dict[str, dict[str, Any]], finished_steps: Any = None) -> int | None:
    """The tokens the run's budget trains. A tokens_per_param budget is the steps the run finished
    with when it did: the count it multiplies has changed between versions (the Standard head's,
    then the Dense model's for the onóna backbones), so today's count may not be the run's."""
    train = setting["train"]
    try:
        per_step = int(train["batch_size"]) * int(train["grad_accum"]) * int(train["seq_len"])
        tpp_only = (
            train.get("steps") is None and train.get("tokens") is None and train.get("tokens_per_param") is not None
        )
        if tpp_only and isinstance(finished_steps, int) and not isinstance(finished_steps, bool) and finished_steps > 0:
            return finished_steps * per_step
        steps = budget_steps(
            train.get("steps"),
            train.get("tokens"),
            train.get("tokens_per_param"),
            per_step,
            lambda: tpp_reference_params(ModelConfig.from_dict(dict(setting["model"]))),
        )
    except (UserError, TypeError, ValueError, KeyError):  # a hand-edited config.json: compared as written
        return None
    return None if steps is None else steps * per_step


def _derived_budget(run_dir: Path) -> tuple[Path, float] | None:
    """(sweep directory, tokens_per_param) when the run's train.tokens is its sweep's tokens_per_param
    budget turned into tokens (sweep/grid.py `_fix_budget`); runs sharing it differ in tokens by design.
    The sweep directory is the one sweep.json's name (the run's path in it) is relative to."""
    data = _sweep_json(run_dir)
    name, tokens_per_param = data.get("name"), data.get("tokens_per_param")
    parts = Path(name).parts if isinstance(name, str) else ()
    if not parts or run_dir.parts[-len(parts) :] != parts or not isinstance(tokens_per_param, (int, float)):
        return None
    return Path(*run_dir.parts[: -len(parts)]), tokens_per_param


def _sweep_json(run_dir: Path) -> dict[str, Any]:
    return read_object(run_dir / "sweep.json") or {}


def _compared(setting: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What two runs of one label must share to be one setting: the resolved setting less NEUTRAL."""
    return {section: {k: v for k, v in setting[section].items() if k not in NEUTRAL[section]} for section in setting}


def _hashable(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _separate_other_settings(
    root: Path, records: list[RunRecord], settings: dict[Path, dict[str, Any]], warnings: list[str]
) -> list[RunRecord]:
    """Runs of one row, model and seed: one setting run twice, or (configs differ) rows of their own."""
    groups: dict[tuple[Any, ...], list[RunRecord]] = {}
    relabelled: dict[Path, RunRecord] = {}
    for r in records:
        groups.setdefault((r.row, r.model, r.seed), []).append(r)
    for group in (g for g in groups.values() if len(g) > 1):
        by_setting: dict[str, list[RunRecord]] = {}
        for r in group:
            by_setting.setdefault(json.dumps(_compared(settings[r.path]), sort_keys=True), []).append(r)
        if len(by_setting) > 1:
            paths = " and ".join(str(r.path) for r in group)
            warnings.append(f"{paths} share a label and seed but not their configs; each config is a row of its own")
        for same in by_setting.values():
            if len(same) > 1:
                paths = " and ".join(str(r.path) for r in same)
                warnings.append(f"{paths} are the same setting and seed; their mean is that seed's value")
            for r in same if len(by_setting) > 1 else ():
                relabelled[r.path] = replace(r, extras=(*r.extras, ("run", same[0].path.relative_to(root).as_posix())))
    return [relabelled.get(r.path, r) for r in records]


def _setting(run_dir: Path) -> dict[str, Any]:
    """What a run trained: its model, train and data sections, less where and how it logged; the
    data directory as the one it names (two datasets in folders of one name are not one setting)."""
    config, logging = json.loads((run_dir / "config.json").read_text()), ("out_dir", "progress", "loggers", "device")
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    if isinstance(data.get("dir"), str):
        data = {**data, "dir": str(Path(data["dir"]).resolve())}
    train = {k: v for k, v in config["train"].items() if k not in logging}
    return {"model": config.get("model"), "train": train, "data": data}
