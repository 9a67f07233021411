"""quickstart's reuse of earlier runs (quickstart.py): a finished run is reused only at the steps
asked for, and a run whose last checkpoint is exactly those steps is finished, not refused."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tango_lm.cli import main


def _fake_quickstart(monkeypatch, trained: list) -> None:
    """Quickstart with its data taken as prepared and training recorded (directory, resume), not run."""
    import tango_lm.quickstart as quickstart

    monkeypatch.setattr(quickstart, "is_prepared", lambda path: True)

    def train(run, resume=False, progress=None):
        trained.append((run.train.out_dir, resume))
        m = run.model
        summary = {"arch": m.arch, "params_total": 1, "tokens": 1, "best_dev_nll": 1.0, "test_nll": 1.0}
        return SimpleNamespace(summary={**summary, "tokens_per_s": 1.0, "steps": run.train.steps})

    monkeypatch.setattr(quickstart, "train", train)


def _checkpoint(run, step: int) -> None:
    (run / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
    (run / "checkpoints" / f"step-{step:08d}" / "COMPLETE").write_text(json.dumps({"step": step}))


def test_a_finished_run_of_other_steps_is_trained_on_not_reused(tmp_path, monkeypatch, capsys):
    # `quickstart --steps 3` then `quickstart --steps 5`: the 3-step summary is no 5-step result.
    trained: list = []
    _fake_quickstart(monkeypatch, trained)
    out = tmp_path / "qs"
    for arch in ("tango", "loop-transformer"):
        _checkpoint(out / arch, 3)
        (out / arch / "summary.json").write_text(json.dumps({"arch": arch, "steps": 3}))
    assert main(["quickstart", "--out", str(out), "--steps", "5", "--json"]) == 0
    assert trained == [(str(out / "tango"), True), (str(out / "loop-transformer"), True)]
    assert [r["steps"] for r in json.loads(capsys.readouterr().out)] == [5, 5]


def test_a_run_stopped_after_its_last_checkpoint_is_finished_not_refused(tmp_path, monkeypatch, capsys):
    # Killed between its last save and its summary: it has trained the steps asked for, not more.
    trained: list = []
    _fake_quickstart(monkeypatch, trained)
    out = tmp_path / "qs"
    _checkpoint(out / "tango", 3)
    assert main(["quickstart", "--out", str(out), "--steps", "3", "--json"]) == 0
    assert trained[0] == (str(out / "tango"), True)


def test_a_damaged_summary_is_resumed_from_its_checkpoint_not_a_traceback(tmp_path, monkeypatch, capsys):
    # A summary.json cut short (a full disk), not UTF-8, or not an object ended quickstart in a
    # JSONDecodeError traceback; the run's checkpoints still hold what it trained.
    trained: list = []
    _fake_quickstart(monkeypatch, trained)
    out = tmp_path / "qs"
    for arch, damaged in (("tango", b'{"steps": 3'), ("loop-transformer", b"\xff[3]")):
        _checkpoint(out / arch, 3)
        (out / arch / "summary.json").write_bytes(damaged)
    assert main(["quickstart", "--out", str(out), "--steps", "3", "--json"]) == 0, capsys.readouterr().err
    assert trained == [(str(out / "tango"), True), (str(out / "loop-transformer"), True)]
    (out / "tango" / "summary.json").write_text("[3]")
    trained.clear()
    assert main(["quickstart", "--out", str(out), "--steps", "3", "--json"]) == 0
    assert trained == [(str(out / "tango"), True), (str(out / "loop-transformer"), True)]
