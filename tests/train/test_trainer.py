"""The training loop: exact resume (docs/design.md §6 "exact resume"), best-dev selection, budgets,
gradient accumulation and the logged learning rate."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import yaml

from tango_lm.config_checks import unread_model_fields
from tango_lm.errors import UserError
from tango_lm.eval.evaluate import evaluate_checkpoint
from tango_lm.train.checkpoint import complete_steps, load_checkpoint
from tango_lm.train.config import RunConfig, load_run_config
from tango_lm.train.optim import lr_at
from tango_lm.train.trainer import Trainer, train
from tests import helpers

pytestmark = pytest.mark.usefixtures("one_thread")


def _interrupted(monkeypatch, run, stop: int, resume: bool = False) -> None:
    """Train `run` but stop (as on Ctrl-C) before the optimizer step after `stop`."""
    original = Trainer.train_step

    def train_step(self):
        if self.step == stop:
            raise KeyboardInterrupt
        return original(self)

    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", train_step)
        with pytest.raises(KeyboardInterrupt):
            train(run, resume=resume)


# -- exact resume ------------------------------------------------------------------------------
# (train overrides, loader (epoch, position) at the step-8 checkpoint, loader state at step 12)
RESUME_CASES = {
    # 9 batches of 4 per epoch: the resumed part crosses the epoch boundary (step 9 -> 10).
    "wsd": ({}, (0, 32), (1, 12)),
    # Steps of 8 windows, 4 per epoch (an epoch ends at a step, not a micro-batch): the resumed
    # part is epoch 2.
    "grad_accum2": ({"grad_accum": 2}, (1, 32), (2, 32)),
    "cosine": ({"schedule": "cosine", "warmup_steps": 3}, (0, 32), (1, 12)),
    # 4 batches of 8 per epoch: the checkpoint sits exactly at the end of an epoch.
    "epoch_end": ({"batch_size": 8}, (1, 32), (2, 32)),
    # inductor's CPU embedding backward adds with parallel atomics: exact only under deterministic kernels
    "compiled": ({"compile": True}, (0, 32), (1, 12)),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_reproduces_uninterrupted_run(data_dir, tmp_path, monkeypatch, case):
    # Compiled kernels' atomics race only on several threads (the file's other tests run on one).
    with helpers.one_thread(2 if RESUME_CASES[case][0].get("compile") else 1):
        _check_exact_resume(data_dir, tmp_path, monkeypatch, *RESUME_CASES[case])


def _check_exact_resume(data_dir, tmp_path, monkeypatch, overrides, at_8, at_12):
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    full = train(helpers.run_config(data_dir, full_dir, **overrides))
    assert sorted(full.losses) == list(range(1, 13))

    run = helpers.run_config(data_dir, cut_dir, **overrides)
    _interrupted(monkeypatch, run, stop=8)
    assert complete_steps(cut_dir / "checkpoints")[-1].name == "step-00000008"
    assert not (cut_dir / "summary.json").exists()
    state8 = load_checkpoint(helpers.step_dir(cut_dir, 8)).train_state()
    assert (state8["loader"]["epoch"], state8["loader"]["position"]) == at_8
    assert state8["step"] == 8 and state8["tokens_seen"] == 8 * run.train.grad_accum * run.train.batch_size * 32

    resumed = train(helpers.run_config(data_dir, cut_dir, **overrides), resume=True)

    # Only the missing steps ran, and each loss is bit-for-bit the uninterrupted one.
    assert sorted(resumed.losses) == [9, 10, 11, 12]
    for step, loss in resumed.losses.items():
        assert loss == full.losses[step], step
    # Final weights and optimizer state are identical.
    helpers.assert_same_weights(
        helpers.weights(helpers.step_dir(full_dir, 12)), helpers.weights(helpers.step_dir(cut_dir, 12))
    )
    sa = load_checkpoint(helpers.step_dir(full_dir, 12)).train_state()
    sb = load_checkpoint(helpers.step_dir(cut_dir, 12)).train_state()
    assert (sb["loader"]["epoch"], sb["loader"]["position"]) == at_12
    assert sa["loader"] == sb["loader"] and sa["best"] == sb["best"] and sa["tokens_seen"] == sb["tokens_seen"]
    for pa, pb in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values(), strict=True):
        assert torch.equal(pa["exp_avg"], pb["exp_avg"]) and torch.equal(pa["exp_avg_sq"], pb["exp_avg_sq"])
    # The logs agree record for record (wall-clock throughput aside), with no duplicated steps.
    assert helpers.loss_records(cut_dir) == helpers.loss_records(full_dir)
    assert [r["step"] for r in helpers.loss_records(cut_dir)] == list(range(1, 13))
    assert helpers.dev_records(cut_dir) == helpers.dev_records(full_dir)
    # And so does the protocol's result.
    for key in ("test_nll", "best_dev_nll", "selected_step", "steps", "tokens", "test_tokens"):
        assert resumed.summary[key] == full.summary[key], key
    assert json.loads((cut_dir / "best.json").read_text()) == json.loads((full_dir / "best.json").read_text())
    summaries = [r for r in helpers.read_metrics(cut_dir) if r.get("event") == "summary"]
    assert len(summaries) == 1


def test_resume_keeps_the_best_dev_record(data_dir, tmp_path, monkeypatch):
    """Best-dev bookkeeping survives the interruption: dev gets worse after the checkpoint."""
    script = {4: 3.0, 8: 2.0, 12: 2.5}
    monkeypatch.setattr(Trainer, "evaluate_dev", lambda self: script[self.step])
    full = train(helpers.run_config(data_dir, tmp_path / "full", keep_last=1))
    cut = tmp_path / "cut"
    _interrupted(monkeypatch, helpers.run_config(data_dir, cut, keep_last=1), stop=8)
    resumed = train(helpers.run_config(data_dir, cut, keep_last=1), resume=True)
    assert resumed.summary["selected_step"] == full.summary["selected_step"] == 8
    assert resumed.summary["best_dev_nll"] == 2.0
    assert resumed.summary["test_nll"] == full.summary["test_nll"]
    assert helpers.step_names(cut) == helpers.step_names(tmp_path / "full") == ["step-00000008", "step-00000012"]


def test_resume_without_the_best_checkpoint_is_refused_before_training(data_dir, tmp_path, monkeypatch):
    # With the best-dev checkpoint deleted (to free disk, say), a resume trained to the end and only
    # then failed to load it, and every later resume did the same.
    script = {4: 2.0, 8: 3.0, 12: 3.5, 16: 4.0}
    monkeypatch.setattr(Trainer, "evaluate_dev", lambda self: script[self.step])
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=8, keep_last=1))
    assert helpers.step_names(out) == ["step-00000004", "step-00000008"]
    shutil.rmtree(helpers.step_dir(out, 4))
    with pytest.raises(UserError, match="best-dev checkpoint step-00000004.*train.select=final"):
        train(helpers.run_config(data_dir, out, steps=16, keep_last=1), resume=True)
    assert helpers.step_names(out) == ["step-00000008"]  # nothing trained
    resumed = train(helpers.run_config(data_dir, out, steps=16, keep_last=1, select="final"), resume=True)
    assert resumed.summary["selected_step"] == 16


def test_resume_with_a_damaged_best_checkpoint_is_refused_before_training(data_dir, tmp_path, monkeypatch):
    # A flipped bit in its weights was found only at the end, after the remaining steps, and then
    # every later resume failed with advice ("use another checkpoint") train cannot follow.
    script = {4: 2.0, 8: 3.0, 12: 3.5, 16: 4.0}
    monkeypatch.setattr(Trainer, "evaluate_dev", lambda self: script[self.step])
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=8, keep_last=1))
    weights = helpers.step_dir(out, 4) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 1
    weights.write_bytes(bytes(data))
    before = helpers.snapshot(out)
    with pytest.raises(UserError, match=r"best-dev checkpoint step-00000004, .* does not match the sha256 .*"
                       r"restore it, or resume with train.select=final"):  # fmt: skip
        train(helpers.run_config(data_dir, out, steps=16, keep_last=1), resume=True)
    assert helpers.snapshot(out) == before
    resumed = train(helpers.run_config(data_dir, out, steps=16, keep_last=1, select="final"), resume=True)
    assert resumed.summary["selected_step"] == 16


def test_the_selected_dev_nll_survives_a_deleted_metrics_file(data_dir, tmp_path, monkeypatch):
    # A corrupt metrics.jsonl's error says to fix or remove it; removed, the summary's dev NLL of
    # the selected checkpoint was null although its meta.json records it.
    script = {4: 2.0, 8: 3.0}
    monkeypatch.setattr(Trainer, "evaluate_dev", lambda self: script[self.step])
    out = tmp_path / "run"
    _interrupted(monkeypatch, helpers.run_config(data_dir, out, steps=8), stop=6)
    (out / "metrics.jsonl").unlink()
    resumed = train(helpers.run_config(data_dir, out, steps=8), resume=True)
    assert resumed.summary["selected_step"] == 4 and resumed.summary["selected_dev_nll"] == 2.0


def test_a_run_resumed_past_its_end_has_no_summary_until_it_ends_again(data_dir, tmp_path, monkeypatch):
    """A finished run trained on with a larger budget is unfinished again: its old summary.json,
    which `report` would show as the run's result, goes when the resume starts."""
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=4))
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    _interrupted(monkeypatch, helpers.run_config(data_dir, out, steps=12), stop=8, resume=True)
    assert helpers.step_names(out)[-1] == "step-00000008" and not (out / "summary.json").exists()
    assert train(helpers.run_config(data_dir, out, steps=12), resume=True).summary["steps"] == 12
    assert json.loads((out / "summary.json").read_text())["steps"] == 12


