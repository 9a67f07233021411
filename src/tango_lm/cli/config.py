"""Config commands: `params`, `presets` and `match`."""

from __future__ import annotations

import argparse
import itertools
import unicodedata
from pathlib import Path
from typing import Any

from tango_lm.cli.output import CONFIG_HELP, JSON_HELP, _print_json, _table, add_overrides
from tango_lm.errors import UserError
from tango_lm.models.archs.gau import GAU_NORMS
from tango_lm.models.matching import PAPER_VOCAB


def _config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The optional CONFIG positional may be the first override when no preset is given (a file or
    directory that exists is a config even with '=' in its path: a sweep's run directories have them)."""
    if args.config and "=" in args.config and not Path(args.config).exists():
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def cmd_params(args: argparse.Namespace) -> None:
    from tango_lm.models.params import active_non_embedding_params
    from tango_lm.train.config import RunConfig, apply_overrides, read_yaml

    config, overrides = _config_and_overrides(args)
    data = read_yaml(config) if config else {}
    run = RunConfig.from_dict(apply_overrides(data, overrides))  # validates every section
    model = run.model
    counts = model.num_params()
    active = active_non_embedding_params(model)
    out = {
        **counts,
        "active_non_embedding": active,
        "arch": model.arch,
        "head": model.head,
        "d_model": model.d_model,
        "width": model.width,
        "depth": model.depth,
        "n_heads": model.n_heads,
        "vocab_size": model.vocab_size,
        "flops_per_token": model.flops_per_token(run.seq_len()),  # at the training length, as train logs it
    }
    if args.json:
        _print_json(out)
    else:
        print(
            f"{model.arch} (head {model.head}): d_model={model.d_model} n_heads={model.n_heads} "
            f"width={model.width} depth={model.depth} vocab={model.vocab_size}"
        )
        print(f"  non-embedding {counts['non_embedding']:>15,}")
        print(f"  embedding     {counts['embedding']:>15,}")
        print(f"  total         {counts['total']:>15,}")
        if active != counts["non_embedding"]:
            print(f"  active        {active:>15,}  (non-embedding parameters one token uses)")


def cmd_presets(args: argparse.Namespace) -> None:
    from tango_lm.train.config import PRESET_DIR, list_presets, load_run_config

    about = {name: _leading_comment(PRESET_DIR / f"{name}.yaml") for name in list_presets()}
    names = list(about)
    if args.filter:  # names first: `tango` is not every baseline whose description names TANGO
        wanted = _folded(args.filter)
        names = [n for n in names if wanted in n] or [n for n in names if wanted in _folded("\n".join(about[n]))]
    rows = []
    for name in names:
        model = load_run_config(name, []).model
        rows.append({"name": name, "arch": model.arch, "total": model.num_params()["total"], "about": about[name][0]})
    if not rows:  # a typo, not an empty answer: an empty table would read as "no presets"
        raise UserError(f"no preset's name or description contains {args.filter!r}; `tango-lm presets` lists them all")
    if args.json:
        _print_json(rows)
    else:
        print(
            _table(
                rows,
                [("name", "preset", ""), ("arch", "arch", ""), ("total", "params", ",d"), ("about", "description", "")],
            )
        )


def _leading_comment(path: Path) -> list[str]:
    """A preset file's description: the comment lines it starts with, '#' removed."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.lstrip("# ") for line in itertools.takewhile(lambda line: line.startswith("#"), lines)] or [""]


def _folded(text: str) -> str:
    """Lower case without accents, so `onona` finds the onóna paper's presets."""
    decomposed = unicodedata.normalize("NFKD", text.casefold())
    return "".join(c for c in decomposed if not unicodedata.combining(c))


# Set by match's own options (or by the matcher: width), not by an override.
_MATCH_OPTIONS = {
    "arch": "--arch",
    "width": "the matcher",
    "d_model": "--d-model",
    "depth": "--depth",
    "vocab_size": "--vocab-size",
    "head_dim": "--head-dim",
    "context_length": "--context-length",
    "gau_norm": "--gau-norm",
}


def _match_overrides(overrides: list[str]) -> dict[str, Any]:
    """`key=value` (or `model.key=value`) model fields every matched architecture is built with: an
    architecture's own setting (FLASH's qk_dim, a window, MoE's experts) changes its count."""
    import dataclasses

    from tango_lm.errors import did_you_mean
    from tango_lm.models.config import ModelConfig
    from tango_lm.train.config import apply_overrides

    sections = apply_overrides({}, overrides, bare_section="model")
    other = [s for s in sections if s != "model"]
    if other:
        raise UserError(f"match takes model fields only (got {other[0]}.*); write e.g. qk_dim=64 or model.window=256")
    fields = sections.get("model", {})
    known = [f.name for f in dataclasses.fields(ModelConfig)]
    for key in fields:
        if key not in known:
            raise UserError(f"unknown model field {key!r}{did_you_mean(key, known)} in match's overrides")
        if key in _MATCH_OPTIONS:
            raise UserError(f"model.{key} is set by {_MATCH_OPTIONS[key]} in match, not by an override")
        if key == "head":  # a head-vs-Standard pair shares one backbone: a sweep matches it with Standard too
            raise UserError(
                "match counts every architecture with the Standard head, as a sweep matches each head's "
                "backbone; leave head out (`tango-lm params` counts a config with its own head)"
            )
    return fields


def cmd_match(args: argparse.Namespace) -> None:
    from tango_lm.models.matching import TIERS, _row, active_ratio_rows, match_tier, parse_tier
    from tango_lm.models.registry import fixed_geometries
    from tango_lm.models.table3_range import non_embedding_range, paper_range

    target, d_model = parse_tier(args.tier, args.d_model)
    if args.ratios and ((target, args.depth, args.vocab_size) != (70_000_000, 4, PAPER_VOCAB) or args.overrides):
        raise UserError(  # its rows are fixed geometries, counted against 70M: under another tier they mean nothing
            f"--ratios gives Table 9's fixed geometries, of the 70M tier at depth 4 with the paper's vocabulary "
            f"({PAPER_VOCAB:,}) and settings; use --tier 70M --depth 4 without --vocab-size or overrides, or leave "
            "--ratios out"
        )
    contexts = list(dict.fromkeys(args.context_length))  # GAU's count (and so its width) depends on it
    fields = {**_match_overrides(args.overrides), "vocab_size": args.vocab_size, "gau_norm": args.gau_norm}
    if args.head_dim is not None:
        fields["head_dim"] = args.head_dim
    archs = list(dict.fromkeys(args.arch)) if args.arch else None  # a repeated --arch is one row
    rows, unmatched = [], {}  # an architecture no width matches is said under the table, not the end of it
    for context in contexts:  # an architecture whose count depends on it (GAU's relative bias): a row each
        missed = {}
        for row in match_tier(target, d_model, args.depth, archs, missed, context_length=context, **fields):
            rows.append({**row, "context_length": context})
        unmatched |= {(arch if len(contexts) == 1 else f"{arch} (n={context})"): e for arch, e in missed.items()}
    by_arch = {arch: [r for r in rows if r["arch"] == arch] for arch in dict.fromkeys(r["arch"] for r in rows)}
    rows = []
    for same in by_arch.values():
        counts = [{k: v for k, v in r.items() if k != "context_length"} for r in same]
        if len(same) == len(contexts) and all(c == counts[0] for c in counts):  # the same at every context: one row
            same = counts[:1]
        rows += same
    if not rows:
        raise UserError(next(iter(unmatched.values())))
    # The paper's own settings: its vocabulary (Table 6's fixed geometries match the tier only with its
    # embedding), its head width and no override (they are the paper's shapes, not the overrides').
    paper_settings = args.vocab_size == PAPER_VOCAB and not args.overrides and args.head_dim in (None, 32)
    tier = next((name for name, tier in TIERS.items() if tier == (target, d_model)), None) if paper_settings else None
    for label, (arch, geometry) in fixed_geometries().items():
        fixed = geometry.config(arch, tier, args.depth, args.vocab_size) if tier else None
        if fixed is not None and not args.arch:
            rows.append(_row(fixed, target, arch=label))
    ratios = active_ratio_rows(args.vocab_size) if args.ratios else []
    # Seed 000 Table 3's last column, and the paper's for its own tiers (same d_model and vocabulary).
    paper = paper_range(tier, args.depth) if tier and not args.arch else None
    paper_row = tier is not None and not args.arch and not args.overrides
    span = non_embedding_range(rows, table3=paper_row)  # else of every row the table shows
    if span is not None:
        span["paper_millions"] = list(paper) if paper else None
    if args.json:
        _print_json(
            {
                "target": target,
                "d_model": d_model,
                "depth": args.depth,
                "models": rows,
                "non_embedding_range": span,
                "active_ratio": ratios,
                "unmatched": unmatched,  # architecture -> why no width matches it
            }
        )
        return
    columns = [
        ("arch", "arch", ""),
        ("d_model", "d", "d"),
        ("n_heads", "heads", "d"),
        ("width", "width", "d"),
        ("non_embedding", "non-embedding", ",d"),
        ("total", "total", ",d"),
        ("gap", "gap to target", "+,d"),
    ]
    if any("context_length" in row for row in rows):
        columns.insert(4, ("context_length", "n", "d"))
    print(f"target {target:,} parameters, depth {args.depth} (matched widths at d_model={d_model})")
    print(_table(rows, columns))
    if span is not None:
        # in millions as the paper writes them; exact where 3 decimals of a million would hide the spread
        count = (lambda n: f"{n / 1e6:.3f}M") if span["min"] >= 10_000_000 else (lambda n: f"{n:,}")
        # Table 3's column is of its architectures as the presets build them: not of a chosen few
        what = "non-embedding range" + (" (seed 000 Table 3's last column)" if paper_row else "")
        line = f"{what}: {count(span['min'])} ({span['min_arch']}) to {count(span['max'])} ({span['max_arch']})"
        if span["paper_millions"]:
            line += f"; the paper: {span['paper_millions'][0]:.3f}M to {span['paper_millions'][1]:.3f}M"
        print(line)
    for arch, error in unmatched.items():
        print(f"{arch}: not matched ({error})")
    if ratios:
        print("\nactive-ratio geometries (seed 000 Table 9; 70M, depth 4)")
        print(_table(ratios, [("target_ratio", "F/d target", ""), ("realized_ratio", "F/d", ".3f"), *columns]))


def add_parsers(sub: Any) -> None:
    """`params`, `presets`, `match`."""
    s = sub.add_parser("params", help="parameter counts of a model config")
    s.add_argument("config", nargs="?", help=CONFIG_HELP)
    add_overrides(s, "key=value overrides, e.g. arch=tango d_model=512")
    s.add_argument("--json", action="store_true", help=JSON_HELP)
    s.set_defaults(func=cmd_params)

    s = sub.add_parser("presets", help="list the named presets")
    s.add_argument(
        "filter",
        nargs="?",
        help=(
            "only presets whose name holds this or, when none does, whose description does, in any case "
            "or accent (tango-70m, onona, 'table 8'); none: an error"
        ),
    )
    s.add_argument("--json", action="store_true", help=JSON_HELP)
    s.set_defaults(func=cmd_presets)

    s = sub.add_parser("match", help="widths that match each architecture to a parameter tier (docs/design.md §2.8)")
    s.add_argument("--tier", required=True, help="70M, 160M, or a parameter count such as 25M, 1.5B, 1e9 or 1500000")
    s.add_argument("--depth", type=int, required=True, help="block applications (looped) or layers")
    add_overrides(s, "model fields every architecture is matched with, e.g. qk_dim=64 model.window=256")
    s.add_argument("--d-model", type=int, default=None, help="width d (default: 512 for 70M, 768 for 160M)")
    s.add_argument("--arch", action="append", help="only these architectures (repeatable)")
    s.add_argument("--vocab-size", type=int, default=PAPER_VOCAB, help="vocabulary V (default: %(default)s, GPT-2's)")
    s.add_argument(
        "--head-dim", type=int, default=None, help="head width d_h (default: the config's, 32); d_model's multiple"
    )
    s.add_argument(
        "--context-length",
        type=int,
        nargs="+",
        default=[1024],
        help="context length(s): an architecture whose count depends on it (GAU's relative bias) gets a row each",
    )
    s.add_argument(
        "--gau-norm",
        choices=GAU_NORMS,
        default="rmsnorm",
        help="GAU/FLASH norm: rmsnorm (design.md §2.7) or layernorm with a bias (docs/table3-ranges.md)",
    )
    s.add_argument(
        "--ratios", action="store_true", help="also print the active-ratio geometries (Table 9: --tier 70M --depth 4)"
    )
    s.add_argument("--json", action="store_true", help=JSON_HELP)
    s.set_defaults(func=cmd_match)
