"""Decoding speed and decode-cache size per architecture, and the onóna head's serving paths.

Architectures (the matched set of `bench/training.py`): each model generates `new_tokens` tokens
after a random prompt of `prompt_len` tokens with `serve.generate.generate` (decode cache, one
position per step), at each batch size, greedy and at temperature 1. A timed run is the whole
`generate` call, prefill included; tokens/s counts the new tokens of every row. Runs alternate
between the models (every model, batch and mode once per round), and each number is the median
over the timed rounds, after one short warm-up round (long enough that its static decoder has the
timed rounds' capacity, so it compiles the step they replay). Prefill tokens/s times the prompt alone
through the cached forward (`model.hidden`, what both decodes start with), prompt tokens of every
row per second. Cache bytes per token are `cache.nbytes() / positions` of one sequence after
prompt + new tokens (fp32). A model whose static step failed to compile (it then decodes on the
uncompiled static step, `serve/static_decode.py`) says so in its row's note ("static_failed").

Heads: on one backbone, the Standard head against onóna sampled two ways at temperature 1 without
truncation: one projection per position (`head.sample`, what `generate` does on its own) and
both projections (`top_k=V`, which changes no probability but forces the full mixture). Ratios
are to the Standard head.

Stopped early (SIGTERM, Ctrl-C: `bench/stopping.py`), it reports every case from the timed rounds
it finished ("stopped", with "part": "architectures" or "heads"); a case with no timed run, and
what comes after the rounds (prefill, cache bytes, the heads), is left out ("-" in the table).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, NamedTuple

import torch

from tango_lm.bench.checks import (
    int_list,
    require_head_multiple,
    require_int_list,
    require_positive,
    require_tango_width_split,
)
from tango_lm.bench.decode_report import case_key, format_report
from tango_lm.bench.memory import memory_config
from tango_lm.bench.peak import _sync
from tango_lm.bench.progress import Progress
from tango_lm.bench.stopping import StopRecord
from tango_lm.bench.training import BASELINE, default_archs, matched_configs
from tango_lm.models.config import ModelConfig
from tango_lm.models.model import build_model
from tango_lm.serve.generate import generate
from tango_lm.serve.static_decode import capacity_bucket
from tango_lm.stop_signals import STOPS
from tango_lm.train.device import pick_device

MODES = {"greedy": 0.0, "t=1": 1.0}


class HeadVariant(NamedTuple):
    """One row of the heads decode bench: the head it builds and how it samples."""

    name: str
    head: str
    top_k_full_vocab: bool  # top_k=V makes the onóna sampler mix both projections
    path: str


HEAD_VARIANTS = (
    HeadVariant("standard", "standard", False, "one table (full softmax)"),
    HeadVariant("onona-one", "onona", False, "one projection per position (head.sample)"),
    HeadVariant("onona-both", "onona", True, "both projections (top_k=V)"),
)


def static_mode(device: torch.device) -> str:
    """The static decode the bench's `static` rows time: CUDA graphs on CUDA, compiled elsewhere."""
    return "cuda-graphs" if device.type == "cuda" else "compile"


def _timed_generate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    new_tokens: int,
    temperature: float,
    top_k: int | None = None,
    static: str | None = None,
) -> tuple[float, float]:
    _sync(prompt.device)
    t0, c0 = time.perf_counter(), time.process_time()
    generate(model, prompt, new_tokens, temperature=temperature, top_k=top_k, seed=0, static=static)
    _sync(prompt.device)
    return time.perf_counter() - t0, time.process_time() - c0


@torch.no_grad()
def cache_bytes_per_token(model: torch.nn.Module, positions: int, device: torch.device) -> float:
    """Bytes of one sequence's decode cache per position after `positions` positions."""
    cache = model.new_cache(positions)
    ids = torch.randint(0, model.config.vocab_size, (1, positions), device=device)
    model.hidden(ids, cache)
    return cache.nbytes() / cache.position


