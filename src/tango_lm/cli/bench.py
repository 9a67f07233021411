"""Benchmarks: `bench`."""

from __future__ import annotations

import argparse
from typing import Any

from tango_lm.cli.output import _print_json


def cmd_bench(args: argparse.Namespace) -> None:
    from tango_lm.bench.suite import run

    report = run(args)
    if args.json:
        _print_json(report)


def add_parsers(sub: Any) -> None:
    """`bench`."""
    s = sub.add_parser("bench", help="benchmark suites: training (TANGO vs matched Loop Transformer++ by default), "
                                     "decoding, windowed TANGO, head memory")
    from tango_lm.bench.suite import add_arguments as add_bench_arguments

    add_bench_arguments(s)
    s.set_defaults(func=cmd_bench)
