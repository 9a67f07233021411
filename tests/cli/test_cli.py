"""The `tango-lm` command line: results of params/match/eval/train, and bad input (exit code 2,
one `error:` line, no traceback, nothing on disk touched)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from tango_lm.cli import build_parser, main
from tango_lm.eval.evaluate import evaluate_checkpoint
from tango_lm.models.config import ModelConfig
from tango_lm.models.model import build_model
from tests import helpers

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory):
    return helpers.synthetic_gpt2_dataset(tmp_path_factory)


TRAIN = {"steps": 4, "save_every": 2, "eval_every": 2, "test_windows": 3}


@pytest.fixture(scope="module")
def cli_run(data_dir, tmp_path_factory):
    """A finished tiny run trained through `tango-lm train --json`; (run dir, printed summary)."""
    out = tmp_path_factory.mktemp("cli") / "run"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["train", *helpers.cli_overrides(data_dir, out, **TRAIN), "--json"])
    assert rc == 0
    return out, json.loads(buf.getvalue())


def _run_json(capsys, argv: list[str]) -> dict:
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)


# -- train / eval ------------------------------------------------------------------------------
def test_train_json_prints_the_summary(cli_run):
    out, summary = cli_run
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["tokens"] == 4 * 4 * 32
    assert summary["arch"] == "tango" and summary["params_total"] == 16480
    assert summary["out_dir"] == str(out)
    assert math.isfinite(summary["test_nll"]) and summary["test_tokens"] == 3 * 32  # train.test_windows
    assert [r["step"] for r in helpers.loss_records(out)] == [1, 2, 3, 4]


def test_train_text_output(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *helpers.cli_overrides(data_dir, out, steps=2, eval_every=2, save_every=2)]) == 0
    text = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert "test NLL" in text and f"{summary['test_nll']:.4f}" in text
    header, _, row = text.splitlines()[:3]
    assert header.split()[:3] == ["arch", "head", "params"] and row.split()[:2] == ["tango", "standard"]
    assert f"run directory: {out} (dev and test NLL of the checkpoint of step {summary['selected_step']})" in text


def test_a_run_directory_is_a_config_whose_out_dir_is_that_directory(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *helpers.cli_overrides(data_dir, out, steps=2, eval_every=2, save_every=2)]) == 0
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    # `train RUN --resume` continues RUN itself, also a copy whose config names the old place
    assert main(["train", str(moved), "--resume", "train.steps=4"]) == 0
    assert helpers.step_names(moved)[-1] == "step-00000004" and helpers.step_names(out)[-1] == "step-00000002"
    rc, _, err, _ = helpers.run_main(capsys, ["train", str(out)])
    assert rc == 2 and "already holds a run" in helpers.assert_one_error_line(err)
    assert main(["train", str(out), f"train.out_dir={tmp_path / 'twin'}", "train.steps=2"]) == 0  # its twin
    assert json.loads((tmp_path / "twin" / "summary.json").read_text())["test_nll"] == pytest.approx(
        json.loads((out / "summary.json").read_text())["test_nll"]
    )
    assert main(["params", str(out)]) == 0 and "16,480" in capsys.readouterr().out
    rc, _, err, _ = helpers.run_main(capsys, ["train", str(data_dir)])
    assert rc == 2 and "is a directory but not a run directory" in helpers.assert_one_error_line(err)
    # A config.yaml cut short (a full disk) is said, never read as the defaults; the fix it names works.
    (moved / "config.yaml").write_text("")
    rc, _, err, _ = helpers.run_main(capsys, ["params", str(moved)])
    fix = f"cp {moved}/config.json {moved / 'config.yaml'}"
    assert rc == 2 and helpers.assert_one_error_line(err).endswith(
        f"is empty (cut short, say by a full disk); the config.json beside it holds the same config, and JSON is YAML: {fix}"
    )
    # Damaged (bytes that are not text, or YAML that does not parse): the same fix, not "give a YAML file".
    for damage in (bytes(range(128, 256)), b"model: {arch: tango\n"):
        (moved / "config.yaml").write_bytes(damage)
        rc, _, err, _ = helpers.run_main(capsys, ["params", str(moved)])
        assert rc == 2 and helpers.assert_one_error_line(err).endswith(f"and JSON is YAML: {fix}"), err
    shutil.copy(moved / "config.json", moved / "config.yaml")
    assert main(["params", str(moved)]) == 0 and "16,480" in capsys.readouterr().out
    # A sweep's run directories have '=' in their names: still a run, not an override.
    swept = tmp_path / "sweep" / "arch=tango" / "seed=1-2"
    shutil.copytree(moved, swept)
    assert main(["params", str(swept)]) == 0 and "16,480" in capsys.readouterr().out
    assert main(["train", str(swept), "--resume", "train.steps=6"]) == 0
    assert helpers.step_names(swept)[-1] == "step-00000006"


def test_a_run_trained_without_a_terminal_keeps_its_own_progress_setting(data_dir, tmp_path, capsys):
    """No terminal (or --no-progress) turns this command's bar off; it was written into the run's
    config as train.progress=false, so the run resumed on a terminal never drew a bar again."""
    out = tmp_path / "run"
    assert main(["train", *helpers.cli_overrides(data_dir, out, steps=2, progress=True), "--no-progress"]) == 0
    assert json.loads((out / "config.json").read_text())["train"]["progress"] is True
    assert "progress: true" in (out / "config.yaml").read_text()
    assert main(["train", *helpers.cli_overrides(data_dir, tmp_path / "quiet", steps=2, progress=False)]) == 0
    assert json.loads((tmp_path / "quiet" / "config.json").read_text())["train"]["progress"] is False  # the user's


def test_resuming_from_another_folder_than_a_relative_data_dir_says_to_pass_data_dir(
    data_dir, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    monkeypatch.chdir(data_dir.parent)
    assert main(["train", *helpers.cli_overrides(data_dir.name, out, steps=2, eval_every=2, save_every=2)]) == 0
    monkeypatch.chdir(tmp_path)
    rc, _, err, _ = helpers.run_main(capsys, ["train", str(out), "--resume", "train.steps=4"])
    assert rc == 2 and helpers.assert_one_error_line(err) == (
        f"error: the run's dataset {data_dir.name} (its data.dir, relative) is not under {tmp_path}; resume from the "
        "folder it trained in, or pass data.dir=DIR (the same tokens anywhere resume)"
    )
    assert main(["train", str(out), "--resume", "train.steps=4", f"data.dir={data_dir}"]) == 0
    assert helpers.step_names(out)[-1] == "step-00000004"


@pytest.mark.parametrize(
    ("stop", "continues", "left_beside"),
    [
        (2, "from the start (no checkpoint was saved yet)", False),
        (5, "from its checkpoint of step 4", False),
        (5, "from its checkpoint of step 4", True),  # a kill's copy of step 4 beside its place: resume puts it back
    ],
)
def test_an_interrupted_train_says_how_to_continue(
    data_dir, tmp_path, capsys, monkeypatch, stop, continues, left_beside
):
    from tango_lm.train.trainer import Trainer

    original = Trainer.train_step

    def train_step(self):
        if self.step == stop:
            if left_beside:
                step = self.ckpt_root / "step-00000004"
                step.rename(step.with_name(".tmp-step-00000004-77"))
            raise KeyboardInterrupt  # Ctrl-C
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    out = tmp_path / "my run"  # the command is quoted for a shell
    rc, _, err, _ = helpers.run_main(capsys, ["train", *helpers.cli_overrides(data_dir, out, steps=8)])
    assert rc == 130
    command = f"tango-lm train '{out}' --resume"
    assert err.strip().splitlines()[-1] == f"interrupted; `{command}` continues the run {continues}"
    monkeypatch.setattr(Trainer, "train_step", original)
    assert main(shlex.split(command)[1:]) == 0 and helpers.step_names(out)[-1] == "step-00000008"


def test_a_train_interrupted_before_its_config_is_written_says_the_command_as_given(
    data_dir, tmp_path, capsys, monkeypatch
):
    # It said `train RUN --resume`: no such run yet (stopped while the model was built), or the
    # run's old config without this command's train.steps=12 (a resume stopped as early).
    from tango_lm.train.trainer import Trainer

    original = Trainer.__init__

    def ctrl_c(self, *args, **kwargs):
        raise KeyboardInterrupt

    out = tmp_path / "run"
    argv = ["train", *helpers.cli_overrides(data_dir, out, steps=4)]
    for first in (argv, ["train", str(out), "--resume", "train.steps=12"]):
        monkeypatch.setattr(Trainer, "__init__", ctrl_c)
        rc, _, err, _ = helpers.run_main(capsys, first)
        assert rc == 130
        command = err.strip().splitlines()[-1].split("`")[1]
        assert command == "tango-lm " + shlex.join([*(a for a in first if a != "--resume"), "--resume"])
        monkeypatch.setattr(Trainer, "__init__", original)
        assert main(shlex.split(command)[1:]) == 0
    assert helpers.step_names(out)[-1] == "step-00000012"


def test_an_interrupted_torchrun_says_to_relaunch_it_and_only_rank_0_says_it(data_dir, tmp_path, capsys, monkeypatch):
    from tango_lm.train.trainer import Trainer

    def ctrl_c(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "__init__", ctrl_c)  # before any process group forms
    argv = ["train", *helpers.cli_overrides(data_dir, tmp_path / "run", steps=8)]
    for rank, line in (
        (
            0,  # the run directory holds no config yet: the command as given
            f"interrupted; `tango-lm {shlex.join([*argv, '--resume'])}`, launched by torchrun as this run "
            "was (2 processes), continues the run from the start (no checkpoint was saved yet)",
        ),
        (1, "interrupted"),
    ):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        rc, _, err, _ = helpers.run_main(capsys, argv)
        assert rc == 130 and err.strip().splitlines()[-1] == line


def test_train_from_yaml_file_with_overrides(data_dir, tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": helpers.TINY_MODEL,
                "data": {"dir": str(data_dir)},
                "train": {**helpers.TINY_TRAIN, "out_dir": str(tmp_path / "run"), "steps": 99},
            }
        )
    )
    summary = _run_json(capsys, ["train", str(cfg), "train.steps=2", "eval_every=1", "--json"])
    assert summary["steps"] == 2
    assert [r["step"] for r in helpers.dev_records(tmp_path / "run")] == [1, 2]  # bare key went to train


def test_train_resume_flag_continues(cli_run, data_dir, tmp_path, capsys):
    out = shutil.copytree(cli_run[0], tmp_path / "run")
    summary = _run_json(
        capsys, ["train", *helpers.cli_overrides(data_dir, out, **{**TRAIN, "steps": 6}), "--resume", "--json"]
    )
    assert summary["steps"] == 6
    assert [r["step"] for r in helpers.loss_records(out)] == [1, 2, 3, 4, 5, 6]


def test_eval_json_fields(cli_run, capsys):
    out, summary = cli_run
    best = json.loads((out / "best.json").read_text())["step"]
    res = _run_json(capsys, ["eval", str(out), "--split", "dev", "--json"])
    assert set(res) == {"checkpoint", "step", "split", "nll", "tokens", "windows"}
    assert res["split"] == "dev" and res["step"] == best and res["windows"] == 8
    assert res["checkpoint"] == str(helpers.step_dir(out, best))
    # the run's own dev windows by default (8 of the 9), so eval reproduces the logged best dev NLL
    assert res["tokens"] == 8 * 32 and res["nll"] == pytest.approx(summary["best_dev_nll"], rel=1e-6)
    assert res["nll"] == evaluate_checkpoint(str(out), "dev")["nll"]
    every = _run_json(capsys, ["eval", str(out), "--split", "dev", "--windows", "all", "--json"])
    assert every["tokens"] == 9 * 32 and every["windows"] == 9
    # more windows than the split has: every one scored, and said (it was silent)
    rc, stdout, err, _ = helpers.run_main(capsys, ["eval", str(out), "--split", "dev", "--windows", "100", "--json"])
    assert rc == 0 and json.loads(stdout)["windows"] == 9
    assert "note: --windows 100: the split has 9, all of them scored" in err
    assert 0 < res["nll"] < 10
    test = _run_json(capsys, ["eval", str(out), "--json"])
    assert test["split"] == "test" and test["tokens"] == 3 * 32  # the run's test_windows
    if summary["selected_step"] == best:
        assert test["nll"] == summary["test_nll"]
    few = _run_json(capsys, ["eval", str(helpers.step_dir(out, 2)), "--split", "dev", "--windows", "2", "--json"])
    assert few["step"] == 2 and few["tokens"] == 2 * 32


def test_eval_text_output(cli_run, capsys):
    out, _ = cli_run
    assert main(["eval", str(out), "--split", "dev"]) == 0
    res = evaluate_checkpoint(str(out), "dev")
    assert capsys.readouterr().out.startswith(f"dev NLL {res['nll']:.4f} nats/token over {res['tokens']:,} tokens")


# -- params / match ----------------------------------------------------------------------------
def test_params_from_overrides_only_matches_numel(capsys):
    res = _run_json(capsys, ["params", "arch=tango", "d_model=64", "width=128", "vocab_size=257", "--json"])
    model = build_model(ModelConfig(arch="tango", d_model=64, width=128, vocab_size=257))
    total = sum(p.numel() for p in model.parameters())
    embed = sum(p.numel() for n, p in model.named_parameters() if "embed" in n)
    assert embed == 257 * 64
    assert res["total"] == total and res["non_embedding"] == total - embed
    assert (res["arch"], res["d_model"], res["width"], res["vocab_size"]) == ("tango", 64, 128, 257)


def test_params_give_the_parameters_one_token_uses(capsys):
    # MoE presets match Dense's *active* parameters (docs/design.md §4.3), a count only Python had.
    argv = ["params", "arch=moe", "d_model=32", "width=64", "depth=2", "n_experts=4", "moe_top_k=2", "head=mos"]
    res = _run_json(capsys, [*argv, "vocab_size=50", "--json"])
    model = build_model(ModelConfig(arch="moe", head="mos", d_model=32, width=64, depth=2, n_experts=4, moe_top_k=2))
    idle = [p.numel() for n, p in model.named_parameters() if re.search(r"\.experts\.[23]\.", n)]  # E - k of them
    assert len(idle) == 2 * 2 * 3 and res["active_non_embedding"] == res["non_embedding"] - sum(idle)
    assert main([*argv, "vocab_size=50"]) == 0
    assert f"  active        {res['active_non_embedding']:>15,}  (non-embedding parameters one token uses)" in (
        capsys.readouterr().out
    )
    res = _run_json(capsys, ["params", "arch=tango", "d_model=32", "width=64", "--json"])
    assert res["active_non_embedding"] == res["non_embedding"]
    assert main(["params", "arch=tango", "d_model=32", "width=64"]) == 0
    assert "active" not in capsys.readouterr().out


def test_params_flops_are_at_the_training_length(capsys):
    # As train logs them: at train.seq_len when it is shorter than the context (it used the context).
    argv = ["params", "arch=tango", "d_model=64", "width=128", "model.context_length=64", "train.seq_len=48", "--json"]
    res = _run_json(capsys, argv)
    assert res["flops_per_token"] == ModelConfig(
        arch="tango", d_model=64, width=128, context_length=64
    ).flops_per_token(48)


def test_params_of_preset(capsys):
    res = _run_json(capsys, ["params", "tango-70m-d4", "--json"])
    assert res["total"] == 70002176 and res["non_embedding"] == 44270592
    res = _run_json(capsys, ["params", "tango-70m-d4", "model.width=28144", "--json"])
    expected = ModelConfig(arch="tango", d_model=512, width=28144, depth=4, vocab_size=50257).num_params()
    assert res["total"] == expected["total"] != 70002176


def test_every_option_of_every_command_says_what_it_does_in_help():
    # `--help` is where a user looks first; 61 options once showed a bare name there.
    assert helpers.arguments_without_help(build_parser(), "tango-lm") == []


def test_every_option_with_a_default_says_it_in_help(capsys):
    # 25 did not: serve --port, generate --temperature, data prepare --dev-fraction, bench --vocab-size, ...
    assert helpers.options_without_their_default(build_parser(), "tango-lm") == []
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "0 picks a free port (the address is printed) (default 8000)" in text
    assert "(default None)" not in text and "(default False)" not in text


def test_version_names_the_package_and_what_it_runs_on(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    line = capsys.readouterr().out.strip()
    pyproject = (helpers.ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, flags=re.M)[1]
    assert line.startswith(f"tango-lm {version} (Python ") and f"torch {torch.__version__}" in line
    assert "triton " in line and ("no CUDA device" in line) != torch.cuda.is_available()


def test_presets_describe_each_preset_in_a_whole_sentence(capsys):
    # The listing shows each file's first comment line; one that ended in ':' read as cut off.
    rows = _run_json(capsys, ["presets", "--json"])
    assert len(rows) >= 70 and {r["name"] for r in rows} >= {"dense-142m", "tango-70m-d4"}
    assert [r["name"] for r in rows if not r["about"].endswith(".")] == []


def test_presets_text_listing_heads_every_column(capsys):
    # The descriptions' column had a rule under it and no heading.
    assert main(["presets", "tango-70m"]) == 0
    header, rule = capsys.readouterr().out.splitlines()[:2]
    assert header.split() == ["preset", "arch", "params", "description"]
    assert len(rule.split()) == 4


def test_presets_train_on_the_datasets_the_readme_names():
    # The README tells where each family's data goes and the command that makes the TANGO presets'.
    from tango_lm.train.config import list_presets, load_run_config

    onona = {"dense", "gdn-hybrid", "moe", "attnres"}
    where = {}
    for name in list_presets():
        run = load_run_config(name, [])
        family = "dense-1b" if name == "dense-1b" else "onona" if run.model.arch in onona else "tango"
        where.setdefault(family, set()).add(run.data.dir)
    assert where == {
        "onona": {"data/climbmix-gpt2"},
        "dense-1b": {"data/climbmix-1b-gpt2"},
        "tango": {"data/dmmath-gpt2"},
    }
    readme = " ".join((helpers.ROOT / "README.md").read_text().split())
    assert "(`tango-lm data prepare dmmath --out data/dmmath-gpt2 --tokenizer gpt2`)" in readme
    assert "They train on `data/climbmix-gpt2` (`dense-1b` on `data/climbmix-1b-gpt2`)" in readme


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_presets_filter_that_matches_nothing_is_one_error_line(capsys, json_flag):
    # It printed an empty table with exit 0, which reads as "there are no presets".
    rc, out, err, _ = helpers.run_main(capsys, ["presets", "tango-7om", *json_flag])
    assert rc == 2 and out == ""
    assert "no preset's name or description contains 'tango-7om'" in helpers.assert_one_error_line(err)


@pytest.mark.parametrize(
    "wanted, names",
    [
        # no name holds these: the descriptions are searched, in any case and without accents
        (
            "onona",
            {f"{a}-{t}" for a in ("dense", "gdn-hybrid", "moe", "attnres") for t in ("142m", "330m")} | {"dense-1b"},
        ),
        (
            "table 8",
            {f"{a}-70m-d8-rotating" for a in ("tango", "tango-windowed", "loop-transformer", "untied-transformer")},
        ),
        # a name holds this: only names count, not the baselines whose descriptions say TANGO
        ("TANGO-70M-D4", {"tango-70m-d4", *(f"tango-70m-d4-ratio{r}" for r in ("0.5", "1", "2", "4", "8"))}),
    ],
)
def test_presets_filter_searches_descriptions_when_no_name_holds_it(capsys, wanted, names):
    # `presets onona` found nothing: the onóna paper's backbones are named dense-142m, moe-330m, ...
    assert {row["name"] for row in _run_json(capsys, ["presets", wanted, "--json"])} == names


def test_params_text_output(capsys):
    assert main(["params", "tango-70m-d4"]) == 0
    text = capsys.readouterr().out
    assert "70,002,176" in text and "44,270,592" in text


@pytest.mark.parametrize(
    "depth,widths",
    [
        (4, {"tango": 28480, "loop-transformer": 28144, "untied-transformer": 6528}),
        (8, {"untied-transformer": 2912}),
    ],
)
def test_match_tier_70m(capsys, depth, widths):
    res = _run_json(capsys, ["match", "--tier", "70M", "--depth", str(depth), "--json"])
    assert res["target"] == 70_000_000 and res["d_model"] == 512 and res["depth"] == depth
    got = {m["arch"]: m for m in res["models"]}
    for arch, width in widths.items():
        assert got[arch]["width"] == width
        counts = ModelConfig(arch=arch, d_model=512, width=width, depth=depth, vocab_size=50257).num_params()
        assert got[arch]["total"] == counts["total"] and got[arch]["non_embedding"] == counts["non_embedding"]


# -- bad input ---------------------------------------------------------------------------------
@dataclass
class Ctx:
    data: Path
    run: Path
    gpt2: Path
    tmp: Path

    @property
    def new_out(self) -> Path:
        return self.tmp / "new-run"

    def train(self, *extra: str) -> list[str]:
        return ["train", *helpers.cli_overrides(self.data, self.new_out, **TRAIN), *extra]


def _corrupt_run(c: Ctx) -> Path:
    copy = shutil.copytree(c.run, c.tmp / "corrupt-run")
    best = json.loads((copy / "best.json").read_text())["step"]
    path = helpers.step_dir(copy, best) / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    return copy


def _data_without_shard(c: Ctx) -> Path:
    copy = shutil.copytree(c.data, c.tmp / "data-no-shard")
    (copy / "train-00000.bin").unlink()
    return copy


def _data_garbage_manifest(c: Ctx) -> Path:
    copy = shutil.copytree(c.data, c.tmp / "data-bad-manifest")
    (copy / "manifest.json").write_text("{ this is not json")
    return copy


def _bad_yaml(c: Ctx) -> Path:
    path = c.tmp / "bad.yaml"
    path.write_text("model:\n  arch: tango\n  width: [64, 128\ntrain: {steps: 2}\n")
    return path


def _list_yaml(c: Ctx) -> Path:
    path = c.tmp / "list.yaml"
    path.write_text("- model\n- train\n")
    return path


BAD = {
    "unknown_arch": lambda c: c.train("model.arch=nope"),
    "unknown_model_field": lambda c: c.train("model.nope=1"),
    "unknown_train_field": lambda c: c.train("train.nope=1"),
    "unknown_data_field": lambda c: c.train("data.nope=1"),
    "unknown_section": lambda c: c.train("optim.lr=1"),
    "wrong_type_int": lambda c: c.train("model.d_model=abc"),
    "wrong_type_float": lambda c: c.train("train.lr=fast"),
    "bool_for_int": lambda c: c.train("model.depth=true"),
    "bad_choice": lambda c: c.train("train.schedule=linear"),
    "override_without_equals": lambda c: ["train", "tango-70m-d4", "model.width"],
    "no_budget": lambda c: c.train("train.steps="),
    "zero_batch": lambda c: c.train("train.batch_size=0"),
    "tango_width_not_multiple_of_heads": lambda c: c.train("model.width=65"),
    "d_model_not_multiple_of_heads": lambda c: c.train("model.n_heads=3"),
    "odd_head_dim": lambda c: c.train("model.d_model=30", "model.n_heads=2", "model.width=64"),
    "seq_len_over_context": lambda c: c.train("train.seq_len=64"),
    "batch_larger_than_data": lambda c: c.train("train.batch_size=64"),
    "token_ids_outside_vocab": lambda c: c.train("model.vocab_size=100"),
    "missing_data_dir": lambda c: c.train(f"data.dir={c.tmp / 'no-such-data'}"),
    "data_missing_shard": lambda c: c.train(f"data.dir={_data_without_shard(c)}"),
    "data_garbage_manifest": lambda c: c.train(f"data.dir={_data_garbage_manifest(c)}"),
    "missing_split": lambda c: c.train("data.dev_split=validation"),
    "missing_test_split": lambda c: c.train("data.test_split=validation"),  # refused before training
    "checkpoints_exist_without_resume": lambda c: ["train", *helpers.cli_overrides(c.data, c.run, **TRAIN)],
    "resume_with_other_model": lambda c: [
        "train",
        *helpers.cli_overrides(c.data, c.run, **TRAIN),
        "model.width=128",
        "--resume",
    ],
    "unknown_preset": lambda c: ["train", "tango-7b-d4", f"data.dir={c.data}", f"train.out_dir={c.new_out}"],
    "unknown_preset_params": lambda c: ["params", "no-such-preset", "--json"],
    "missing_yaml_file": lambda c: ["train", str(c.tmp / "missing.yaml")],
    "malformed_yaml": lambda c: ["train", str(_bad_yaml(c)), f"data.dir={c.data}", f"train.out_dir={c.new_out}"],
    "yaml_not_a_mapping": lambda c: ["params", str(_list_yaml(c))],
    "params_unknown_arch": lambda c: ["params", "arch=nope", "--json"],
    "params_of_a_directory": lambda c: ["params", str(c.tmp)],
    "params_wrong_type": lambda c: ["params", "arch=tango", "d_model=abc"],
    "match_bad_tier": lambda c: ["match", "--tier", "lots", "--depth", "4"],
    "match_zero_d_model_on_a_paper_tier": lambda c: ["match", "--tier", "70M", "--depth", "4", "--d-model", "0"],
    "eval_other_tokenizer": lambda c: ["eval", str(c.run), "--data", str(c.gpt2)],
    "eval_missing_checkpoint": lambda c: ["eval", str(c.tmp / "no-such-run")],
    "eval_corrupt_checkpoint": lambda c: ["eval", str(_corrupt_run(c)), "--json"],
    "eval_missing_data": lambda c: ["eval", str(c.run), "--data", str(c.tmp / "no-such-data")],
    "eval_corrupt_data": lambda c: ["eval", str(c.run), "--data", str(_data_garbage_manifest(c))],
    "eval_unknown_split": lambda c: ["eval", str(c.run), "--split", "validation"],
    "eval_zero_windows": lambda c: ["eval", str(c.run), "--windows", "0"],
    "eval_superscript_windows": lambda c: ["eval", str(c.run), "--windows", "\u00b2"],  # isdigit() but not int()
    "eval_unknown_device": lambda c: ["eval", str(c.run), "--device", "tpu9"],
    "eval_meta_device": lambda c: ["eval", str(c.run), "--device", "meta"],
    "train_meta_device": lambda c: c.train("train.device=meta"),
    "negative_lr": lambda c: c.train("train.lr=-1"),
    "seed_past_64_bits": lambda c: c.train("train.seed=99999999999999999999999"),
    "data_seed_too_large": lambda c: c.train("train.data_seed=100000000000000"),  # x 1,000,003 overflows
    "eval_sample_seed_negative": lambda c: c.train("train.eval_sample_seed=-1"),
    "zero_steps": lambda c: c.train("train.steps=0"),
    "negative_steps": lambda c: c.train("train.steps=-1"),
    "zero_keep_last": lambda c: c.train("train.keep_last=0"),
    "beta_out_of_range": lambda c: c.train("train.beta2=1.5"),
    "negative_grad_clip": lambda c: c.train("train.grad_clip=-1"),
    "negative_min_lr_ratio": lambda c: c.train("train.min_lr_ratio=-1"),
    "params_unknown_train_field": lambda c: ["params", "tango-70m-d4", "train.nope=1"],
}


@pytest.mark.parametrize(
    "case",
    list(BAD),
)
def test_bad_input_exits_2_with_one_error_line(case, cli_run, data_dir, gpt2_dir, tmp_path, capsys):
    ctx = Ctx(data=data_dir, run=cli_run[0], gpt2=gpt2_dir, tmp=tmp_path)
    argv = BAD[case](ctx)
    before = helpers.snapshot(ctx.data, ctx.run, ctx.gpt2, ctx.tmp)
    rc, out, err, _ = helpers.run_main(capsys, argv)
    assert rc == 2, (out, err)
    helpers.assert_one_error_line(err)
    assert out == ""
    assert helpers.snapshot(ctx.data, ctx.run, ctx.gpt2, ctx.tmp) == before
    assert not ctx.new_out.exists()


def test_error_messages_name_the_problem(cli_run, data_dir, gpt2_dir, tmp_path, capsys):
    ctx = Ctx(data=data_dir, run=cli_run[0], gpt2=gpt2_dir, tmp=tmp_path)
    expect = {
        "unknown_arch": "nope",
        "unknown_model_field": "nope",
        "unknown_train_field": "train.nope",
        "wrong_type_int": "model.d_model",
        "tango_width_not_multiple_of_heads": "model.width=65",
        "d_model_not_multiple_of_heads": "n_heads=3",
        "token_ids_outside_vocab": "vocab_size",
        "eval_other_tokenizer": "gpt2",
        "checkpoints_exist_without_resume": "--resume",
        "unknown_preset": "tango-7b-d4",
        "malformed_yaml": "bad.yaml",
        "missing_data_dir": "no-such-data",
        "data_missing_shard": "train-00000.bin",
        "eval_corrupt_checkpoint": "corrupt-run",
        "params_of_a_directory": "is a directory",
        "match_zero_d_model_on_a_paper_tier": "d_model must be at least 1",
    }
    for case, needle in expect.items():
        assert main(BAD[case](ctx)) == 2
        line = helpers.assert_one_error_line(capsys.readouterr().err)
        assert needle in line, (case, line)


def test_flags_may_come_between_overrides(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    overrides = helpers.cli_overrides(data_dir, out, steps=2, eval_every=2, save_every=2)
    try:
        rc = main(["train", *overrides[:3], "--json", *overrides[3:]])
    except SystemExit as exc:
        rc = f"argparse exit {exc.code}"
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 2


def test_every_command_that_takes_overrides_takes_flags_between_them(capsys):
    # The commands parsed intermixed were a list kept by hand beside the parsers (add_overrides now).
    from tango_lm.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    with_overrides = {name for name, p in commands.items() if any(a.dest == "overrides" for a in p._actions)}
    assert with_overrides == {name for name, p in commands.items() if p.intermixed} == {"train", "params", "match"}
    assert main(["params", "arch=tango", "--json", "d_model=64", "width=128", "vocab_size=257"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] > 0
    assert (
        main(["match", "--tier", "10M", "window=8", "--depth", "2", "--d-model", "64", "--arch", "tango", "--json"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)


# -- the installed console script -----------------------------------------------------------------
def _script() -> str:
    script = Path(sys.executable).with_name("tango-lm")
    return str(script) if script.exists() else shutil.which("tango-lm") or "tango-lm"


def test_console_script_params_json():
    proc = subprocess.run(
        [_script(), "params", "arch=tango", "d_model=64", "width=128", "vocab_size=257", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["total"] == ModelConfig(arch="tango", d_model=64, width=128, vocab_size=257).num_params()["total"]


def test_console_script_bad_input(data_dir, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [_script(), "train", *helpers.cli_overrides(data_dir, out, **TRAIN), "model.arch=nope"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2
    assert helpers.assert_one_error_line(proc.stderr).startswith("error: unknown architecture 'nope'")
    assert proc.stdout == "" and not out.exists()


def test_the_console_script_starts_without_torch():
    # `tango-lm` runs tango_lm.entry:main, which imports the command line (torch, ~1.3 s) inside its
    # Ctrl-C handler: nothing before it may import torch (the package's names load on first use).
    code = "import sys, tango_lm.entry; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "[]\n", (proc.stdout, proc.stderr)
    import tango_lm

    assert tango_lm.build_model is build_model and tango_lm.ModelConfig is ModelConfig
    assert set(tango_lm.__all__) <= set(dir(tango_lm))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tango_lm.nope  # noqa: B018


def test_tango_lm_eval_without_lm_eval_names_the_extra():
    # The script pointed at the adapter module, which imports lm_eval at the top: without the [eval]
    # extra, `tango-lm-eval --help` was a ModuleNotFoundError traceback and exit code 1.
    target = re.search(r'^tango-lm-eval = "([\w.]+):(\w+)"', (helpers.ROOT / "pyproject.toml").read_text(), re.M)
    code = (  # None in sys.modules: importing lm_eval raises ModuleNotFoundError, as when it is not installed
        "import importlib, sys; sys.modules['lm_eval'] = None; "
        f"sys.exit(getattr(importlib.import_module({target[1]!r}), {target[2]!r})())"
    )
    proc = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert helpers.assert_one_error_line(proc.stderr) == (
        "error: tango-lm-eval needs lm-evaluation-harness; pip install 'tango-lm[eval]'"
    )


def test_ctrl_c_while_the_command_line_imports_is_interrupted_not_a_traceback(monkeypatch, capsys):
    from tango_lm import entry

    class Interrupting:  # a meta path finder: the import of tango_lm.cli meets Ctrl-C
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "tango_lm.cli":
                raise KeyboardInterrupt

    monkeypatch.delitem(sys.modules, "tango_lm.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupting, *sys.meta_path])
    assert entry.main() == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_a_table_shows_a_value_its_number_format_does_not_take():
    # A sweep over a run whose damaged summary.json says "test_nll": "x" was a ValueError traceback.
    from tango_lm.cli.output import _table

    table = _table(
        [{"run": "a", "nll": 1.5}, {"run": "b", "nll": "x"}, {"run": "c"}], [("run", "run", ""), ("nll", "nll", ".4f")]
    )
    assert table.splitlines()[2:] == ["a    1.5000", "b         x", "c         -"]


def test_json_output_is_standard_json(capsys):
    # An infinite word perplexity (a long word on a weak model) printed as Python's `Infinity`,
    # which JSON.parse, Go and Rust refuse.
    from tango_lm.cli.output import _print_json

    _print_json({"word_perplexity": float("inf"), "rows": [{"nll": float("nan"), "tokens": 3}], "pair": (1, 2.5)})
    text = capsys.readouterr().out
    assert json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON")) == {
        "word_perplexity": None,
        "rows": [{"nll": None, "tokens": 3}],
        "pair": [1, 2.5],
    }


@pytest.mark.parametrize("argv", [["quickstart", "--out", "x"], ["data", "prepare", "dmmath", "--out", "x"]])
def test_commands_without_a_progress_flag_write_lines_off_a_terminal(monkeypatch, argv):
    # pytest's captured stderr is no terminal: bars there are only noise in a log file, so data
    # preparation and quickstart (which can take hours, and minutes) write lines there
    # (progress_lines.py); quickstart passed False and said nothing until its table.
    import tango_lm.data.dmmath as dmmath
    import tango_lm.data.shards as shards
    import tango_lm.quickstart as quickstart

    seen = {}
    monkeypatch.setattr(quickstart, "run_quickstart", lambda *a, progress, **k: seen.update(progress=progress) or [])
    monkeypatch.setattr(dmmath.DMMathSource, "prepare", lambda self, out, **k: seen.update(k) or Path(out))
    monkeypatch.setattr(shards.PreparedDataset, "open", lambda path: SimpleNamespace(path=path, splits=[]))
    assert main(argv) == 0
    assert seen["progress"] == "lines"


def test_a_config_file_whose_path_has_an_equals_sign_is_a_config(tmp_path, capsys):
    # A sweep's run directories are named arch=tango/seed=1: their config.yaml was read as an override.
    run_dir = tmp_path / "sweep" / "arch=tango"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"arch": "loop-transformer", "width": 40}}))
    assert main(["params", str(run_dir / "config.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["arch"], out["width"]) == ("loop-transformer", 40)


def _fake_quickstart(monkeypatch, trained: list) -> None:
    """Quickstart with its data taken as prepared and training recorded, not run."""
    import tango_lm.quickstart as quickstart

    monkeypatch.setattr(quickstart, "is_prepared", lambda path: True)

    def train(run, resume=False, progress=None):
        trained.append(run.train.out_dir)
        # warmup below the steps (the run would warn to lower train.warmup_steps: no quickstart flag)
        assert run.train.warmup_steps < run.train.steps
        m = run.model
        summary = {"arch": m.arch, "params_total": 1, "tokens": 1, "best_dev_nll": 1.0, "test_nll": 1.0}
        return SimpleNamespace(summary={**summary, "tokens_per_s": 1.0, "steps": run.train.steps})

    monkeypatch.setattr(quickstart, "train", train)


@contextlib.contextmanager
def _lock_held_by_another_process(lock: Path):
    """Another process holds `lock` (flock) while the block runs."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)", str(lock)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        yield
    finally:
        holder.kill()
        holder.wait()