def test_resume_with_manual_steps_and_save(data_dir, tmp_path):
    """Driving Trainer by hand (train_step/save) and resuming gives the same trajectory."""
    full = train(helpers.run_config(data_dir, tmp_path / "full"))
    cut = tmp_path / "cut"
    trainer = Trainer(helpers.run_config(data_dir, cut))
    cut.mkdir()
    manual = [trainer.train_step() for _ in range(6)]
    assert manual == [full.losses[s] for s in range(1, 7)]
    trainer.save()
    resumed = train(helpers.run_config(data_dir, cut), resume=True)
    assert resumed.losses == {s: full.losses[s] for s in range(7, 13)}
    helpers.assert_same_weights(
        helpers.weights(helpers.step_dir(tmp_path / "full", 12)), helpers.weights(helpers.step_dir(cut, 12))
    )


def test_resume_of_finished_run_changes_nothing(data_dir, tmp_path):
    out = tmp_path / "run"
    first = train(helpers.run_config(data_dir, out, steps=4))
    before = helpers.weights(helpers.step_dir(out, 4))
    again = train(helpers.run_config(data_dir, out, steps=4), resume=True)
    assert again.losses == {}
    assert again.summary["test_nll"] == first.summary["test_nll"]
    assert again.summary["steps"] == 4
    helpers.assert_same_weights(before, helpers.weights(helpers.step_dir(out, 4)))
    assert [r["step"] for r in helpers.loss_records(out)] == [1, 2, 3, 4]
    assert len([r for r in helpers.read_metrics(out) if r.get("event") == "summary"]) == 1
    # A summary.json cut short is written again by a resume, as `report`'s error says.
    (out / "summary.json").write_text((out / "summary.json").read_text()[:20])
    train(helpers.run_config(data_dir, out, steps=4), resume=True)
    assert json.loads((out / "summary.json").read_text())["test_nll"] == first.summary["test_nll"]
    # A schedule change applies from the resumed step on: with none left it applied to no step, yet
    # config.json and config.yaml said the run trained with it.
    config = (out / "config.json").read_text()
    from tango_lm.train.resume import SCHEDULE

    other = {"lr": 0.5, "schedule": "cosine", "warmup_steps": 7, "min_lr_ratio": 0.5, "decay_fraction": 0.5}
    other["grad_clip"] = 0.25
    assert set(other) == set(SCHEDULE)  # every field that may change on a resume: each one alone
    for change in [{field: value} for field, value in other.items()] + [{"schedule": "cosine", "warmup_steps": 7}]:
        with pytest.raises(UserError, match=r"it has trained all 4 steps, so the change would apply to none"):
            train(helpers.run_config(data_dir, out, steps=4, **change), resume=True)
        assert (out / "config.json").read_text() == config
    train(helpers.run_config(data_dir, out, steps=6, lr=0.5), resume=True)  # with steps to train: from step 5 on


