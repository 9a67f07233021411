"""PNG plots of a report (`tango-lm report`): learning curves per seed, NLL against depth and
NLL against throughput.

Uses matplotlib's object API (`Figure` + `savefig`), so it never switches the caller's backend
or needs a display. Without matplotlib the report is still written, with a warning.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from tango_lm.eval.report import RunRecord, model_name, model_order
from tango_lm.eval.report_runs import NO_TIER

MAX_SLUG = 160  # file names stop at 255 bytes; rows told apart by many fields would pass that


def _slug(*parts: Any) -> str:
    text = "_".join(str(p) for p in parts if p not in (None, ""))
    slug = re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-") or "all"
    if len(slug) > MAX_SLUG:  # a prefix to read, and a hash of the whole to keep names apart
        slug = f"{slug[: MAX_SLUG - 13]}--{hashlib.sha256(text.encode()).hexdigest()[:10]}"
    return slug


def _tier_slug(tier: str) -> str:
    return "" if tier == NO_TIER else f"tier={tier}"


def _with_tier(dataset: str, tier: str) -> str:
    """A figure's heading: a plain run has no tier to name ("tier -" read as a missing value)."""
    return dataset if tier == NO_TIER else f"{dataset}, tier {tier}"


def _extras_slug(extras: tuple[tuple[str, Any], ...]) -> str:
    return _slug(*(f"{k}={v}" for k, v in extras)) if extras else ""


def write_plots(report: dict[str, Any], records: list[RunRecord], out: Path) -> tuple[list[Path], list[str]]:
    """Write every plot under `out`; returns (files, warnings)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return [], ["matplotlib is not installed, so no plots were drawn; `pip install matplotlib` and rerun"]
    out.mkdir(parents=True, exist_ok=True)
    files = []
    files += _learning_curves(Figure, records, out / "curves")
    files += _depth_plots(Figure, report, out)
    files += _throughput_plots(Figure, records, report["split"], out)
    return files, []


def _learning_curves(Figure: Any, records: list[RunRecord], out: Path) -> list[Path]:
    """One figure per row (dataset, tier, depth, other axes) and seed: train NLL (MoE's without its
    load-balancing term) and dev NLL against tokens, one line per model."""
    groups: dict[tuple[Any, ...], list[RunRecord]] = {}
    for r in records:
        groups.setdefault((*r.row, r.seed), []).append(r)
    files = []
    for (dataset, tier, depth, extras, seed), runs in groups.items():
        if not any(r.train_curve or r.dev_curve for r in runs):
            continue
        fig = Figure(figsize=(10, 4))
        ax_train, ax_dev = fig.subplots(1, 2)
        for r in sorted(runs, key=lambda r: model_order(r.model)):
            if r.train_curve:  # one record (steps <= log_every): a marker, as a lone point has no line
                one = {"marker": "o", "markersize": 3} if len(r.train_curve) == 1 else {}
                ax_train.plot(*zip(*r.train_curve, strict=True), label=model_name(r.model), linewidth=1, **one)
            if r.dev_curve:
                ax_dev.plot(*zip(*r.dev_curve, strict=True), marker="o", markersize=3, label=model_name(r.model))
        for ax, what in ((ax_train, "train NLL"), (ax_dev, "dev NLL")):
            ax.set_xlabel("tokens")
            ax.set_ylabel(f"{what} (nats/token)")
            ax.grid(alpha=0.3)
        # on the panel with lines (matplotlib warns on stderr of a legend with none)
        (ax_dev if any(r.dev_curve for r in runs) else ax_train).legend(fontsize=7)
        title = f"{_with_tier(dataset, tier)}, depth {depth}, seed {seed}"
        if extras:
            title += ", " + ", ".join(f"{k}={v}" for k, v in extras)
        fig.suptitle(title)
        fig.tight_layout()
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{_slug(dataset, _tier_slug(tier), f'depth={depth}', _extras_slug(extras), 'seed=' + seed)}.png"
        fig.savefig(path, dpi=100)
        files.append(path)
    return files


def _depth_plots(Figure: Any, report: dict[str, Any], out: Path) -> list[Path]:
    """NLL against depth, one figure per dataset and tier (error bars: std over seeds)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in report["depth"]:
        extras = tuple(
            (k, v) for k, v in row.items() if k not in ("dataset", "tier", "model", "depths", "non_increasing")
        )
        groups.setdefault((row["dataset"], row["tier"], extras), []).append(row)
    files = []
    for (dataset, tier, extras), rows in groups.items():
        if not any(len(r["depths"]) > 1 for r in rows):
            continue
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        for r in rows:
            depths = sorted(r["depths"])
            means = [r["depths"][d]["mean"] for d in depths]
            stds = [r["depths"][d]["std"] or 0.0 for d in depths]
            ax.errorbar(depths, means, yerr=stds, marker="o", capsize=3, label=model_name(r["model"]))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({d for r in rows for d in r["depths"]}))
        ax.get_xaxis().set_major_formatter(_int_formatter())
        ax.set_xlabel("depth (block applications)")
        ax.set_ylabel(f"{report['split']} NLL (nats/token)")
        ax.set_title(_with_tier(dataset, tier))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"depth_{_slug(dataset, _tier_slug(tier), _extras_slug(extras))}.png"
        fig.savefig(path, dpi=100)
        files.append(path)
    return files


