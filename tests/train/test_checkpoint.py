"""Checkpoints that lose nothing: contents, best-dev resolution, pruning, corruption, and saves
killed half-way (in-process failures and a SIGKILLed `tango-lm train`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tango_lm.atomic_files import write_json_atomic, write_text_atomic
from tango_lm.cli import main
from tango_lm.data.shards import PreparedDataset, write_prepared
from tango_lm.data.tokenizers import get_tokenizer
from tango_lm.errors import UserError
from tango_lm.models.model import build_model
from tango_lm.train import checkpoint as ckpt_mod
from tango_lm.train import trainer as trainer_module
from tango_lm.train.checkpoint import (
    DESCRIBED,
    FORMAT,
    MARKER,
    SUMMED,
    complete_steps,
    load_checkpoint,
    prune_checkpoints,
    resolve_run_checkpoint,
    restorable_steps,
    restore_interrupted_saves,
    save_checkpoint,
)
from tango_lm.train.trainer import Trainer, train
from tests import helpers

FILES = {"model.safetensors", "train_state.pt", "config.json", "tokenizer.json", "meta.json", "COMPLETE"}
DEV_SCRIPT = {2: 3.0, 4: 1.0, 6: 2.0, 8: 2.5}  # best dev at step 4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def scripted_run(data_dir, tmp_path_factory):
    """8 steps, eval and save every 2, keep_last 2, scripted dev NLL whose best is step 4.
    Read-only: tests that modify it work on a copy."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    run = helpers.run_config(data_dir, out, steps=8, save_every=2, eval_every=2, keep_last=2)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Trainer, "evaluate_dev", lambda self: DEV_SCRIPT[self.step])
        result = train(run)
    return out, run, result


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# -- contents ----------------------------------------------------------------------------------
def test_step_directories_hold_exactly_the_documented_files(scripted_run):
    out, run, _ = scripted_run
    for name in helpers.step_names(out):
        assert {p.name for p in (out / "checkpoints" / name).iterdir()} == FILES
    assert not [p for p in (out / "checkpoints").iterdir() if not p.name.startswith("step-")]


def test_weights_are_safetensors_matching_the_model(scripted_run):
    out, run, _ = scripted_run
    path = helpers.step_dir(out, 8)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": FORMAT}
    state = load_file(str(path / "model.safetensors"))
    model = build_model(run.model)
    assert state.keys() == model.state_dict().keys()
    model.load_state_dict(state)  # strict
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in state.values())


def test_train_state_loads_with_weights_only(scripted_run):
    out, run, _ = scripted_run
    for step in (4, 6, 8):
        state = torch.load(helpers.step_dir(out, step) / "train_state.pt", map_location="cpu", weights_only=True)
        assert set(state) == {
            "optimizer",
            "loader",
            "rng",
            "step",
            "tokens_seen",
            "best",
            "nonfinite",
            "step_times",
            "step_times_on",
            "data",
            "compute_dtype",
            "eval_batch_size",
        }
        assert state["compute_dtype"] == "float32" and state["eval_batch_size"] == run.train.batch_size
        assert len(state["step_times"]) == step and set(state["data"]) == {"train", "dev"}
        assert state["step_times_on"] == {
            "world_size": 1,
            "device": "cpu",
            "parallel": "none",
            "compile": False,
            "activation_checkpointing": False,
        }
        assert state["nonfinite"] == {"in_a_row": 0, "skipped": 0}
        assert state["step"] == step and state["tokens_seen"] == step * 4 * 32
        assert state["best"] == {"step": 4, "dev_nll": 1.0}
        loader = {"epoch": 0, "position": step * 4, "data_seed": 101, "seq_len": 32, "global_batch": 4}
        assert state["loader"] == {**loader, "reshuffle": True}
        assert isinstance(state["rng"]["torch"], torch.Tensor)
        assert len(state["optimizer"]["param_groups"]) == 2


def test_json_sidecars(scripted_run, data_dir):
    out, run, _ = scripted_run
    dataset = PreparedDataset.open(data_dir)
    tok = dataset.tokenizer.to_dict()
    data = {split: dataset.content_id(split) for split in ("dev", "test", "train")}
    for step in (4, 6, 8):
        path = helpers.step_dir(out, step)
        assert json.loads((path / "config.json").read_text()) == run.to_dict()
        assert json.loads((path / "tokenizer.json").read_text()) == tok
        assert json.loads((path / "COMPLETE").read_text()) == {"step": step}
        meta = json.loads((path / "meta.json").read_text())
        sums = {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in (*SUMMED, *DESCRIBED)}
        assert meta == {
            "format": FORMAT,
            "step": step,
            "dev_nll": DEV_SCRIPT[step],
            "tokens_seen": step * 128,
            "data": data,
            "sha256": sums,
            "best_step": 4,  # the best-dev step when it was saved (DEV_SCRIPT's best is step 4's)
        }
        ck = load_checkpoint(path)
        assert ck.path == path and ck.meta == meta and ck.config == run.to_dict() and ck.tokenizer == tok


def test_keep_last_prunes_but_spares_the_best(scripted_run):
    out, _, result = scripted_run
    assert result.summary["selected_step"] == 4
    assert helpers.step_names(out) == ["step-00000004", "step-00000006", "step-00000008"]
    assert json.loads((out / "best.json").read_text()) == {"step": 4, "dev_nll": 1.0}