def test_a_resume_lowered_to_its_checkpoints_step_scores_that_last_step(data_dir, tmp_path, monkeypatch):
    # The step-8 checkpoint was saved on save_every, not evaluated: a resume with steps=8 trained
    # nothing and reported step 6's checkpoint with no dev NLL at the run's last step.
    monkeypatch.setattr(Trainer, "evaluate_dev", lambda self: {6: 3.0, 8: 2.0, 12: 2.5}[self.step])
    out = tmp_path / "run"
    _interrupted(monkeypatch, helpers.run_config(data_dir, out, eval_every=6), stop=8)
    s = train(helpers.run_config(data_dir, out, eval_every=6, steps=8), resume=True).summary
    assert (s["selected_step"], s["selected_dev_nll"], s["best_dev_nll"]) == (8, 2.0, 2.0)
    assert json.loads((out / "best.json").read_text()) == {"step": 8, "dev_nll": 2.0}
    assert load_checkpoint(helpers.step_dir(out, 8)).meta["dev_nll"] == 2.0
    train(helpers.run_config(data_dir, out, eval_every=6, steps=8), resume=True)  # scored once
    assert [(r["step"], r["dev_nll"]) for r in helpers.dev_records(out)] == [(6, 3.0), (8, 2.0)]


def test_training_without_resume_refuses_existing_checkpoints(data_dir, tmp_path):
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=4))
    before = helpers.snapshot(out)
    with pytest.raises(UserError, match="already holds a run"):
        train(helpers.run_config(data_dir, out, steps=8))
    assert helpers.snapshot(out) == before


def test_resume_with_different_model_config_is_refused(data_dir, tmp_path):
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=4))
    before = helpers.snapshot(out)
    with pytest.raises(UserError, match=r"different model config \(width\).*it had model.width=64\)"):
        train(helpers.run_config(data_dir, out, model={"width": 128}, steps=8), resume=True)
    assert helpers.snapshot(out) == before


def test_resume_passes_over_a_field_the_architecture_does_not_read(data_dir, tmp_path):
    # A sweep's base sets window for its tango runs too (windowed TANGO reads it): a grid edited to
    # another window marked the half-trained tango run resumable, and its resume was then refused.
    out = tmp_path / "run"
    interrupted = train(helpers.run_config(data_dir, out, steps=4))
    resumed = train(helpers.run_config(data_dir, out, model={"window": 5}, steps=6), resume=True)
    assert interrupted.summary["steps"] == 4 and resumed.summary["steps"] == 6
    with pytest.raises(UserError, match=r"different model config \(arch, window\)"):  # one that reads it
        train(helpers.run_config(data_dir, out, model={"arch": "tango-windowed", "window": 7}, steps=8), resume=True)


def test_changed_batch_size_on_resume_is_a_user_error(data_dir, tmp_path):
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=4))
    with pytest.raises(UserError, match="batch_size"):
        train(helpers.run_config(data_dir, out, steps=8, batch_size=2), resume=True)


# -- best-dev protocol -------------------------------------------------------------------------
def _scripted_dev(monkeypatch, script: dict[int, float]) -> None:
    def evaluate_dev(self):
        return script[self.step]

    monkeypatch.setattr(Trainer, "evaluate_dev", evaluate_dev)


def test_best_dev_checkpoint_is_the_one_tested(data_dir, tmp_path, monkeypatch):
    _scripted_dev(monkeypatch, {4: 3.0, 8: 2.0, 12: 2.5})  # dev gets worse after step 8
    out = tmp_path / "run"
    result = train(helpers.run_config(data_dir, out, keep_last=1))
    s = result.summary
    assert s["selected_step"] == 8 and s["best_dev_nll"] == 2.0 and s["steps"] == 12
    assert json.loads((out / "best.json").read_text()) == {"step": 8, "dev_nll": 2.0}
    # keep_last=1 keeps the newest checkpoint and spares the best one.
    assert helpers.step_names(out) == ["step-00000008", "step-00000012"]
    best = evaluate_checkpoint(str(helpers.step_dir(out, 8)), "test")
    final = evaluate_checkpoint(str(helpers.step_dir(out, 12)), "test")
    assert s["test_nll"] == best["nll"]
    assert s["test_nll"] != final["nll"]  # the selection matters for this run
    assert s["test_tokens"] == best["tokens"] == 9 * 32  # all 9 test windows
    # The run directory resolves to the best-dev checkpoint.
    assert evaluate_checkpoint(str(out), "test")["step"] == 8
    dev_log = helpers.dev_records(out)
    assert [(r["step"], r["dev_nll"], r["best"]) for r in dev_log] == [(4, 3.0, True), (8, 2.0, True), (12, 2.5, False)]
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(s))


def test_select_final_tests_the_last_step(data_dir, tmp_path, monkeypatch):
    _scripted_dev(monkeypatch, {4: 3.0, 8: 2.0, 12: 2.5})
    out = tmp_path / "run"
    s = train(helpers.run_config(data_dir, out, select="final")).summary
    assert s["selected_step"] == 12
    assert s["best_dev_nll"] == 2.0
    assert s["test_nll"] == evaluate_checkpoint(str(helpers.step_dir(out, 12)), "test")["nll"]


def test_real_dev_nll_is_logged_and_best_is_its_minimum(data_dir, tmp_path):
    out = tmp_path / "run"
    s = train(helpers.run_config(data_dir, out, eval_every=2)).summary
    devs = {r["step"]: r["dev_nll"] for r in helpers.dev_records(out)}
    assert sorted(devs) == [2, 4, 6, 8, 10, 12]
    assert s["best_dev_nll"] == min(devs.values())
    assert s["selected_step"] == min(devs, key=devs.get)
    assert all(math.isfinite(v) and 0 < v < 10 for v in devs.values())
    # The dev NLL the trainer logs is evaluate_checkpoint's on the same fixed windows.
    ev = evaluate_checkpoint(str(helpers.step_dir(out, 12)), "dev", max_windows=8)
    assert ev["nll"] == pytest.approx(devs[12], rel=1e-6, abs=1e-6)