def _int_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda x, _pos: f"{x:g}")


def throughput_points(records: list[RunRecord]) -> dict[str, dict[str, list[tuple[float, float, str]]]]:
    """dataset -> model -> (tokens/s, NLL, "tier/dDEPTH") per tier, depth and the other settings
    that split the tables' rows (tagged `name=value` after it, or two points share one tag): means
    over seeds, a seed run twice counted once (the mean of its copies, as the tables' `seed_values`)."""
    import statistics

    copies: dict[str, dict[tuple[Any, ...], dict[str, list[RunRecord]]]] = {}
    for r in records:
        if r.tokens_per_s:
            point = copies.setdefault(r.dataset, {}).setdefault((r.model, r.tier, r.depth, r.extras), {})
            point.setdefault(r.seed, []).append(r)

    def over_seeds(by_seed: dict[str, list[RunRecord]], value: Any) -> float:
        return statistics.fmean(statistics.fmean(value(r) for r in runs) for runs in by_seed.values())

    out: dict[str, dict[str, list[tuple[float, float, str]]]] = {}
    for dataset, points in copies.items():
        per_model = out.setdefault(dataset, {})
        # Only the settings that tell a model's points of one tier and depth apart: every label
        # on every point made tags too long to read (and squeezed the axes to a strip).
        shared: dict[tuple[Any, ...], list[tuple[tuple[str, Any], ...]]] = {}
        for model, tier, depth, extras in points:
            shared.setdefault((model, tier, depth), []).append(extras)
        for (model, tier, depth, extras), by_seed in points.items():
            x = over_seeds(by_seed, lambda r: r.tokens_per_s)
            group = shared[(model, tier, depth)]
            apart = [(name, value) for name, value in extras if any(dict(e).get(name) != value for e in group)]
            where = f"d{depth}" if tier == NO_TIER else f"{tier}/d{depth}"
            tag = " ".join([where, *(f"{name}={value}" for name, value in apart)])
            per_model.setdefault(model, []).append((x, over_seeds(by_seed, lambda r: r.value), tag))
    return out


def _label_within_a_decade(ax: Any, xs: list[float]) -> None:
    """Throughputs within one decade (the usual case) have no power of 10 between them, so a log
    axis draws only its unlabelled minor ticks: give it a few plain ticks across the points."""
    import math

    from matplotlib.ticker import MaxNLocator

    lo, hi = min(xs), max(xs)
    if lo <= 0 or math.floor(math.log10(lo)) != math.floor(math.log10(hi)):
        return  # a decade boundary lies between them: its labelled major tick shows
    ticks = [t for t in MaxNLocator(nbins=4).tick_values(lo, hi) if lo * 0.8 <= t <= hi * 1.25 and t > 0]
    ax.set_xticks(
        ticks or [lo], [f"{t:,.0f}" if float(t).is_integer() else f"{t:,.4g}" for t in ticks or [lo]]
    )  # not 1e+04


def _throughput_plots(Figure: Any, records: list[RunRecord], split: str, out: Path) -> list[Path]:
    """NLL against training throughput (tokens/s), one figure per dataset; a point per model,
    tier and depth (`throughput_points`), labelled with its tier and depth."""
    from matplotlib.ticker import NullFormatter

    files = []
    for dataset, per_model in throughput_points(records).items():
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        for m in sorted(per_model, key=model_order):
            xs, ys, tags = zip(*per_model[m], strict=True)
            ax.scatter(xs, ys, label=model_name(m))
            for x, y, tag in zip(xs, ys, tags, strict=True):
                note = ax.annotate(tag, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
                note.set_in_layout(False)  # a tag past the axes must not shrink them (tight_layout)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks overlap when the runs lie within 10x
        _label_within_a_decade(ax, [x for points in per_model.values() for x, _, _ in points])
        ax.set_xlabel("training throughput (tokens/s)")
        ax.set_ylabel(f"{split} NLL (nats/token)")
        ax.set_title(dataset)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"throughput_{_slug(dataset)}.png"
        fig.savefig(path, dpi=100)
        files.append(path)
    return files
