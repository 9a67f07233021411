"""The report's text forms (docs/design.md §6): `report.md` from `to_markdown`, the CSV tables
from `csv_tables`; `eval/report.py` builds the report they render and writes the files."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from tango_lm.eval.report import head_label, model_name


def _fmt(x: float | None, digits: int, sign: bool = False) -> str:
    if x is None:
        return "–"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _cell(c: dict[str, Any] | None, digits: int, bold: bool) -> str:
    if c is None:
        return "–"
    text = _fmt(c["mean"], digits) + (f" ± {_fmt(c['std'], digits)}" if c["std"] is not None else "")
    return f"**{text}**" if bold else text


def _extras_keys(rows: list[dict[str, Any]], fixed: tuple[str, ...]) -> list[str]:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in fixed and k not in keys]
    return keys


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def to_markdown(report: dict[str, Any], digits: int = 3) -> str:
    models, seeds = report["models"], report["seeds"]
    fixed_main = ("dataset", "tier", "depth", "cells", "best")
    extra = _extras_keys(report["main"], fixed_main)
    lead = ["Dataset", "Tier", "Depth", *extra]
    out = [f"# Report: {report['metric']}", ""]
    out += [
        f"## Mean ± standard deviation over seeds ({report['split']} NLL)",
        "",
        "Bold marks the lowest mean in each row; ± is the sample standard deviation (ddof = 1) over seeds.",
        "",
    ]
    rows = []
    for row in report["main"]:
        cells = [_cell(row["cells"].get(m), digits, m in row["best"]) for m in models]
        rows.append([str(row[k]) if k in row else "" for k in ("dataset", "tier", "depth", *extra)] + cells)
    out += _md_table(lead + [model_name(m) for m in models], rows) + [""]

    of = model_name(report["reference"]) if report.get("reference") else "the best model"  # --reference
    out += [
        f"## Per-seed margin of {of} over the best other model",
        "",
        "Each value is the model's NLL minus the lowest NLL among the other models at the same seed pair; "
        "negative values favor the model.",
        "",
    ]
    rows = [
        [str(m[k]) if k in m else "" for k in ("dataset", "tier", "depth", *extra)]
        + [model_name(m["model"])]
        + [_fmt(m["seeds"][s]["margin"], digits + 1, sign=True) if s in m["seeds"] else "–" for s in seeds]
        for m in report["margins"]
    ]
    out += _md_table(lead + ["Model"] + [f"Seed {s}" for s in seeds], rows) + [""]

    scaling = [row for row in report["depth"] if len(row["depths"]) > 1]  # models run at several depths
    depths = sorted({d for row in scaling for d in row["depths"]})
    if scaling:
        dextra = _extras_keys(scaling, ("dataset", "tier", "model", "depths", "non_increasing"))
        out += [
            "## Depth scaling",
            "",
            "Mean NLL per depth (± over seeds); the last column says whether the mean never increases as depth rises.",
            "",
        ]
        rows = [
            [str(r[k]) if k in r else "" for k in ("dataset", "tier", *dextra)]
            + [model_name(r["model"])]
            + [_cell(r["depths"].get(d), digits, False) for d in depths]
            + [{True: "yes", False: "no", None: "–"}[r["non_increasing"]]]
            for r in scaling
        ]
        out += _md_table(
            ["Dataset", "Tier", *dextra, "Model"] + [f"Depth {d}" for d in depths] + ["Non-increasing"], rows
        ) + [""]

    if report["heads"]:
        out += [
            "## Heads against Standard",
            "",
            "Means over the seeds both heads have; Δ = head − Standard, negative values favor the head.",
            "",
        ]
        rows = [
            [str(h[k]) if k in h else "" for k in ("dataset", "tier", "depth", *extra)]
            + [
                model_name(h["arch"]),
                head_label(h["head"]),
                _fmt(h["head_nll"], digits + 1),
                _fmt(h["standard_nll"], digits + 1),
                _fmt(h["delta"], digits + 1, sign=True)
                + (f" ± {_fmt(h['delta_std'], digits + 1)}" if h["delta_std"] is not None else ""),
                str(h["n"]),
            ]
            for h in report["heads"]
        ]
        out += _md_table(lead + ["Backbone", "Head", "Head NLL", "Standard NLL", "Δ", "Seeds"], rows) + [""]
    return "\n".join(out)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def csv_tables(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Long-format rows of each table, as written to the CSV files."""
    main, margins, depth = [], [], []
    for row in report["main"]:
        base = {k: v for k, v in row.items() if k not in ("cells", "best")}
        for m in report["models"]:
            c = row["cells"].get(m)
            if c is not None:
                main.append(
                    {**base, "model": m, "n": c["n"], "mean": c["mean"], "std": c["std"], "best": int(m in row["best"])}
                )
    for row in report["margins"]:
        base = {k: v for k, v in row.items() if k not in ("seeds", "model")}
        for seed, m in row["seeds"].items():
            margins.append({**base, "model": row["model"], "seed": seed, "next": m["next"], "margin": m["margin"]})
    for row in report["depth"]:
        base = {k: v for k, v in row.items() if k not in ("depths", "non_increasing")}
        for d, s in row["depths"].items():
            depth.append({**base, "depth": d, "n": s["n"], "mean": s["mean"], "std": s["std"]})
    heads = [{k: (" ".join(v) if k == "seeds" else v) for k, v in h.items()} for h in report["heads"]]
    return {"main": main, "margins": margins, "depth": depth, "heads": heads, "runs": report["runs"]}
