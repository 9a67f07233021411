"""Every command's bad arguments are clean: exit code 2, one line `error: ...` on stderr and nothing
else (no traceback, usage block, warning or progress bar), nothing on disk touched. The table adds
to test_cli.py's: generate's sampling arguments, numbers that cannot train, corrupt checkpoint
configs, unreadable or binary YAML and shards, empty or truncated data preparation, and control
characters in file names."""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tango_lm.cli import main
from tango_lm.data import verify
from tests import helpers

pytestmark = pytest.mark.usefixtures("one_thread")

TRAIN = {"steps": 2, "save_every": 2, "eval_every": 2}


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bad-input") / "run"
    assert main(["train", *helpers.cli_overrides(data_dir, out, **TRAIN), "--no-progress"]) == 0
    return out


@dataclass
class Ctx:
    data: Path
    run: Path
    tmp: Path
    monkeypatch: pytest.MonkeyPatch

    @property
    def new_out(self) -> Path:
        return self.tmp / "new-run"

    def train(self, *extra: str) -> list[str]:
        return ["train", *helpers.cli_overrides(self.data, self.new_out, **TRAIN), *extra]

    def without_steps(self) -> list[str]:  # a train command whose budget the caller gives
        return [a for a in self.train() if not a.startswith("train.steps=")]

    def generate(self, *extra: str) -> list[str]:
        return ["generate", str(self.run), "--prompt", "abc", "--max-new-tokens", "2", *extra]

    def prepare(self, *extra: str) -> list[str]:
        return ["data", "prepare", "text", "--out", str(self.tmp / "new-data"), "--tokenizer", "byte", *extra]


def _checkpoint_with_config(c: Ctx, config) -> Path:
    copy = Path(shutil.copytree(c.run, c.tmp / "odd-run"))
    for step in copy.glob("checkpoints/step-*"):
        helpers.rewrite_step_json(step, "config.json", config)
    return copy


def _model_only(c: Ctx) -> dict:
    step = next(c.run.glob("checkpoints/step-*"))
    return {"model": json.loads((step / "config.json").read_text())["model"]}


def _checkpoint_without_step(c: Ctx) -> Path:
    copy = Path(shutil.copytree(c.run, c.tmp / "odd-run"))
    for step in copy.glob("checkpoints/step-*"):
        meta = json.loads((step / "meta.json").read_text())
        del meta["step"]
        (step / "meta.json").write_text(json.dumps(meta))
    return copy


def _checkpoint_with_meta(c: Ctx, data: bytes | None, name: str = "meta.json") -> Path:
    """A copy of the run whose checkpoints' file `name` holds `data` (None: has none)."""
    copy = Path(shutil.copytree(c.run, c.tmp / "odd-run"))
    for step in copy.glob("checkpoints/step-*"):
        if data is None:
            (step / name).unlink()
        else:
            (step / name).write_bytes(data)
    return copy


def _file(c: Ctx, name: str, data: bytes) -> Path:
    path = c.tmp / name
    path.write_bytes(data)
    return path


def _unreadable(c: Ctx, path: Path) -> Path:
    """`path` made unreadable: by its mode for a normal user, by a failing open for root."""
    if os.geteuid() != 0:
        path.chmod(0)
        return path
    real_open = builtins.open

    def refuse(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(file, *args, **kwargs)

    for module in (builtins, verify):
        c.monkeypatch.setattr(module, "open", refuse, raising=False)
    c.monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: refuse(self) if self == path else real_read(self))
    return path