# -- budget, accumulation, schedule --------------------------------------------------------------
def test_budget_by_tokens_and_tokens_per_param(data_dir, tmp_path):
    per_step = 4 * 2 * 32
    run = helpers.run_config(data_dir, tmp_path, steps=None, tokens=per_step * 3 + 1, grad_accum=2)
    assert run.total_steps() == 4  # rounded up
    run = helpers.run_config(data_dir, tmp_path, steps=None, tokens_per_param=0.5, grad_accum=2)
    budget = 0.5 * run.model.num_params()["total"]  # 8240 tokens: 32.2 steps of 256
    assert run.total_steps() == 33  # rounded up, like a token budget
    assert (run.total_steps() - 1) * per_step < budget <= run.total_steps() * per_step
    run = helpers.run_config(data_dir, tmp_path, steps=7, tokens=10**9)
    assert run.total_steps() == 7  # steps wins
    with pytest.raises(UserError, match="no training budget"):
        helpers.run_config(data_dir, tmp_path, steps=None).total_steps()


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("schedule", "cosin", "train.schedule must be one of"),  # trained WSD
        ("grad_accum", 0, "train.grad_accum must be at least 1"),  # NaN steps, then a summary
        ("lr", -1.0, "train.lr must be positive"),  # a ValueError from AdamW
    ],
)
def test_a_run_config_built_in_python_is_checked_as_a_file_is(data_dir, tmp_path, field, value, said):
    import dataclasses

    run = helpers.run_config(data_dir, tmp_path / "run")
    bad = dataclasses.replace(run, train=dataclasses.replace(run.train, **{field: value}))
    with pytest.raises(UserError, match=said):
        train(bad)
    assert not (tmp_path / "run").exists()
    split = dataclasses.replace(run, data=dataclasses.replace(run.data, dev_split="train"))
    with pytest.raises(UserError, match="data.dev_split is 'train', the training split"):
        Trainer(split)


def test_a_run_directorys_tokens_and_tpp_must_agree_for_a_new_run(data_dir, tmp_path, capsys):
    # The run's config.yaml records the tokens its TPP gave (so --resume keeps its budget): used as
    # the config of a wider model, the new run trained the old count under the old TPP's name.
    from tango_lm.cli import main

    first = tmp_path / "first"
    train(helpers.run_config(data_dir, first, steps=None, tokens_per_param=0.05))
    saved = yaml.safe_load((first / "config.yaml").read_text())["train"]
    assert saved["tokens"] is not None and saved["tokens_per_param"] == 0.05
    wider = ["train", str(first), "model.width=128", f"train.out_dir={tmp_path / 'wider'}"]
    assert main(wider) == 2
    said = helpers.assert_one_error_line(capsys.readouterr().err)
    assert f"train.tokens={saved['tokens']:,} and train.tokens_per_param=0.05 both set the budget and disagree" in said
    assert not (tmp_path / "wider").exists()
    assert main([*wider, "train.tokens=null"]) == 0  # its TPP, counted on the wider model
    # the same model agrees with its own record, and a resume keeps the tokens it began with
    assert main(["train", str(first), f"train.out_dir={tmp_path / 'twin'}"]) == 0
    assert main(["train", str(first), "--resume"]) == 0


def test_tokens_per_param_counts_the_standard_head_for_every_head(data_dir, tmp_path):
    # seed 001 §3.1: "40 TPP based on the Dense Standard parameter count": every head of a
    # comparison trains on the same tokens. onóna's own (twin-table) count gave it more steps than
    # Standard (27,635 against 21,740 at dense-142m), and `sweep` counted Standard's: they disagreed.
    from tango_lm.sweep.grid import _fix_budget
    from tango_lm.train.config import tpp_reference_params

    runs = {
        head: helpers.run_config(data_dir, tmp_path, {"head": head}, steps=None, tokens_per_param=2)
        for head in ("standard", "onona", "untied", "mos")
    }
    assert runs["onona"].model.num_params()["total"] > runs["standard"].model.num_params()["total"]
    assert len({run.total_steps() for run in runs.values()}) == 1
    standard = runs["standard"].model.num_params()["total"]
    assert tpp_reference_params(runs["onona"].model) == standard
    for run in runs.values():  # the sweep's budget: the same steps
        _fix_budget(run, None)
        assert run.train.tokens == 2 * standard and run.total_steps() == runs["standard"].total_steps()


@pytest.mark.parametrize("preset", ["gdn-hybrid-142m", "moe-142m", "attnres-142m", "moe-330m"])
def test_tokens_per_param_counts_the_dense_model_for_the_onona_backbones(preset):
    # seed 001 Appendix C: 40 x the Dense Standard count (142,469,888 and 329,961,472) for every
    # arm of a size, "including ... MoE models with additional expert parameters". Each backbone's
    # own count gave MoE-142m 56,315 steps at 40 TPP, against the paper's (and its preset's) 21,740.
    from tango_lm.train.config import load_run_config, tpp_reference_params

    run = load_run_config(preset, ["train.tokens_per_param=40", "model.head=onona"])
    dense = {"142m": 142_469_888, "330m": 329_961_472}[preset.rsplit("-", 1)[1]]
    assert run.model.num_params()["total"] != dense
    assert tpp_reference_params(run.model) == dense
    assert run.total_steps() == load_run_config(preset, []).total_steps()  # the preset's own steps


def test_a_tokens_per_param_run_keeps_its_budget_when_the_count_changes(data_dir, tmp_path, monkeypatch):
    # The count a TPP budget multiplies changed between versions (twice): `train RUN --resume` then
    # trained to another total, its schedule jumping at the resume, or was refused as past it.
    from tango_lm.train import config as config_module
    from tango_lm.train.config import load_run_config, tpp_reference_params

    out = tmp_path / "run"
    run = helpers.run_config(data_dir, out, steps=None, tokens_per_param=0.5)
    steps = run.total_steps()
    assert steps > 2
    _interrupted(monkeypatch, run, stop=2)
    saved = json.loads((out / "config.json").read_text())["train"]
    assert saved["tokens_per_param"] == 0.5 and saved["tokens"] == int(0.5 * tpp_reference_params(run.model))
    monkeypatch.setattr(config_module, "tpp_reference_params", lambda model: 10**6)  # a later version's count
    assert helpers.run_config(data_dir, out, steps=None, tokens_per_param=0.5).total_steps() != steps
    resumed = train(load_run_config(str(out), []), resume=True)
    assert resumed.summary["steps"] == steps


