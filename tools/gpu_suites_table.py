"""Print what `tools/gpu_suites.sh` measured: one line per suite (status, time), then each suite's
own table (the formatters of `tango-lm bench`), from OUT_DIR/<name>.json.

    PYTHONPATH=src python3 tools/gpu_suites_table.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tango_lm.bench.registry import BENCH_SUITES


def load(out: Path, name: str) -> tuple[str, dict | None]:
    """(status, report): a suite stopped by its timeout still printed what it measured before
    (`bench/stopping.py`); its status says so, and its tables show it."""
    rc = (out / f"{name}.rc").read_text().strip() if (out / f"{name}.rc").exists() else "?"
    status = {"0": "ok", "124": "TIMEOUT", "137": "KILLED", "skipped": "SKIPPED (budget)"}.get(
        rc, f"FAILED (exit {rc})"
    )
    try:
        report = json.loads((out / f"{name}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return (status if rc != "0" else "FAILED (no JSON report)"), None
    if report.get("stopped"):  # no "suite" when it was stopped before any suite ran
        status += f" (partial: {report['stopped'].get('suite', 'nothing measured')})"
    return status, report


def main(out: Path) -> None:
    names = [p.stem for p in sorted(out.glob("*.rc"), key=lambda p: p.stat().st_mtime)]  # in the order they ran
    reports = {name: load(out, name) for name in names}
    env = next((r["environment"] for _, r in reports.values() if r and "environment" in r), {})
    print(f"GPU suites in {out}: torch {env.get('torch', '?')}, python {env.get('python', '?')}")
    wide = max([len("suite"), *map(len, names)]) + 2
    status_wide = max([len("status"), *(len(reports[n][0]) for n in names)]) + 2
    print(f"{'suite':<{wide}}{'status':<{status_wide}}seconds")
    for name in names:
        log = (out / f"{name}.log").read_text().splitlines() if (out / f"{name}.log").exists() else []
        took = next((line.split()[-1] for line in reversed(log) if line.startswith(f"{name} rc=")), "?")
        print(f"{name:<{wide}}{reports[name][0]:<{status_wide}}{took}")
    for name in names:
        status, report = reports[name]
        if report is None:
            continue
        for key in (k for k in report.get("suites", []) if k in report):  # a stopped suite has none
            print(f"\n[{name}]")
            print(BENCH_SUITES[key].format(report[key]))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
