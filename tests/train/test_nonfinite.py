"""Non-finite numbers in training (train/nonfinite.py): a NaN loss skips its update but still
counts as a step, a resumed run skips and stops exactly where the uninterrupted one does, too many
skips in a row stop the run, and non-finite weights are never saved."""

from __future__ import annotations

import math

import pytest
import torch

from tango_lm.errors import UserError
from tango_lm.train.checkpoint import complete_steps, load_checkpoint
from tango_lm.train.trainer import Trainer, train
from tests import helpers

pytestmark = pytest.mark.usefixtures("one_thread")


def poison(monkeypatch, steps: set[int], weights_after: int | None = None) -> dict[int, dict]:
    """Make the loss of the given (1-based) steps NaN, or a weight NaN after step `weights_after`;
    returns the weights and AdamW step count seen at the start of each step."""
    seen: dict[int, dict] = {}
    real = Trainer.train_step

    def train_step(self):
        first = next(iter(self.optimizer.state.values()), {}).get("step")
        seen[self.step + 1] = {
            "weights": {k: v.clone() for k, v in self.model.state_dict().items()},
            "adam_step": None if first is None else int(first),
        }
        forward = self.step_fn
        if self.step + 1 in steps:
            self.step_fn = lambda inputs, targets: forward(inputs, targets) * float("nan")
        try:
            return real(self)
        finally:
            self.step_fn = forward
            if self.step == weights_after:
                with torch.no_grad():
                    next(self.model.parameters()).view(-1)[0] = float("nan")

    monkeypatch.setattr(Trainer, "train_step", train_step)
    return seen


def test_a_nan_loss_skips_its_update_and_still_counts(data_dir, tmp_path, monkeypatch, capsys):
    seen = poison(monkeypatch, {3, 4})
    result = train(helpers.run_config(data_dir, tmp_path / "run", steps=6))
    helpers.assert_same_weights(seen[3]["weights"], seen[5]["weights"])  # steps 3 and 4 changed nothing
    assert seen[3]["adam_step"] == seen[5]["adam_step"] == 2  # not even AdamW's step count
    name = next(iter(seen[5]["weights"]))
    assert not torch.equal(seen[5]["weights"][name], seen[6]["weights"][name])  # step 5 updated again
    records = {r["step"]: r for r in helpers.loss_records(tmp_path / "run")}
    assert sorted(records) == [1, 2, 3, 4, 5, 6]  # skipped steps are steps: logged, their data consumed
    assert [s for s, r in records.items() if r.get("skipped")] == [3, 4]
    assert records[3]["loss"] is None and records[3]["tokens"] == 3 * 4 * 32
    assert all(math.isfinite(records[s]["loss"]) for s in (1, 2, 5, 6))
    assert result.summary["skipped_steps"] == 2 and math.isfinite(result.summary["test_nll"])
    err = capsys.readouterr().err
    assert (
        "warning: step 3: the loss is nan and the gradient norm is nan; its update was skipped (1 in a row, "
        "the run stops after 5)"
    ) in err
    assert "warning: step 4:" in err and "(2 in a row" in err


def test_a_resumed_run_skips_and_stops_where_the_uninterrupted_one_does(data_dir, tmp_path, monkeypatch):
    """Skips at 3 and at 7, 8, 9 with at most 2 in a row: both runs stop at step 9, keeping step 8."""
    settings = {"max_nonfinite_steps": 2, "keep_last": 3}
    poison(monkeypatch, {3, 7, 8, 9})
    with pytest.raises(UserError) as full:
        train(helpers.run_config(data_dir, tmp_path / "full", **settings))

    cut = helpers.run_config(data_dir, tmp_path / "cut", **settings)
    real = Trainer.train_step

    def stop_at_8(self):
        if self.step == 8:
            raise KeyboardInterrupt
        return real(self)

    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", stop_at_8)
        with pytest.raises(KeyboardInterrupt):
            train(cut)
    with pytest.raises(UserError) as resumed:
        train(cut, resume=True)  # the streak of 2 was saved with the step-8 checkpoint

    message = str(full.value).replace(str(tmp_path / "full"), "RUN")
    assert message == str(resumed.value).replace(str(tmp_path / "cut"), "RUN")
    assert message.startswith("training stopped at step 9: the 3 updates of steps 7-9 had a non-finite loss")
    # Step 8's checkpoint holds the weights that kept failing, and the streak's count: resuming
    # from it stopped again at once, whatever the new lr. The advice resumes from step 4.
    assert message.endswith(
        "move step-00000008 (their weights failed) out of RUN/checkpoints, then lower train.lr, raise "
        "train.warmup_steps or lower train.grad_clip and continue with --resume from RUN/checkpoints/step-00000004 "
        "(should it stop again at once, its weights are past training too: move it out as well)"
    ), message
    for run in ("full", "cut"):
        assert [p.name for p in complete_steps(tmp_path / run / "checkpoints")] == ["step-00000004", "step-00000008"]
        # the step that stops the run is skipped too, and says so as every skipped step does
        assert [r["step"] for r in helpers.loss_records(tmp_path / run) if r.get("skipped")] == [3, 7, 8, 9]
    assert helpers.loss_records(tmp_path / "full") == helpers.loss_records(tmp_path / "cut")
    helpers.assert_same_weights(
        helpers.weights(helpers.step_dir(tmp_path / "full", 8)), helpers.weights(helpers.step_dir(tmp_path / "cut", 8))
    )
    # Following the advice: step 8 moved away, a resume from step 4 trains on past the streak.
    (tmp_path / "full" / "checkpoints" / "step-00000008").rename(tmp_path / "step-00000008")
    monkeypatch.undo()
    result = train(helpers.run_config(data_dir, tmp_path / "full", **settings), resume=True)
    assert result.summary["skipped_steps"] == 1  # step 3's, restored from step 4's checkpoint