def test_run_directory_resolves_to_best_then_latest(scripted_run, tmp_path):
    out, _, _ = scripted_run
    assert load_checkpoint(out).path == helpers.step_dir(out, 4)
    assert resolve_run_checkpoint(out, "latest") == helpers.step_dir(out, 8)
    run = _copy(out, tmp_path / "run")
    (run / "best.json").unlink()  # no dev NLL yet: the latest is all there is
    assert load_checkpoint(run).path == helpers.step_dir(run, 8)
    # A best-dev checkpoint that is gone, or a best.json that cannot be read, is said, never
    # replaced by another checkpoint whose numbers would pass for the run's.
    latest = f"point at one of its checkpoints/step-\\* directories \\(the latest is {helpers.step_dir(run, 8)}\\)$"
    (run / "best.json").write_text(json.dumps({"step": 2, "dev_nll": 3.0}))  # deleted to free disk
    with pytest.raises(
        UserError,
        match=f"best-dev checkpoint {helpers.step_dir(run, 2)} .* is missing or incomplete; restore it, or {latest}",
    ):
        load_checkpoint(run)
    (run / "best.json").write_text("{not json")
    with pytest.raises(
        UserError, match=f"best.json cannot be read, so the run's best-dev checkpoint is unknown; {latest}"
    ):
        load_checkpoint(run)
    with pytest.raises(
        UserError, match=f"^{run / 'checkpoints'} is a run's checkpoints folder; give the run directory {run} "
    ):
        load_checkpoint(run / "checkpoints")
    (run / "best.json").write_text(json.dumps({"step": 6, "dev_nll": 2.0}))
    assert load_checkpoint(run).path == helpers.step_dir(run, 6)
    # A step directory itself is used as given.
    assert load_checkpoint(helpers.step_dir(run, 8)).meta["step"] == 8


def test_a_run_that_selects_its_final_model_resolves_to_its_latest(scripted_run, tmp_path):
    # train.select=final (the onóna protocol) reports the last step: eval, generate, serve and
    # export of the run directory must load that one, not the best dev one best.json records.
    out, _, _ = scripted_run
    run = _copy(out, tmp_path / "run")
    for path in [run / "config.json", *run.glob("checkpoints/step-*/config.json")]:  # as a run writes them
        config = json.loads(path.read_text())
        config["train"]["select"] = "final"
        path.write_text(json.dumps(config))
        if path.parent != run:
            helpers.rewrite_step_json(path.parent, "config.json", config)
    assert json.loads((run / "best.json").read_text())["step"] == 4
    assert load_checkpoint(run).path == helpers.step_dir(run, 8)


def test_run_directory_without_checkpoints_is_a_user_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "empty")
    with pytest.raises(UserError, match="does not exist"):
        load_checkpoint(tmp_path / "missing")


