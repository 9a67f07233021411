"""`tango-lm bench`: the benchmark suites (docs/design.md §6, "Throughput"), each registered in
`bench/registry.py`; `all` runs every one, in that order.

Without `--suite`, `tango-lm bench` is the original comparison: TANGO against a matched Loop
Transformer++ at d=256, T=256 (the train suite with `--archs tango,loop-transformer`), and
`--json` prints that one report. With `--suite`, `--json` prints one object with a key per suite.
"""

from __future__ import annotations

import argparse
import platform
from typing import Any

from tango_lm.bench.checks import require_positive
from tango_lm.bench.registry import BENCH_SUITES
from tango_lm.bench.training import PAIR, default_archs
from tango_lm.bench.training import run_suite as run_train_suite
from tango_lm.cli.output import DEVICE_HELP
from tango_lm.errors import UserError
from tango_lm.stop_signals import STOPS, signal_name


def _names(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(","))
    if not all(names):  # '' or 'tango,': not the default list, which an empty value read as before
        raise argparse.ArgumentTypeError(f"expected comma-separated architecture names, got {text!r}")
    return names


def add_arguments(s: argparse.ArgumentParser) -> None:
    """The `bench` subcommand's options."""
    s.add_argument(
        "--suite",
        choices=(*BENCH_SUITES, "all"),
        default=None,
        help="benchmark suite (default: TANGO vs matched Loop Transformer++ training speed)",
    )
    s.add_argument(
        "--archs",
        type=_names,
        default=None,
        help="comma-separated architectures for train/decode (default: those registered in the bench suite: "
        f"{', '.join(default_archs())})",
    )
    s.add_argument("--d-model", type=int, default=256, help="width d of the models (default %(default)s)")
    s.add_argument("--depth", type=int, default=4, help="block applications or layers (default %(default)s)")
    s.add_argument("--tango-width", type=int, default=8192, help="TANGO's F; the other widths are matched to it")
    s.add_argument("--vocab-size", type=int, default=257, help="vocabulary of the train and decode suites")
    s.add_argument("--device", default="auto", help=DEVICE_HELP)
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    s.add_argument("--memory-steps", type=int, default=2, help="training steps per memory measurement (train, memory)")
    s.add_argument("--repeats", type=int, default=3, help="timed rounds (decode, windowed)")
    s.add_argument("--head-vocab", type=int, default=50304, help="vocabulary of the head comparisons (decode, memory)")
    for name, suite in BENCH_SUITES.items():  # each suite's own options, in a group of its own
        if suite.add_arguments is not None:
            suite.add_arguments(s.add_argument_group(f"{name} suite"))
    s.add_argument(
        "--compile",
        action="store_true",
        help="train and memory suites: also every model through torch.compile, beside eager; "
        "decode suite: also the static-cache decode step (compiled; CUDA graphs on CUDA)",
    )
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.add_argument(
        "--quiet", action="store_true", help="no progress on stderr (default: a bar on a terminal, else lines)"
    )


def environment() -> dict[str, Any]:
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "threads": torch.get_num_threads(),
    }


def check_arguments(args: argparse.Namespace) -> None:
    """Every option the chosen suites read, before the first one starts (a bad value found by a
    later suite of `--suite all` would throw away the ones before it): a UserError for the first."""
    from tango_lm.train.device import pick_device

    pick_device(args.device)  # an absent CUDA: the memory suite's children each failed with a traceback
    shared = ["d_model", "depth", "tango_width", "vocab_size", "memory_steps"]
    require_positive(args, shared + (["threads"] if args.threads is not None else []))
    for name in _suites(args):
        BENCH_SUITES[name].check(args)


def _suites(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(BENCH_SUITES) if args.suite == "all" else (args.suite or "train",)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the suites `args` names, print each table unless --json, and return the report (the
    caller prints it as JSON). SIGTERM (under `bench.stopping.stop_on_sigterm`) or Ctrl-C ends it
    early: the report's "stopped" names the signal and the suite it stopped; the suites before it
    are whole, and a stopped suite keeps what its finished rounds measured."""
    import torch

    from tango_lm.train.cpu_allocator import keep_freed_memory

    check_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # host memory as training uses it (cpu_allocator.py); the memory suite's children do not
    show = not args.json
    progress = getattr(args, "progress", "none")  # `tango-lm bench` sets it (cli/bench.py)
    if args.suite is None:
        try:
            return run_train_suite(args, show, progress, archs=args.archs or PAIR)
        except (RuntimeError, MemoryError) as exc:
            raise out_of_memory_error(exc, "train", finished=[]) from None
    suites = _suites(args)
    out: dict[str, Any] = {"suites": list(suites), "environment": environment(), "stopped": None, "failed": None}
    for i, suite in enumerate(suites):
        if show and i:
            print()
        try:
            out[suite] = BENCH_SUITES[suite].run(args, show, progress)
        except STOPS as stop:  # a time limit or Ctrl-C: the suites finished so far are the report
            out["stopped"] = {"signal": signal_name(stop), "suite": suite}
            break
        except (RuntimeError, MemoryError) as exc:  # out of memory: the suites before it are the report
            out["failed"] = {"suite": suite, "error": str(out_of_memory_error(exc, suite, suites[:i]))}
            break
        if (out[suite].get("stopped") or {}).get("signal"):  # stopped inside its rounds, its rows kept
            out["stopped"] = {"signal": out[suite]["stopped"]["signal"], "suite": suite}
            break
        if out[suite].get("failed"):  # a model past the memory, the ones before it kept
            out["failed"] = {"suite": suite, "error": str(out_of_memory_error(out[suite]["failed"], suite, suites[:i]))}
            break
    return out


def out_of_memory_error(exc: BaseException | str, suite: str, finished: tuple[str, ...] | list[str]) -> UserError:
    """The one-line error of a suite whose sizes are past the machine's memory: what failed and the
    flags that size that suite; `exc` itself, re-raised, when it is not an allocation that failed."""
    from tango_lm.bench.child import is_out_of_memory

    if isinstance(exc, BaseException) and not is_out_of_memory(exc):
        raise exc
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    kept = f"; the report has the {', '.join(finished)} suite{'s' * (len(finished) > 1)} before it" if finished else ""
    flags = BENCH_SUITES[suite].size_flags
    return UserError(
        f"the {suite} suite ran out of memory ({said[:300]}); lower {', '.join(flags[:-1])} or {flags[-1]}{kept}"
    )
