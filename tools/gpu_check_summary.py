"""The summary table of `tools/gpu_check.sh`: one row per section (status, seconds, its result in
one line), then the train bench's and the kernel benches' own tables.

Usage: PYTHONPATH=src python tools/gpu_check_summary.py OUT_DIR

OUT_DIR holds `sections.tsv` (name, status, seconds per line, in run order), `<name>.log` per
section and the JSON reports the sections wrote. A section's one-line result comes from
`RESULTS[name]` (a function of OUT_DIR), else from the last line of its log.
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _json(out: Path, name: str) -> dict | None:
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def _last_line(out: Path, name: str) -> str:
    try:
        lines = [line.strip() for line in (out / f"{name}.log").read_text(errors="replace").splitlines()]
    except OSError:
        return "(no log)"
    lines = [line for line in lines if line]
    return lines[-1] if lines else "(empty log)"


def pytest_result(out: Path, name: str) -> str:
    """pytest's closing line ('12 passed, 3 skipped in 40.1s') without its '=' rule."""
    return _last_line(out, name).strip("= ")


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"  # None: no baseline row in that mode


def train_result(out: Path, name: str) -> str:
    report = _json(out, name)
    if not report or "train" not in report:
        return _last_line(out, name)
    rows = [r for r in report["train"]["models"] if r["arch"] != "loop-transformer"]
    stopped = report["train"].get("stopped")  # its time limit ended the steps: the rounds it timed
    result = f"{stopped['timed_rounds_done']}/{stopped['timed_rounds']} timed rounds; " if stopped else ""
    if not rows:  # stopped in the warm-up: no model was timed
        return result + "no model timed"
    result += "MFU x Loop: " + ", ".join(f"{r['arch']} {_x(r['mfu_vs_loop'])}" for r in rows)
    if all(r.get("memory_vs_loop") is not None for r in rows):  # CUDA's peaks; docs/benchmarks.md predicts them
        result += "; peak memory x Loop: " + ", ".join(f"{r['arch']} {r['memory_vs_loop']:.2f}" for r in rows)
    return result


def kernel_result(out: Path, name: str) -> str:
    report = _json(out, name)
    if not report:
        return _last_line(out, name)
    return ", ".join(f"{r['impl']} {r['tflop_per_s']:.0f} TFLOP/s ({r['of_peak']:.0%})" for r in report["rows"])


RESULTS: dict[str, Callable[[Path, str], str]] = {
    "cuda-tests": pytest_result,
    "train-bench": train_result,
    "kernel-bench": kernel_result,
    "relu2-bench": kernel_result,
}
# The sections whose JSON report a tool's `format_report` renders as a table below the summary.
TABLES = {"kernel-bench": "gate_average_bench", "relu2-bench": "relu2_attention_bench"}


def _environment() -> str:
    parts = [datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), platform.node()]
    try:
        import torch

        parts.append(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
        parts.append(f"torch {torch.__version__}")
    except ImportError:
        parts.append("no torch")
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        parts.append("no triton")
    try:  # a GPU image may have no git (the copied tree may have no .git either: a non-zero exit)
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
    except OSError:
        commit = None
    if commit is not None and commit.returncode == 0:
        parts.append(f"commit {commit.stdout.strip()}")
    return ", ".join(parts)


def summary(out: Path) -> str:
    sections = [line.split("\t") for line in (out / "sections.tsv").read_text().splitlines() if line.strip()]
    width = max([len(s[0]) for s in sections] + [7])
    lines = [
        f"gpu check: {_environment()}; logs in {out}",
        f"{'section':<{width}}  {'status':<12}{'seconds':>8}  result",
    ]
    for name, status, seconds in sections:
        result = " ".join(RESULTS.get(name, _last_line)(out, name).split())
        lines.append(f"{name:<{width}}  {status:<12}{seconds:>8}  {result}")
    train = _json(out, "train-bench")
    if train and "train" in train:
        from tango_lm.bench.training import format_report

        lines += ["", format_report(train["train"])]
    for name, tool in TABLES.items():
        report = _json(out, name)
        if report:
            from importlib import import_module

            sys.path.insert(0, str(Path(__file__).resolve().parent))
            lines += ["", import_module(tool).format_report(report)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not (Path(args[0]) / "sections.tsv").is_file():
        print("error: give the gpu check's output directory (it holds sections.tsv)", file=sys.stderr)
        return 2
    print(summary(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
