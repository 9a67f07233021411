"""Shared helpers for the trainer, checkpoint, optimizer and CLI tests.

Test modules wrap these in their own small fixtures (so ruff sees no imported fixture names);
`synthetic_dataset` caches its directory under the session's base temp dir, so the dataset is
written once per session however many modules ask for it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import random
import string
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from tango_lm.data.dataset_dir import is_prepared
from tango_lm.data.shards import PreparedDataset, write_prepared
from tango_lm.data.tokenizers import get_tokenizer
from tango_lm.train.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]  # the repository
FIXTURES = ROOT / "tests" / "fixtures"
TOOLS = ROOT / "tools"


def tool(name: str) -> ModuleType:
    """A script under tools/ imported as a module: its functions and `main(argv)` run in this process
    (a subprocess costs seconds of imports; each script keeps one end-to-end subprocess test)."""
    sys.path.insert(0, str(TOOLS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(TOOLS))


# d_model 32 with head_dim 16 -> 2 heads; width 64 is a multiple of 2.
TINY_MODEL: dict[str, Any] = {
    "arch": "tango",
    "d_model": 32,
    "head_dim": 16,
    "width": 64,
    "depth": 2,
    "vocab_size": 257,
    "context_length": 32,
}
SEQ_LEN = 32
DOC_CHARS = 31  # + 1 EOT = 32 byte tokens per document
TRAIN_DOCS = 40  # 1280 tokens -> (1280 - 1) // 32 = 39 training windows
TRAIN_WINDOWS = (TRAIN_DOCS * (DOC_CHARS + 1) - 1) // SEQ_LEN
EVAL_DOCS = 10  # 320 tokens -> 9 dev / test windows

# Training defaults of the tiny runs (overridable per call).
TINY_TRAIN: dict[str, Any] = {
    "steps": 12,
    "batch_size": 4,
    "grad_accum": 1,
    "save_every": 4,
    "eval_every": 4,
    "log_every": 1,
    "warmup_steps": 2,
    "eval_windows": 8,
    "keep_last": 2,
    "lr": 3e-3,
    "progress": False,
    "device": "cpu",
    "precision": "fp32",
}


def make_docs(n: int, seed: int, chars: int = DOC_CHARS) -> list[str]:
    """`n` documents of exactly `chars` lowercase letters/spaces (byte tokens = chars + 1 EOT)."""
    rng = random.Random(seed)
    alphabet = string.ascii_lowercase[:12] + " "
    return ["".join(rng.choice(alphabet) for _ in range(chars)) for _ in range(n)]


def synthetic_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The byte-tokenized synthetic dataset, written once per session."""
    path = tmp_path_factory.getbasetemp() / "tango-synthetic-byte"
    if not is_prepared(path):
        write_prepared(
            path,
            get_tokenizer("byte"),
            {"train": make_docs(TRAIN_DOCS, 0), "dev": make_docs(EVAL_DOCS, 1), "test": make_docs(EVAL_DOCS, 2)},
            {"name": "synthetic"},
            progress=False,
        )
    ds = PreparedDataset.open(path)
    assert ds.num_tokens("train") == TRAIN_DOCS * (DOC_CHARS + 1)
    return path


def synthetic_gpt2_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small dataset prepared with the GPT-2 tokenizer (for tokenizer-mismatch errors)."""
    path = tmp_path_factory.getbasetemp() / "tango-synthetic-gpt2"
    if not is_prepared(path):
        docs = [" ".join(["the cat sat on the mat"] * 8)] * 8
        write_prepared(
            path, get_tokenizer("gpt2"), {"train": docs, "dev": docs, "test": docs}, {"name": "g"}, progress=False
        )
    return path


def run_config(data_dir: Path, out_dir: Path, model: dict[str, Any] | None = None, **train: Any) -> RunConfig:
    """A validated tiny RunConfig."""
    return RunConfig.from_dict(
        {
            "model": {**TINY_MODEL, **(model or {})},
            "data": {"dir": str(data_dir)},
            "train": {**TINY_TRAIN, "out_dir": str(out_dir), **train},
        }
    )


def cli_overrides(data_dir: Path, out_dir: Path, **train: Any) -> list[str]:
    """The same tiny run as `key=value` overrides for `tango-lm train`."""
    items = [f"model.{k}={v}" for k, v in TINY_MODEL.items()]
    items.append(f"data.dir={data_dir}")
    settings = {**TINY_TRAIN, "out_dir": str(out_dir), **train}
    items += [f"train.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()]
    return items


@contextlib.contextmanager
def one_thread(threads: int = 1) -> Iterator[None]:
    """Tiny models are much faster on one thread (and the CI box has two busy cores); a test of
    what parallel kernels do asks for more."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Fields of a training record that depend on the machine and the moment, not on the run.
