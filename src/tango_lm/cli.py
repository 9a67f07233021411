"""The `tango-lm` command: parse arguments, call the library, print results.

Every error a user can cause is a `UserError`: printed as one line `error: ...`, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tango_lm.errors import UserError


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=float))


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table: columns are (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([("-" if row.get(k) is None else format(row[k], fmt)) for k, _, fmt in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The optional CONFIG positional may be the first override when no preset is given."""
    if args.config and "=" in args.config:
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


# -- commands -------------------------------------------------------------------------------
def cmd_params(args: argparse.Namespace) -> None:
    from tango_lm.models.config import ModelConfig
    from tango_lm.train.config import apply_overrides, read_yaml

    config, overrides = _config_and_overrides(args)
    data = read_yaml(config) if config else {}
    model = ModelConfig.from_dict(apply_overrides(data, overrides).get("model", {}))
    counts = model.num_params()
    out = {**counts, "arch": model.arch, "head": model.head, "d_model": model.d_model, "width": model.width,
           "depth": model.depth, "n_heads": model.n_heads, "vocab_size": model.vocab_size,
           "flops_per_token": model.flops_per_token()}
    if args.json:
        _print_json(out)
    else:
        print(f"{model.arch} (head {model.head}): d_model={model.d_model} n_heads={model.n_heads} "
              f"width={model.width} depth={model.depth} vocab={model.vocab_size}")
        print(f"  non-embedding {counts['non_embedding']:>15,}")
        print(f"  embedding     {counts['embedding']:>15,}")
        print(f"  total         {counts['total']:>15,}")


def cmd_match(args: argparse.Namespace) -> None:
    from tango_lm.models.matching import _row, active_ratio_rows, conventional_untied, match_tier, parse_tier

    target, d_model = parse_tier(args.tier, args.d_model)
    rows = match_tier(target, d_model, args.depth, args.arch or None, vocab_size=args.vocab_size,
                      context_length=args.context_length)
    conventional = conventional_untied(args.tier, args.depth, args.vocab_size)
    if conventional is not None and not args.arch:
        rows.append(_row(conventional, target, arch="conventional-untied"))
    ratios = active_ratio_rows(args.vocab_size) if args.ratios else []
    if args.json:
        _print_json({"target": target, "d_model": d_model, "depth": args.depth, "models": rows,
                     "active_ratio": ratios})
        return
    columns = [("arch", "arch", ""), ("d_model", "d", ""), ("n_heads", "heads", ""), ("width", "width", ""),
               ("non_embedding", "non-embedding", ",d"), ("total", "total", ",d"), ("gap", "gap to target", "+,d")]
    print(f"target {target:,} parameters, depth {args.depth} (matched widths at d_model={d_model})")
    print(_table(rows, columns))
    if ratios:
        print("\nactive-ratio geometries (seed 000 Table 9; 70M, depth 4)")
        print(_table(ratios, [("target_ratio", "F/d target", ""), ("realized_ratio", "F/d", ".3f"), *columns]))


def cmd_train(args: argparse.Namespace) -> None:
    from tango_lm.train.config import load_run_config
    from tango_lm.train.trainer import train

    run = load_run_config(*_config_and_overrides(args))
    if args.no_progress:
        run.train.progress = False
    result = train(run, resume=args.resume)
    s = result.summary
    if args.json:
        _print_json(s)
        return
    print(_table([s], [("arch", "arch", ""), ("params_total", "params", ",d"), ("tokens", "tokens", ",d"),
                       ("best_dev_nll", "best dev NLL", ".4f"), ("test_nll", "test NLL", ".4f"),
                       ("tokens_per_s", "tokens/s", ",.0f")]))
    print(f"run directory: {s['out_dir']} (test NLL from step {s['selected_step']})")


def cmd_eval(args: argparse.Namespace) -> None:
    from tango_lm.eval.evaluate import evaluate_checkpoint

    res = evaluate_checkpoint(args.checkpoint, args.split, data_dir=args.data, max_windows=args.windows,
                              device=args.device)
    if args.json:
        _print_json(res)
    else:
        print(f"{res['split']} NLL {res['nll']:.4f} nats/token over {res['tokens']:,} tokens "
              f"({res['checkpoint']}, step {res['step']})")


def cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from tango_lm.data.tokenizers import tokenizer_from_dict
    from tango_lm.serve.generate import generate
    from tango_lm.train.checkpoint import load_checkpoint
    from tango_lm.train.device import pick_device

    ckpt = load_checkpoint(args.checkpoint)
    device = pick_device(args.device)
    model = ckpt.build_model(device)
    tok = tokenizer_from_dict(ckpt.tokenizer)
    prompt_text = args.prompt.replace("\\n", "\n")
    ids = tok.encode(prompt_text)
    if not ids:
        raise UserError("the prompt is empty; give some text with --prompt")
    prompt = torch.tensor([ids] * args.num_samples, device=device)
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, eos_id=None if args.no_stop else tok.eot_id)
    texts = []
    for row in out.tolist():
        new = row[len(ids):]
        if not args.no_stop and tok.eot_id in new:
            new = new[: new.index(tok.eot_id)]
        texts.append(tok.decode(new))
    if args.json:
        _print_json({"prompt": args.prompt, "completions": texts, "checkpoint": str(ckpt.path)})
        return
    for i, text in enumerate(texts):
        if i:
            print("-" * 40)
        print(prompt_text + text)