def real_read(path: Path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _unreadable_shard(c: Ctx) -> Path:
    copy = Path(shutil.copytree(c.data, c.tmp / "data-unreadable"))  # a new copy: verified afresh
    _unreadable(c, copy / "train-00000.bin")
    return copy


def _grid(c: Ctx, out_dir: Path | None = None) -> Path:
    base = {"model": helpers.TINY_MODEL, "data": {"dir": str(c.data)}, "train": {**helpers.TINY_TRAIN, **TRAIN}}
    out = str(out_dir or c.tmp / "sweep")
    return _file(c, "grid.yaml", json.dumps({"out_dir": out, "base": base, "axes": {"seed": [17]}}).encode())


def _warns_then_fails(c: Ctx) -> list[str]:
    """A command that raises a torch-style UserWarning before it finds the bad argument."""
    from tango_lm.train import config

    real = config.apply_overrides

    def noisy(*args, **kwargs):
        warnings.warn("TypedStorage is deprecated", UserWarning, stacklevel=1)
        return real(*args, **kwargs)

    c.monkeypatch.setattr(config, "apply_overrides", noisy)
    return c.train("model.arch=nope")


BAD = {
    # generate
    "prompt_not_utf8": lambda c: ["generate", str(c.run), "--prompt", "ab\udcffc", "--max-new-tokens", "2"],
    "temperature_nan": lambda c: c.generate("--temperature", "nan"),
    "temperature_inf": lambda c: c.generate("--temperature", "inf"),
    "temperature_denormal": lambda c: c.generate("--temperature", "1e-310"),
    "temperature_negative": lambda c: c.generate("--temperature", "-0.5"),
    "num_samples_zero": lambda c: c.generate("--num-samples", "0"),
    "num_samples_negative": lambda c: c.generate("--num-samples", "-3"),
    "max_new_tokens_negative": lambda c: c.generate("--max-new-tokens", "-1"),
    "max_new_tokens_past_context": lambda c: c.generate("--max-new-tokens", "31"),
    "top_k_zero": lambda c: c.generate("--top-k", "0"),
    "top_k_negative": lambda c: c.generate("--top-k", "-5"),
    "top_p_nan": lambda c: c.generate("--top-p", "nan"),
    "seed_past_64_bits": lambda c: c.generate("--seed", str(2**64)),
    "device_without_cuda": lambda c: _without_cuda(c, c.generate("--device", "cuda")),
    "prompt_longer_than_context": lambda c: ["generate", str(c.run), "--prompt", "a" * 40],
    "num_samples_not_a_number": lambda c: c.generate("--num-samples", "many"),
    "generate_without_prompt": lambda c: ["generate", str(c.run)],
    "generate_samples_past_memory": lambda c: [
        *("generate", str(c.run), "--prompt", "a", "--num-samples", "100000000000", "--max-new-tokens", "1")
    ],
    # checkpoints whose config.json is not a run config
    "checkpoint_config_without_model": lambda c: [
        "generate",
        str(_checkpoint_with_config(c, {"train": {}})),
        "--prompt",
        "a",
    ],
    "checkpoint_config_is_a_list": lambda c: ["eval", str(_checkpoint_with_config(c, ["model"])), "--split", "dev"],
    "checkpoint_config_only_model": lambda c: [
        "eval",
        str(_checkpoint_with_config(c, _model_only(c))),
        "--split",
        "dev",
    ],
    "checkpoint_meta_without_step": lambda c: ["eval", str(_checkpoint_without_step(c)), "--split", "dev"],
    # it said "is corrupt (JSONDecodeError)", naming no file; one not UTF-8 ended in a traceback
    "checkpoint_meta_not_json": lambda c: ["eval", str(_checkpoint_with_meta(c, b'{"step": 3')), "--split", "dev"],
    "checkpoint_meta_not_utf8": lambda c: ["eval", str(_checkpoint_with_meta(c, b"\xff{}")), "--split", "dev"],
    "checkpoint_without_tokenizer": lambda c: [
        *("generate", str(_checkpoint_with_meta(c, None, "tokenizer.json")), "--prompt", "a")
    ],
    # numbers that cannot train
    "lr_inf": lambda c: c.train("train.lr=.inf"),
    "lr_nan": lambda c: c.train("train.lr=.nan"),
    "init_std_nan": lambda c: c.train("model.init_std=.nan"),
    "norm_eps_negative": lambda c: c.train("model.norm_eps=-1"),
    "rope_theta_zero": lambda c: c.train("model.rope_theta=0"),
    "lr_overflows_float": lambda c: c.train("train.lr=" + "9" * 400),
    "width_beyond_memory": lambda c: c.train("model.width=100000000000"),
    # a looped model's depth costs no parameters: 1e9 filled the memory, 1e20 overflowed in a forward
    "depth_beyond_memory": lambda c: c.train("model.depth=1000000000"),
    "depth_past_64_bits": lambda c: c.train("model.depth=1e20"),
    "tokens_per_param_past_64_bits": lambda c: [*c.without_steps(), "train.tokens_per_param=1e30"],  # endless
    "tokens_per_param_past_a_float": lambda c: [*c.without_steps(), "train.tokens_per_param=1e308"],
    "window_past_64_bits": lambda c: c.train("model.arch=tango-windowed", "model.window=1e20"),
    "max_nonfinite_steps_negative": lambda c: c.train("train.max_nonfinite_steps=-1"),
    # config files
    "binary_yaml": lambda c: ["train", str(_file(c, "weights.yaml", bytes(range(256)) * 4))],
    "yaml_number_key": lambda c: ["train", str(_file(c, "k.yaml", b"train: {steps: 5, 1: 2}\n"))],
    "yaml_mixed_keys": lambda c: ["params", str(_file(c, "k.yaml", b"model: {arch: tango, 2: 3, zz: 1}\n"))],
    "yaml_boolean_key": lambda c: ["train", str(_file(c, "k.yaml", b"train: {on: 5}\n"))],
    "unreadable_yaml": lambda c: ["train", str(_unreadable(c, _file(c, "locked.yaml", b"model: {arch: tango}\n")))],
    "config_name_with_newline": lambda c: ["train", str(c.tmp / "two\nlines.yaml")],
    "config_name_with_escape": lambda c: ["params", str(c.tmp / "\x1b[31mred.yaml")],
    # data
    "unreadable_shard": lambda c: c.train(f"data.dir={_unreadable_shard(c)}"),
    "max_docs_negative": lambda c: c.prepare(str(_file(c, "doc.txt", b"some text")), "--max-docs", "-1"),
    "max_docs_zero": lambda c: c.prepare(str(_file(c, "doc.txt", b"some text")), "--max-docs", "0"),
    "empty_input": lambda c: c.prepare(str(_file(c, "empty.txt", b""))),
    "whitespace_input": lambda c: c.prepare(str(_file(c, "blank.txt", b"  \n\n \t\n"))),
    "tokenizer_max_docs_negative": lambda c: [
        "data",
        "train-tokenizer",
        "--input",
        str(_file(c, "t.txt", b"ab ab")),
        "--vocab-size",
        "300",
        "--out",
        str(c.tmp / "tok.json"),
        "--max-docs",
        "-1",
    ],
    "verify_missing_dataset": lambda c: ["data", "verify", str(c.tmp / "nothing-here")],
    "eval_negative_windows": lambda c: ["eval", str(c.run), "--windows", "-1"],
    "eval_zero_stride": lambda c: ["eval", str(c.run), "--ppl", str(_file(c, "p.txt", b"some text")), "--stride", "0"],
    "eval_ppl_directory": lambda c: ["eval", str(c.run), "--ppl", str(c.tmp)],
    "eval_ppl_device_file": lambda c: ["eval", str(c.run), "--ppl", os.devnull],
    "eval_empty_split": lambda c: ["eval", str(c.run), "--split", ""],
    "code_max_file_bytes_zero": lambda c: [
        *("data", "prepare", "code", str(_file(c, "m.py", b"x = 1\n"))),
        *("--out", str(c.tmp / "new-data"), "--tokenizer", "byte", "--max-file-bytes", "0"),
    ],
    "yaml_number_for_a_path": lambda c: c.train("data.test_split=2024"),
    "test_split_is_train": lambda c: c.train("data.test_split=train"),
    # an unset shell variable: the current directory (quickstart generated its data and runs there);
    # run from tmp, so that a regression writes where the snapshot sees it, not into the checkout
    "quickstart_out_empty": lambda c: c.monkeypatch.chdir(c.tmp) or ["quickstart", "--out", ""],
    "export_hf_empty": lambda c: c.monkeypatch.chdir(c.tmp) or ["export", str(c.run), "--hf", " "],
    "prepare_out_empty": lambda c: c.monkeypatch.chdir(c.tmp) or ["data", "prepare", "text", "--out", "", str(c.tmp)],
    "dev_split_is_train": lambda c: c.train("data.train_split=dev"),
    "yaml_bool_for_a_string": lambda c: c.train("train.precision=off"),
    # loggers, serve, sweep launchers
    "logger_unknown": lambda c: c.train("train.loggers=[jsonl,mlflow]"),
    "loggers_without_jsonl": lambda c: c.train("train.loggers=[tensorboard]"),
    "serve_max_batch_size_zero": lambda c: ["serve", str(c.run), "--max-batch-size", "0"],
    "serve_threads_zero": lambda c: ["serve", str(c.run), "--threads", "0"],
    "serve_port_out_of_range": lambda c: ["serve", str(c.run), "--port", "70000"],
    "serve_batch_wait_inf": lambda c: ["serve", str(c.run), "--batch-wait-ms", "inf"],
    "serve_batch_wait_nan": lambda c: ["serve", str(c.run), "--batch-wait-ms", "nan"],
    "serve_missing_run": lambda c: ["serve", str(c.tmp / "no-run")],
    "sweep_slurm_flag_without_slurm": lambda c: ["sweep", str(_grid(c)), "--partition", "gpu"],
    "sweep_slurm_bad_time": lambda c: ["sweep", str(_grid(c)), "--launcher", "slurm", "--time", "soon"],
    "sweep_slurm_negative_gpus": lambda c: ["sweep", str(_grid(c)), "--launcher", "slurm", "--gpus-per-job", "-1"],
    "sweep_inside_a_dataset": lambda c: ["sweep", str(_grid(c, c.data / "sweep"))],
    # bench: every option checked before the first suite runs (a late one would waste the earlier suites)
    "bench_steps_zero": lambda c: ["bench", "--steps", "0"],
    "bench_warmup_negative": lambda c: ["bench", "--warmup", "-1"],
    "bench_batch_size_zero": lambda c: ["bench", "--suite", "train", "--batch-size", "0"],
    "bench_threads_negative": lambda c: ["bench", "--threads", "-1"],
    "bench_decode_batches_empty": lambda c: ["bench", "--suite", "decode", "--decode-batches="],
    "bench_decode_batches_gap": lambda c: ["bench", "--suite", "decode", "--decode-batches", "1,,2"],
    "bench_decode_batches_zero": lambda c: ["bench", "--suite", "decode", "--decode-batches", "1,0"],
    "bench_archs_empty": lambda c: ["bench", "--archs="],
    "bench_decode_batches_repeated": lambda c: ["bench", "--suite", "decode", "--decode-batches=1,8,1"],
    "bench_windowed_lens_decreasing": lambda c: ["bench", "--suite", "windowed", "--windowed-lens=64,16"],
    "bench_windowed_heads": lambda c: ["bench", "--suite", "windowed", "--d-model", "48"],
    "bench_all_bad_memory_backbone": lambda c: ["bench", "--suite", "all", "--memory-backbone", "dens"],
    "bench_memory_device_without_cuda": lambda c: _without_cuda(c, ["bench", "--suite", "memory", "--device", "cuda"]),
    "bench_all_bad_head_backbone": lambda c: ["bench", "--suite", "all", "--head-backbone", "dens"],
    "bench_all_decode_tier_without_preset": lambda c: [
        "bench",
        "--suite",
        "all",
        "--depth",
        "2",
        "--decode-tier",
        "70m",
    ],
    # what comes before an error is not printed
    "warning_before_error": _warns_then_fails,
    "argparse_usage": lambda c: ["train", "--no-such-flag"],
    # commands without overrides are parsed from the top: the error named `tango-lm --help`
    "argparse_usage_eval": lambda c: ["eval", str(c.run), "--no-such-flag"],
    "argparse_usage_nested": lambda c: ["data", "prepare", "text", "in.txt", "--out", "o", "--field", "x"],
    "unknown_command": lambda c: ["trian"],
}


def _without_cuda(c: Ctx, argv: list[str]) -> list[str]:
    c.monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU machine, on any
    return argv


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_with_one_error_line(case, run, data_dir, tmp_path, capsys, monkeypatch):
    ctx = Ctx(data=data_dir, run=run, tmp=tmp_path, monkeypatch=monkeypatch)
    argv = BAD[case](ctx)
    before = helpers.snapshot(ctx.data, ctx.run, ctx.tmp)
    rc, out, err, leaked = helpers.run_main(capsys, argv)  # leaked: warnings the command line would print
    monkeypatch.undo()
    assert rc == 2, (out, err)
    assert leaked == []
    helpers.assert_one_error_line(err)
    assert out == ""
    with contextlib.suppress(FileNotFoundError):
        for p in ctx.tmp.rglob("*"):
            p.chmod(p.stat().st_mode | 0o600)
    assert helpers.snapshot(ctx.data, ctx.run, ctx.tmp) == before
    assert not ctx.new_out.exists() and not (ctx.tmp / "new-data").exists()


EXPECT = {
    "prompt_not_utf8": "--prompt is not valid UTF-8 (byte 0xff at character 2)",
    "temperature_nan": "temperature must be 0 (greedy decoding) or a number from 0.0001 to 3.403e+38 (got nan)",
    "temperature_denormal": "(got 1e-310)",
    "num_samples_zero": "--num-samples must be at least 1 (got 0)",
    "max_new_tokens_negative": "max_new_tokens (--max-new-tokens) must be a whole number of at least 0 (got -1)",
    "max_new_tokens_past_context": "a prompt of 3 tokens leaves room for 30 new tokens in the model's context of 32",
    "top_k_zero": "top_k must be a whole number of at least 1 (got 0)",
    "seed_past_64_bits": "seed must be a whole number between -2**63 and 2**64 - 1 (got 18446744073709551616)",
    "device_without_cuda": "CUDA is not available; use --device cpu",
    "serve_batch_wait_inf": "--batch-wait-ms must be between 0 and 60000 (got inf)",
    "prompt_longer_than_context": "the prompt has 40 tokens, more than the model's context of 32",
    "num_samples_not_a_number": "tango-lm generate: argument --num-samples: invalid int value: 'many'; see",
    "checkpoint_config_without_model": "has a config.json without a model section",
    "checkpoint_config_is_a_list": "has a config.json that is a list, not a mapping",
    "checkpoint_config_only_model": "has an incomplete config.json (no 'data'); it is corrupt",
    "checkpoint_meta_without_step": "has a meta.json without its step; it is corrupt",
    "checkpoint_meta_not_json": "has a meta.json that is not valid JSON (Expecting ',' delimiter at line 1 column 11); it",
    "checkpoint_meta_not_utf8": "has a meta.json that is not UTF-8 text (byte 0); it is corrupt, use another checkpoint",
    "checkpoint_without_tokenizer": "has no tokenizer.json; it is corrupt, use another checkpoint",
    "lr_inf": "train.lr must be a finite number (got inf)",
    "depth_beyond_memory": "model.depth=1,000,000,000 applications each keep their input for the backward",
    "depth_past_64_bits": "model.depth=100000000000000000000 does not fit in 64 bits",
    "tokens_per_param_past_64_bits": "train.tokens_per_param=1e+30 gives 1.29e+32 steps, which does not fit in 64",
    "tokens_per_param_past_a_float": "train.tokens_per_param=1e+308 gives inf steps, which does not fit in 64",
    "window_past_64_bits": "model.window=100000000000000000000 does not fit in 64 bits",
    "lr_nan": "train.lr must be a finite number (got nan)",
    "init_std_nan": "model.init_std must be a finite number (got nan)",
    "norm_eps_negative": "model.norm_eps must be above 0 (got -1.0)",
    "rope_theta_zero": "model.rope_theta must be above 0 (got 0.0)",
    "width_beyond_memory": "training keeps 16 bytes per parameter",
    "binary_yaml": "weights.yaml is not text (not UTF-8)",
    "yaml_number_key": "k.yaml has the key 1 in section 'train', which YAML read as a number, not a name",
    "yaml_mixed_keys": "k.yaml has the key 2 in section 'model', which YAML read as a number",
    "yaml_boolean_key": "has the key True in section 'train', which YAML read as a boolean, not a name",
    "unreadable_yaml": "cannot read config file",
    "config_name_with_newline": "two\\nlines.yaml does not exist",
    "config_name_with_escape": "\\x1b[31mred.yaml",
    "unreadable_shard": "cannot read shard",
    "max_docs_negative": "max_docs (--max-docs) must be at least 1, got -1",
    "empty_input": "the input holds no train documents (empty or whitespace-only), so no dataset was written",
    "warning_before_error": "unknown architecture 'nope'",
    "argparse_usage": "tango-lm train: unrecognized arguments: --no-such-flag; see `tango-lm train --help`",
    "argparse_usage_eval": "tango-lm eval: unrecognized arguments: --no-such-flag; see `tango-lm eval --help`",
    "argparse_usage_nested": "prepare text: unrecognized arguments: --field x; see `tango-lm data prepare text --help`",
    "eval_negative_windows": "--windows takes a positive number or 'all' (got '-1')",
    "eval_zero_stride": "--stride must be between 1 and the window length 32 (got 0)",
    "eval_ppl_directory": "is a directory; give a text file to --ppl",
    "eval_ppl_device_file": f"{os.devnull} is not a regular file; give a text file to --ppl",
    "eval_empty_split": "split '' is not in",
    "code_max_file_bytes_zero": "--max-file-bytes must be at least 1 (got 0)",
    "yaml_number_for_a_path": "YAML read it as a number: quote what you wrote",
    # the test NLL (or the dev NLL selecting the checkpoint) would be of training text
    # ran until the kernel's OOM killer ended it, or a traceback from the allocator
    "generate_samples_past_memory": "100,000,000,000 rows of 2 positions need at least",
    "quickstart_out_empty": "argument --out: an empty path; give a file or directory",
    "export_hf_empty": "argument --hf: an empty path",
    "prepare_out_empty": "argument --out: an empty path",
    "test_split_is_train": "data.test_split is 'train', the training split: its NLL would be of training text",
    "dev_split_is_train": "data.dev_split is 'dev', the training split",
    "yaml_bool_for_a_string": "YAML read a bare on/off/yes/no/true/false as a boolean: quote what you wrote",
    "bench_warmup_negative": "--warmup must be 0 or more (got -1)",
    "sweep_inside_a_dataset": "sweep is inside the prepared dataset",
    "bench_decode_batches_empty": "--decode-batches must list positive integers (got '')",
    "bench_decode_batches_gap": "argument --decode-batches: expected comma-separated integers, got '1,,2'",
    "bench_decode_batches_zero": "--decode-batches must list positive integers (got '1,0')",
    "bench_archs_empty": "argument --archs: expected comma-separated architecture names, got ''",
    "bench_decode_batches_repeated": "--decode-batches lists a value twice (got '1,8,1')",
    "bench_windowed_lens_decreasing": "--windowed-lens must be in increasing order (got '64,16')",
    "bench_windowed_heads": "--d-model must be a multiple of 32",
    "bench_all_bad_memory_backbone": "no preset or file named 'dens'",
    "bench_all_bad_head_backbone": "no preset or file named 'dens'",
    "bench_all_decode_tier_without_preset": "has no preset loop-transformer-70m-d2",
}


def test_error_messages_say_what_to_change(run, data_dir, tmp_path, capsys, monkeypatch):
    for case, needle in EXPECT.items():
        with monkeypatch.context() as m:
            ctx = Ctx(data=data_dir, run=run, tmp=tmp_path / case, monkeypatch=m)
            ctx.tmp.mkdir()
            assert main(BAD[case](ctx)) == 2, case
        line = helpers.assert_one_error_line(capsys.readouterr().err)
        assert needle in line, (case, line)


def test_a_prompt_filling_the_context_still_gets_its_token(run, capsys):
    """Only the last new token needs no room: 32 prompt tokens in a context of 32 get one more.
    The default of 64 new tokens is clipped to that room, with a note; the warning is printed
    because the command succeeded."""
    assert main(["generate", str(run), "--prompt", "b" * 32, "--temperature", "0", "--no-stop", "--json"]) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["completions"][0].encode()) == 1
    assert captured.err == (
        "note: at most 1 new token (not 64): the prompt's 32 tokens fill the rest of the model's context of 32\n"
    )
    assert (
        main(
            [
                "generate",
                str(run),
                "--prompt",
                "b" * 31,
                "--max-new-tokens",
                "2",
                "--temperature",
                "0",
                "--no-stop",
                "--json",
            ]
        )
        == 0
    )
    assert len(json.loads(capsys.readouterr().out)["completions"][0].encode()) == 2
    # --json shows the prompt the model continued (\n a newline), as the plain output does.
    assert main(["generate", str(run), "--prompt", "a\\nb", "--max-new-tokens", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt"] == "a\nb"


def test_generate_draws_only_the_tokenizers_ids(run, capsys, monkeypatch):
    # A model's table may be padded past its tokenizer (GPT-2: 50257 ids in 50304 rows).
    from tango_lm.serve import generate as generate_module

    seen = []
    real = generate_module.generate
    monkeypatch.setattr(generate_module, "generate", lambda *a, **kw: seen.append(kw["vocab_size"]) or real(*a, **kw))
    assert main(["generate", str(run), "--prompt", "ab", "--max-new-tokens", "2"]) == 0
    assert seen == [257]  # the byte tokenizer's


def test_generate_from_an_empty_prompt_starts_a_document(run, capsys, monkeypatch):
    # As the server's: the end-of-text token alone (it was an error).
    from tango_lm.serve import generate as generate_module

    prompts = []
    real = generate_module.generate
    monkeypatch.setattr(
        generate_module, "generate", lambda m, p, *a, **kw: prompts.append(p.tolist()) or real(m, p, *a, **kw)
    )
    argv = ["generate", str(run), "--prompt", "", "--max-new-tokens", "3", "--temperature", "0", "--no-stop", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert prompts == [[[256]]] and out["prompt"] == "" and len(out["completions"]) == 1  # the byte tokenizer's EOT


def test_generate_eager_skips_the_static_steps(run, capsys, monkeypatch):
    # --eager: the eager cached forward on CUDA too (no compile wait for a short answer).
    from tango_lm.serve import generate as generate_module

    seen = []
    real = generate_module.generate
    monkeypatch.setattr(generate_module, "generate", lambda *a, **kw: seen.append(kw["static"]) or real(*a, **kw))
    texts = []
    for flags in ([], ["--eager"]):
        argv = ["generate", str(run), "--prompt", "ab", "--max-new-tokens", "2", "--temperature", "0", "--json"]
        assert main([*argv, *flags]) == 0
        texts.append(json.loads(capsys.readouterr().out)["completions"])
    assert seen == ["auto", None] and texts[0] == texts[1]


def test_warnings_of_a_command_that_succeeds_are_still_printed(capsys, monkeypatch):
    from tango_lm.cli import config

    def noisy(args):
        warnings.warn("something worth knowing", UserWarning, stacklevel=1)
        print("done")

    monkeypatch.setattr(config, "cmd_presets", noisy)
    with warnings.catch_warnings(record=True) as shown:
        assert main(["presets"]) == 0
    assert capsys.readouterr().out == "done\n"
    assert [str(w.message) for w in shown] == ["something worth knowing"]


def test_an_option_is_named_as_python_and_the_command_line_spell_it():
    from tango_lm.errors import option

    assert option("max_docs") == "max_docs (--max-docs)" and option("tokens") == "tokens (--tokens)"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["params", "tango-70m-d4", "train.warmup_step=3"],
            "unknown field train.warmup_step (did you mean 'warmup_steps'?)",
        ),
        (["params", "tango-70m-d4", "model.widht=3"], "unknown model field 'widht' (did you mean 'width'?)"),
        (["params", "tango-70m-d4", "model.arch=tnago"], "unknown architecture 'tnago' (did you mean 'tango'?)"),
        (["params", "tango-70m-d4", "model.head=onnoa"], "unknown head 'onnoa' (did you mean 'onona'?)"),
        (["params", "tango-160m-d44"], "no preset or file named 'tango-160m-d44' (did you mean 'tango-160m-d4'?)"),
        (["params", "tango"], "no preset or file named 'tango'; model.arch=tango names the architecture"),
        (["params", "tango-70m-d4", "model.zzz=1"], "unknown model field 'zzz'; known fields are"),  # nothing close
        (["params", "tango-70m-d4", "trian.lr=3"], "names unknown section 'trian' (did you mean 'train'?)"),
        (["params", "tango-70m-d4", "widht=3"], "no section has a field 'widht' (did you mean model.width?)"),
    ],
)
def test_a_mistyped_name_is_answered_with_the_closest_one(capsys, argv, said):
    rc, _, err, _ = helpers.run_main(capsys, argv)
    assert rc == 2 and said in helpers.assert_one_error_line(err)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["trian"], "invalid choice: 'trian' (choose from "),
        (["data", "prepare", "jsnl", "x"], "invalid choice: 'jsnl' (choose from "),
        (["eval", "run", "--format", "lambda"], "invalid choice: 'lambda' (choose from "),
    ],
)
def test_a_mistyped_command_or_choice_is_answered_with_the_closest_one(capsys, argv, said):
    rc, _, err, _ = helpers.run_main(capsys, argv)
    line = helpers.assert_one_error_line(err)
    meant = {"trian": "train", "jsnl": "jsonl", "lambda": "lambada"}[said.split("'")[1]]
    assert rc == 2 and said in line and f"(did you mean '{meant}'?); see `tango-lm" in line


