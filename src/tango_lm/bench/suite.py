"""`tango-lm bench`: the benchmark suites (docs/design.md §6, "Throughput").

- `train` (`bench/training.py`): training tokens/s, analytic FLOPs per token, achieved FLOP/s, MFU
  against a matmul peak measured in the same run, and peak memory, of every architecture at
  matched total parameters, trained side by side; ratios to Loop Transformer++.
- `decode` (`bench/decode.py`): decoding tokens/s and decode-cache bytes per token per
  architecture; onóna's one-projection sampling against both projections and the Standard head.
- `windowed` (`bench/windowed.py`): windowed against full TANGO time per token as T grows.
- `memory` (`bench/memory.py`): peak memory of a whole training step, each head against Standard (onóna by default).
- `all`: every suite, in that order.

Without `--suite`, `tango-lm bench` is the original comparison: TANGO against a matched Loop
Transformer++ at d=256, T=256 (the train suite with `--archs tango,loop-transformer`), and
`--json` prints that one report. With `--suite`, `--json` prints one object with a key per suite.
"""

from __future__ import annotations

import argparse
import platform
from typing import Any

from tango_lm.bench.memory import HEADS_COMPARED
from tango_lm.bench.stopping import STOPS, StopRecord, signal_name, stopped_line
from tango_lm.bench.training import default_archs
from tango_lm.cli.output import DEVICE_HELP
from tango_lm.errors import UserError, did_you_mean

# torch is imported inside the functions: `tango-lm --help` builds this parser and stays fast.

SUITES = ("train", "decode", "windowed", "memory")
# The flags that size each suite's models and batches: what its out-of-memory error says to lower.
SIZE_FLAGS = {
    "train": ("--tango-width", "--vocab-size", "--d-model", "--depth", "--batch-size", "--seq-len", "--peak-size"),
    "decode": (
        "--decode-batches",
        "--prompt-len",
        "--new-tokens",
        "--tango-width",
        "--vocab-size",
        "--head-vocab",
        "--d-model",
        "--depth",
    ),
    "windowed": ("--windowed-tokens", "--windowed-lens", "--windowed-width", "--d-model"),
    "memory": ("--memory-seq-len", "--memory-batch-size", "--head-vocab", "--memory-backbone", "--d-model", "--depth"),
}
WINDOWED_TARGET = 1.3  # windowed time/token at the longest T over its time at the shortest
WINDOWED_HEAD_DIM = 32  # the windowed suite's blocks: d_model / 32 heads


def _ints(text: str) -> tuple[int, ...]:
    items = text.split(",") if text.strip() else []  # none at all: check_arguments says what the list needs
    try:
        if any(not v.strip() for v in items):  # 1,,2: a value left out, not a list of two
            raise ValueError
        return tuple(int(v) for v in items)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(","))
    if not all(names):  # '' or 'tango,': not the default list, which an empty value read as before
        raise argparse.ArgumentTypeError(f"expected comma-separated architecture names, got {text!r}")
    return names


def _head_names(text: str) -> tuple[str, ...]:
    """--memory-heads: registered heads, with Standard (what the ratios are to) first."""
    from tango_lm.heads.registry import HEADS

    names = tuple(v.strip() for v in text.split(","))
    for name in names:
        if name not in HEADS:
            raise argparse.ArgumentTypeError(
                f"unknown head {name!r}{did_you_mean(name, HEADS)}; choose from {', '.join(HEADS)}"
            )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a head is listed twice (got {text!r})")
    return ("standard", *(n for n in names if n != "standard"))


