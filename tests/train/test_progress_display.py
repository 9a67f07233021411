"""Training progress in a log file (train/progress_display.py): without a terminal, `train` and a
sweep's runs write plain lines (a batch job's log said nothing until the run's summary)."""

from __future__ import annotations

import io
import json
import re

import pytest

from tango_lm.train.progress_display import ProgressLines, StepStats, progress_style
from tests import helpers

STATS = StepStats(loss=3.21449, tokens_per_s=51234.4, mfu=0.41234, memory_mib=12345.2, dev_nll=None)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_come_at_the_first_step_then_each_interval_at_evaluations_and_at_the_end():
    clock, out = Clock(), io.StringIO()
    lines = ProgressLines("train tango", total=10, initial=0, every_s=30.0, clock=clock, stream=out)
    said = []
    for step, seconds, milestone in [(1, 5, False), (2, 20, False), (3, 10, False), (4, 1, True), (5, 1, False)]:
        clock.now += seconds
        lines.update(step, STATS, milestone)
        said.append(out.getvalue().count("\n"))
    # step 1: the first; step 2 (25 s after it): not yet; step 3 (35 s): due; step 4: an evaluation
    assert said == [1, 1, 2, 3, 3]
    clock.now += 1
    lines.update(10, STATS)  # the last step is always said
    assert out.getvalue().count("\n") == 4 and "step 10/10 (100%)" in out.getvalue().splitlines()[-1]


def test_a_line_holds_the_numbers_of_the_bar_and_the_time_left():
    clock, out = Clock(), io.StringIO()
    lines = ProgressLines("train tango", total=5000, initial=1000, clock=clock, stream=out)  # a resumed run
    clock.now += 300.0  # 250 steps in 5 minutes: 1.2 s a step, 3,750 steps left
    lines.update(1250, StepStats(3.21449, 51234.4, 0.41234, 12345.2, 3.30119), milestone=True)
    assert out.getvalue() == (
        "train tango: step 1,250/5,000 (25%), loss 3.214, dev 3.301, 51,234 tok/s, MFU 41.2%, 12,345 MiB, "
        "5m00s elapsed, ETA 1h15m\n"
    )
    readme = " ".join((helpers.ROOT / "README.md").read_text().split())
    assert f"e.g. `{out.getvalue().strip()}`" in readme  # the README's example is this line
    lines.update(1251, StepStats(float("nan"), 1.0, None, 1.0, None), milestone=True)  # a skipped step, no MFU yet
    assert (
        out.getvalue()
        .splitlines()[-1]
        .startswith("train tango: step 1,251/5,000 (25%), loss nan, dev -, 1 tok/s, MFU -")
    )


def test_the_style_follows_the_command_and_then_the_runs_train_progress():
    assert [progress_style(p, True) for p in (None, "lines", True, False)] == ["bar", "lines", "bar", "none"]
    assert [progress_style(p, False) for p in (None, "lines", True, False)] == ["none", "none", "bar", "none"]
    with pytest.raises(ValueError, match="'line'"):
        progress_style("line", True)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return helpers.synthetic_dataset(tmp_path_factory)


def _train_argv(data_dir, out, *extra):
    model = [f"model.{k}={v}" for k, v in helpers.TINY_MODEL.items()]
    train = [f"train.{k}={v}" for k, v in {**helpers.TINY_TRAIN, "progress": True}.items()]
    return ["train", *model, f"data.dir={data_dir}", *train, f"train.out_dir={out}", *extra]


def test_train_without_a_terminal_writes_lines_with_the_logged_numbers(data_dir, tmp_path, capsys):
    rc, _, err, _ = helpers.run_main(capsys, _train_argv(data_dir, tmp_path / "run"))
    assert rc == 0
    said = [line for line in err.splitlines() if line.startswith("train tango: step ")]
    steps = [int(re.match(r"train tango: step (\d+)/12", line)[1]) for line in said]
    assert steps[0] == 1 and steps[-1] == 12 and {4, 8} <= set(steps)  # first, each evaluation, last
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    dev = {r["step"]: r["dev_nll"] for r in records if "dev_nll" in r}
    for line, step in zip(said, steps, strict=True):
        if step in dev:
            assert f", dev {dev[step]:.3f}, " in line
    assert "\r" not in err  # no bar redraws in the log


@pytest.mark.parametrize("extra", [["--no-progress"], ["train.progress=false"]])
def test_no_lines_with_no_progress_or_a_run_without_progress(data_dir, tmp_path, capsys, extra):
    rc, _, err, _ = helpers.run_main(capsys, _train_argv(data_dir, tmp_path / "run", *extra))
    assert rc == 0 and "step " not in err


def test_a_terminal_gets_the_bar_not_lines(data_dir, tmp_path, capsys, monkeypatch):
    from tango_lm.cli import output

    monkeypatch.setattr(output, "_is_terminal", lambda stream: True)
    rc, _, err, _ = helpers.run_main(capsys, _train_argv(data_dir, tmp_path / "run"))
    assert rc == 0 and "train tango:" in err and "ETA" not in err and "12/12" in err  # tqdm's bar