def test_the_readmes_quickstart_table_has_the_quickstarts_parameters_and_tokens():
    # The other quickstart tests train a stand-in; the README's counts are the real models'.
    from tango_lm import quickstart

    readme = (helpers.ROOT / "README.md").read_text()
    rows = {
        m.group(1): m.groups()[1:] for m in re.finditer(r"^(tango|loop-transformer) +([\d,]+) +([\d,]+) ", readme, re.M)
    }
    models = {m.arch: m.num_params()["total"] for m in quickstart.quickstart_models()}
    tokens = quickstart.DEFAULT_STEPS * quickstart.BATCH * quickstart.SEQ_LEN
    assert {arch: (f"{models[arch]:,}", f"{tokens:,}") for arch in models} == rows


def test_quickstart_refuses_bad_steps_and_fresh_keeps_what_is_not_the_runs(tmp_path, monkeypatch, capsys):
    # --steps -1 "trained" 0 steps and printed a table, 0 became 150; --fresh deleted the whole
    # folder (a user's notes too), and a run in progress in it, before taking its lock.
    trained: list = []
    _fake_quickstart(monkeypatch, trained)
    out = tmp_path / "qs"
    for steps in ("-1", "0"):
        assert main(["quickstart", "--out", str(out), "--steps", steps]) == 2
        assert "--steps must be at least 1" in helpers.assert_one_error_line(capsys.readouterr().err)
    assert not out.exists() and not trained
    (tmp_path / "afile").write_text("mine")  # nothing printed before the error line
    rc, stdout, err, _ = helpers.run_main(capsys, ["quickstart", "--out", str(tmp_path / "afile")])
    assert (rc, stdout) == (2, "") and "afile is a file; give a directory" in helpers.assert_one_error_line(err)
    run = out / "tango"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "notes.txt").write_text("mine")
    with _lock_held_by_another_process(run / ".lock"):  # as a training run holds it
        assert main(["quickstart", "--out", str(out), "--fresh"]) == 2
        assert "is in use" in helpers.assert_one_error_line(capsys.readouterr().err)
        assert (run / "checkpoints").is_dir() and not trained
    assert main(["quickstart", "--out", str(out), "--fresh", "--steps", "3", "--json"]) == 0
    captured = capsys.readouterr()
    assert [r["arch"] for r in json.loads(captured.out)] == ["tango", "loop-transformer"]  # stdout: the JSON alone
    assert "training tango" in captured.err
    assert [p.name for p in run.iterdir() if p.name != ".lock"] == ["notes.txt"] and trained == [
        str(run),
        str(out / "loop-transformer"),
    ]