def add_arguments(s: argparse.ArgumentParser) -> None:
    """The `bench` subcommand's options."""
    s.add_argument(
        "--suite",
        choices=(*SUITES, "all"),
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
    s.add_argument("--seq-len", type=int, default=256, help="train suite: tokens per sequence (default %(default)s)")
    s.add_argument("--depth", type=int, default=4, help="block applications or layers (default %(default)s)")
    s.add_argument("--batch-size", type=int, default=4, help="train suite: sequences per step (default %(default)s)")
    s.add_argument("--steps", type=int, default=6, help="timed training steps per model")
    s.add_argument("--warmup", type=int, default=2, help="untimed training steps per model")
    s.add_argument("--tango-width", type=int, default=8192, help="TANGO's F; the other widths are matched to it")
    s.add_argument("--vocab-size", type=int, default=257, help="vocabulary of the train and decode suites")
    s.add_argument("--device", default="auto", help=DEVICE_HELP)
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    s.add_argument("--no-memory", action="store_true", help="train suite: skip the per-model memory measurement")
    s.add_argument("--memory-steps", type=int, default=2, help="training steps per memory measurement")
    s.add_argument(
        "--peak-size",
        type=int,
        default=None,
        help="side of the square matmuls of the measured peak (default 2048 on CPU, 8192 on CUDA)",
    )
    g = s.add_argument_group("decode suite")
    g.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence (default %(default)s)")
    g.add_argument("--new-tokens", type=int, default=128, help="tokens generated after it (default %(default)s)")
    g.add_argument("--decode-batches", type=_ints, default=(1, 8), help="comma-separated batch sizes (default 1,8)")
    g.add_argument("--repeats", type=int, default=3, help="timed rounds (decode, windowed)")
    g.add_argument(
        "--head-backbone",
        default="dense",
        help="architecture (at --d-model/--depth) or preset (e.g. dense-142m) under the heads (decode suite)",
    )
    g.add_argument(
        "--decode-tier",
        choices=("70m", "160m"),
        default=None,
        help="decode the presets {arch}-{tier}-d{depth} (seed 000 Table 3 sizes) instead of matched models "
        "at --d-model",
    )
    g.add_argument("--head-vocab", type=int, default=50304, help="vocabulary of the head comparisons")
    g = s.add_argument_group("windowed suite")
    g.add_argument("--window", type=int, default=64, help="windowed TANGO's window W (default %(default)s)")
    g.add_argument(
        "--windowed-lens",
        type=_ints,
        default=(256, 512, 1024, 2048, 4096),
        help="comma-separated sequence lengths, increasing (default 256,512,1024,2048,4096)",
    )
    g.add_argument("--windowed-width", type=int, default=2048, help="TANGO's F in the windowed comparison")
    g.add_argument("--windowed-tokens", type=int, default=16384, help="tokens per step at every T")
    g.add_argument("--no-full-tango", action="store_true", help="windowed suite: time the windowed block only")
    g.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="windowed suite timer")
    g = s.add_argument_group("memory suite")
    g.add_argument(
        "--memory-backbone",
        default="dense-142m",
        help="a preset (its model section) or an architecture at --d-model/--depth",
    )
    g.add_argument("--memory-batch-size", type=int, default=1, help="sequences per measured step (default %(default)s)")
    g.add_argument("--memory-seq-len", type=int, default=512, help="tokens per sequence (default %(default)s)")
    g.add_argument(
        "--memory-heads",
        type=_head_names,
        default=HEADS_COMPARED,
        help=f"comma-separated heads, Standard first as the ratios' reference (default {','.join(HEADS_COMPARED)})",
    )
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


def run_windowed(args: argparse.Namespace, print_table: bool, progress: str = "none") -> dict[str, Any]:
    import torch

    from tango_lm.bench.windowed import windowed_time_per_token
    from tango_lm.train.device import autocast_dtype

    stops = StopRecord(args.repeats)
    dtype = autocast_dtype("auto", _device(args.device))  # bf16 autocast where training uses it (CUDA)
    kwargs = dict(
        seq_lens=args.windowed_lens,
        window=args.window,
        d_model=args.d_model,
        width=args.windowed_width,
        head_dim=WINDOWED_HEAD_DIM,
        tokens=args.windowed_tokens,
        repeats=args.repeats,
        include_tango=not args.no_full_tango,
        device=args.device,
        print_table=False,
        progress=progress,
        stops=stops,
        dtype=dtype,
    )
    if args.clock != "wall":
        kwargs["clock"] = args.clock
    rows = windowed_time_per_token(**kwargs)
    # The target is read at the longest length against the first: not measured when a stop came before
    # it, nor with one length (which compares nothing).
    reached = rows and rows[-1]["seq_len"] == args.windowed_lens[-1] and len(args.windowed_lens) > 1
    longest = rows[-1]["windowed_vs_first"] if reached else None
    report = {
        "device": str(_device(args.device)),
        "threads": torch.get_num_threads(),
        "d_model": args.d_model,
        "width": args.windowed_width,
        "window": args.window,
        "tokens_per_step": args.windowed_tokens,
        "repeats": args.repeats,
        "clock": args.clock,
        "precision": "bf16 autocast" if dtype == torch.bfloat16 else "fp32",
        "rows": rows,
        "target": WINDOWED_TARGET,
        "longest_vs_first": longest,
        "target_met": None if longest is None else longest <= WINDOWED_TARGET,
        "stopped": stops.record,  # None, or the signal and after how many timed rounds
    }
    if print_table:
        print(format_windowed(report))
    return report


def _device(name: str) -> Any:
    from tango_lm.train.device import pick_device

    return pick_device(name)


