"""Paper-style reports of a directory of runs (docs/design.md §6): `tango-lm report DIR`.

Every run directory below DIR (one holding `config.json`) that finished (`summary.json`) is read
with its `metrics.jsonl` (report_runs.py). Runs are labelled by their sweep's `sweep.json` when present, else by
their config (dataset = the data directory's name, seed = model/data seed pair, tier unknown);
runs of one label and seed whose configs differ are rows of their own, labelled `run`.

The value reported per run is, for `split="test"`, the test NLL of the selected checkpoint
(`summary.json`), and for `split="dev"`, the dev NLL of that same checkpoint (the best dev NLL
under the TANGO protocol, the final one under `train.select: final`).

Tables (seed 000 and seed 001):

- `main` (Tables 1/12/14): rows dataset x tier x depth (x any other sweep axis), one column per
  model (architecture, plus head when it is not `standard`); mean and standard deviation
  (ddof = 1) over seeds; the lowest mean of each row is marked.
- `margins` (Table 13): per row and seed, the NLL of the row's best model (lowest mean) minus
  the lowest NLL among the other models at that seed; negative values favor the best model.
- `depth` (Table 5): each model's mean NLL per depth, and whether it never increases with depth.
- `heads` (seed 001 Table 1): per backbone, each non-standard head against the standard head
  over the seeds both have: head NLL, Standard NLL and delta = head - Standard (means).

Written as `report.md`, `report.json` and `main.csv`, `margins.csv`, `depth.csv`, `heads.csv`,
`runs.csv`, plus PNG plots (`eval/plots.py`).

Damaged inputs: an unreadable `config.json`, `summary.json` or `sweep.json` is an error naming the
file (the report would be wrong); a partial last line of `metrics.jsonl` (a run killed while
logging) is skipped with a warning; a run without `summary.json` is left out with a warning.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from tango_lm.errors import UserError
from tango_lm.eval.report_runs import RunRecord, collect_runs


# -- ordering ---------------------------------------------------------------------------------
def _tier_value(tier: str) -> float:
    from tango_lm.models.matching import parse_tier

    try:
        return float(parse_tier(tier, 1)[0])
    except UserError:
        return 0.0


def _natural(v: Any) -> tuple[int, Any]:
    """Numbers (and numerals: seed "17" is a label's text) before words, in numeric order."""
    if isinstance(v, str) and v.strip().lstrip("-").isascii() and v.strip().lstrip("-").isdigit():
        v = int(v)
    return (0, float(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, str(v))


def arch_labels() -> dict[str, str]:
    """Every `arch` label a run can carry -> its display name, in report order: each registered
    architecture followed by its paper geometries (`conventional-untied` after the Untied one)."""
    from tango_lm.models.registry import ARCHITECTURES

    labels: dict[str, str] = {}
    for name, arch in ARCHITECTURES.items():
        labels[name] = arch.display_name or name
        labels.update({geometry.label: geometry.display_name for geometry in arch.fixed_geometries})
    return labels


def head_label(head: str) -> str:
    from tango_lm.heads.registry import HEADS

    return (HEADS[head].display_name if head in HEADS else "") or head


def model_order(model: str) -> tuple[int, int, str]:
    from tango_lm.heads.registry import HEADS

    archs = list(arch_labels())
    arch, _, head = model.partition("+")
    heads = list(HEADS)
    return (archs.index(arch) if arch in archs else len(archs), heads.index(head) + 1 if head in heads else 0, model)


def _row_order(records: list[RunRecord]) -> list[tuple[Any, ...]]:
    datasets = list(dict.fromkeys(r.dataset for r in records))
    rows = {r.row for r in records}
    return sorted(
        rows, key=lambda k: (datasets.index(k[0]), _tier_value(k[1]), k[1], k[2], tuple(_natural(v) for _, v in k[3]))
    )


def model_name(model: str) -> str:
    arch, _, head = model.partition("+")
    return arch_labels().get(arch, arch) + (f" ({head_label(head)})" if head else "")


# -- statistics -------------------------------------------------------------------------------
def stats(values: list[float]) -> dict[str, Any]:
    """Mean and sample standard deviation (ddof = 1; None for a single value)."""
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None,
    }


def _row_label(key: tuple[Any, ...]) -> str:
    """A row as a warning names it: dataset, tier, depth and its other axes."""
    extras = "".join(f", {k}={v}" for k, v in key[3])
    return f"{key[0]}, tier {key[1]}, depth {key[2]}{extras}"


def _row_dict(key: tuple[Any, ...]) -> dict[str, Any]:
    return {"dataset": key[0], "tier": key[1], "depth": key[2], **dict(key[3])}


def build_report(records: list[RunRecord], split: str = "test", reference: str | None = None) -> dict[str, Any]:
    """The four tables as plain data (see the module docstring). `reference` names the model
    whose margins Table 13 gives (default: the best mean of each row)."""
    models = sorted({r.model for r in records}, key=model_order)
    seeds = sorted({r.seed for r in records}, key=lambda s: tuple(_natural(p) for p in s.split("/")))
    cells = seed_values(records)  # row -> model -> seed -> value

    main, margins, uneven = [], [], []
    for key in _row_order(records):
        row_cells = {m: {**stats(list(v.values())), "seeds": v} for m, v in cells[key].items()}
        best_mean = min(c["mean"] for c in row_cells.values())
        lowest = [m for m in models if m in row_cells and row_cells[m]["mean"] == best_mean]
        # Means over different seeds rank nothing (one seed of a model against another's three, a
        # part-trained or part-failed grid): no best is marked then, and it is said.
        ranked = len({frozenset(c["seeds"]) for c in row_cells.values()}) == 1
        main.append({**_row_dict(key), "cells": row_cells, "best": lowest if ranked else []})
        if not ranked:
            counts = ", ".join(f"{model_name(m)} {len(row_cells[m]['seeds'])}" for m in models if m in row_cells)
            uneven.append(f"{_row_label(key)}: the models have different seeds ({counts}); no best is marked")
        margins.append(_margins(key, row_cells, lowest[0], reference, seeds))

    depth = []
    groups: dict[tuple[Any, ...], dict[str, dict[int, dict[str, float]]]] = {}
    for (dataset, tier, depth_, extras), per_model in cells.items():
        for m, by_seed in per_model.items():
            groups.setdefault((dataset, tier, extras), {}).setdefault(m, {})[depth_] = by_seed
    datasets = list(dict.fromkeys(r.dataset for r in records))
    for (dataset, tier, extras), per_model in sorted(
        groups.items(),
        key=lambda kv: (
            datasets.index(kv[0][0]),
            _tier_value(kv[0][1]),
            kv[0][1],
            tuple(_natural(v) for _, v in kv[0][2]),
        ),
    ):
        for m in sorted(per_model, key=model_order):
            by_depth = {d: stats(list(v.values())) for d, v in sorted(per_model[m].items())}
            means = [s["mean"] for s in by_depth.values()]
            same_seeds = len({frozenset(v) for v in per_model[m].values()}) == 1  # else no verdict: other seeds
            monotone = all(b <= a for a, b in zip(means, means[1:], strict=False)) if len(means) > 1 else None
            monotone = monotone if same_seeds else None
            depth.append(
                {
                    "dataset": dataset,
                    "tier": tier,
                    **dict(extras),
                    "model": m,
                    "depths": by_depth,
                    "non_increasing": monotone,
                }
            )

    return {
        "split": split,
        "metric": f"{split} NLL (nats/token) of the selected checkpoint",
        "models": models,
        "seeds": seeds,
        "main": main,
        "reference": reference,  # the model the margins are of (None: each row's best)
        "margins": margins,
        "depth": depth,
        "heads": _heads(records, cells),
        "runs": [_run_dict(r) for r in records],
        "uneven_seeds": uneven,  # one line per row whose models have different seeds (write_report warns)
    }


def _margins(
    key: tuple[Any, ...], row_cells: dict[str, dict[str, Any]], best: str, reference: str | None, seeds: list[str]
) -> dict[str, Any]:
    focus = reference if reference is not None else best
    out = {**_row_dict(key), "model": focus, "seeds": {}}
    if focus not in row_cells:
        return out
    for seed in seeds:
        mine = row_cells[focus]["seeds"].get(seed)
        others = [(c["seeds"][seed], m) for m, c in row_cells.items() if m != focus and seed in c["seeds"]]
        if mine is None or not others:
            continue
        value, other = min(others)
        out["seeds"][seed] = {"margin": mine - value, "next": other}
    return out


def seed_values(records: list[RunRecord]) -> dict[tuple[Any, ...], dict[str, dict[str, float]]]:
    """row -> model -> seed -> value: the mean of a seed's copies (the same setting and seed run
    twice; collect_runs warns), so every table counts a seed once and gives it one value."""
    copies: dict[tuple[Any, ...], dict[str, dict[str, list[float]]]] = {}
    for r in records:
        copies.setdefault(r.row, {}).setdefault(r.model, {}).setdefault(r.seed, []).append(r.value)
    return {
        row: {m: {seed: statistics.fmean(v) for seed, v in by_seed.items()} for m, by_seed in per_model.items()}
        for row, per_model in copies.items()
    }


def _heads(records: list[RunRecord], cells: dict[tuple[Any, ...], dict[str, dict[str, float]]]) -> list[dict[str, Any]]:
    """Each head against the Standard head on its backbone, seed by seed (`cells`: `seed_values`)."""
    arch_of = {(r.row, r.model): (r.arch, r.head) for r in records}
    backbones: dict[tuple[Any, ...], dict[str, dict[str, float]]] = {}
    for row, per_model in cells.items():
        for model, by_seed in per_model.items():
            arch, head = arch_of[row, model]
            backbones.setdefault((*row, arch), {})[head] = by_seed
    out = []
    rows = _row_order(records)
    for key in sorted(backbones, key=lambda k: (rows.index(k[:4]), model_order(k[4]))):
        per_head = backbones[key]
        if "standard" not in per_head:
            continue
        for head in sorted((h for h in per_head if h != "standard"), key=lambda h: model_order(f"x+{h}")):
            paired = sorted(set(per_head[head]) & set(per_head["standard"]))
            if not paired:
                continue
            deltas = [per_head[head][s] - per_head["standard"][s] for s in paired]
            d = stats(deltas)
            out.append(
                {
                    **_row_dict(key[:4]),
                    "arch": key[4],
                    "head": head,
                    "n": len(paired),
                    "seeds": paired,
                    "head_nll": statistics.fmean(per_head[head][s] for s in paired),
                    "standard_nll": statistics.fmean(per_head["standard"][s] for s in paired),
                    "delta": d["mean"],
                    "delta_std": d["std"],
                }
            )
    return out


def _run_dict(r: RunRecord) -> dict[str, Any]:
    return {
        "path": str(r.path),
        "dataset": r.dataset,
        "tier": r.tier,
        "depth": r.depth,
        **dict(r.extras),
        "arch": r.arch,
        "head": r.head,
        "model": r.model,
        "seed": r.seed,
        "value": r.value,
        "test_nll": r.test_nll,
        "dev_nll": r.dev_nll,
        "tokens_per_s": r.tokens_per_s,
        "params_total": r.params_total,
        "tokens": r.tokens,
    }


# -- writing ----------------------------------------------------------------------------------
def _plots_written_before(out: Path) -> set[str]:
    """The plot files (relative to `out`) the report last written to `out` lists in its report.json;
    only those are ever removed, so a folder of the user's own in `out` is never touched."""
    try:
        listed = json.loads((out / "report.json").read_text()).get("plots")
    except (OSError, ValueError, AttributeError):
        return set()
    if not isinstance(listed, list):
        return set()
    return {p for p in listed if isinstance(p, str) and p.startswith("plots/") and ".." not in Path(p).parts}


def write_report(
    root: str | Path,
    out: str | Path | None = None,
    split: str = "test",
    plots: bool = True,
    reference: str | None = None,
    digits: int = 3,
) -> dict[str, Any]:
    """Read the runs under `root` and write the report to `out` (default `root/report`).
    Returns {"out": ..., "files": [...], "warnings": [...], "report": ...}."""
    from tango_lm.eval.report_tables import csv_tables, to_markdown, write_csv  # it imports model_name from here

    root = Path(root)
    out = Path(out) if out is not None else root / "report"
    if root.is_dir() and root.resolve().is_relative_to(out.resolve()):  # its runs would be skipped as the report's
        raise UserError(
            f"--out {out} holds the runs of {root} it would report; give the report a directory of its own "
            f"(default: {root / 'report'})"
        )
    records, warnings = collect_runs(root, split, skip=out)
    if reference is not None and reference not in {r.model for r in records}:
        raise UserError(
            f"--reference {reference!r} is not a model of these runs; models are: "
            f"{', '.join(sorted({r.model for r in records}, key=model_order))}"
        )
    report = build_report(records, split, reference)
    warnings += report["uneven_seeds"]
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory for the report (default: {root / 'report'})")
    from tango_lm.data.dataset_dir import is_prepared
    from tango_lm.train.run_dir import enclosing, holds_run

    dataset = enclosing(out, is_prepared)  # re-preparing it (--overwrite) would take the report with it
    if dataset is not None or holds_run(out):  # beside a run's own files, under its names
        where = f"is inside the prepared dataset {dataset}" if dataset is not None else "holds a run"
        raise UserError(f"--out {out} {where}; give the report a directory of its own (default: {root / 'report'})")
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "report.md", out / "report.json"]
    earlier_plots = _plots_written_before(out)
    made: list[Path] = []
    if plots:
        from tango_lm.eval.plots import write_plots

        made, plot_warnings = write_plots(report, records, out / "plots")
        warnings += plot_warnings
    report["warnings"] = warnings
    report["plots"] = [p.relative_to(out).as_posix() for p in made]
    for stale in earlier_plots - set(report["plots"]):  # of runs or rows no longer there: not this report's
        (out / stale).unlink(missing_ok=True)
    files[0].write_text(to_markdown(report, digits))
    files[1].write_text(json.dumps(report, indent=2, default=str))
    for name, rows in csv_tables(report).items():
        write_csv(out / f"{name}.csv", rows)
        files.append(out / f"{name}.csv")
    if plots:
        files += made
    return {"out": str(out), "files": [str(f) for f in files], "warnings": warnings, "report": report}