def test_every_data_source_takes_no_progress():
    # `data prepare dmmath --no-progress` was refused while every other source took it.
    import argparse

    from tango_lm.cli import build_parser
    from tango_lm.data.sources import SOURCES

    def choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    prepare = choices(choices(choices(build_parser())["data"])["prepare"])
    assert set(prepare) == set(SOURCES)
    for name, parser in prepare.items():
        assert "--no-progress" in parser._option_string_actions, name


def test_quickstart_starts_again_a_run_stopped_before_its_first_checkpoint(tmp_path, monkeypatch, capsys):
    # Its config and records stayed, so the rerun trained without --resume and was refused
    # ("already holds a run; pass --resume"), a flag quickstart lacks: only --fresh got out.
    trained: list = []
    _fake_quickstart(monkeypatch, trained)
    import tango_lm.quickstart as quickstart

    fake_train, found = quickstart.train, {}

    def train(run, resume=False, progress=None):
        found[run.train.out_dir] = (resume, sorted(p.name for p in Path(run.train.out_dir).glob("*")))
        return fake_train(run, resume, progress)

    monkeypatch.setattr(quickstart, "train", train)
    run = tmp_path / "qs" / "tango"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("config.json", "config.yaml", "metrics.jsonl", "notes.txt"):
        (run / name).write_text("{}\n")
    with _lock_held_by_another_process(run / ".lock"):  # a run in progress: it is not restarted under it
        assert main(["quickstart", "--out", str(tmp_path / "qs"), "--steps", "3"]) == 2
        line = helpers.assert_one_error_line(capsys.readouterr().err)
        assert "is in use" in line and "--fresh" not in line and (run / "config.json").exists()
    assert main(["quickstart", "--out", str(tmp_path / "qs"), "--steps", "3"]) == 0
    assert found[str(run)] == (False, ["notes.txt"])  # the attempt's files gone, the user's kept


def test_quickstart_with_fewer_steps_than_a_run_trained_names_fresh(tmp_path, monkeypatch, capsys):
    # Resuming past the steps asked for is refused by resume with "raise train.steps", which
    # quickstart has no flag for: it names --fresh, before anything trains.
    trained: list = []
    _fake_quickstart(monkeypatch, trained)
    out = tmp_path / "qs"
    (out / "tango" / "checkpoints" / "step-00000040").mkdir(parents=True)
    (out / "tango" / "checkpoints" / "step-00000040" / "COMPLETE").write_text('{"step": 40}')  # a real one:
    assert main(["quickstart", "--out", str(out), "--steps", "30"]) == 2  # its Path was compared with an int
    line = helpers.assert_one_error_line(capsys.readouterr().err)
    assert "trained 40 steps, more than the 30 asked for; add --fresh" in line and not trained