def format_windowed(report: dict[str, Any]) -> str:
    rows = report["rows"]
    full = any("tango_us_per_token" in r for r in rows) or not rows  # --no-full-tango times windowed alone
    blocks = "same weights for both blocks" if full else "the windowed block alone (--no-full-tango)"
    lines = [
        f"windowed: device {report['device']} ({report['threads']} threads), one block, d={report['d_model']}, "
        f"F={report['width']}, W={report['window']}, forward + backward on about {report['tokens_per_step']} "
        f"tokens per step (batch = max(tokens // T, 1)), {blocks}; each time is the best of {report['repeats']} "
        f"rounds that alternate every T and block ({report['clock']} clock, {report.get('precision', 'fp32')}, "
        "bench/windowed.py)",
        f"{'T':>6}{'batch':>7}{'windowed us/tok':>17}{'vs T=' + str(rows[0]['seq_len'] if rows else '-'):>11}"
        + (f"{'tango us/tok':>14}{'tango/windowed':>16}" if full else ""),
    ]
    for r in rows:
        tango = f"{r['tango_us_per_token']:>14.2f}{r['tango_vs_windowed']:>16.2f}" if "tango_us_per_token" in r else ""
        lines.append(
            f"{r['seq_len']:>6}{r['batch']:>7}{r['windowed_us_per_token']:>17.2f}{r['windowed_vs_first']:>11.2f}{tango}"
        )
    if report["longest_vs_first"] is not None:
        lines.append(
            f"target: windowed time/token at T={rows[-1]['seq_len']} <= {report['target']} x its time at "
            f"T={rows[0]['seq_len']}: {report['longest_vs_first']:.2f} "
            f"({'met' if report['target_met'] else 'NOT met'})"
        )
    if report.get("stopped"):
        meaning = "each time is the best of the rounds its length finished; the lengths not reached have no row"
        lines.append(stopped_line(report["stopped"], "timed rounds", meaning))
    return "\n".join(lines)