def test_a_tokens_per_param_budget_of_under_one_token_resumes(data_dir, tmp_path):
    # It trains one step, and had written tokens: 0 beside it, which its own resume refused.
    out = tmp_path / "run"
    assert train(helpers.run_config(data_dir, out, steps=None, tokens_per_param=1e-30)).summary["steps"] == 1
    assert json.loads((out / "config.json").read_text())["train"]["tokens"] == 1
    assert train(load_run_config(str(out), []), resume=True).summary["steps"] == 1


def test_token_budget_trains_that_many_steps(data_dir, tmp_path):
    out = tmp_path / "run"
    s = train(helpers.run_config(data_dir, out, steps=None, tokens=3 * 4 * 32)).summary
    assert s["steps"] == 3 and s["tokens"] == 3 * 4 * 32


def test_grad_accum_matches_one_big_batch(data_dir, tmp_path):
    """batch 2 x accum 2 sees the same windows as batch 4 and takes (numerically) the same steps."""
    a = train(helpers.run_config(data_dir, tmp_path / "a", steps=4, batch_size=4, grad_accum=1))
    b = train(helpers.run_config(data_dir, tmp_path / "b", steps=4, batch_size=2, grad_accum=2))
    assert a.losses[1] == pytest.approx(b.losses[1], rel=1e-6)
    for step in range(2, 5):
        assert a.losses[step] == pytest.approx(b.losses[step], rel=1e-4)
    assert a.summary["tokens"] == b.summary["tokens"] == 4 * 4 * 32
    # The accumulated gradient is the mean over micro-batches, not their sum.
    norms_a = [r["grad_norm"] for r in helpers.loss_records(tmp_path / "a")]
    norms_b = [r["grad_norm"] for r in helpers.loss_records(tmp_path / "b")]
    assert norms_a == pytest.approx(norms_b, rel=1e-3)
    wa, wb = helpers.weights(helpers.step_dir(tmp_path / "a", 4)), helpers.weights(helpers.step_dir(tmp_path / "b", 4))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


def test_logged_lr_follows_the_schedule(data_dir, tmp_path):
    out = tmp_path / "run"
    run = helpers.run_config(
        data_dir, out, steps=10, warmup_steps=3, schedule="wsd", decay_fraction=0.3, eval_every=10, save_every=10
    )
    train(run)
    recs = helpers.loss_records(out)
    assert [r["lr"] for r in recs] == [lr_at(s, 10, run.train) for s in range(10)]
    assert recs[-1]["lr"] == pytest.approx(run.train.lr * run.train.min_lr_ratio)
    assert [r["tokens"] for r in recs] == [4 * 32 * s for s in range(1, 11)]
    assert all(r["grad_norm"] > 0 for r in recs)


def test_log_every_logs_multiples_and_the_last_step(data_dir, tmp_path):
    out = tmp_path / "run"
    result = train(helpers.run_config(data_dir, out, log_every=5))
    recs = helpers.loss_records(out)
    assert [r["step"] for r in recs] == [5, 10, 12]
    assert [r["loss"] for r in recs] == [result.losses[s] for s in (5, 10, 12)]


def test_gradients_are_clipped_before_the_update(data_dir, tmp_path, monkeypatch):
    seen = []
    clip = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *args, **kwargs):
        params = list(params)
        norm = clip(params, max_norm, *args, **kwargs)
        after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
        seen.append((max_norm, float(norm), float(after)))
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=3, grad_clip=0.05, eval_every=3, save_every=3))
    assert len(seen) == 3
    assert all(max_norm == 0.05 and before > 0.05 and after <= 0.05 * 1.0001 for max_norm, before, after in seen)
    assert [r["grad_norm"] for r in helpers.loss_records(out)] == [before for _, before, _ in seen]


def test_model_seed_and_data_seed_are_separate(data_dir, tmp_path):
    def first_loss(name, **kw):
        return train(helpers.run_config(data_dir, tmp_path / name, steps=1, eval_every=1, save_every=1, **kw)).losses[1]

    base = first_loss("base")
    assert first_loss("same") == base
    assert first_loss("seed", seed=18) != base
    assert first_loss("data", data_seed=102) != base


def test_run_config_roundtrip_through_checkpoint(data_dir, tmp_path):
    out = tmp_path / "run"
    run = helpers.run_config(data_dir, out, steps=2, eval_every=2, save_every=2)
    train(run)
    ckpt = load_checkpoint(out)
    assert ckpt.config == run.to_dict()
    assert RunConfig.from_dict(ckpt.config).to_dict() == run.to_dict()
    assert json.loads((out / "config.json").read_text()) == run.to_dict()


def test_a_peak_the_run_beats_is_measured_again(data_dir, tmp_path, monkeypatch):
    # Measured while the machine was busy, the start-up peak came out at half the real one and MFU
    # read 112%: a run that beats it measures it once more and keeps the better measurement.
    from tango_lm.train import utilization

    calls = []

    def measure(device, dtype, size, repeats):
        calls.append(size)
        return 1.0 if len(calls) == 1 else 1e15  # a useless first measurement, then a real one

    monkeypatch.setattr(utilization, "_PEAKS", {})
    monkeypatch.setattr(utilization, "measure_matmul_peak", measure)
    result = train(helpers.run_config(data_dir, tmp_path / "run", steps=4, eval_every=2, save_every=2, log_every=1))
    mfus = [r["mfu"] for r in helpers.read_metrics(tmp_path / "run") if "loss" in r]
    assert len(calls) == 2 and all(m < 1 for m in mfus) and 0 < result.summary["mfu"] < 1
    # the summary names the denominator, so that its MFU can be recomputed (and compared across runs)
    summary = result.summary
    flops = summary["flops_per_token"] * summary["tokens_per_s"]
    assert summary["params_active_non_embedding"] == summary["params_non_embedding"]  # no experts
    assert summary["mfu_peak_flop_per_s"] == 1e15 and summary["mfu"] == pytest.approx(flops / 1e15, rel=1e-12)