def test_what_is_no_checkpoint_is_not_called_an_interrupted_save(scripted_run, tmp_path):
    # A config.yaml or an empty step-* folder was "incomplete (no COMPLETE marker; the save was
    # interrupted); use an earlier one", which sent its user looking for a save that never was.
    (tmp_path / "config.yaml").write_text("model: {}\n")
    with pytest.raises(UserError, match=r"config.yaml is a file, not a checkpoint; give a run directory or a"):
        load_checkpoint(tmp_path / "config.yaml")
    (tmp_path / "step-xyz").mkdir()
    with pytest.raises(UserError, match=r"step-xyz holds no checkpoint; give a run directory"):
        load_checkpoint(tmp_path / "step-xyz")
    out, _, _ = scripted_run
    path = _copy(helpers.step_dir(out, 8), tmp_path / "step-00000008")
    (path / "COMPLETE").unlink()
    with pytest.raises(UserError, match="incomplete .no COMPLETE marker; the save was interrupted"):
        load_checkpoint(path)
    killed = _copy(helpers.step_dir(out, 8), tmp_path / ".tmp-step-00000009-123")  # killed before its JSON files
    for name in ("COMPLETE", "meta.json", "config.json", "tokenizer.json"):
        (killed / name).unlink()
    with pytest.raises(UserError, match="incomplete .no COMPLETE marker; the save was interrupted"):
        load_checkpoint(killed)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_a_byte(path: Path) -> None:
    """One byte mid-file: a weight's or an optimizer moment's bits, which still load as a number."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "weights_truncated": lambda p: _truncate(p / "model.safetensors"),
    "weights_garbage": lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 7),
    "weights_missing": lambda p: (p / "model.safetensors").unlink(),
    "train_state_garbage": lambda p: (p / "train_state.pt").write_bytes(b"not a torch file"),
    "train_state_truncated": lambda p: _truncate(p / "train_state.pt"),
    "weights_bit_flip": lambda p: _flip_a_byte(p / "model.safetensors"),
    "train_state_bit_flip": lambda p: _flip_a_byte(p / "train_state.pt"),
    "meta_garbage": lambda p: (p / "meta.json").write_text("{"),
    "meta_wrong_format": lambda p: (p / "meta.json").write_text(json.dumps({"format": "other/9", "step": 8})),
    "config_missing": lambda p: (p / "config.json").unlink(),
    "marker_missing": lambda p: (p / "COMPLETE").unlink(),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_checkpoint_raises_one_line_user_error(scripted_run, tmp_path, corruption):
    out, _, _ = scripted_run
    path = _copy(helpers.step_dir(out, 8), tmp_path / "step-00000008")
    # The intact copy loads completely.
    intact = load_checkpoint(path)
    intact.build_model()
    intact.train_state()
    CORRUPTIONS[corruption](path)
    with pytest.raises(UserError) as info:
        ck = load_checkpoint(path)
        ck.build_model()
        ck.train_state()
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg


def test_resume_uses_latest_complete_and_ignores_incomplete(scripted_run, data_dir, tmp_path):
    out, run, _ = scripted_run
    copy = _copy(out, tmp_path / "run")
    (helpers.step_dir(copy, 8) / "COMPLETE").unlink()  # as if step 8 never finished
    trainer = Trainer(helpers.run_config(data_dir, copy, steps=8, save_every=2, eval_every=2), resume=True)
    assert trainer.step == 6 and trainer.best == {"step": 4, "dev_nll": 1.0}
    state = load_checkpoint(helpers.step_dir(copy, 6)).train_state()
    assert torch.equal(torch.get_rng_state(), state["rng"]["torch"])
    assert trainer.loader.state_dict() == state["loader"] and trainer.tokens_seen == 6 * 128
    helpers.assert_same_weights(
        {k: v for k, v in trainer.model.state_dict().items()}, helpers.weights(helpers.step_dir(copy, 6))
    )


def test_resume_keeps_the_step_times_of_the_throughput(scripted_run, data_dir, tmp_path):
    # tokens/s is the median of the final 100 steps: after a resume some of them came before it
    out, _, result = scripted_run
    copy = _copy(out, tmp_path / "run")
    state = load_checkpoint(helpers.step_dir(copy, 8)).train_state()
    assert len(state["step_times"]) == 8 and all(t > 0 for t in state["step_times"])
    again = train(helpers.run_config(data_dir, copy, steps=8, save_every=2, eval_every=2, keep_last=2), resume=True)
    assert again.summary["steps"] == 8 and again.summary["tokens_per_s"] == result.summary["tokens_per_s"]
    assert again.summary["mfu"] == result.summary["mfu"]


def test_resume_on_another_setup_drops_the_step_times_it_did_not_time(scripted_run, data_dir, tmp_path, monkeypatch):
    # Times of steps on 2 processes made a 1-process resume's tokens/s theirs, and its MFU (per
    # process) twice theirs. Resumed on another setup, only its own steps count.
    from tango_lm.train.trainer_checkpoints import TrainerCheckpoints

    out, _, _ = scripted_run
    copy = _copy(out, tmp_path / "run")
    real = TrainerCheckpoints._timing_setup
    monkeypatch.setattr(TrainerCheckpoints, "_timing_setup", lambda self: {**real(self), "world_size": 2})
    again = train(helpers.run_config(data_dir, copy, steps=8, save_every=2, eval_every=2, keep_last=2), resume=True)
    assert again.summary["tokens_per_s"] is None and again.summary["mfu"] is None  # no step of its own


def test_resume_refuses_other_data_and_takes_the_same_data_anywhere(scripted_run, data_dir, tmp_path):
    # The loader position and the best dev NLL refer to the tokens the run trained on.
    out, _, _ = scripted_run
    copy = _copy(out, tmp_path / "run")
    moved = _copy(data_dir, tmp_path / "moved-data")  # the same tokens elsewhere: resumes
    assert Trainer(helpers.run_config(moved, copy, steps=8, save_every=2, eval_every=2), resume=True).step == 8
    other = tmp_path / "other-data"
    splits = {"train": helpers.make_docs(helpers.TRAIN_DOCS, 5), "dev": helpers.make_docs(helpers.EVAL_DOCS, 1)}
    write_prepared(
        other, get_tokenizer("byte"), {**splits, "test": helpers.make_docs(helpers.EVAL_DOCS, 2)}, {}, progress=False
    )
    with pytest.raises(UserError, match=r"the train split\(s\) of .*other-data hold other tokens"):
        Trainer(helpers.run_config(other, copy, steps=8, save_every=2, eval_every=2), resume=True)


def test_resume_restores_the_global_rng(data_dir, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(helpers.run_config(data_dir, out))
    out.mkdir()
    trainer.train_step()
    torch.rand(5)  # something drew from the global generator
    trainer.save()
    expected = torch.get_rng_state()
    torch.manual_seed(1234)
    Trainer(helpers.run_config(data_dir, out), resume=True)
    assert torch.equal(torch.get_rng_state(), expected)


def test_resume_from_weights_that_do_not_fit_is_a_user_error(scripted_run, data_dir, tmp_path, capsys):
    out, _, _ = scripted_run
    copy = _copy(out, tmp_path / "run")
    path = helpers.step_dir(copy, 8) / "model.safetensors"
    state = load_file(str(path))
    state.pop("norm.weight")
    save_file(state, str(path), metadata={"format": FORMAT})
    meta = json.loads((path.parent / "meta.json").read_text())  # consistent with its sums: past that check
    meta["sha256"]["model.safetensors"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (path.parent / "meta.json").write_text(json.dumps(meta))
    argv = ["train", *helpers.cli_overrides(data_dir, copy, steps=10, save_every=2, eval_every=2), "--resume"]
    try:
        rc = main(argv)
    except RuntimeError:
        rc = "traceback"
    assert rc == 2
    line = helpers.assert_one_error_line(capsys.readouterr().err)
    assert "is corrupt or from another run (Error(s) in loading" in line and "to resume from the one before it" in line


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("moment", "the saved optimizer's exp_avg of parameter 0 has shape (3,), not"),
        ("nonfinite", "is corrupt or from another run"),
    ],
)
def test_a_train_state_of_another_shape_is_refused_before_anything_changes(
    scripted_run, data_dir, tmp_path, capsys, damage, said
):
    # A moment of the wrong shape (a train_state.pt of another run, or saved before the sums) passed
    # every check: the run's summary and metrics were rewritten, then fused AdamW crashed in native
    # code. A nonfinite record of the wrong type was a 20-line traceback.
    out, _, _ = scripted_run
    copy = _copy(out, tmp_path / "run")
    path = helpers.step_dir(copy, 8) / "train_state.pt"
    state = torch.load(path, weights_only=True)
    if damage == "moment":
        state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)
    else:
        state["nonfinite"] = [1]
    torch.save(state, path)
    meta = json.loads((path.parent / "meta.json").read_text())  # consistent with its sums: past that check
    meta["sha256"]["train_state.pt"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (path.parent / "meta.json").write_text(json.dumps(meta))
    before = helpers.snapshot(copy)
    argv = ["train", *helpers.cli_overrides(data_dir, copy, steps=10, save_every=2, eval_every=2), "--resume"]
    assert main([*argv, "--no-progress"]) == 2
    line = helpers.assert_one_error_line(capsys.readouterr().err)
    assert said in line and "to resume from the one before it" in line
    assert helpers.snapshot(copy) == before


def test_a_flipped_bit_in_a_checkpoints_config_or_weights_is_refused_not_scored(scripted_run, tmp_path, capsys):
    # config.json's depth 2 -> 3 (one bit) built a deeper looped model on the same weights, and eval,
    # generate, serve and export used it; a NaN weight (its sum updated) printed "dev NLL nan".
    out, _, _ = scripted_run
    copy = _copy(out, tmp_path / "run")
    step = helpers.step_dir(copy, 8)
    config = step / "config.json"
    config.write_text(config.read_text().replace('"depth": 2', '"depth": 3', 1))
    with pytest.raises(UserError, match="has a config.json that does not match the sha256 in its meta.json"):
        load_checkpoint(step)
    shutil.copy(helpers.step_dir(out, 8) / "config.json", config)
    (step / "tokenizer.json").write_text(json.dumps({"name": "gpt2", "vocab_size": 50257, "eot_id": 50256}))
    with pytest.raises(UserError, match="has a tokenizer.json that does not match the sha256"):
        load_checkpoint(step)
    shutil.copy(helpers.step_dir(out, 8) / "tokenizer.json", step / "tokenizer.json")
    weights = step / "model.safetensors"
    state = load_file(str(weights))
    state["norm.weight"][0] = float("nan")
    save_file(state, str(weights), metadata={"format": FORMAT})
    meta = json.loads((step / "meta.json").read_text())  # consistent with its sums: past that check
    meta["sha256"]["model.safetensors"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    (step / "meta.json").write_text(json.dumps(meta))
    assert main(["eval", str(step), "--split", "dev"]) == 2
    line = helpers.assert_one_error_line(capsys.readouterr().err)
    assert (
        line == f"error: checkpoint {step} has non-finite values in norm.weight; it is corrupt, use another checkpoint"
    )


@pytest.mark.parametrize("text", ['{"step": 6, "dev_nll": DEV}', '{"step": 4.7, "dev_nll": DEV}', '{"step": true}'])
def test_a_best_json_naming_another_step_is_refused(scripted_run, tmp_path, text):
    # A flipped digit (4 -> 6) made eval, generate, serve and export use step 6 as the best-dev
    # checkpoint; int() also took 4.7 as step 4 and true as step 1.
    out, _, _ = scripted_run
    copy = _copy(out, tmp_path / "run")
    best = json.loads((copy / "best.json").read_text())
    assert best["step"] == 4 and load_checkpoint(copy).path == helpers.step_dir(copy, 4)
    (copy / "best.json").write_text(text.replace("DEV", repr(best["dev_nll"])))
    with pytest.raises(UserError, match=f"{copy / 'best.json'} (names step 6 with dev NLL|cannot be read)"):
        load_checkpoint(copy)


def test_a_damaged_latest_checkpoint_says_how_to_resume_from_the_one_before(scripted_run, data_dir, tmp_path, capsys):
    out, _, _ = scripted_run
    copy = _copy(out, tmp_path / "run")
    _flip_a_byte(helpers.step_dir(copy, 8) / "train_state.pt")
    argv = ["train", *helpers.cli_overrides(data_dir, copy, steps=8, save_every=2, eval_every=2), "--resume"]
    assert main([*argv, "--no-progress"]) == 2
    line = helpers.assert_one_error_line(capsys.readouterr().err)
    assert "does not match the sha256" in line and "another checkpoint" not in line
    assert f"move {helpers.step_dir(copy, 8)} out of {copy / 'checkpoints'} to resume from the one before it" in line
    shutil.move(helpers.step_dir(copy, 8), tmp_path / "aside")  # as it says
    assert Trainer(helpers.run_config(data_dir, copy, steps=8, save_every=2, eval_every=2), resume=True).step == 6


def test_the_advice_for_a_damaged_latest_checkpoint_works_when_it_was_a_new_best(data_dir, tmp_path, monkeypatch):
    # Step 8 a new best: pruning kept steps 6 and 8 and deleted step 4, which step 6's state names
    # as its best. Moved out as the error said, step 8 left a run --resume refused for want of step 4.
    out = tmp_path / "run"
    run = helpers.run_config(data_dir, out, steps=8, save_every=2, eval_every=2, keep_last=2)
    monkeypatch.setattr(Trainer, "evaluate_dev", lambda self: {2: 3.0, 4: 2.0, 6: 2.5, 8: 1.0}[self.step])
    train(run)
    assert helpers.step_names(out) == ["step-00000004", "step-00000006", "step-00000008"]
    assert json.loads((helpers.step_dir(out, 6) / "meta.json").read_text())["best_step"] == 4
    shutil.move(helpers.step_dir(out, 8), tmp_path / "aside")
    resumed = Trainer(run, resume=True)
    assert resumed.step == 6 and resumed.best["step"] == 4


def test_a_run_whose_only_checkpoint_is_damaged_is_not_told_to_move_it_or_started_over(
    data_dir, tmp_path, monkeypatch, capsys
):
    # With keep_last 1 the advice led to a run without checkpoints, which --resume then trained from
    # step 1 with no word (rewriting its metrics).
    out = tmp_path / "run"
    run = helpers.run_config(data_dir, out, steps=4, save_every=2, eval_every=2, keep_last=1)
    monkeypatch.setattr(Trainer, "evaluate_dev", lambda self: {2: 2.0, 4: 1.0}[self.step])
    train(run)
    assert helpers.step_names(out) == ["step-00000004"]
    _flip_a_byte(helpers.step_dir(out, 4) / "train_state.pt")
    argv = ["train", *helpers.cli_overrides(data_dir, out, steps=4, save_every=2, eval_every=2, keep_last=1)]
    assert main([*argv, "--resume", "--no-progress"]) == 2
    line = helpers.assert_one_error_line(capsys.readouterr().err)
    assert "it is the run's only complete checkpoint" in line and "move" not in line
    shutil.move(helpers.step_dir(out, 4), tmp_path / "aside")
    before = helpers.snapshot(out)
    assert main([*argv, "--resume", "--no-progress"]) == 2
    line = helpers.assert_one_error_line(capsys.readouterr().err)
    assert f"cannot resume {out}: it finished (its summary.json) but holds no complete checkpoint" in line
    assert helpers.snapshot(out) == before


def test_resume_with_another_data_order_says_to_change_the_config_back(scripted_run, data_dir, tmp_path):
    # Every checkpoint of the run holds the same data order: moving one away would not help.
    out, _, _ = scripted_run
    copy = _copy(out, tmp_path / "run")
    with pytest.raises(UserError) as info:
        Trainer(helpers.run_config(data_dir, copy, steps=8, batch_size=8), resume=True)
    assert "data position was saved with global micro-batch 4 (now 8)" in str(info.value)
    assert "train.batch_size (the global micro-batch)" in str(info.value) and "move" not in str(info.value)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"grad_accum": 2}, "train.grad_accum=1 (now 2)"),  # the summary's tokens/s doubled with no step run
        ({"eval_windows": 2}, "train.eval_windows=8 (now 2)"),  # best dev compared across window sets
        ({"eval_sample_seed": 5}, "train.eval_sample_seed=None (now 5)"),
        # Restored from the optimizer state over the config's: recorded in config.json, never applied.
        ({"weight_decay": 5.0}, "train.weight_decay=0.1 (now 5.0)"),
        ({"beta1": 0.1}, "train.beta1=0.9 (now 0.1)"),
        ({"beta2": 0.5}, "train.beta2=0.95 (now 0.5)"),
        ({"seed": 99}, "train.seed=17 (now 99)"),  # the weights were initialized with 17: reports paired it as 99
    ],
)
def test_resume_with_a_setting_a_resume_keeps_changed_is_refused(scripted_run, data_dir, tmp_path, change, said):
    out, _, _ = scripted_run
    copy = _copy(out, tmp_path / "run")
    with pytest.raises(UserError, match=r"its checkpoint was trained with ") as info:
        Trainer(helpers.run_config(data_dir, copy, steps=8, save_every=2, eval_every=2, **change), resume=True)
    assert said in str(info.value) and "move" not in str(info.value)


def test_resume_past_the_configured_steps_is_refused(scripted_run, data_dir, tmp_path):
    out, _, _ = scripted_run
    copy = _copy(out, tmp_path / "run")
    with pytest.raises(UserError, match="latest checkpoint is at step 8, past the 4 steps this config trains"):
        Trainer(helpers.run_config(data_dir, copy, steps=4, save_every=2, eval_every=2), resume=True)


# -- atomic save / prune -------------------------------------------------------------------------
def test_resaving_a_step_replaces_it_atomically(tmp_path):
    root = tmp_path / "checkpoints"
    a = {"w": torch.zeros(3)}
    b = {"w": torch.ones(3)}
    first = save_checkpoint(root, 5, a, {"step": 5}, {"model": {}, "c": 1}, {"name": "byte"}, {"dev_nll": None})
    second = save_checkpoint(root, 5, b, {"step": 5}, {"model": {}, "c": 2}, {"name": "byte"}, {"dev_nll": 1.5})
    assert first == second == root / "step-00000005"
    assert [p.name for p in root.iterdir()] == ["step-00000005"]
    ck = load_checkpoint(second)
    assert (
        torch.equal(ck.model_state()["w"], b["w"]) and ck.config == {"model": {}, "c": 2} and ck.meta["dev_nll"] == 1.5
    )


@pytest.mark.parametrize("killed", ["a save after its marker", "a re-save between its renames"])
def test_a_save_stopped_midway_keeps_its_step(data_dir, tmp_path, killed):
    # A kill between a re-save's two renames left only .replaced-* (was .old-*) and .tmp-* copies,
    # which the next start deleted; so was a first save's complete .tmp-* killed before its rename.
    # The step was lost, and the run trained again from the one before, or from step 1.
    out = tmp_path / "run"
    run = helpers.run_config(data_dir, out, steps=4, save_every=2, eval_every=2, keep_last=1)
    train(run)
    root = out / "checkpoints"
    step = helpers.step_dir(out, 4)
    if killed == "a re-save between its renames":
        shutil.copytree(step, root / ".tmp-step-00000004-999")  # the new copy, complete
        os.rename(step, root / ".replaced-step-00000004-999")
    else:
        os.rename(step, root / ".tmp-step-00000004-999")
    assert complete_steps(root) == [] and restorable_steps(root) == [4]
    longer = helpers.run_config(data_dir, out, steps=6, save_every=2, eval_every=2, keep_last=1)
    assert min(train(longer, resume=True).losses) == 5  # from step 4, not from step 1
    assert helpers.step_names(out) == ["step-00000006"] and not list(root.glob(".*"))


def test_only_a_copy_that_can_take_its_place_counts_as_restorable(tmp_path):
    # A copy of a name that does not parse raised from the sweep's plan (a traceback), and one whose
    # place is a link was counted, then failed to be put back ("Not a directory") at every rerun.
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 4, {"w": torch.zeros(1)}, {"step": 4}, {"model": {}}, {}, {})
    for name in (".tmp-step-00000004.bak", ".tmp-step-abc-1", ".tmp-step-00000008-77", ".tmp-step-00000012-5"):
        shutil.copytree(root / "step-00000004", root / name)
    (tmp_path / "elsewhere").mkdir()
    (root / "step-00000012").symlink_to(tmp_path / "elsewhere")  # its place taken by a link
    assert restorable_steps(root) == [4, 8]
    restore_interrupted_saves(root)
    assert [p.name for p in complete_steps(root)] == ["step-00000004", "step-00000008"]
    assert (root / "step-00000012").is_symlink() and (root / ".tmp-step-abc-1").is_dir()


def save_stopped_at_its_rename(monkeypatch, root: Path, step: int, value: float) -> None:
    """`save_checkpoint` of step `step` with Ctrl-C as its copy is renamed into place."""
    real_rename = os.rename

    def interrupted(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise KeyboardInterrupt
        real_rename(src, dst)

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(os, "rename", interrupted)
        save_checkpoint(root, step, {"w": torch.full((3,), value)}, {"step": step}, {"model": {}}, {}, {})


def test_ctrl_c_between_a_resaves_renames_puts_the_old_copy_back(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 5, {"w": torch.zeros(3)}, {"step": 5}, {"model": {}, "c": 1}, {}, {})
    save_stopped_at_its_rename(monkeypatch, root, 5, 1.0)
    assert torch.equal(load_checkpoint(root / "step-00000005").model_state()["w"], torch.zeros(3))
    assert not list(root.glob(".replaced-*"))


def test_ctrl_c_before_a_first_saves_rename_keeps_its_complete_copy(tmp_path, monkeypatch):
    # The copy holds its COMPLETE marker: a stop now must not delete it, the next start puts it back.
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 4, {"w": torch.zeros(3)}, {"step": 4}, {"model": {}}, {}, {})
    save_stopped_at_its_rename(monkeypatch, root, 8, 1.0)
    assert restorable_steps(root) == [4, 8]
    restore_interrupted_saves(root)
    assert torch.equal(load_checkpoint(root / "step-00000008").model_state()["w"], torch.ones(3))


def test_which_copy_of_an_interrupted_resave_comes_back(tmp_path):
    root = tmp_path / "checkpoints"

    def copy(name: str, value: float, complete: bool = True) -> None:
        scratch = tmp_path / f"scratch-{value}"
        done = save_checkpoint(scratch, 20, {"w": torch.full((1,), value)}, {"step": 20}, {"model": {}}, {}, {})
        if not complete:
            (done / MARKER).unlink()
        root.mkdir(exist_ok=True)
        os.rename(done, root / name)

    def restored() -> float:
        restore_interrupted_saves(root)
        return load_checkpoint(root / "step-00000020").model_state()["w"].item()

    # Killed between a re-save's renames, both copies complete: the new one (.tmp-) is the step.
    copy(".replaced-step-00000020-1", 1.0)
    copy(".tmp-step-00000020-2", 2.0)
    assert restorable_steps(root) == [20] and restored() == 2.0
    # Killed after the second rename, before the old copy went: the step stays as it is.
    copy(".replaced-step-00000020-3", 3.0)
    assert restored() == 2.0
    # A copy without its marker is no step to resume from, nor to put back.
    copy(".tmp-step-00000030-4", 4.0, complete=False)
    assert restorable_steps(root) == [20] and not (root / "step-00000030").exists()


@pytest.mark.parametrize("what", ["file", "link"])
def test_a_file_where_the_step_goes_is_left_alone_and_named(tmp_path, what):
    # Not a copy of the step to move aside: the save removes its own copy and says what to move.
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 4, {"w": torch.zeros(3)}, {"step": 4}, {"model": {}}, {}, {})
    place = root / "step-00000008"
    if what == "file":
        place.write_text("x")
    else:
        place.symlink_to(root / "step-00000004", target_is_directory=True)
    with pytest.raises(UserError, match=f"step-00000008 is a {what}, not a checkpoint directory; move it away"):
        save_checkpoint(root, 8, {"w": torch.ones(3)}, {"step": 8}, {"model": {}}, {}, {})
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000008"]
    if what == "link":
        assert place.resolve() == (root / "step-00000004").resolve()
    else:
        assert place.read_text() == "x" and [p.name for p in complete_steps(root)] == ["step-00000004"]


def test_prune_keeps_the_best_step_a_kept_checkpoint_names(tmp_path):
    root = tmp_path / "checkpoints"
    for step, best in ((1, 1), (2, 1), (3, 3), (4, 3)):
        save_checkpoint(root, step, {"w": torch.zeros(1)}, {"step": step}, {}, {}, {"best_step": best})
    prune_checkpoints(root, keep_last=1, protect={3})
    assert [p.name for p in complete_steps(root)] == ["step-00000003", "step-00000004"]
    save_checkpoint(root, 5, {"w": torch.zeros(1)}, {"step": 5}, {}, {}, {"best_step": 5})
    prune_checkpoints(root, keep_last=2, protect={5})  # step 4 kept, so step 3 (its best) too
    assert [p.name for p in complete_steps(root)] == ["step-00000003", "step-00000004", "step-00000005"]
    # A damaged meta.json naming `true` names no step (True == 1 kept step 1 for good).
    save_checkpoint(root, 1, {"w": torch.zeros(1)}, {"step": 1}, {}, {}, {})
    save_checkpoint(root, 6, {"w": torch.zeros(1)}, {"step": 6}, {}, {}, {"best_step": True})
    prune_checkpoints(root, keep_last=1, protect=set())
    assert [p.name for p in complete_steps(root)] == ["step-00000006"]


def test_a_users_copy_beside_the_step_directories_is_no_checkpoint(data_dir, tmp_path):
    # step-00000006.bak ended the next run in a traceback (int('00000006.bak')), and
    # step-00000002-backup was read as step 2 and pruned.
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    train(helpers.run_config(data_dir, out, steps=6, save_every=2, eval_every=2, keep_last=1))
    for name in ("step-00000006.bak", "step-00000002-backup", "step-00000004 (copy)"):
        shutil.copytree(ckpts / "step-00000006", ckpts / name)
    assert [p.name for p in complete_steps(ckpts)] == ["step-00000006"]
    train(helpers.run_config(data_dir, out, steps=8, save_every=2, eval_every=2, keep_last=1), resume=True)
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["step-00000002-backup", "step-00000004 (copy)", "step-00000006.bak", "step-00000008"]


def test_prune_keeps_newest_and_protected_and_removes_leftovers(tmp_path):
    root = tmp_path / "checkpoints"
    for step in range(1, 6):
        save_checkpoint(root, step, {"w": torch.zeros(1)}, {"step": step}, {}, {}, {})
    (root / ".tmp-step-00000006-12345").mkdir()
    (root / ".old-step-00000003-12345").mkdir()
    prune_checkpoints(root, keep_last=2, protect={2})
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000004", "step-00000005"]


def test_tmp_directory_is_not_a_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, {"w": torch.zeros(1)}, {"step": 1}, {}, {}, {})
    tmp = root / ".tmp-step-00000002-777"
    shutil.copytree(root / "step-00000001", tmp)
    (tmp / "COMPLETE").unlink()
    assert complete_steps(root) == [root / "step-00000001"]
    assert resolve_run_checkpoint(tmp_path) == root / "step-00000001"
    with pytest.raises(UserError, match="incomplete"):
        load_checkpoint(tmp)


# -- killed saves --------------------------------------------------------------------------------
def _fail_in_torch_save(m: pytest.MonkeyPatch) -> None:
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == 8:
            Path(f).write_bytes(b"half a file")
            raise OSError(28, "No space left on device")
        return real(obj, f, *args, **kwargs)

    m.setattr(ckpt_mod.torch, "save", save)


def _fail_at_marker(m: pytest.MonkeyPatch) -> None:
    real = ckpt_mod._write_json

    def write(path, data):
        if Path(path).name == "COMPLETE" and data.get("step") == 8:
            raise OSError(28, "No space left on device")
        return real(path, data)

    m.setattr(ckpt_mod, "_write_json", write)


@pytest.mark.parametrize("fail", [_fail_in_torch_save, _fail_at_marker], ids=["train_state", "marker"])
def test_save_killed_midway_keeps_previous_checkpoint(data_dir, tmp_path, monkeypatch, fail):
    full_dir, out = tmp_path / "full", tmp_path / "cut"
    full = train(helpers.run_config(data_dir, full_dir))
    with monkeypatch.context() as m:
        fail(m)
        with pytest.raises(UserError, match="No space left on device"):
            train(helpers.run_config(data_dir, out))
    root = out / "checkpoints"
    assert [p.name for p in complete_steps(root)] == ["step-00000004"]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]  # the failed save removed its copy
    foreign = root / ".tmp-step-00000012-4242424"  # from another (killed) process
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"partial")
    # The step-4 checkpoint is the latest complete one and fully loadable.
    assert load_checkpoint(out).path == helpers.step_dir(out, 4)
    ck = load_checkpoint(helpers.step_dir(out, 4))
    ck.build_model()
    assert ck.train_state()["step"] == 4
    with pytest.raises(UserError):
        load_checkpoint(foreign)
    # Resume continues from step 4 and reproduces the uninterrupted run exactly.
    resumed = train(helpers.run_config(data_dir, out), resume=True)
    assert resumed.losses == {s: full.losses[s] for s in range(5, 13)}
    helpers.assert_same_weights(
        helpers.weights(helpers.step_dir(full_dir, 12)), helpers.weights(helpers.step_dir(out, 12))
    )
    assert helpers.loss_records(out) == helpers.loss_records(full_dir)
    assert helpers.dev_records(out) == helpers.dev_records(full_dir)
    assert resumed.summary["test_nll"] == full.summary["test_nll"]
    # Leftovers of the killed saves are gone after the next save.
    assert not [p for p in root.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_kill_between_best_checkpoint_and_best_json(data_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    script = {4: 3.0, 8: 2.0, 12: 2.5}
    monkeypatch.setattr(Trainer, "evaluate_dev", lambda self: script[self.step])
    real_save = Trainer.save

    def save(self, dev_nll=None):
        path = real_save(self, dev_nll)
        if self.step == 8:
            raise KeyboardInterrupt  # killed right after the best checkpoint is complete
        return path

    with monkeypatch.context() as m:
        m.setattr(Trainer, "save", save)
        with pytest.raises(KeyboardInterrupt):
            train(helpers.run_config(data_dir, out))
    summary = train(helpers.run_config(data_dir, out), resume=True).summary
    assert summary["selected_step"] == 8
    assert json.loads((out / "best.json").read_text())["step"] == 8
    assert load_checkpoint(out).meta["step"] == 8  # what `tango-lm eval RUN` evaluates


def _console_script() -> str:
    script = Path(sys.executable).with_name("tango-lm")
    return str(script) if script.exists() else shutil.which("tango-lm") or "tango-lm"


def test_sigkilled_training_resumes_and_matches(data_dir, tmp_path, capsys):
    steps = 60
    out, ref = tmp_path / "killed", tmp_path / "ref"
    settings = {"steps": steps, "save_every": 3, "eval_every": 3}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [_console_script(), "train", *helpers.cli_overrides(data_dir, out, **settings)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    try:
        while not complete_steps(out / "checkpoints"):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "summary.json").exists(), "the run finished before it could be killed"
    killed_at = int(complete_steps(out / "checkpoints")[-1].name.split("-")[1])
    assert killed_at < steps

    assert main(["train", *helpers.cli_overrides(data_dir, out, **settings), "--resume", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == steps and summary == json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in helpers.loss_records(out)] == list(range(1, steps + 1))

    # Same numbers as a run that was never killed.
    reference = train(helpers.run_config(data_dir, ref, **settings))
    assert helpers.loss_records(out) == helpers.loss_records(ref)
    assert summary["test_nll"] == reference.summary["test_nll"]
    helpers.assert_same_weights(
        helpers.weights(helpers.step_dir(out, steps)), helpers.weights(helpers.step_dir(ref, steps))
    )


def test_resume_in_another_compute_dtype_is_refused_and_in_the_same_accepted(data_dir, tmp_path, monkeypatch):
    # precision "auto" is bf16 on a bf16 GPU and fp32 on a CPU: a run moved between them compared its
    # best dev NLL across precisions though its config (and train.precision) read the same.
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(trainer_module, "autocast_dtype", lambda precision, device: torch.bfloat16)  # a bf16 device
        train(helpers.run_config(data_dir, out, steps=2, save_every=2, eval_every=2, precision="auto"))
    before = helpers.snapshot(out)
    with pytest.raises(UserError, match=r"it trained in bfloat16 and train.precision='auto' gives float32 on this"):
        Trainer(helpers.run_config(data_dir, out, steps=4, save_every=2, eval_every=2, precision="auto"), resume=True)
    assert helpers.snapshot(out) == before
    with monkeypatch.context() as m:  # back on a bf16 device it resumes, "auto" or "bf16" alike (one dtype there)
        m.setattr(trainer_module, "autocast_dtype", lambda precision, device: torch.bfloat16)
        train(helpers.run_config(data_dir, out, steps=4, save_every=2, eval_every=2, precision="bf16"), resume=True)
    # On a CPU, fp32 ("auto"'s dtype there) to bf16 is another precision; "auto" to "fp32" is not.
    cpu = tmp_path / "cpu"
    train(helpers.run_config(data_dir, cpu, steps=2, save_every=2, eval_every=2, precision="auto"))
    with pytest.raises(UserError, match=r"it trained in float32 and train.precision='bf16' gives bfloat16.*; resume "
                       r"with train.precision=fp32 or use"):  # fmt: skip
        Trainer(helpers.run_config(data_dir, cpu, steps=4, save_every=2, eval_every=2, precision="bf16"), resume=True)
    train(helpers.run_config(data_dir, cpu, steps=4, save_every=2, eval_every=2, precision="fp32"), resume=True)


def test_resume_of_moe_with_another_eval_batch_is_refused(data_dir, tmp_path):
    # MoE's dev NLL depends on its batch mates (expert capacity is per forward): best-dev would
    # compare values measured in two batchings. Other models resume with any eval batch.
    for arch in ("moe", "tango"):
        out = tmp_path / arch
        train(
            helpers.run_config(
                data_dir, out, model={"arch": arch}, steps=2, save_every=2, eval_every=2, eval_batch_size=4
            )
        )
        again = helpers.run_config(
            data_dir, out, model={"arch": arch}, steps=4, save_every=2, eval_every=2, eval_batch_size=1
        )
        if arch == "tango":
            train(again, resume=True)
            continue
        before = helpers.snapshot(out)
        with pytest.raises(UserError, match=r"batches of 4 windows per process.*set train.eval_batch_size=4"):
            Trainer(again, resume=True)
        assert helpers.snapshot(out) == before


def test_moe_logs_its_load_balancing_term_apart_and_the_report_curve_is_the_nll(data_dir, tmp_path):
    # MoE's loss is NLL + aux: its learning curve sat ~alpha above the other backbones' NLL curves.
    from tango_lm.eval.report_runs import read_run

    for arch in ("moe", "tango"):
        out = tmp_path / arch
        train(
            helpers.run_config(data_dir, out, model={"arch": arch}, steps=3, save_every=3, eval_every=3, grad_accum=2)
        )
        steps = [r for r in helpers.read_metrics(out) if "loss" in r and r.get("event") != "summary"]
        if arch == "tango":
            assert all("aux_loss" not in r for r in steps)
            continue
        # alpha * E * sum_i f_i P_i >= alpha (equality when routing is uniform); far below the NLL
        assert all(0.0099 < r["aux_loss"] < 0.05 for r in steps), steps
        curve = read_run(out, "test", [])
        assert curve.train_curve == [(r["tokens"], r["loss"] - r["aux_loss"]) for r in steps]


def test_an_atomic_write_that_fails_leaves_the_file_as_it_was_and_nothing_beside_it(tmp_path, monkeypatch):
    """config.yaml, config.json, best.json, summary.json: a disk that fills up mid-write leaves the
    previous file whole (a resume reads it back) and no temporary sibling."""
    path = tmp_path / "config.yaml"
    write_text_atomic(path, "model: {}\n")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    for write in (lambda: write_text_atomic(path, "train: {}\n"), lambda: write_json_atomic(path, {"a": 1})):
        with pytest.raises(OSError, match="No space left"):
            write()
        assert path.read_text() == "model: {}\n" and sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_an_atomic_write_over_a_directory_names_that_directory(tmp_path):
    # best.json made a directory: the error named the temporary sibling (.best.json.tmp-PID), a file
    # the user has never seen and cannot find.
    from tango_lm.errors import os_error_text

    (tmp_path / "best.json").mkdir()
    with pytest.raises(IsADirectoryError) as info:
        write_json_atomic(tmp_path / "best.json", {"step": 4})
    assert os_error_text(info.value) == f"Is a directory ({tmp_path / 'best.json'})"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.json"]


def test_a_checkpoint_whose_tokenizer_has_more_ids_than_its_model_is_refused(scripted_run, tmp_path):
    # From a checkpoint without sums (or rewritten with its sum): serve started and answered every
    # request with a 500, and export --hf wrote a model whose end-of-text id is past its table.
    out, _, _ = scripted_run
    step = _copy(out, tmp_path / "run") / "checkpoints" / "step-00000008"
    helpers.rewrite_step_json(step, "tokenizer.json", {"name": "gpt2"})
    with pytest.raises(UserError, match="has a tokenizer of 50,257 ids for a model of 257 rows; it is corrupt"):
        load_checkpoint(step).build_model()
