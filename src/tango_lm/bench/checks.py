"""Checks of `tango-lm bench` options that several suites share; each suite's own are its module's
`check_suite_args` (`bench/registry.py`). Each raises a one-line UserError that names the flag:
the model's own errors would name model fields (model.d_model), which bench does not have."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from tango_lm.errors import UserError

HEAD_DIM = 32  # the benchmark models' head width: d_model / 32 heads


def int_list(text: str) -> tuple[int, ...]:
    """An option of comma-separated integers (argparse type)."""
    items = text.split(",") if text.strip() else []  # none at all: the suite's check says what the list needs
    try:
        if any(not v.strip() for v in items):  # 1,,2: a value left out, not a list of two
            raise ValueError
        return tuple(int(v) for v in items)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def require_positive(args: argparse.Namespace, names: Iterable[str]) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise UserError(f"{flag(name)} must be at least 1 (got {getattr(args, name)})")


def require_head_multiple(args: argparse.Namespace) -> None:
    """For a suite that builds models at --d-model (not presets)."""
    if args.d_model % HEAD_DIM:
        raise UserError(f"--d-model must be a multiple of {HEAD_DIM}, the models' head width (got {args.d_model})")


def require_tango_width_split(args: argparse.Namespace) -> None:
    """For a suite that builds TANGO at --tango-width: it splits its gate width across the heads."""
    heads = max(1, args.d_model // HEAD_DIM)
    if args.tango_width % heads:
        raise UserError(
            f"--tango-width must be a multiple of the models' {heads} heads (--d-model {args.d_model} / {HEAD_DIM}): "
            f"TANGO splits its gate width across them (got {args.tango_width})"
        )


def require_int_list(args: argparse.Namespace, name: str) -> None:
    """A comma-separated list option: positive values, none twice (a repeat is a second row of one setting)."""
    values = getattr(args, name)
    if not values or min(values) < 1:
        raise UserError(f"{flag(name)} must list positive integers (got {','.join(map(str, values))!r})")
    if len(set(values)) != len(values):
        raise UserError(f"{flag(name)} lists a value twice (got {','.join(map(str, values))!r})")