def cmd_data_prepare(args: argparse.Namespace) -> None:
    from tango_lm.data.dmmath import prepare_dmmath

    path = prepare_dmmath(
        args.out, tokenizer=args.tokenizer, train_per_module=args.train_per_module,
        test_per_module=args.test_per_module, dev_fraction=args.dev_fraction, seed=args.seed,
        include_extrapolate=args.extrapolate, workers=args.workers, overwrite=args.overwrite,
    )
    print(f"prepared {path}")


def cmd_quickstart(args: argparse.Namespace) -> None:
    from tango_lm.quickstart import run_quickstart

    rows = run_quickstart(args.out, steps=args.steps, fresh=args.fresh)
    if args.json:
        _print_json(rows)


def cmd_bench(args: argparse.Namespace) -> None:
    from tango_lm.bench.training import run_training_bench

    report = run_training_bench(d_model=args.d_model, seq_len=args.seq_len, depth=args.depth,
                                batch_size=args.batch_size, steps=args.steps, warmup=args.warmup,
                                tango_width=args.tango_width, vocab_size=args.vocab_size, device=args.device,
                                print_table=not args.json)
    if args.json:
        _print_json(report)


# -- parser ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tango-lm", description="Train, compare, evaluate and serve TANGO and onóna LMs.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("params", help="parameter counts of a model config")
    s.add_argument("config", nargs="?", help="preset name or YAML file (optional)")
    s.add_argument("overrides", nargs="*", help="key=value overrides, e.g. arch=tango d_model=512")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_params)

    s = sub.add_parser("match", help="widths that match each architecture to a parameter tier (SPEC 2.8)")
    s.add_argument("--tier", required=True, help="70M, 160M, or a parameter count such as 25M or 1500000")
    s.add_argument("--depth", type=int, required=True)
    s.add_argument("--d-model", type=int, default=None, help="width d (default: 512 for 70M, 768 for 160M)")
    s.add_argument("--arch", action="append", help="only these architectures (repeatable)")
    s.add_argument("--vocab-size", type=int, default=50257)
    s.add_argument("--context-length", type=int, default=1024)
    s.add_argument("--ratios", action="store_true", help="also print the active-ratio geometries (Table 9)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_match)

    s = sub.add_parser("train", help="train a model from a preset or YAML file")
    s.add_argument("config", nargs="?", help="preset name or YAML file (optional)")
    s.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.steps=100")
    s.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in train.out_dir")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("eval", help="NLL of a checkpoint on a split")
    s.add_argument("checkpoint", help="run directory (its best-dev checkpoint) or checkpoints/step-* directory")
    s.add_argument("--split", default="test", help="dev, test, or another split of the dataset")
    s.add_argument("--data", default=None, help="prepared dataset (default: the one the run trained on)")
    s.add_argument("--windows", type=int, default=None, help="evaluate only the first N windows")
    s.add_argument("--device", default="auto")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_eval)

    s = sub.add_parser("generate", help="sample text from a checkpoint")
    s.add_argument("checkpoint", help="run directory (its best-dev checkpoint) or checkpoints/step-* directory")
    s.add_argument("--prompt", required=True, help="text to continue (\\n for a newline)")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=1.0, help="0 for greedy decoding")
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--num-samples", type=int, default=1)
    s.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    s.add_argument("--device", default="auto")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("data", help="prepare datasets")
    dsub = s.add_subparsers(dest="data_command", required=True)
    d = dsub.add_parser("prepare", help="prepare a dataset")
    dsrc = d.add_subparsers(dest="source", required=True)
    m = dsrc.add_parser("dmmath", help="DeepMind Mathematics from DeepMind's generator")
    m.add_argument("--out", required=True, help="output directory")
    m.add_argument("--tokenizer", default="gpt2", help="gpt2 or byte")
    m.add_argument("--train-per-module", type=int, default=300)
    m.add_argument("--test-per-module", type=int, default=30)
    m.add_argument("--dev-fraction", type=float, default=0.05)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--extrapolate", action="store_true", help="also write the extrapolate split")
    m.add_argument("--workers", type=int, default=None)
    m.add_argument("--overwrite", action="store_true")
    m.set_defaults(func=cmd_data_prepare)

    s = sub.add_parser("quickstart", help="DM Math, TANGO vs Loop Transformer++ at matched parameters, on a CPU")
    s.add_argument("--out", default="runs/quickstart")
    s.add_argument("--steps", type=int, default=None, help="optimizer steps per model")
    s.add_argument("--fresh", action="store_true", help="retrain even if finished runs exist")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_quickstart)

    s = sub.add_parser("bench", help="training speed of TANGO vs Loop Transformer++ at matched parameters")
    s.add_argument("--d-model", type=int, default=256)
    s.add_argument("--seq-len", type=int, default=256)
    s.add_argument("--depth", type=int, default=4)
    s.add_argument("--batch-size", type=int, default=4)
    s.add_argument("--steps", type=int, default=6, help="timed steps per model")
    s.add_argument("--warmup", type=int, default=2, help="untimed steps per model")
    s.add_argument("--tango-width", type=int, default=8192, help="TANGO's F; the Loop width is matched to it")
    s.add_argument("--vocab-size", type=int, default=257)
    s.add_argument("--device", default="auto")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