def test_each_run_reports_its_own_peak_memory(data_dir, tmp_path, monkeypatch):
    # A sweep trains its runs in one process: each reported the largest peak of any run before it.
    from tango_lm.train import trainer as trainer_module
    from tango_lm.train import utilization

    cpu = torch.device("cpu")
    if not utilization.reset_peak_memory(cpu):
        pytest.skip("this kernel does not let a process reset its peak resident set")
    resident = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")) * 1024
    assert utilization.peak_rss_bytes() < resident + 2**24  # the peak starts over at what is resident now
    calls = []
    monkeypatch.setattr(trainer_module, "reset_peak_memory", lambda device: calls.append(device))
    train(helpers.run_config(data_dir, tmp_path / "run", steps=2, eval_every=2, save_every=2))
    assert calls == [cpu]  # at the start of the run, before its first step


def test_a_dev_nll_that_is_never_finite_is_null_in_the_files(data_dir, tmp_path, monkeypatch):
    # JSON.parse and jq refuse NaN and Infinity; the table says '-', not inf.
    monkeypatch.setattr(Trainer, "evaluate_dev", lambda self: float("nan"))
    result = train(helpers.run_config(data_dir, tmp_path / "run", steps=4, eval_every=2, save_every=2))

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a JSON file"))

    summary = strict((tmp_path / "run" / "summary.json").read_text())
    records = [strict(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["best_dev_nll"] is None and result.summary["best_dev_nll"] is None
    assert [r["dev_nll"] for r in records if "dev_nll" in r] == [None, None]


@pytest.mark.parametrize(("vocab_size", "warned"), [(257, False), (385, False), (50257, True)])
def test_a_table_mostly_of_rows_the_tokenizer_never_produces_is_warned_at_the_start(
    data_dir, tmp_path, capsys, vocab_size, warned
):
    # Byte-level data under the default GPT-2 vocabulary trained a table of 50,000 unused rows:
    # 13M parameters counted in the comparison, silently. Padding (257 -> 320, or 128 rows more) is not warned.
    run = helpers.run_config(data_dir, tmp_path / "run", model={"vocab_size": vocab_size}, steps=1, eval_every=1)
    capsys.readouterr()
    train(run)
    err = capsys.readouterr().err
    warning = "warning: model.vocab_size is 50,257 but the data's tokenizer 'byte' has 257 ids: 50,000 rows"
    assert (warning in err) == warned and err.count("warning: model.vocab_size") == warned
    if warned:
        assert "set model.vocab_size=257 unless" in err


@pytest.mark.parametrize(
    ("ids", "vocab_size", "warned"),
    [(257, 385, False), (257, 386, True), (50257, 50304, False), (32000, 32768, False), (32000, 50257, True)],
)
def test_unused_rows_beyond_padding_are_what_is_warned(ids, vocab_size, warned):
    from types import SimpleNamespace

    from tango_lm.config_checks import unused_table_rows

    run = SimpleNamespace(model=SimpleNamespace(vocab_size=vocab_size))
    dataset = SimpleNamespace(tokenizer=SimpleNamespace(vocab_size=ids, name="t"))
    assert (unused_table_rows(run, dataset) is not None) == warned


@pytest.mark.parametrize(("window", "warned"), [(31, False), (32, True)])
def test_a_window_that_covers_the_context_is_warned_at_the_start(data_dir, tmp_path, capsys, window, warned):
    # windowed TANGO with window >= context is full-prefix TANGO at its quadratic cost (docs/design.md §2.3)
    model = {"arch": "tango-windowed", "window": window}
    train(helpers.run_config(data_dir, tmp_path / "run", model=model, steps=1, eval_every=1))
    err = capsys.readouterr().err
    line = "warning: model.window=32 is at least model.context_length=32: no source is ever older than the window"
    assert (line in err) == warned and err.count("warning: model.window") == warned


def test_a_window_or_group_past_the_runs_shorter_sequences_is_warned(data_dir, tmp_path, capsys):
    # Compared with the context only: a window of 16 over train.seq_len=8 computed full-prefix TANGO
    # (and a FLASH group of 16 one group per sequence), unsaid.
    from tango_lm.models.registry import ARCHITECTURES
    from tests.arch_cases import tiny_config

    model = {"arch": "tango-windowed", "window": 16}
    train(helpers.run_config(data_dir, tmp_path / "run", model=model, steps=1, eval_every=1, seq_len=8))
    said = "warning: model.window=16 is at least train.seq_len=8, the length of the run's sequences: no source"
    assert said in capsys.readouterr().err
    flash = tiny_config("flash").replace(group_size=8)
    assert ARCHITECTURES["flash"].warnings(flash, seq_len=flash.context_length) == []
    (line,) = ARCHITECTURES["flash"].warnings(flash, seq_len=8)
    assert line.startswith("model.group_size=8 is at least train.seq_len=8, the length of the run's sequences")


def test_a_flash_group_that_holds_the_whole_context_is_warned():
    # Its linear part never runs and bias entries past the context never train, with no word.
    from tango_lm.models.registry import ARCHITECTURES
    from tests.arch_cases import tiny_config

    flash = tiny_config("flash")
    assert ARCHITECTURES["flash"].warnings(flash.replace(group_size=flash.context_length - 1)) == []
    (line,) = ARCHITECTURES["flash"].warnings(flash.replace(group_size=flash.context_length))
    assert line.startswith(f"model.group_size={flash.context_length} is at least model.context_length=")


def test_a_hybrid_without_an_attention_layer_is_warned():
    # attention_every past the depth built GDN layers only (a small-depth smoke test of the hybrid).
    from tango_lm.models.registry import ARCHITECTURES
    from tests.arch_cases import tiny_config

    gdn = tiny_config("gdn-hybrid")
    for every in (0, gdn.depth):
        assert ARCHITECTURES["gdn-hybrid"].warnings(gdn.replace(attention_every=every)) == []
    (line,) = ARCHITECTURES["gdn-hybrid"].warnings(gdn.replace(attention_every=gdn.depth + 1))
    assert line.startswith(f"model.attention_every={gdn.depth + 1} is more than model.depth={gdn.depth}: no layer")


def test_a_hybrid_whose_width_leaves_gdn_key_channels_out_is_warned():
    # d_model 32 with 12-wide GDN heads: two heads read 24 of the 32 channels, without a word.
    from tango_lm.models.registry import ARCHITECTURES
    from tests.arch_cases import tiny_config

    gdn = tiny_config("gdn-hybrid")
    assert gdn.d_model % gdn.gdn_head_dim == 0 and ARCHITECTURES["gdn-hybrid"].warnings(gdn) == []
    odd = gdn.replace(d_model=32, gdn_head_dim=12)
    (line,) = ARCHITECTURES["gdn-hybrid"].warnings(odd)
    assert line.startswith("model.d_model=32 is not a multiple of model.gdn_head_dim=12")
    assert "read 24 key channels (2 heads); set model.gdn_n_heads" in line
    assert ARCHITECTURES["gdn-hybrid"].warnings(odd.replace(gdn_n_heads=3)) == []  # chosen: nothing to say


def test_top_1_routing_with_renormalized_weights_is_warned():
    # Each token's one weight is then 1: the router's gradient from the loss is zero (~1e-10 measured),
    # so routing learns from the load-balancing term alone, with no word.
    from tango_lm.models.registry import ARCHITECTURES
    from tests.arch_cases import tiny_config

    moe = tiny_config("moe")
    assert ARCHITECTURES["moe"].warnings(moe.replace(moe_top_k=2)) == []
    assert ARCHITECTURES["moe"].warnings(moe.replace(moe_top_k=1, moe_renormalize=False)) == []
    (line,) = ARCHITECTURES["moe"].warnings(moe.replace(moe_top_k=1))
    assert line.startswith("model.moe_top_k=1 with model.moe_renormalize=true") and "moe_renormalize=false" in line
    from tango_lm import build_model

    def router_gradient(renormalize: bool) -> float:
        torch.manual_seed(0)
        model = build_model(moe.replace(moe_top_k=1, moe_renormalize=renormalize)).double().eval()
        ids = torch.randint(0, moe.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
        model.nll(ids[:, :-1], ids[:, 1:]).backward()  # eval: no load-balancing term, the loss alone
        return max(p.grad.abs().max().item() for name, p in model.named_parameters() if "router" in name)

    assert router_gradient(renormalize=True) < 1e-9 < 1e-6 < router_gradient(renormalize=False)


def test_no_architecture_warns_of_its_own_tiny_config_or_of_a_preset():
    from tango_lm.models.registry import ARCHITECTURES
    from tango_lm.train.config import list_presets, load_run_config
    from tests.arch_cases import tiny_config

    assert {name: arch.warnings(tiny_config(name)) for name, arch in ARCHITECTURES.items()} == {
        name: [] for name in ARCHITECTURES
    }
    models = [load_run_config(name, []).model for name in list_presets()]
    assert len(models) > 70 and [m for m in models if ARCHITECTURES[m.arch].warnings(m)] == []
    assert [m for m in models if unread_model_fields(m)] == []
    assert {name: unread_model_fields(tiny_config(name)) for name in ARCHITECTURES} == {
        name: [] for name in ARCHITECTURES
    }


@pytest.mark.parametrize(
    ("model", "said"),
    [
        # GQA asked of a Transformer++ silently trained full multi-head attention
        ({"arch": "loop-transformer", "n_kv_heads": 1}, "model.n_kv_heads=1 is read only by dense, gdn-hybrid"),
        ({"arch": "tango", "window": 8}, "model.window=8 is read only by tango-windowed: tango does not use it"),
        ({"arch": "dense", "n_experts": 4}, "model.n_experts=4 is read only by moe: dense does not use it"),
        ({"arch": "gau", "n_heads": 2, "qk_dim": 8}, "model.n_heads=2 is not used by gau"),
        ({"arch": "dense", "n_kv_heads": 1}, None),  # it reads it
        ({"arch": "moe", "n_experts": 4, "moe_top_k": 2}, None),  # capacity_factor_eval derived from them
    ],
)
def test_a_field_the_architecture_does_not_read_is_warned_at_the_start(data_dir, tmp_path, capsys, model, said):
    train(helpers.run_config(data_dir, tmp_path / "run", model=model, steps=1, eval_every=1))
    err = capsys.readouterr().err
    unread = [line for line in err.splitlines() if "does not use it" in line or "is not used by" in line]
    assert unread == ([] if said is None else [next(line for line in unread if said in line)]), err


@pytest.mark.parametrize(("steps", "warned"), [(3, False), (2, True)])
def test_a_warmup_as_long_as_the_run_is_warned_at_the_start(data_dir, tmp_path, capsys, steps, warned):
    # A preset's 200 warmup steps under a short budget warmed up to the last step, never at train.lr.
    train(helpers.run_config(data_dir, tmp_path / "run", steps=steps, warmup_steps=2, eval_every=steps))
    err = capsys.readouterr().err
    line = "warning: train.warmup_steps=2 is not below the run's 2 steps: the learning rate warms up over all but"
    assert (line in err) == warned and err.count("warning: train.warmup_steps") == warned


def test_splits_with_fewer_windows_than_the_run_scores_are_warned_at_the_start(data_dir, tmp_path, capsys):
    # eval_windows past the dev split's scored all of them, silently: the protocol's 1,024 became
    # however many the split held, and nothing said so.
    from tango_lm.data.loader import count_eval_windows
    from tango_lm.data.shards import PreparedDataset

    dev = count_eval_windows(PreparedDataset.open(data_dir).tokens("dev"), 32)
    train(helpers.run_config(data_dir, tmp_path / "a", steps=1, eval_every=1, eval_windows=dev + 1, test_windows=2))
    err = capsys.readouterr().err
    assert f"warning: the dev split ('dev') holds {dev:,} windows of 32 tokens, fewer than train.eval_windows" in err
    assert "test split" not in err
    train(helpers.run_config(data_dir, tmp_path / "b", steps=1, eval_every=1, eval_windows=dev))
    assert "fewer than train" not in capsys.readouterr().err


def test_a_split_of_one_window_is_warned_of_in_the_singular(data_dir, tmp_path):
    # it said "holds 1 windows of 8 tokens: its NLL is over those 1"
    from types import SimpleNamespace

    import numpy as np

    from tango_lm.config_checks import fewer_windows_than_asked

    run = helpers.run_config(data_dir, tmp_path / "a", eval_windows=4, test_windows=None)
    one_window = SimpleNamespace(tokens=lambda split: np.zeros(run.seq_len() + 1, dtype=np.int64))
    assert fewer_windows_than_asked(run, one_window) == [
        f"the dev split ('dev') holds 1 window of {run.seq_len()} tokens, fewer than train.eval_windows=4: "
        "its NLL is over that one"
    ]


def test_a_sweeps_architectures_fields_are_not_warned_for_its_other_runs():
    # A sweep's base sets window (windowed TANGO) for its tango runs too; n_kv_heads, which no
    # architecture of this sweep reads, is still said.
    from tests.arch_cases import tiny_config

    tango = tiny_config("tango").replace(window=8, n_kv_heads=1)
    assert len(unread_model_fields(tango)) == 2
    (line,) = unread_model_fields(tango, also_read_by={"tango", "tango-windowed"})
    assert line.startswith("model.n_kv_heads=1 is read only by dense")


def test_raising_steps_before_the_decay_is_the_longer_run_and_after_it_restarts_at_the_peak(
    data_dir, tmp_path, monkeypatch
):
    """What the README says a raised budget does to WSD: exact before the decay began (step 10 of
    12), a jump back to the peak lr after it."""
    longer = train(helpers.run_config(data_dir, tmp_path / "longer", steps=16))
    _interrupted(monkeypatch, helpers.run_config(data_dir, tmp_path / "cut", steps=12), stop=8)
    resumed = train(helpers.run_config(data_dir, tmp_path / "cut", steps=16), resume=True)
    assert resumed.losses == {step: longer.losses[step] for step in range(9, 17)}
    train(helpers.run_config(data_dir, tmp_path / "done", steps=12))
    train(helpers.run_config(data_dir, tmp_path / "done", steps=16), resume=True)
    lr = {r["step"]: r["lr"] for r in helpers.loss_records(tmp_path / "done")}
    assert lr[12] < lr[11] < lr[13] == max(lr.values()) and lr[16] < lr[13]


def test_the_last_step_is_saved_when_it_is_neither_best_nor_on_save_every(data_dir, tmp_path, monkeypatch):
    # 10 steps, saves every 4, dev NLL best at step 8: the run's last step must still be a
    # checkpoint (a resume to more steps, and `select: final`, start from it).
    dev = {4: 3.0, 8: 2.0, 10: 2.5}
    monkeypatch.setattr(Trainer, "evaluate_dev", lambda self: dev[self.step])
    out = tmp_path / "run"
    run = helpers.run_config(data_dir, out, steps=10, save_every=4, eval_every=4, keep_last=5, select="final")
    result = train(run)
    assert helpers.step_names(out) == ["step-00000004", "step-00000008", "step-00000010"]
    assert result.summary["selected_step"] == 10


def test_throughput_counts_every_micro_batch_and_the_summary_takes_the_median(data_dir, tmp_path, monkeypatch):
    # A fake clock: the steps take 1, 1, 3 and 1 s. Each record's tokens/s is the global batch (all
    # grad_accum micro-batches) over its step's time; the summary's is over the median step time,
    # the papers' measure (the mean step time would give 171 tokens/s here, not 256).
    import tango_lm.train.trainer as trainer_module

    clock, durations = [0.0], {1: 1.0, 2: 1.0, 3: 3.0, 4: 1.0}
    original = Trainer.train_step

    def timed_step(self):
        loss = original(self)
        clock[0] += durations[self.step]
        return loss

    monkeypatch.setattr(Trainer, "train_step", timed_step)
    monkeypatch.setattr(trainer_module.time, "perf_counter", lambda: clock[0])
    out = tmp_path / "run"
    result = train(helpers.run_config(data_dir, out, steps=4, grad_accum=2, batch_size=4, log_every=1, eval_every=4))
    tokens_per_step = 2 * 4 * 32
    logged = {r["step"]: r["tokens_per_s"] for r in helpers.read_metrics(out) if "tokens_per_s" in r}
    assert logged == {s: tokens_per_step / d for s, d in durations.items()}
    assert result.summary["tokens_per_s"] == tokens_per_step / 1.0


@pytest.mark.parametrize("field", ["eval_sample_seed", "reshuffle_each_epoch"])
def test_a_run_from_before_a_train_field_existed_resumes(data_dir, tmp_path, field):
    # Its config.json lacks the field, which it ran with at today's default: a resume compares the
    # saved value only where there is one (a raw KeyError otherwise, from the checks of what a
    # resume keeps).
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=4, save_every=4, eval_every=4))
    step = helpers.step_dir(out, 4)
    for where in (out, step):
        config = json.loads((where / "config.json").read_text())
        del config["train"][field]
        if where == step:
            helpers.rewrite_step_json(step, "config.json", config)
        else:
            (where / "config.json").write_text(json.dumps(config))
    assert (
        train(helpers.run_config(data_dir, out, steps=6, save_every=4, eval_every=4), resume=True).summary["steps"] == 6
    )


def test_a_resume_with_another_reshuffle_setting_is_refused_for_the_run_not_its_checkpoint(data_dir, tmp_path):
    # Every checkpoint of the run carries the setting: advice to move the latest one out cannot help.
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=4, save_every=4, eval_every=4))
    with pytest.raises(UserError) as refused:
        train(helpers.run_config(data_dir, out, steps=6, reshuffle_each_epoch=False), resume=True)
    assert "reshuffle_each_epoch True (now False)" in str(refused.value)
    assert "cannot resume" in str(refused.value) and "move" not in str(refused.value)