def test_the_closest_choice_is_found_in_either_argparse_spelling():
    from tango_lm.cli.output import Parser
    from tango_lm.errors import UserError

    for listed in ("'train', 'eval'", "train, eval"):  # Python 3.11 quotes the choices, 3.12 does not
        with pytest.raises(UserError, match=r"\(did you mean 'train'\?\)"):
            Parser(prog="p").error(f"argument command: invalid choice: 'trian' (choose from {listed})")


def test_typos_in_sections_grid_keys_axis_values_and_bench_archs_get_the_closest_name(tmp_path, capsys):
    # The README promises the closest name for a mistyped section, architecture, head, sweep axis
    # or slurm setting; these sites listed the choices only (and `modle: 1` said "must be a mapping").
    import yaml

    from tango_lm.cli import main

    for text in ("modle: {arch: tango}\n", "modle: 1\n"):
        (tmp_path / "s.yaml").write_text(text)
        assert main(["params", str(tmp_path / "s.yaml")]) == 2
        assert "unknown config section 'modle' (did you mean 'model'?)" in helpers.assert_one_error_line(
            capsys.readouterr().err
        )
    grid = {"out_dir": str(tmp_path / "sw"), "base": {"model": {"vocab_size": 257}}, "axes": {"arch": ["tangoo"]}}
    cases = (
        (grid, "unknown arch 'tangoo' (did you mean 'tango'?)"),
        ({**grid, "axes": {"head": ["onnona"]}}, "unknown head 'onnona' (did you mean 'onona'?)"),
        ({"bse": {}, **grid}, "unknown key 'bse' (did you mean 'base'?)"),
        ({**grid, "axes": {"seed": [1]}, "slurm": {"partiton": "gpu"}}, "unknown slurm setting 'partiton' (did you"),
    )
    for spec, said in cases:
        (tmp_path / "g.yaml").write_text(yaml.safe_dump(spec))
        assert main(["sweep", str(tmp_path / "g.yaml"), "--dry-run"]) == 2  # the local launcher too
        assert said in helpers.assert_one_error_line(capsys.readouterr().err)
    assert main(["bench", "--archs", "tangoo", "--quiet"]) == 2
    assert "unknown architecture 'tangoo' (did you mean 'tango'?)" in helpers.assert_one_error_line(
        capsys.readouterr().err
    )


@pytest.mark.parametrize("command", ["eval", "generate", "serve", "export", "resume"])
def test_a_flipped_bit_in_the_weights_is_one_line_for_every_command_that_loads_them(run, tmp_path, capsys, command):
    # The README promises it for --resume, eval, generate, serve and export; the tests loaded the
    # checkpoint directly. A flipped bit loads as a valid number: only the recorded sha256 tells.
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    weights = helpers.step_dir(copy, 2) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10
    weights.write_bytes(bytes(data))
    before = helpers.snapshot(copy)
    argv = {
        "eval": ["eval", str(copy), "--split", "dev"],
        "generate": ["generate", str(copy), "--prompt", "abc", "--max-new-tokens", "2"],
        "serve": ["serve", str(copy), "--port", "0"],
        "export": ["export", str(copy), "--hf", str(tmp_path / "hf")],
        "resume": ["train", str(copy), "--resume", "train.steps=4", "--no-progress"],
    }[command]
    assert main(argv) == 2
    line = helpers.assert_one_error_line(capsys.readouterr().err)
    assert "model.safetensors" in line and "sha256" in line, line
    assert helpers.snapshot(copy) == before and not (tmp_path / "hf").exists()
