"""DeepMind Mathematics, generated locally by DeepMind's own generator and prepared as shards.

Why a separate environment: the PyPI package `mathematics-dataset` does not run as shipped with
today's numpy, sympy or Python (`np.object`, `ndarray.itemset`, `base_solution_linear` moved
inside sympy, floats passed to `random.randint`, which Python 3.12 refuses). The worker patches
these, and its patches (one of them to the `random` module) and pinned versions (numpy 1.26.4
where it has wheels) belong in an environment and a process of their own, not in the user's, whose
torch has its own numpy. So the generator lives in a dedicated virtual environment
(`<cache>/dmmath-env`, `<cache>` = `tango_lm.cache_root.cache_root()`) that is created once,
and `dmmath_worker.py` runs in it as a subprocess, patching and importing the generator there.
What it generates is cached under `<cache>/dmmath/<key>`, keyed by the generation parameters and
the generator's pinned versions, so a second prepare reuses it.

Splits: train = train-easy/medium/hard modules (the per-module count split equally over the
three difficulties) minus the held-out dev documents; dev = `dev_fraction` of each module's
generated train documents, rounded and at least one per module so dev covers every module (a larger
share at small `train_per_module`: 1 of 3), same distribution, disjoint from train; test = the official
*interpolate* split (56 modules); optionally extrapolate. A document is question + "\\n" + answer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tango_lm.cache_root import cache_root
from tango_lm.data.source import DataSource
from tango_lm.errors import UserError, option, path_arg
from tango_lm.progress_lines import Progress, progress_bar

__all__ = [
    "DMMathSource",
    "prepare_dmmath",
    "ensure_generator_env",
    "generate_examples",
    "generator_requirements",
    "cache_root",
    "REQUIREMENTS",
]


def generator_requirements(python: tuple[int, int] = sys.version_info[:2]) -> tuple[str, ...]:
    """What the generator's environment installs for a Python version, pinned so that cached
    generations are reproducible. numpy 1.26.4 is the generator's own numpy, but it has no wheel
    past Python 3.12 (pip builds it from source: minutes, and a C compiler), so later Pythons get numpy
    2.5.5 with the worker's shims for what numpy 2 removed: on every module the two generate the
    same questions from one seed (tools/compare_dmmath_generators.py; docs/benchmarks.md)."""
    numpy = "numpy==1.26.4" if python < (3, 13) else "numpy==2.5.5"
    return (numpy, "sympy==1.14.0", "mathematics-dataset==1.0.1")


# The environment is made with this Python (sys.executable), so these are its requirements.
REQUIREMENTS = generator_requirements()
# Bump when the worker's sampling or seeding changes, to invalidate cached generations.
WORKER_VERSION = 1
TRAIN_SPLITS = ("train-easy", "train-medium", "train-hard")
_ENV_MARKER = "tango-lm-env.json"
WORKER = Path(__file__).with_name("dmmath_worker.py")
# A fixed hash seed keeps set iteration order, and thus the generated problems, reproducible (on
# one Python: 3.10 hashes strings otherwise than 3.11 and later, and generates other problems).
WORKER_ENV = {"PYTHONHASHSEED": "0", "PYTHONWARNINGS": "ignore"}


def _generated_root() -> Path:
    return cache_root() / "dmmath"


def _env_python(env_dir: Path) -> Path:
    return env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_generator_env(
    env_dir: Path | None = None, interpreter: str = sys.executable, requirements: Sequence[str] = REQUIREMENTS
) -> Path:
    """Python executable of the generator's environment, creating the environment once.

    The environment is built under a temporary name and renamed into place, with a marker file
    naming its requirements written last, so an interrupted install is rebuilt next time.
    `interpreter` makes it, with `requirements` (`generator_requirements` of its version).
    """
    env_dir = env_dir or cache_root() / "dmmath-env"
    marker = env_dir / _ENV_MARKER
    try:
        if json.loads(marker.read_text())["requirements"] == list(requirements):
            return _env_python(env_dir)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    print(
        f"tango-lm: creating the DeepMind Mathematics generator environment at {env_dir} "
        f"(once; pip install {' '.join(requirements)})",
        file=sys.stderr,
        flush=True,
    )
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = env_dir.parent / f".{env_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        steps = [
            ("create a virtual environment", [interpreter, "-m", "venv", str(tmp)]),
            ("pip install", [str(_env_python(tmp)), "-m", "pip", "install", "--quiet", *requirements]),
        ]
        for what, cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                lines = (proc.stderr or proc.stdout).strip().splitlines()
                detail = lines[-1] if lines else f"exit code {proc.returncode}"
                raise UserError(
                    f"could not set up the DeepMind Mathematics generator environment at {env_dir}: "
                    f"{what} failed ({detail}); check that PyPI is reachable and run the command again"
                )
        (tmp / _ENV_MARKER).write_text(json.dumps({"requirements": list(requirements)}) + "\n")
        # venv's bin/python finds its environment relative to itself, so the env survives a rename.
        if env_dir.exists():
            old = env_dir.parent / f".{env_dir.name}.old-{os.getpid()}"
            os.rename(env_dir, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, env_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _env_python(env_dir)


def _generation_key(seed: int, counts: dict[str, int]) -> str:
    spec = {
        "requirements": list(REQUIREMENTS),
        "worker_version": WORKER_VERSION,
        "seed": seed,
        "counts": dict(sorted(counts.items())),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def _split_evenly(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def generate_examples(
    seed: int,
    counts: dict[str, int],
    workers: int | None = None,
    progress: Progress = True,
) -> Path:
    """Directory of generated JSONL files (one per split and module), generating them if not cached.

    `counts` maps generator splits (train-easy, train-medium, train-hard, interpolate,
    extrapolate) to examples per module.
    """
    key = _generation_key(seed, counts)
    final = _generated_root() / key
    if (final / "params.json").is_file():
        return final
    python = ensure_generator_env()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    log = final.parent / f"{key}.log"
    config = {"out_dir": str(tmp), "seed": seed, "counts": counts, "workers": workers or os.cpu_count()}
    config_path = tmp / "worker-config.json"
    config_path.write_text(json.dumps(config))
    env = {**os.environ, **WORKER_ENV}
    proc = None
    try:
        with (
            open(log, "w", encoding="utf-8") as err,
            progress_bar(progress, desc="generate dmmath", unit="module") as bar,
        ):
            proc = subprocess.Popen(
                [str(python), str(WORKER), str(config_path)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                start_new_session=True,
            )
            for line in proc.stdout:
                parts = line.split()
                if parts[:1] == ["tasks"]:
                    bar.reset(total=int(parts[1]))
                elif parts[:1] == ["done"]:
                    bar.update(1)
                    bar.set_postfix_str(f"{parts[1]}/{parts[2]}")
            rc = proc.wait()
        if rc != 0:
            lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
            detail = lines[-1] if lines else f"exit code {rc}"
            raise UserError(
                f"the DeepMind Mathematics generator failed ({detail}); see {log}, and if the environment "
                f"is broken delete {python.parent.parent} and run the command again"
            )
        config_path.unlink()
        params = {"seed": seed, "counts": counts, "requirements": list(REQUIREMENTS), "worker_version": WORKER_VERSION}
        (tmp / "params.json").write_text(json.dumps(params, indent=2) + "\n")
        if final.exists():  # an earlier, incomplete copy without params.json
            shutil.rmtree(final)
        os.rename(tmp, final)
        log.unlink(missing_ok=True)
    finally:
        if proc is not None and proc.poll() is None:
            # Interrupted: stop the worker and its pool processes (their own session).
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _read_jsonl(directory: Path, split: str) -> dict[str, list[str]]:
    """Documents per module of one generator split, modules in sorted order."""
    docs: dict[str, list[str]] = {}
    for path in sorted(directory.glob(f"{split}__*.jsonl")):
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        docs[path.stem.split("__", 1)[1]] = [r["question"] + "\n" + r["answer"] for r in rows]
    return docs


def _hold_out(docs: list[str], fraction: float, rng: random.Random) -> tuple[list[str], list[str]]:
    """Split one module's documents into (train, dev) with no document text in both: dev takes the
    rounded fraction, but at least one (every module in dev) and never all of them."""
    unique = list(dict.fromkeys(docs))
    n_dev = 0 if fraction <= 0 else min(len(unique) - 1, max(1, round(fraction * len(docs))))
    rng.shuffle(unique)
    dev = set(unique[: max(0, n_dev)])
    return [d for d in docs if d not in dev], [d for d in unique if d in dev]


@dataclass(kw_only=True)
class DMMathSource(DataSource):
    """DeepMind Mathematics, generated, as a prepared dataset with splits train/dev/test.

    `train_per_module` examples are generated per train module (split equally over easy, medium
    and hard), and `dev_fraction` of them are held out as dev; test is the interpolate split with
    `test_per_module` per module; `include_extrapolate` adds an `extrapolate` split.
    """

    name = "dmmath"
    help = "DeepMind Mathematics from DeepMind's generator"

    tokenizer: str = "gpt2"
    train_per_module: int = 300
    test_per_module: int = 30
    dev_fraction: float = 0.05
    seed: int = 0
    include_extrapolate: bool = False
    workers: int | None = None

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", required=True, type=path_arg, help="output directory")
        parser.add_argument("--tokenizer", default="gpt2", help="gpt2, byte, or bpe:PATH (data train-tokenizer)")
        parser.add_argument(
            "--train-per-module",
            type=int,
            default=300,
            help="examples per train module, split over easy, medium and hard (default %(default)s)",
        )
        parser.add_argument(
            "--test-per-module", type=int, default=30, help="interpolate examples per module (default %(default)s)"
        )
        parser.add_argument(
            "--dev-fraction",
            type=float,
            default=0.05,
            help="share of each module's train examples held out as dev, rounded, at least one per module so dev "
            "covers every module (default %(default)s: 15 of the default 300)",
        )
        parser.add_argument("--seed", type=int, default=0, help="generator seed (default %(default)s)")
        parser.add_argument("--extrapolate", action="store_true", help="also write the extrapolate split")
        parser.add_argument("--workers", type=int, default=None, help="generator processes (default: one per CPU)")
        cls.add_overwrite_argument(parser)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DMMathSource:
        return cls(
            tokenizer=args.tokenizer,
            train_per_module=args.train_per_module,
            test_per_module=args.test_per_module,
            dev_fraction=args.dev_fraction,
            seed=args.seed,
            include_extrapolate=args.extrapolate,
            workers=args.workers,
        )

    def check(self) -> None:
        if self.train_per_module < 1 or self.test_per_module < 1:
            raise UserError(
                f"{option('train_per_module')} and {option('test_per_module')} must be at least 1; raise them"
            )
        if not 0 <= self.dev_fraction < 1:
            raise UserError(f"{option('dev_fraction')} must be in [0, 1), got {self.dev_fraction}; pick e.g. 0.05")
        if self.workers is not None and self.workers < 1:
            raise UserError(f"{option('workers')} must be at least 1, got {self.workers}; omit it to use every CPU")

    def open_tokenizer(self) -> Any:
        from tango_lm.data.tokenizers import get_tokenizer

        return get_tokenizer(self.tokenizer)

    def read(self, tokenizer: Any, out_dir: Path, progress: Progress) -> dict[str, list[str]]:
        seed, dev_fraction = self.seed, self.dev_fraction
        counts = dict(zip(TRAIN_SPLITS, _split_evenly(self.train_per_module, 3), strict=True))
        counts["interpolate"] = self.test_per_module
        if self.include_extrapolate:
            counts["extrapolate"] = self.test_per_module
        directory = generate_examples(seed, counts, workers=self.workers, progress=progress)

        per_module: dict[str, list[str]] = defaultdict(list)
        for split in TRAIN_SPLITS:
            for module, docs in _read_jsonl(directory, split).items():
                per_module[module].extend(docs)
        test = [d for docs in _read_jsonl(directory, "interpolate").values() for d in docs]
        extra = [d for docs in _read_jsonl(directory, "extrapolate").values() for d in docs]
        # Keep evaluation questions out of training data: a few easy modules repeat questions.
        held = set(test) | set(extra)
        train: list[str] = []
        dev: list[str] = []
        for module in sorted(per_module):
            rng = random.Random(f"{seed}/dev/{module}")
            t, d = _hold_out([x for x in per_module[module] if x not in held], dev_fraction, rng)
            train.extend(t)
            dev.extend(d)
        # Shuffle each split once, so that the first windows of dev/test (eval's max_windows)
        # cover every module rather than the alphabetically first ones.
        for i, docs in enumerate((train, dev, test, extra)):
            random.Random(f"{seed}/order/{i}").shuffle(docs)

        splits = {"train": train, "dev": dev, "test": test}
        if self.include_extrapolate:
            splits["extrapolate"] = extra
        self._generated = {
            "train_modules": len(per_module),
            "test_modules": len(_read_jsonl(directory, "interpolate")),
            "cache_key": directory.name,
        }
        return splits

    def fingerprint(self) -> dict[str, Any]:
        return {
            "name": "dmmath",
            "generator": list(REQUIREMENTS),
            "worker_version": WORKER_VERSION,
            "seed": self.seed,
            "train_per_module": self.train_per_module,
            "test_per_module": self.test_per_module,
            "dev_fraction": self.dev_fraction,
            "include_extrapolate": self.include_extrapolate,
            **self._generated,
        }


def prepare_dmmath(
    out_dir: str | os.PathLike,
    tokenizer: str = "gpt2",
    train_per_module: int = 300,
    test_per_module: int = 30,
    dev_fraction: float = 0.05,
    seed: int = 0,
    include_extrapolate: bool = False,
    workers: int | None = None,
    overwrite: bool = False,
    progress: Progress = True,
) -> Path:
    """Generate DeepMind Mathematics and write it as a prepared dataset (DMMathSource)."""
    source = DMMathSource(
        tokenizer=tokenizer,
        train_per_module=train_per_module,
        test_per_module=test_per_module,
        dev_fraction=dev_fraction,
        seed=seed,
        include_extrapolate=include_extrapolate,
        workers=workers,
    )
    return source.prepare(out_dir, overwrite=overwrite, progress=progress)