def test_non_finite_weights_are_never_saved(data_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    poison(monkeypatch, set(), weights_after=3)
    with pytest.raises(
        UserError,
        match="the weights became non-finite by step 4, so no checkpoint was written; "
        "checkpoint .*step-00000002 stays the latest",
    ):
        train(helpers.run_config(data_dir, out, save_every=2, eval_every=2))
    assert helpers.step_names(out) == ["step-00000002"]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    assert all(bool(torch.isfinite(t).all()) for t in helpers.weights(helpers.step_dir(out, 2)).values())


def test_a_sharded_save_before_the_first_update_counts_no_adamw_step(data_dir, tmp_path, monkeypatch):
    # torch's DCP state-dict helpers create a missing optimizer state by stepping at lr 0: a sharded
    # checkpoint saved while every update so far was skipped made AdamW count a step never taken,
    # and every later update bias-corrected for it (losses left the full-format run's at step 3).
    seen = poison(monkeypatch, {1})
    losses = {}
    for fmt in ("full", "sharded"):
        run = helpers.run_config(data_dir, tmp_path / fmt, steps=4, save_every=1, checkpoint_format=fmt)
        losses[fmt] = train(run).losses
        assert seen[3]["adam_step"] == 1, fmt  # step 2 was the first update
    assert {s: v for s, v in losses["sharded"].items() if s > 1} == {s: v for s, v in losses["full"].items() if s > 1}
    full, sharded = (load_checkpoint(helpers.step_dir(tmp_path / fmt, 4)).model_state() for fmt in ("full", "sharded"))
    helpers.assert_same_weights(full, sharded)


def test_a_streak_that_starts_just_after_a_save_keeps_that_save(data_dir, tmp_path, monkeypatch):
    # Steps 4-7 fail: step 2's checkpoint is the one before them and must survive the saves at 4
    # and 6 (an off-by-one in what pruning protects deleted it: the advice then had no checkpoint).
    poison(monkeypatch, {4, 5, 6, 7})
    run = helpers.run_config(data_dir, tmp_path / "run", max_nonfinite_steps=3, save_every=2, eval_every=2, keep_last=2)
    with pytest.raises(UserError) as stopped:
        train(run)
    message = str(stopped.value).replace(str(tmp_path / "run"), "RUN")
    assert "continue with --resume from RUN/checkpoints/step-00000002" in message
    steps = [p.name for p in complete_steps(tmp_path / "run" / "checkpoints")]
    assert steps == ["step-00000002", "step-00000004", "step-00000006"]


@pytest.mark.parametrize("keep_last", [5, 2])
def test_the_checkpoint_just_before_a_streak_is_the_one_to_resume_from_and_is_kept(
    data_dir, tmp_path, monkeypatch, keep_last
):
    # A skipped step changes no weight: step 4's checkpoint holds the weights steps 5-7 failed from,
    # so a resume from it replays the streak (same weights, same batches). Resume from step 2.
    # With keep_last 2, the save at step 6, inside the streak, had pruned step 2, the one checkpoint
    # before it; the advice then said to start again from step 0.
    poison(monkeypatch, {5, 6, 7})
    run = helpers.run_config(
        data_dir, tmp_path / "run", max_nonfinite_steps=2, save_every=2, eval_every=2, keep_last=keep_last
    )
    with pytest.raises(UserError) as stopped:
        train(run)
    message = str(stopped.value).replace(str(tmp_path / "run"), "RUN")
    assert "move step-00000004, step-00000006 (their weights failed) out of RUN/checkpoints" in message
    assert "continue with --resume from RUN/checkpoints/step-00000002" in message
    assert [p.name for p in complete_steps(tmp_path / "run" / "checkpoints")] == [
        "step-00000002",
        "step-00000004",
        "step-00000006",
    ]


def test_the_advice_of_a_streak_before_any_checkpoint_works(data_dir, tmp_path, monkeypatch):
    # It said "train again without --resume", which the run's config and records always refuse.
    poison(monkeypatch, {1, 2, 3})
    run = helpers.run_config(data_dir, tmp_path / "run", max_nonfinite_steps=2, save_every=2, eval_every=2)
    with pytest.raises(UserError) as stopped:
        train(run)
    message = str(stopped.value).replace(str(tmp_path / "run"), "RUN")
    assert message.endswith(
        "move step-00000002 (their weights failed) out of RUN/checkpoints, then lower train.lr, raise "
        "train.warmup_steps or lower train.grad_clip and train again with --resume (no checkpoint is left, so it "
        "starts from step 0)"
    ), message
    (tmp_path / "run" / "checkpoints" / "step-00000002").rename(tmp_path / "moved")
    monkeypatch.undo()
    with pytest.raises(UserError, match="already holds a run"):
        train(run)  # what it used to advise
    result = train(run, resume=True)
    assert result.summary["skipped_steps"] == 0 and min(result.losses) == 1
