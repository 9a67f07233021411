"""The benchmark suites of `tango-lm bench --suite`: a new suite is a module in `bench/` with a
runner, a check of its options, a table formatter and (if it has any) its own options, plus one
entry here. `--suite all` runs them in this order; `tools/gpu_suites_table.py` prints each report
with its suite's `format`.

- `train` (`bench/training.py`): training tokens/s, analytic FLOPs per token, achieved FLOP/s, MFU
  against a matmul peak measured in the same run, and peak memory, of every architecture at
  matched total parameters, trained side by side; ratios to Loop Transformer++.
- `decode` (`bench/decode.py`): decoding tokens/s and decode-cache bytes per token per
  architecture; onóna's one-projection sampling against both projections and the Standard head.
- `windowed` (`bench/windowed.py`): windowed against full TANGO time per token as T grows.
- `memory` (`bench/memory.py`): peak memory of a whole training step, each head against Standard
  (onóna by default).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tango_lm.bench import decode, memory, training, windowed
from tango_lm.bench.decode_report import format_report as format_decode_report


@dataclass(frozen=True)
class BenchSuite:
    run: Callable[[argparse.Namespace, bool, str], dict[str, Any]]  # (args, print_table, progress) -> report
    check: Callable[[argparse.Namespace], None]  # its options, before any suite starts: a UserError
    format: Callable[[dict[str, Any]], str]  # its report as the table it prints
    size_flags: tuple[str, ...]  # the flags that size its models and batches: what running out of memory names
    add_arguments: Callable[[Any], None] | None = None  # its own options, into an argparse group of its name


BENCH_SUITES = {
    "train": BenchSuite(
        training.run_suite,
        training.check_suite_args,
        training.format_report,
        ("--tango-width", "--vocab-size", "--d-model", "--depth", "--batch-size", "--seq-len", "--peak-size"),
        training.add_suite_arguments,
    ),
    "decode": BenchSuite(
        decode.run_suite,
        decode.check_suite_args,
        format_decode_report,
        (
            "--decode-batches",
            "--prompt-len",
            "--new-tokens",
            "--tango-width",
            "--vocab-size",
            "--head-vocab",
            "--d-model",
            "--depth",
        ),
        decode.add_suite_arguments,
    ),
    "windowed": BenchSuite(
        windowed.run_suite,
        windowed.check_suite_args,
        windowed.format_report,
        ("--windowed-tokens", "--windowed-lens", "--windowed-width", "--d-model"),
        windowed.add_suite_arguments,
    ),
    "memory": BenchSuite(
        memory.run_suite,
        memory.check_suite_args,
        memory.format_report,
        ("--memory-seq-len", "--memory-batch-size", "--head-vocab", "--memory-backbone", "--d-model", "--depth"),
        memory.add_suite_arguments,
    ),
}
