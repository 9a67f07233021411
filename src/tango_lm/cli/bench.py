"""Benchmarks: `bench`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tango_lm.cli.output import _is_terminal, _print_json
from tango_lm.errors import UserError


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the suites; a SIGTERM or Ctrl-C still prints what was measured (`bench/stopping.py`) and
    then exits as the signal would (143, 130)."""
    from tango_lm.bench.suite import run
    from tango_lm.stop_signals import STOPS, exit_code, signal_name, stop_on_sigterm

    args.progress = "none" if args.quiet else ("bar" if _is_terminal(sys.stderr) else "lines")
    try:
        with stop_on_sigterm():
            report = run(args)  # sizes past the machine's memory: a UserError, or the report's "failed"
    except STOPS as stop:  # before any suite had rows to report (building models, the matmul peak)
        if args.json:  # still a report, so that a reader of the JSON sees why it is empty
            _print_json({"stopped": {"signal": signal_name(stop)}})
        print(f"stopped by {signal_name(stop)} before anything was measured", file=sys.stderr)
        return exit_code(signal_name(stop))
    if args.json:
        _print_json(report)
    if report.get("failed"):  # out of memory in a suite: the ones before it were reported
        raise UserError(report["failed"]["error"])
    stopped = report.get("stopped")
    if not stopped:
        return 0
    where = f" in the {stopped['suite']} suite" if "suite" in stopped else ""
    reports = [report[suite] for suite in report["suites"] if suite in report] if "suites" in report else [report]
    if not any(_measured(suite_report) for suite_report in reports):  # stopped in the first one's warm-up
        print(f"stopped by {stopped['signal']}{where} before anything was measured", file=sys.stderr)
        return exit_code(stopped["signal"])
    print(f"stopped by {stopped['signal']}{where}: the report has what was measured before", file=sys.stderr)
    return exit_code(stopped["signal"])


def _measured(suite_report: dict[str, Any]) -> bool:
    """Whether a suite's report holds a measurement: it was not stopped, or after a timed round, or
    in the decode suite's head comparison (its architectures were measured before)."""
    stopped = suite_report.get("stopped") or {}
    return not stopped or stopped.get("timed_rounds_done", 1) > 0 or stopped.get("part") == "heads"


def add_parsers(sub: Any) -> None:
    """`bench`."""
    s = sub.add_parser(
        "bench",
        help="benchmark suites: training (TANGO vs matched Loop Transformer++ by default), "
        "decoding, windowed TANGO, head memory",
    )
    from tango_lm.bench.suite import add_arguments as add_bench_arguments

    add_bench_arguments(s)
    s.set_defaults(func=cmd_bench)