MEASURED = ("tokens_per_s", "mfu", "peak_memory_mib")


def loss_records(run_dir: Path) -> list[dict[str, Any]]:
    """Training-loss records without the wall-clock and memory fields."""
    return [{k: v for k, v in r.items() if k not in MEASURED} for r in read_metrics(run_dir) if "loss" in r]


def dev_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if "dev_nll" in r and r.get("event") != "summary"]


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def rewrite_step_json(step: Path, name: str, data: Any) -> None:
    """Write a checkpoint's config.json or tokenizer.json as a test's scenario has it, with its
    sha256 in meta.json to match (a file changed without it is refused as damaged)."""
    (step / name).write_text(json.dumps(data))
    meta = json.loads((step / "meta.json").read_text())
    meta["sha256"][name] = hashlib.sha256((step / name).read_bytes()).hexdigest()
    (step / "meta.json").write_text(json.dumps(meta))


def step_names(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) if root.is_dir() else []


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def snapshot(*roots: Path) -> dict[str, tuple[int, str]]:
    """path -> (mtime_ns, sha256) of every file under the roots (and the directory listing)."""
    out: dict[str, tuple[int, str]] = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.is_file():
                out[str(p)] = (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                out[str(p)] = (0, "dir")
    return out


def run_main(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str, list[str]]:
    """`tango-lm ARGV` in this process: (exit code, stdout, stderr, the warnings it left). An
    exception escaping `main` (argparse's exit included) fails the test: the command line would
    print a traceback."""
    from tango_lm.cli import main

    capsys.readouterr()
    try:
        with warnings.catch_warnings(record=True) as leaked:
            rc = main(argv)
    except BaseException as exc:  # noqa: BLE001 - an escaping exception is the failure we report
        pytest.fail(f"{type(exc).__name__} escaped main(): {exc}")
    captured = capsys.readouterr()
    return rc, captured.out, captured.err, [str(w.message) for w in leaked]


def assert_one_error_line(err: str) -> str:
    """stderr holds exactly one line, `error: ...`, and no traceback."""
    assert "Traceback" not in err
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    return lines[0]


class NanEmptyTorch:
    """torch for the kernels' module, with `torch.empty` filled with NaN (fla's rule: NaN-filled
    buffers show any element a kernel forgets to write). Patched into that module only: replacing
    torch.empty itself would also be seen by torch.compile's tracing rules."""

    def __init__(self):
        self.calls = 0

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        self.calls += 1
        return torch.empty(*args, **kwargs).fill_(float("nan"))


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) any op produces while it is active, and the shapes made."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                self.shapes.add(tuple(t.shape))
        return out


def arguments_without_help(parser: argparse.ArgumentParser, command: str) -> list[str]:
    """Every argument of `parser` and its subcommands that `--help` shows with no line on what it does."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += arguments_without_help(sub, f"{command} {name}")
        elif not action.help:
            missing.append(f"{command} {(action.option_strings or [action.dest])[-1]}")
    return missing


def options_without_their_default(parser: argparse.ArgumentParser, command: str) -> list[str]:
    """Every option of `parser` and its subcommands that has a default value (not None, an empty
    list or a flag's absence) and whose line in `--help` does not say it."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += options_without_their_default(sub, f"{command} {name}")
        elif action.option_strings and action.nargs != 0 and action.default not in (None, [], argparse.SUPPRESS):
            if "default" not in (parser._get_formatter()._get_help_string(action) or ""):
                missing.append(f"{command} {action.option_strings[-1]}")
    return missing


def gpu_suites_process(out: Path, **env: str) -> subprocess.CompletedProcess:
    """tools/gpu_suites.sh into `out` with `echo` standing in for Python (unless env's PYTHON says
    otherwise): each suite's "report" is the command line it would run, and it takes no time."""
    return subprocess.run(
        ["bash", str(TOOLS / "gpu_suites.sh"), str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": "echo", **env},
        timeout=60,
    )
