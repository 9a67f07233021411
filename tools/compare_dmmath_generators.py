"""Do two Pythons generate the same DeepMind Mathematics questions? Each interpreter gets a
generator environment of its own (the numpy, sympy and mathematics-dataset pins that
`dmmath.generator_requirements` gives its version, as `data prepare dmmath` would install), the
worker generates every module of every split with one seed in each, and the files are compared.

Usage: python tools/compare_dmmath_generators.py /usr/bin/python3.11 /usr/bin/python3.13
           [--per-module 60] [--seed 5] [--workers 2] [--envs DIR]

The first interpreter is the reference. Prints each one's requirements, problems and time, then
the files that differ from the reference; exits 1 if any do. Environments are kept in `--envs`
(default: `generator-envs` under the cache root), so a second comparison installs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from op_timing import positive_int

from tango_lm.cache_root import cache_root
from tango_lm.data import dmmath
from tango_lm.errors import UserError, run_script

SPLITS = ("train-easy", "train-medium", "train-hard", "interpolate", "extrapolate")


def python_version(interpreter: str) -> tuple[int, int]:
    try:
        proc = subprocess.run(
            [interpreter, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True, text=True
        )
    except OSError as exc:
        raise UserError(f"cannot run {interpreter}: {exc.strerror}; give a Python interpreter") from None
    if proc.returncode != 0:
        raise UserError(f"{interpreter} is not a Python interpreter (exit code {proc.returncode})")
    major, minor = proc.stdout.split()
    return int(major), int(minor)


def generate(python: Path, out: Path, per_module: int, seed: int, workers: int) -> float:
    """Seconds the worker took to write every module of every split into `out`."""
    out.mkdir(parents=True)
    config = out.with_suffix(".json")
    config.write_text(
        json.dumps({"out_dir": str(out), "seed": seed, "counts": dict.fromkeys(SPLITS, per_module), "workers": workers})
    )
    start = time.perf_counter()
    proc = subprocess.run(
        [str(python), str(dmmath.WORKER), str(config)],
        capture_output=True,
        text=True,
        env={**os.environ, **dmmath.WORKER_ENV},
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"]
        raise UserError(f"the generator failed under {python}: {lines[-1]}")
    return time.perf_counter() - start


def differing(reference: Path, other: Path) -> list[str]:
    names = sorted({p.name for p in reference.iterdir()} | {p.name for p in other.iterdir()})
    return [
        name
        for name in names
        if not (reference / name).is_file()
        or not (other / name).is_file()
        or (reference / name).read_bytes() != (other / name).read_bytes()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("interpreters", nargs="+", help="Python interpreters to compare; the first is the reference")
    parser.add_argument(
        "--per-module", type=positive_int, default=60, help="problems per module and split (default 60)"
    )
    parser.add_argument("--seed", type=int, default=5, help="the generation seed (default 5)")
    parser.add_argument("--workers", type=positive_int, default=2, help="generator processes (default 2)")
    parser.add_argument(
        "--envs",
        type=Path,
        default=None,
        help="where the environments are kept (default: the cache root's generator-envs)",
    )
    args = parser.parse_args(argv)
    if len(args.interpreters) < 2:
        raise UserError("give at least two interpreters to compare")
    envs = args.envs or cache_root() / "generator-envs"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, interpreter in enumerate(args.interpreters):
            version = python_version(interpreter)
            requirements = dmmath.generator_requirements(version)
            python = dmmath.ensure_generator_env(envs / f"python{version[0]}.{version[1]}", interpreter, requirements)
            out = Path(tmp) / f"{i}"
            seconds = generate(python, out, args.per_module, args.seed, args.workers)
            problems = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in out.iterdir())
            rows.append((interpreter, f"{version[0]}.{version[1]}", requirements[0], problems, seconds, out))
        reference = rows[0][-1]
        print(f"{'interpreter':40} {'python':>6} {'numpy':>14} {'problems':>9} {'seconds':>8}  differing files")
        failed = False
        for interpreter, version, numpy, problems, seconds, out in rows:
            if out == reference:
                shown = "(the reference)"
            else:
                diff = differing(reference, out)
                failed |= bool(diff)
                named = ", ".join(diff[:3]) + (f" and {len(diff) - 3} more" if len(diff) > 3 else "")
                shown = f"{len(diff)}: {named}" if diff else "0"
            print(f"{interpreter:40} {version:>6} {numpy.split('==')[1]:>14} {problems:>9,} {seconds:>8.1f}  {shown}")
    return 1 if failed else 0


if __name__ == "__main__":
    run_script(main)