def _prompts(batches: tuple[int, ...], prompt_len: int, vocab: int, device: torch.device) -> dict[int, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    return {b: torch.randint(0, vocab, (b, prompt_len), generator=gen, device=device) for b in batches}


def static_fell_back(model: torch.nn.Module) -> bool:
    """Whether a static decoder of `model` failed to compile and so decoded eagerly from then on
    (`serve/static_decode.py` logs one line and carries on): its "static" rows then time the static
    step uncompiled, not CUDA graphs."""
    return any(d.compiled_failed for d in model.__dict__.get("_static_decoders", {}).values())


def warmup_tokens(prompt_len: int, new_tokens: int, context_length: int) -> int:
    """New tokens of the warm-up round: 8 (at most new_tokens), or more where the static decoder of
    the timed rounds' length has a larger capacity bucket, so the warm-up compiles the step they use."""
    want = capacity_bucket(prompt_len + new_tokens - 1, context_length)
    n = min(8, new_tokens)
    while capacity_bucket(prompt_len + n - 1, context_length) != want:
        n += 1
    return n


@torch.no_grad()
def prefill_walls(
    models: dict[str, Any], prompts: dict[int, torch.Tensor], repeats: int
) -> dict[tuple[str, int], list[float]]:
    """Wall seconds of the prompt's cached forward per (model, batch): one warm-up round, then
    `repeats` rounds alternating the models."""
    out: dict[tuple[str, int], list[float]] = {}
    for i in range(1 + repeats):
        for b, prompt in prompts.items():
            for name, model in models.items():
                cache = model.new_cache(prompt.shape[1])
                _sync(prompt.device)
                t0 = time.perf_counter()
                model.hidden(prompt, cache)
                _sync(prompt.device)
                if i > 0:
                    out.setdefault((name, b), []).append(time.perf_counter() - t0)
    return out


def run_decode_bench(
    archs: tuple[str, ...] | list[str] | None = None,
    d_model: int = 256,
    depth: int = 4,
    tango_width: int = 8192,
    vocab_size: int = 257,
    prompt_len: int = 32,
    new_tokens: int = 128,
    batches: tuple[int, ...] = (1, 8),
    repeats: int = 3,
    head_backbone: str = "dense",
    head_vocab: int = 50304,
    heads: bool = True,
    device: str = "auto",
    threads: int | None = None,
    print_table: bool = True,
    static: bool = False,
    tier: str | None = None,
    progress: str = "none",
) -> dict[str, Any]:
    """`static`: every case also through static decode steps (`static_mode`), as rows "... static"
    with their ratio to the same model's eager rows. `tier` ("70m", "160m"): each architecture's
    preset `{arch}-{tier}-d{depth}` (seed 000 Table 3 sizes, GPT-2 vocabulary) instead of the
    models matched at `d_model`; the head comparison then runs on `head_backbone` as a preset
    (e.g. dense-142m) when it names one. `progress`: "bar", "lines" or "none" (`bench/progress.py`)."""
    archs = archs or default_archs()
    dev = pick_device(device)
    if threads:
        torch.set_num_threads(threads)
    positions = prompt_len + new_tokens
    report: dict[str, Any] = {
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "d_model": d_model,
        "depth": depth,
        "vocab_size": vocab_size,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "batches": list(batches),
        "modes": list(MODES),
        "repeats": repeats,
    }
    report["paths"] = ["eager", "static"] if static else ["eager"]
    report["static_mode"] = static_mode(dev) if static else None
    triples = (
        preset_configs(archs, tier, depth, positions)
        if tier
        else matched_configs(archs, d_model, depth, tango_width, vocab_size, positions)
    )
    if tier:
        built = [c for _, c, _ in triples if c is not None]
        report.update(tier=tier, d_model=built[0].d_model, vocab_size=built[0].vocab_size)
    report["skipped"] = [{"arch": a, "note": note} for a, c, note in triples if c is None]
    pairs = [(c, note) for _, c, note in triples if c is not None]
    models = {}
    for cfg, _ in pairs:
        torch.manual_seed(0)
        models[cfg.arch] = build_model(cfg).to(dev).eval()
    cases = [(b, m, path) for b in batches for m in MODES for path in report["paths"]]
    prompts = _prompts(batches, prompt_len, report["vocab_size"], dev)  # a tier's presets: their vocabulary
    bar = Progress("decode", 1 + repeats, len(cases) * len(models), 1, progress)
    stops = StopRecord(repeats)
    wall = _interleaved(
        models, cases, prompts, new_tokens, repeats, static=report["static_mode"], progress=bar, stops=stops
    )
    prefill = stops.unless_stopped(lambda: prefill_walls(models, prompts, repeats)) or {}
    rows = []
    for cfg, note in pairs:
        row: dict[str, Any] = {
            "arch": cfg.arch,
            "width": cfg.width,
            "params_total": cfg.num_params()["total"],
            "note": note,
            "tokens_per_s": {
                case_key(b, m, path): b * new_tokens / statistics.median(wall[cfg.arch, b, m, path])
                for b, m, path in cases
                if (cfg.arch, b, m, path) in wall  # a stop can leave a case untimed
            },
            "prefill_tokens_per_s": {
                f"b{b}": b * prompt_len / statistics.median(prefill[cfg.arch, b]) for b in batches if prefill
            },
            "cache_bytes_per_token": stops.unless_stopped(
                lambda cfg=cfg: cache_bytes_per_token(models[cfg.arch], positions, dev)
            ),
        }
        if static:
            row["static_failed"] = static_fell_back(models[cfg.arch])
        rows.append(row)
    base = next(r for r in rows if r["arch"] == BASELINE)
    for r in rows:
        r["tokens_per_s_vs_loop"] = ratios(r["tokens_per_s"], base["tokens_per_s"])
        r["prefill_vs_loop"] = ratios(r["prefill_tokens_per_s"], base["prefill_tokens_per_s"])
        if static:
            r["static_vs_eager"] = {
                case_key(b, m, "eager"): r["tokens_per_s"][case_key(b, m, "static")]
                / r["tokens_per_s"][case_key(b, m, "eager")]
                for b in batches
                for m in MODES
                if case_key(b, m, "static") in r["tokens_per_s"] and case_key(b, m, "eager") in r["tokens_per_s"]
            }
        both = r["cache_bytes_per_token"] is not None and base["cache_bytes_per_token"]
        r["cache_vs_loop"] = r["cache_bytes_per_token"] / base["cache_bytes_per_token"] if both else None
    report["archs"] = rows
    report["stopped"] = stops.record and {**stops.record, "part": "architectures"}
    models.clear()  # free the architectures before the heads are built
    if heads and not stops.record:
        heads_stops = StopRecord(repeats)
        try:
            report["heads"] = run_head_decode(
                head_backbone,
                d_model,
                depth,
                head_vocab,
                prompt_len,
                new_tokens,
                batches,
                repeats,
                dev,
                report["paths"],
                report["static_mode"],
                progress,
                heads_stops,
            )
        except STOPS as stop:  # while the heads' models were built, before their first round
            report["heads"] = None
            heads_stops.stop(stop, 0)
        report["stopped"] = heads_stops.record and {**heads_stops.record, "part": "heads"}
    if print_table:
        print(format_report(report))
    return report


def ratios(values: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """values[k] / base[k] for every k both measured (a stop can leave cases out of either)."""
    return {k: v / base[k] for k, v in values.items() if k in base}


def _interleaved(
    models: dict[str, Any],
    cases: list[tuple[int, str, str]],
    prompts: dict[int, torch.Tensor],
    new_tokens: int,
    repeats: int,
    top_k: dict[str, int | None] | None = None,
    temperature: dict[str, float] | None = None,
    static: str | None = None,
    progress: Progress | None = None,
    stops: StopRecord | None = None,
) -> dict[tuple[str, int, str, str], list[float]]:
    """Wall seconds per (model, batch, mode, path): one short warm-up round (it also compiles the
    static steps, `warmup_tokens`), then `repeats` rounds of every case for every model. A stop
    (SIGTERM, Ctrl-C) ends the rounds: recorded in `stops` (raised when there is none), the walls
    timed before it are returned."""
    progress = progress or Progress("decode", 1 + repeats, len(cases) * len(models), 1)
    out: dict[tuple[str, int, str, str], list[float]] = {}
    i = 0
    try:
        with progress:
            for i in range(1 + repeats):
                for b, m, path in cases:
                    for name, model in models.items():
                        n = (
                            new_tokens
                            if i
                            else warmup_tokens(prompts[b].shape[1], new_tokens, model.config.context_length)
                        )
                        t = temperature[name] if temperature else MODES[m]
                        label = f"{name} {case_key(b, m, path)}"
                        progress.run_start(label)
                        wall, _ = _timed_generate(
                            model, prompts[b], n, t, (top_k or {}).get(name), static if path == "static" else None
                        )
                        progress.run_done(i, label, wall)
                        if i > 0:
                            out.setdefault((name, b, m, path), []).append(wall)
                progress.round_done(i)
    except STOPS as stop:  # a time limit or Ctrl-C: the rounds timed so far are the result
        if stops is None:
            raise
        stops.stop(stop, i - 1)
    return out


def run_head_decode(
    backbone: str,
    d_model: int,
    depth: int,
    vocab_size: int,
    prompt_len: int,
    new_tokens: int,
    batches: tuple[int, ...],
    repeats: int,
    dev: torch.device,
    paths: list[str] | None = None,
    static: str | None = None,
    progress: str = "none",
    stops: StopRecord | None = None,
) -> dict[str, Any]:
    """Standard vs onóna (one projection) vs onóna (both projections), temperature 1, untruncated;
    `backbone` an architecture (at d_model, depth, width 4d) or a preset name (its model). A stop
    in the rounds is recorded in `stops` (see `_interleaved`)."""
    from tango_lm.bench.memory import memory_config

    decode_paths = paths or ["eager"]
    base = memory_config(backbone, d_model, depth, vocab_size, prompt_len + new_tokens)
    models = {}
    for variant in HEAD_VARIANTS:
        torch.manual_seed(0)  # one seed: every head gets the same body
        models[variant.name] = build_model(base.replace(head=variant.head)).to(dev).eval()
    if not models["onona-one"].head.one_projection_sampling:
        raise RuntimeError("the onóna head has no one-projection sampler")
    top_k = {v.name: vocab_size if v.top_k_full_vocab else None for v in HEAD_VARIANTS}
    temperature = {v.name: 1.0 for v in HEAD_VARIANTS}
    cases = [(b, "t=1", path) for b in batches for path in decode_paths]
    prompts = _prompts(batches, prompt_len, vocab_size, dev)
    bar = Progress("decode heads", 1 + repeats, len(cases) * len(models), 1, progress)
    wall = _interleaved(models, cases, prompts, new_tokens, repeats, top_k, temperature, static, bar, stops)
    rows = []
    for variant in HEAD_VARIANTS:
        name = variant.name
        tps = {
            f"b{b}" + (" static" if path == "static" else ""): b
            * new_tokens
            / statistics.median(wall[name, b, "t=1", path])
            for b in batches
            for path in decode_paths
            if (name, b, "t=1", path) in wall
        }
        rows.append(
            {
                "variant": name,
                "path": variant.path,
                "params_total": models[name].config.num_params()["total"],
                "tokens_per_s": tps,
            }
        )
        if "static" in decode_paths:
            rows[-1]["static_failed"] = static_fell_back(models[name])
    for r in rows:
        r["tokens_per_s_vs_standard"] = ratios(r["tokens_per_s"], rows[0]["tokens_per_s"])
    return {
        "backbone": backbone,
        "d_model": base.d_model,
        "depth": base.depth,
        "width": base.width,
        "vocab_size": vocab_size,
        "variants": rows,
    }


def preset_configs(
    archs: tuple[str, ...] | list[str], tier: str, depth: int, positions: int
) -> list[tuple[str, ModelConfig | None, str]]:
    """(arch, config, note) from each architecture's preset `{arch}-{tier}-d{depth}` (the baseline
    added when missing); an architecture without such a preset has config None."""
    from tango_lm.errors import UserError
    from tango_lm.train.config import load_run_config

    archs = list(dict.fromkeys([*archs, BASELINE]))
    out: list[tuple[str, ModelConfig | None, str]] = []
    for arch in archs:
        name = f"{arch}-{tier.lower()}-d{depth}"
        try:
            cfg = load_run_config(name, []).model
        except UserError as exc:
            out.append((arch, None, f"skipped: {str(exc).splitlines()[0]}"))
            continue
        out.append((arch, cfg.replace(context_length=max(cfg.context_length, positions)), f"preset {name}"))
    if out[archs.index(BASELINE)][1] is None:
        raise UserError(
            f"the baseline {BASELINE} has no preset {BASELINE}-{tier}-d{depth}; choose another tier or depth"
        )
    return out


def add_suite_arguments(g: Any) -> None:
    """The decode suite's own options (an argparse group)."""
    g.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence (default %(default)s)")
    g.add_argument("--new-tokens", type=int, default=128, help="tokens generated after it (default %(default)s)")
    g.add_argument("--decode-batches", type=int_list, default=(1, 8), help="comma-separated batch sizes (default 1,8)")
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


def check_suite_args(args: argparse.Namespace) -> None:
    """The decode suite's options of `tango-lm bench` (`bench/registry.py`)."""
    from tango_lm.models.registry import ARCHITECTURES

    require_positive(args, ("prompt_len", "new_tokens", "repeats", "head_vocab"))
    matched = args.decode_tier is None  # models matched at --d-model, not the presets of a tier
    if matched or args.head_backbone in ARCHITECTURES:  # the heads' backbone too, when not a preset
        require_head_multiple(args)
    if matched:
        require_tango_width_split(args)
    require_int_list(args, "decode_batches")
    positions = args.prompt_len + args.new_tokens
    memory_config(args.head_backbone, args.d_model, args.depth, args.head_vocab, positions)
    if args.decode_tier is not None:  # the baseline's preset at that tier and depth must exist
        preset_configs([], args.decode_tier, args.depth, positions)


def run_suite(args: argparse.Namespace, print_table: bool, progress: str = "none") -> dict[str, Any]:
    """The decode suite of `tango-lm bench` at its options."""
    return run_decode_bench(
        archs=args.archs or default_archs(),
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
        print_table=print_table,
        static=args.compile,
        tier=args.decode_tier,
        progress=progress,
    )