def check_arguments(args: argparse.Namespace) -> None:
    """Every option the chosen suites read, before the first one starts (a bad value found by a
    later suite of `--suite all` would throw away the ones before it): a UserError for the first."""
    suites = SUITES if args.suite == "all" else (args.suite or "train",)
    _device(args.device)  # an absent CUDA: the memory suite's children each failed with a traceback
    positive = ["d_model", "depth", "seq_len", "batch_size", "steps", "tango_width", "vocab_size", "memory_steps"]
    positive += [name for name in ("threads", "peak_size") if getattr(args, name) is not None]
    if "decode" in suites:
        positive += ["prompt_len", "new_tokens", "repeats", "head_vocab"]
    if "windowed" in suites:
        positive += ["window", "windowed_width", "windowed_tokens", "repeats"]
    if "memory" in suites:
        positive += ["memory_batch_size", "memory_seq_len"]
    for name in positive:
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.warmup < 0:
        raise UserError(f"--warmup must be 0 or more (got {args.warmup})")
    # The models have heads of 32 channels: the model's own errors name model fields, not these
    # flags. Only where the suites build models at --d-model (not presets: --decode-tier, a preset
    # --memory-backbone).
    from tango_lm.models.registry import ARCHITECTURES

    matched_decode = "decode" in suites and args.decode_tier is None
    at_d_model = (  # windowed's own check (below) says its d_model and width
        "train" in suites
        or matched_decode
        or ("decode" in suites and args.head_backbone in ARCHITECTURES)  # its heads' backbone
        or ("memory" in suites and args.memory_backbone in ARCHITECTURES)
    )
    if at_d_model and args.d_model % WINDOWED_HEAD_DIM:
        raise UserError(f"--d-model must be a multiple of 32, the models' head width (got {args.d_model})")
    heads = max(1, args.d_model // WINDOWED_HEAD_DIM)
    if ("train" in suites or matched_decode) and args.tango_width % heads:
        raise UserError(
            f"--tango-width must be a multiple of the models' {heads} heads (--d-model {args.d_model} / 32): "
            f"TANGO splits its gate width across them (got {args.tango_width})"
        )
    lists = (["decode_batches"] if "decode" in suites else []) + (["windowed_lens"] if "windowed" in suites else [])
    for name in lists:
        values = getattr(args, name)
        if not values or min(values) < 1:
            raise UserError(
                f"--{name.replace('_', '-')} must list positive integers (got {','.join(map(str, values))!r})"
            )
        if len(set(values)) != len(values):  # a repeat is a second row of one setting
            raise UserError(f"--{name.replace('_', '-')} lists a value twice (got {','.join(map(str, values))!r})")
    if "windowed" in suites and list(args.windowed_lens) != sorted(args.windowed_lens):
        # its target compares the time per token at the last (longest) length with the first (shortest)
        raise UserError(f"--windowed-lens must be in increasing order (got {','.join(map(str, args.windowed_lens))!r})")
    if "windowed" in suites and args.clock == "cpu" and _device(args.device).type != "cpu":
        raise UserError(
            f"--clock cpu times this process's CPU, not a {_device(args.device).type} device; use --clock wall"
        )
    if "windowed" in suites:
        heads, head_dim = args.d_model // WINDOWED_HEAD_DIM, WINDOWED_HEAD_DIM
        if args.d_model % head_dim or args.windowed_width % heads:
            raise UserError(
                f"the windowed suite uses heads of {head_dim}: --d-model must be a multiple of {head_dim} and "
                f"--windowed-width a multiple of d_model / {head_dim} (got {args.d_model}, {args.windowed_width})"
            )
    from tango_lm.bench.memory import memory_config

    if "memory" in suites:
        memory_config(args.memory_backbone, args.d_model, args.depth, args.head_vocab, args.memory_seq_len)
    if "decode" in suites:
        from tango_lm.bench.decode import preset_configs

        memory_config(args.head_backbone, args.d_model, args.depth, args.head_vocab, args.prompt_len + args.new_tokens)
        if args.decode_tier is not None:  # the baseline's preset at that tier and depth must exist
            preset_configs([], args.decode_tier, args.depth, args.prompt_len + args.new_tokens)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the suites `args` names, print each table unless --json, and return the report (the
    caller prints it as JSON). SIGTERM (under `bench.stopping.stop_on_sigterm`) or Ctrl-C ends it
    early: the report's "stopped" names the signal and the suite it stopped; the suites before it
    are whole, and a stopped suite keeps what its finished rounds measured."""
    import torch

    from tango_lm.bench.decode import run_decode_bench
    from tango_lm.bench.memory import run_memory_bench
    from tango_lm.bench.training import PAIR, default_archs, run_training_bench
    from tango_lm.train.cpu_allocator import keep_freed_memory

    check_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # host memory as training uses it (cpu_allocator.py); the memory suite's children do not
    show = not args.json
    progress = getattr(args, "progress", "none")  # `tango-lm bench` sets it (cli/bench.py)

    def train_bench(archs: list[str]) -> dict[str, Any]:  # the default run and the train suite
        return run_training_bench(
            d_model=args.d_model,
            seq_len=args.seq_len,
            depth=args.depth,
            batch_size=args.batch_size,
            steps=args.steps,
            warmup=args.warmup,
            tango_width=args.tango_width,
            vocab_size=args.vocab_size,
            device=args.device,
            archs=archs,
            memory=not args.no_memory,
            memory_steps=args.memory_steps,
            threads=args.threads,
            peak_size=args.peak_size,
            print_table=show,
            compile=args.compile,
            progress=progress,
        )

    if args.suite is None:
        try:
            return train_bench(args.archs or PAIR)
        except (RuntimeError, MemoryError) as exc:
            raise out_of_memory_error(exc, "train", finished=[]) from None
    suites = SUITES if args.suite == "all" else (args.suite,)
    archs = args.archs or default_archs()
    runners = {
        "train": lambda: train_bench(archs),
        "decode": lambda: run_decode_bench(
            archs=archs,
            d_model=args.d_model,
            depth=args.depth,
            tango_width=args.tango_width,
            vocab_size=args.vocab_size,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            batches=args.decode_batches,
            repeats=args.repeats,
            head_backbone=args.head_backbone,
            head_vocab=args.head_vocab,
            device=args.device,
            threads=args.threads,
            print_table=show,
            static=args.compile,
            tier=args.decode_tier,
            progress=progress,
        ),
        "windowed": lambda: run_windowed(args, show, progress),
        "memory": lambda: run_memory_bench(
            backbone=args.memory_backbone,
            d_model=args.d_model,
            depth=args.depth,
            vocab_size=args.head_vocab,
            batch_size=args.memory_batch_size,
            seq_len=args.memory_seq_len,
            steps=args.memory_steps,
            device=args.device,
            threads=args.threads,
            print_table=show,
            compile=args.compile,
            progress=progress,
            heads=args.memory_heads,
        ),
    }
    out: dict[str, Any] = {"suites": list(suites), "environment": environment(), "stopped": None, "failed": None}
    for i, suite in enumerate(suites):
        if show and i:
            print()
        try:
            out[suite] = runners[suite]()
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
    flags = SIZE_FLAGS[suite]
    return UserError(
        f"the {suite} suite ran out of memory ({said[:300]}); lower {', '.join(flags[:-1])} or {flags[-1]}{kept}"
    )
